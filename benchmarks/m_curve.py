#!/usr/bin/env python
"""Fidelity versus the first-stage width m: how wide must EOGP's first stage be?

For each case (a model directory with ``model/``, ``corpus/train.jsonl.gz`` and
``queries.jsonl``, laid out as ``examples/default``), this measures what ``eogp eval fidelity``
measures — NDCG@20 and Spearman of EOGP's scores against kronfluence's uncompressed EK-FAC, at
the evaluation's budgets — for a grid of first-stage widths ``m_u = min(d_u, max(k_u, M))``
(a constant ``M`` for every budget, the rule of ``eogp fit --m M``), for ``m_u = d_u``, and for
the old rule ``m_u = min(d_u, 8 k_u)``.

Everything comes from the evaluation's own code (:mod:`eogp_index.evaluation.fidelity`), run
once per case: EK-FAC fitted by kronfluence on the training documents, kronfluence's reference
scores, one shared gradient pass keeping every module's full-width half-whitened coordinates.
Each width is then a prefix of those coordinates. The PCA is fitted in-sample, on the training
documents, as the evaluation does by default, so each (width, budget) needs only the
eigendecomposition of an ``n × n`` Gram matrix (:func:`gram_spectra`), shared by every budget;
the storage rounding is ``eogp eval fidelity``'s. The evaluation's own path (``fit_pca``, then
projecting) is run on two pairs as a check and the largest metric difference is printed: any
row can be reproduced with ``eogp eval fidelity --m M``.

    python benchmarks/m_curve.py                                   # shipped model
    python benchmarks/m_curve.py --case manpages=examples/manpages --case default=examples/default \\
        --plot examples/eval/m_curve.png
    python benchmarks/m_curve.py --replot --plot examples/eval/m_curve.png   # from the saved JSON

Results are kept as ``<work>/<case>.json``; the text table goes to stdout, and ``--json PATH``
also writes every case's results as one JSON list.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from common import add_json_argument, write_json

ROOT = Path(__file__).resolve().parents[1]
OLD_RULE = "8k (old)"
FULL = "d_u"
DEFAULT_GRID = (256, 1024, 4096, 16384, 65536)


def parse_case(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError(f"--case takes NAME=DIRECTORY, got {text!r}")
    return name, Path(path)


def measure(name: str, folder: Path, args: argparse.Namespace) -> dict:
    """Every (width rule, method, budget) of one case: NDCG@20, Spearman, and the widths used."""
    import torch

    from eogp_index.config import CurvatureConfig, first_stage_width
    from eogp_index.evaluation import metrics
    from eogp_index.evaluation.fidelity import (
        ModuleShape,
        SharedPass,
        kronfluence_scores,
        plan_methods,
    )
    from eogp_index.evaluation.run import load_documents
    from eogp_index.fit.curvature import fit_curvature
    from eogp_index.gradients.model import find_attributed_modules, load_model, pad_token_id, replace_conv1d

    torch.manual_seed(0)

    def say(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    model, tokenizer = load_model(str(folder / "model"), device="cpu")
    train = load_documents(
        [str(folder / "corpus" / "train.jsonl.gz")], tokenizer, max_tokens=args.max_tokens, limit=args.limit_train
    )
    queries = load_documents(
        [str(folder / "queries.jsonl")], tokenizer, max_tokens=args.max_tokens, limit=args.limit_queries
    )
    pad = pad_token_id(tokenizer)
    replace_conv1d(model)
    model.eval()
    names = find_attributed_modules(model, None)
    work = args.work / name
    timings = {}
    t0 = time.perf_counter()
    curvature = fit_curvature(
        model,
        train.pairs(),
        names,
        work / "curvature",
        config=CurvatureConfig(num_examples=len(train), batch_size=8, damping_ratio=0.1, seed=0),
        pad_token_id=pad,
        device="cpu",
        progress=False,
    )
    timings["ekfac_fit_s"] = time.perf_counter() - t0
    say(f"EK-FAC fitted on {len(train)} documents in {timings['ekfac_fit_s']:.0f}s")
    t0 = time.perf_counter()
    reference = kronfluence_scores(model, names, work / "curvature", queries, train, pad_token_id=pad)
    timings["reference_s"] = time.perf_counter() - t0
    say(f"kronfluence reference {reference.shape} in {timings['reference_s']:.0f}s")
    shapes = tuple(ModuleShape(n, *curvature[n].shape) for n in names)
    widest = max(mod.d for mod in shapes)
    # One pass at m = d_u keeps the full-width coordinates; every other width is a prefix of them.
    configs, skipped = plan_methods(shapes, args.budgets, args.methods, m=widest)
    t0 = time.perf_counter()
    shared = SharedPass(model, curvature, configs, damping_ratio=0.1, references=False)
    shared.run(queries, "query", batch_size=8, pad_token_id=pad)
    shared.run(train, "train", batch_size=8, pad_token_id=pad)
    timings["gradient_passes_s"] = time.perf_counter() - t0
    say(f"shared gradient pass in {timings['gradient_passes_s']:.0f}s")

    rules = [OLD_RULE] + [M for M in args.grid if M < widest] + [FULL]

    def widths(cfg, rule):
        if rule == OLD_RULE:
            return tuple(min(mod.d, 8 * k) for mod, k in zip(shapes, cfg.k))
        if rule == FULL:
            return tuple(mod.d for mod in shapes)
        return tuple(first_stage_width(mod.d, k, max(k, rule)) for mod, k in zip(shapes, cfg.k))

    t0 = time.perf_counter()
    plans = {(rule, cfg.id): dataclasses.replace(cfg, m=widths(cfg, rule)) for rule in rules for cfg in configs}
    spectra = gram_spectra(shared, names, {n: {c.m[u] for c in plans.values()} for u, n in enumerate(names)})
    timings["gram_s"] = time.perf_counter() - t0
    say(f"Gram matrices of {len(plans)} (width, budget) pairs in {timings['gram_s']:.0f}s")
    rows = []
    for (rule, _), cfg in plans.items():
        scores = pca_scores(spectra, names, cfg)
        rows.append(
            {
                "rule": rule,
                "method": cfg.method,
                "budget": cfg.budget,
                "k": cfg.k[0],
                "m": list(cfg.m),
                "ndcg@20": metrics.mean_ndcg_at_k(scores, reference, 20),
                "spearman": metrics.mean_spearman(scores, reference)[0],
            }
        )
    # The evaluation's own path (SharedPass.finish: fit_pca, then project) on the cheapest pairs:
    # the Gram-domain scores above must give the same metrics.
    check = [cfg for (rule, _), cfg in plans.items() if rule == rules[1]][:2]
    shared.configs = check
    reference_path = shared.finish()[0]
    agreement = 0.0
    for cfg in check:
        row = next(r for r in rows if r["rule"] == rules[1] and r["method"] == cfg.method and r["budget"] == cfg.budget)
        agreement = max(
            agreement,
            abs(metrics.mean_ndcg_at_k(reference_path[cfg.id][0], reference, 20) - row["ndcg@20"]),
            abs(metrics.mean_spearman(reference_path[cfg.id][0], reference)[0] - row["spearman"]),
        )
    say(
        f"Gram-domain scores against the evaluation's fit_pca path on {len(check)} pairs: metrics differ by "
        f"at most {agreement:.1e}"
    )
    return {
        "case": name,
        "folder": str(folder),
        "num_train": len(train),
        "num_queries": len(queries),
        "modules": [dataclasses.asdict(mod) for mod in shapes],
        "rows": rows,
        "skipped": skipped,
        "timings": timings,
        "check_max_metric_difference": agreement,
    }


def gram_spectra(shared, names, widths_of) -> dict:
    """Per module and width ``m``: the eigendecomposition of the fitting set's Gram matrix of the
    first ``m`` first-stage coordinates, and the queries' cross-Gram, built column block by
    column block for all widths at once (float64).

    The PCA fitting set is the training documents (the evaluation's default), so with
    ``Z = U W^{1/2} Vᵀ``, ``P = V_k`` (``fit_pca``'s directions, either route), the training
    coordinates ``Z P = U_k W_k^{1/2}`` and a query's ``z P = (z Zᵀ) U_k W_k^{-1/2}``: every
    (width, budget) pair comes from one ``n × n`` eigendecomposition, without forming ``P``.
    """
    import torch

    out = {}
    for name in names:
        train = torch.cat(shared.train_parts["pca"][name], dim=0)  # (n, d_u) float32
        query = torch.cat(shared.query_parts["pca"][name], dim=0)  # (q, d_u)
        gram = torch.zeros(train.shape[0], train.shape[0], dtype=torch.float64)
        cross = torch.zeros(query.shape[0], train.shape[0], dtype=torch.float64)
        done = 0
        for m in sorted(widths_of[name]):
            for i in range(done, m, 8192):
                block = train[:, i : min(m, i + 8192)].double()
                gram += block @ block.T
                cross += query[:, i : min(m, i + 8192)].double() @ block.T
            done = m
            weights, vectors = torch.linalg.eigh(gram)
            out[(name, m)] = (weights.flip(0), vectors.flip(1), cross.clone())
    return out


def pca_scores(spectra, names, cfg):
    """``(queries, train)`` EOGP scores of one (width, budget) pair from :func:`gram_spectra`."""
    import numpy as np

    from eogp_index.evaluation.fidelity import stored_coordinates

    xs, ys = [], []
    for u, name in enumerate(names):
        weights, vectors, cross = spectra[(name, cfg.m[u])]
        k = cfg.k[u]
        if not weights[k - 1] > weights[0] * 1e-10:
            raise SystemExit(f"{cfg.id} {name}: the fitting set spans fewer than k={k} directions")
        root = weights[:k].sqrt()
        xs.append((vectors[:, :k] * root).float().numpy())
        ys.append((cross @ (vectors[:, :k] / root)).numpy())
    x, y = np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)
    return y @ stored_coordinates(x, cfg.precision, cfg.k).astype(np.float64).T


def table(result: dict) -> str:
    """Rows: method and width rule; columns: budgets; cells NDCG@20 / Spearman."""
    rows = result["rows"]
    budgets = sorted({r["budget"] for r in rows})
    d = sorted({m["d_out"] * m["d_in"] for m in result["modules"]})
    lines = [
        f"## {result['case']} ({result['folder']}): {len(result['modules'])} modules, d_u {d[0]:,}..{d[-1]:,}, "
        f"{result['num_train']} training documents (PCA fitted on them), {result['num_queries']} queries",
        "NDCG@20 / Spearman against kronfluence's EK-FAC; m_u = min(d_u, max(k_u, M))",
        f"{'method':<10} {'M':>9} " + " ".join(f"{b:>13}" for b in budgets),
    ]
    for method in dict.fromkeys(r["method"] for r in rows):
        for rule in dict.fromkeys(r["rule"] for r in rows):
            cells = {r["budget"]: r for r in rows if r["method"] == method and r["rule"] == rule}
            text = " ".join(
                f"{cells[b]['ndcg@20']:.3f} / {cells[b]['spearman']:.3f}" if b in cells else f"{'-':>13}"
                for b in budgets
            )
            lines.append(f"{method:<10} {str(rule):>9} {text}")
        ks = {r["budget"]: r["k"] for r in rows if r["method"] == method}
        lines.append(f"{'':<10} {'k_u':>9} " + " ".join(f"{ks.get(b, '-'):>13}" for b in budgets))
    return "\n".join(lines)


def compare(result: dict, new_rule: int) -> str:
    """The chosen default against the old rule at every budget: the criterion of the choice."""
    rows = result["rows"]
    lines = [f"{result['case']}: M = {new_rule} against the old rule min(d_u, 8k)"]
    worst = None
    for r in rows:
        if r["rule"] != new_rule:
            continue
        old = next(
            o for o in rows if o["rule"] == OLD_RULE and o["method"] == r["method"] and o["budget"] == r["budget"]
        )
        dn, ds = r["ndcg@20"] - old["ndcg@20"], r["spearman"] - old["spearman"]
        worst = min(dn, ds) if worst is None else min(worst, dn, ds)
        lines.append(
            f"  {r['method']:<10} {r['budget']:>5} B  k {r['k']:>4}  NDCG@20 {old['ndcg@20']:.3f} -> "
            f"{r['ndcg@20']:.3f} ({dn:+.3f})  Spearman {old['spearman']:.3f} -> {r['spearman']:.3f} ({ds:+.3f})"
        )
    if worst is not None:
        lines.append(
            f"  smallest change: {worst:+.4f} ({'never below the old rule' if worst >= 0 else 'below the old rule somewhere'})"
        )
    return "\n".join(lines)


def plot(results: list, path: Path, new_rule: int | None) -> None:
    """NDCG@20 (top) and Spearman (bottom) against M, one column per case, one line per budget
    (EOGP, 1-bit); a cross marks the old rule's width at each budget, the dashed line the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.0 * len(results), 7.0), squeeze=False, sharex="col")
    for col, result in enumerate(results):
        rows = [r for r in result["rows"] if r["method"] == "eogp"]
        widest = max(m["d_out"] * m["d_in"] for m in result["modules"])
        d = sorted({m["d_out"] * m["d_in"] for m in result["modules"]})
        for row, metric in enumerate(("ndcg@20", "spearman")):
            ax = axes[row][col]
            for i, budget in enumerate(sorted({r["budget"] for r in rows})):
                line = [r for r in rows if r["budget"] == budget and r["rule"] != OLD_RULE]
                xs = [widest if r["rule"] == FULL else max(r["rule"], r["k"]) for r in line]
                ax.plot(xs, [r[metric] for r in line], "o-", color=f"C{i}", label=f"{budget} B (k={line[0]['k']})")
                old = next(r for r in rows if r["budget"] == budget and r["rule"] == OLD_RULE)
                ax.plot([max(old["m"])], [old[metric]], "x", color=f"C{i}", markersize=10, mew=2)
            if new_rule is not None:
                ax.axvline(new_rule, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.set_ylabel(f"{'NDCG@20' if metric == 'ndcg@20' else 'Spearman'} vs EK-FAC (EOGP, 1-bit)")
            if row == 0:
                ax.set_title(
                    f"{result['case']}: d_u {d[0] // 1000}k-{d[-1] // 1000}k; right end m_u = d_u", fontsize=10
                )
                ax.legend(fontsize=7, title="budget (x: old rule m_u = 8k_u)", title_fontsize=7)
            else:
                ax.set_xlabel("M, with m_u = min(d_u, max(k_u, M))")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--case",
        type=parse_case,
        action="append",
        help="NAME=DIRECTORY (repeatable; default: default=examples/default)",
    )
    parser.add_argument(
        "--grid",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=DEFAULT_GRID,
        help="widths M, comma-separated (d_u and the old rule are always added)",
    )
    parser.add_argument(
        "--budgets",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="bytes per example (default: eogp eval fidelity's)",
    )
    parser.add_argument("--methods", type=lambda s: tuple(s.split(",")), default=("eogp", "eogp-fp16"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit-train", type=int, default=None)
    parser.add_argument("--limit-queries", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/m-curve"), help="kronfluence's files and the JSON")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--replot", action="store_true", help="only print and plot the saved JSON of the cases")
    parser.add_argument(
        "--new", type=int, default=None, help="compare this M with the old rule (default: the library's DEFAULT_M)"
    )
    add_json_argument(parser)
    args = parser.parse_args()
    from eogp_index.config import DEFAULT_M
    from eogp_index.evaluation.config import DEFAULT_BUDGETS

    args.budgets = args.budgets or DEFAULT_BUDGETS
    cases = args.case or [("default", ROOT / "examples" / "default")]
    new_rule = args.new or DEFAULT_M
    results = []
    for name, folder in cases:
        saved = args.work / f"{name}.json"
        if args.replot:
            result = json.loads(saved.read_text())
        else:
            result = measure(name, folder, args)
            saved.parent.mkdir(parents=True, exist_ok=True)
            write_json(str(saved), result)
        results.append(result)
        print(table(result))
        if any(r["rule"] == new_rule for r in result["rows"]):
            print(compare(result, new_rule))
        print()
    if args.plot:
        plot(
            results, args.plot, new_rule if any(r["rule"] == new_rule for res in results for r in res["rows"]) else None
        )
        print(f"plot: {args.plot}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
