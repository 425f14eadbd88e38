"""``eogp eval``'s orchestration: read the documents, score, retrain, write the report.

:func:`run_fidelity`, :func:`run_lds` and :func:`run_all` take the frozen configs of
:mod:`eogp_index.evaluation.config` (defaults from the paper's Appendix C-D, sized for the shipped
tiny model) and write, under ``out``:

* ``results.json``, ``results.md`` and one ``<metric>.png`` per metric
  (:func:`report.write_report`: ``ndcg_at_20.png``, ``spearman.png``,
  ``pearson_1bit_fp16.png``, ``lds.png``), plus ``counterfactual.png``;
* ``details.json``: every configuration's dimensions and actual bytes, per-seed values,
  skipped (method, budget) pairs, reference checks and timings;
* caches: ``scores.npz`` (the score matrices, reused by a later run with the same model,
  documents and fidelity config), ``retraining.npz`` and ``counterfactual.json``
  (:mod:`eogp_index.evaluation.lds`), and kronfluence's factors under ``curvature/``.

Documents are tokenized as the default model was fine-tuned: a ``text`` record becomes
:func:`tinylm.tokenize_documents` (at most ``max_tokens`` tokens, ending in eos) and every
position counts in the loss; ``input_ids`` records are used as given; ``messages`` records
(chats; fidelity only) follow :func:`ingest.records.tokenize_record`.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation import methods as registry
from eogp_index.evaluation import report, tinylm
from eogp_index.evaluation.config import (  # re-exported: defined torch-free
    DataConfig,
    EnsembleConfig,
    FidelityConfig,
    LDSConfig,
)
from eogp_index.evaluation.ensemble import (
    CHECKPOINTS_DIR,
    ENSEMBLE_FILE,
    Checkpoint,
    check_compatible,
    checkpoint_names,
    ensemble_lds,
    ensemble_markdown,
    read_weights,
    save_scores,
)
from eogp_index.evaluation.fidelity import (
    Documents,
    ScoreSet,
    compute_scores,
    fidelity_records,
)

__all__ = [
    "DataConfig",
    "EnsembleConfig",
    "EvalResult",
    "FidelityConfig",
    "LDSConfig",
    "load_documents",
    "run_all",
    "run_fidelity",
    "run_lds",
]

SCORES_FILE = "scores.npz"
DETAILS_FILE = "details.json"


@dataclass
class EvalResult:
    """What a run measured: report records, details, the files written and the timings."""

    records: List[Dict[str, Any]]
    details: Dict[str, Any]
    paths: Dict[str, Path]

    def to_json(self) -> Dict[str, Any]:
        return {"records": self.records, "details": self.details, "files": {k: str(v) for k, v in self.paths.items()}}


# --------------------------------------------------------------------------- documents


def load_documents(paths: Sequence[str], tokenizer, *, max_tokens: int = 128, limit: Optional[int] = None) -> Documents:
    """Read and tokenize documents (see the module docstring for the conventions).

    Ids are the records' ``id`` field, else ``shard:position``.
    """
    from eogp_index.data.readers import ParseError, expand_shards, iter_raw_records, shard_names
    from eogp_index.data.records import RecordSpec, tokenize_record

    shards = expand_shards(list(paths))
    ids: List[str] = []
    tokens: List[Tuple[int, ...]] = []
    labels: List[Tuple[int, ...]] = []
    texts: Dict[int, str] = {}
    spec = RecordSpec(max_tokens=max_tokens)
    for path, name in zip(shards, shard_names(shards)):
        for shard, position, record in iter_raw_records(path, shard=name):
            if limit is not None and len(ids) >= limit:
                break
            if isinstance(record, ParseError):
                raise record.to_error()
            ident = record.get("id")
            ids.append(str(ident) if ident is not None else f"{shard}:{position}")
            if isinstance(record.get("text"), str):
                texts[len(tokens)] = record["text"]
                tokens.append(())
                labels.append(())
                continue
            example = tokenize_record(record, shard=shard, position=position, spec=spec, tokenizer=tokenizer)
            tokens.append(tuple(example.input_ids))
            labels.append(tuple(example.labels))
    if texts:
        order = sorted(texts)
        encoded = tinylm.tokenize_documents([texts[i] for i in order], tokenizer, max_tokens)
        for i, doc in zip(order, encoded):
            tokens[i] = labels[i] = tuple(doc)
    if not ids:
        raise InputError(f"no documents in {list(paths)}")
    if len(set(ids)) != len(ids):
        raise InputError(f"duplicate document ids in {list(paths)}")
    return Documents(ids=tuple(ids), input_ids=tuple(tokens), labels=tuple(labels))


def _plain(docs: Documents, what: str) -> List[List[int]]:
    """Token lists for retraining; refuses documents with masked labels (chats)."""
    for ident, ids, labels in zip(docs.ids, docs.input_ids, docs.labels):
        if tuple(ids[1:]) != tuple(labels[1:]):
            raise InputError(
                f"{what} document {ident!r} masks part of its loss; retraining evaluation "
                "(LDS) needs plain documents whose every token counts"
            )
    return [list(d) for d in docs.input_ids]


def _load_inputs(data: DataConfig, seed: int = 0):
    from eogp_index.gradients.model import load_model

    if not (Path(data.model) / "config.json").is_file():
        raise ConfigError(f"{data.model}: not a model directory (no config.json); pass --model")
    model, tokenizer = load_model(data.model, device="cpu")
    train = load_documents(data.train, tokenizer, max_tokens=data.max_tokens, limit=data.limit_train)
    queries = load_documents(data.queries, tokenizer, max_tokens=data.max_tokens, limit=data.limit_queries)
    pca_docs = None
    if data.pca_data:
        pca_docs = load_documents(data.pca_data, tokenizer, max_tokens=data.max_tokens).sample(data.pca_sample, seed)
    return model, tokenizer, train, queries, pca_docs


# --------------------------------------------------------------------------- scoring (cached)


def _scores(data: DataConfig, cfg: FidelityConfig, out: Path, log) -> Tuple[ScoreSet, Documents, Documents, bool]:
    from eogp_index.gradients.model import model_sha256
    from eogp_index.gradients.model import pad_token_id as _pad_id

    model, tokenizer, train, queries, pca_docs = _load_inputs(data, cfg.seed)
    key = hashlib.sha256(
        json.dumps(
            {
                "model": model_sha256(model),
                "train": train.fingerprint(),
                "queries": queries.fingerprint(),
                "pca": pca_docs.fingerprint() if pca_docs is not None else None,
                # The rescoring factors only read the cached scores.
                "config": {k: v for k, v in asdict(cfg).items() if k not in ("rescore_factors", "rescore")},
                "version": 3,
            },
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()
    cache = out / SCORES_FILE
    if cache.exists():
        try:
            cached = ScoreSet.load(cache)
        except (OSError, ValueError, KeyError):
            cached = None
        if cached is not None and cached.key == key:
            log(f"scores reused from {cache}")
            return cached, train, queries, True
    log(
        f"scoring {len(queries)} queries against {len(train)} training documents "
        f"({len(cfg.methods)} methods x {len(cfg.budgets)} budgets)"
    )
    scoreset = compute_scores(
        model,
        train,
        queries,
        out,
        budgets=cfg.budgets,
        methods=cfg.methods,
        modules=cfg.modules,
        damping_ratio=cfg.damping_ratio,
        m=cfg.m,
        gaussian_seeds=cfg.gaussian_seeds,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        pca_docs=pca_docs,
        pad_token_id=_pad_id(tokenizer),
        log=log,
        tier_codes=cfg.tier_codes,
        tier_k=cfg.tier_k,
        tier_k_max=cfg.tier_k_max,
    )
    scoreset.key = key
    scoreset.save(cache)
    return scoreset, train, queries, False


def _setup_details(data: DataConfig, cfg: FidelityConfig, scoreset: ScoreSet) -> Dict[str, Any]:
    import torch

    return {
        "model": data.model,
        "train": list(data.train),
        "queries": list(data.queries),
        "pca_data": list(data.pca_data) if data.pca_data else "the training documents",
        "pca_sample": data.pca_sample if data.pca_data else None,
        "num_train": len(scoreset.train_ids),
        "num_queries": len(scoreset.query_ids),
        "max_tokens": data.max_tokens,
        "fidelity_config": asdict(cfg),
        "modules": [asdict(m) for m in scoreset.modules],
        "configs": [c.to_json() for c in scoreset.configs],
        "skipped": scoreset.skipped,
        "notes": scoreset.notes,
        "index_vs_kronfluence_rel_err": scoreset.reference_error(),
        "score_timings_s": scoreset.timings,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "processor": platform.machine(),
        },
    }


# --------------------------------------------------------------------------- runs


def _log_to(log: Optional[Callable[[str], None]]) -> Callable[[str], None]:
    return log or (lambda _msg: None)


def run_fidelity(
    data: DataConfig = DataConfig(),
    cfg: FidelityConfig = FidelityConfig(),
    out: Path = Path("runs/eval"),
    *,
    log: Optional[Callable[[str], None]] = None,
) -> EvalResult:
    """Fidelity to EK-FAC of every method at every budget; writes the report under ``out``."""
    return _run(data, cfg, None, Path(out), _log_to(log), fidelity=True)


def run_lds(
    data: DataConfig = DataConfig(),
    cfg: FidelityConfig = FidelityConfig(),
    lds_cfg: LDSConfig = LDSConfig(),
    out: Path = Path("runs/eval"),
    *,
    ensemble: EnsembleConfig = EnsembleConfig(),
    log: Optional[Callable[[str], None]] = None,
) -> EvalResult:
    """LDS (and counterfactual removal) of every method at every budget; writes the report.

    ``ensemble.checkpoints``: also the LDS of each of them alone and of their weighted sum with
    ``data.model`` (:mod:`~eogp_index.evaluation.ensemble`).
    """
    return _run(data, cfg, lds_cfg, Path(out), _log_to(log), fidelity=False, ensemble=ensemble)


def run_all(
    data: DataConfig = DataConfig(),
    cfg: FidelityConfig = FidelityConfig(),
    lds_cfg: LDSConfig = LDSConfig(),
    out: Path = Path("runs/eval"),
    *,
    ensemble: EnsembleConfig = EnsembleConfig(),
    log: Optional[Callable[[str], None]] = None,
) -> EvalResult:
    """Fidelity, LDS and counterfactual from one scoring pass; writes one report (``ensemble``: as
    :func:`run_lds`; the ensemble is measured by LDS only)."""
    return _run(data, cfg, lds_cfg, Path(out), _log_to(log), fidelity=True, ensemble=ensemble)


def _checkpoints(data: DataConfig, cfg: FidelityConfig, ensemble: EnsembleConfig, first, docs, out: Path, log):
    """The ensemble's :class:`~eogp_index.evaluation.ensemble.Checkpoint` list, ``data.model``
    (scored as ``first``) first; each other checkpoint scored as it is, cached under
    ``out/checkpoints/<c>/``."""
    paths = (data.model, *ensemble.checkpoints)
    weights = read_weights(ensemble.checkpoint_weights, paths)
    names = checkpoint_names(paths)
    members = [Checkpoint(names[0], data.model, weights[0], first)]
    for c, path in enumerate(ensemble.checkpoints, start=1):
        log(f"checkpoint {c} ({path}): scoring with its own EK-FAC and PCA")
        scoreset, train, queries, _ = _scores(replace(data, model=path), cfg, out / CHECKPOINTS_DIR / str(c), log)
        member = Checkpoint(names[c], path, weights[c], scoreset)
        check_compatible(members[0], member, docs, (train, queries))
        members.append(member)
    return members


def _run(
    data: DataConfig,
    cfg: FidelityConfig,
    lds_cfg: Optional[LDSConfig],
    out: Path,
    log,
    *,
    fidelity: bool,
    ensemble: EnsembleConfig = EnsembleConfig(),
) -> EvalResult:
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if ensemble.checkpoints:
        # A bad weights file is refused before any scoring.
        read_weights(ensemble.checkpoint_weights, (data.model, *ensemble.checkpoints))
    scoreset, train, queries, reused = _scores(data, cfg, out, log)
    members = None
    if ensemble.checkpoints and lds_cfg is not None:
        members = _checkpoints(data, cfg, ensemble, scoreset, (train, queries), out, log)
    records: List[Dict[str, Any]] = []
    details: Dict[str, Any] = {"setup": _setup_details(data, cfg, scoreset), "scores_reused": reused}
    lines: Dict[str, Dict[str, float]] = {}
    if fidelity:
        t0 = time.perf_counter()
        fid_records, fid_details = fidelity_records(
            scoreset, ndcg_k=cfg.ndcg_k, rescore_factors=cfg.rescore_factors, rescore=cfg.rescore
        )
        records += fid_records
        details["fidelity"] = fid_details
        lines.update(fid_details["reference_lines"])
        details.setdefault("timings_s", {})["fidelity_metrics"] = time.perf_counter() - t0
    if lds_cfg is not None:
        lds_records_, lds_details = _lds_part(scoreset, train, queries, lds_cfg, out, log, members)
        records += lds_records_
        details["lds"] = lds_details
        lines["lds"] = lds_details["reference_lines"]
    present = {r["metric"] for r in records}
    lines = {m: v for m, v in lines.items() if m in present and v}
    paths = report.write_report(records, out, reference_lines=lines, colours=registry.colours())
    if (details.get("fidelity") or {}).get("rescoring"):
        from eogp_index.evaluation.rescoring import rescoring_plots

        paths.update(rescoring_plots(details["fidelity"]["rescoring"], out, ndcg_k=cfg.ndcg_k, factor=cfg.rescore))
    if lds_cfg is not None and lds_cfg.counterfactual and "counterfactual" in details["lds"]:
        paths["counterfactual"] = _plot_counterfactual(details["lds"]["counterfactual"], out / "counterfactual.png")
    details.setdefault("timings_s", {})["total"] = time.perf_counter() - t_start
    (out / DETAILS_FILE).write_text(json.dumps(_jsonable(details), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    paths["details"] = out / DETAILS_FILE
    with open(paths["markdown"], "a", encoding="utf-8") as fh:
        fh.write("\n" + details_markdown(details))
    log(f"wrote {out} in {details['timings_s']['total']:.1f}s")
    return EvalResult(records=records, details=_jsonable(details), paths=paths)


def _lds_part(scoreset: ScoreSet, train: Documents, queries: Documents, cfg: LDSConfig, out: Path, log, members=None):
    from eogp_index.evaluation.lds import (
        COUNTERFACTUAL_FILE,
        RETRAINING_FILE,
        counterfactual,
        lds_records,
        retrain_subsets,
    )

    train_tokens, query_tokens = _plain(train, "training"), _plain(queries, "query")
    t0 = time.perf_counter()
    retraining = retrain_subsets(
        cfg.base,
        train_tokens,
        query_tokens,
        recipe=cfg.recipe,
        num_subsets=cfg.num_subsets,
        fraction=cfg.fraction,
        seed=cfg.seed,
        cache=out / RETRAINING_FILE,
        log=log,
    )
    t_retrain = time.perf_counter() - t0
    log(
        f"LDS retraining: {retraining.num_trained} subsets trained now, "
        f"{cfg.num_subsets - retraining.num_trained} reused ({t_retrain:.1f}s)"
    )
    t0 = time.perf_counter()
    records, details = lds_records(scoreset, retraining, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
    details["config"] = {**asdict(cfg), "recipe": cfg.recipe.to_dict()}
    if members:
        more, details["ensemble"], summed = ensemble_lds(
            members, retraining, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed
        )
        records += more
        details["reference_lines"].update(details["ensemble"]["reference_lines"])
        details["ensemble"]["scores_file"] = str(save_scores(summed, members, out / ENSEMBLE_FILE))
    details["timings_s"] = {
        "retraining": t_retrain,
        "lds_metrics": time.perf_counter() - t0,
        "subsets_trained_now": retraining.num_trained,
    }
    if cfg.counterfactual:
        chosen: Dict[str, np.ndarray] = {}
        for method in cfg.cf_methods:
            c = scoreset.config(method, cfg.cf_budget)
            if c is None:
                log(f"counterfactual: {method} has no configuration at {cfg.cf_budget} B; left out")
                continue
            chosen[f"{c.label} @ {report.format_bytes(c.budget)}"] = scoreset.scores[c.id][0]
        chosen["EK-FAC (uncompressed)"] = scoreset.reference
        t0 = time.perf_counter()
        removals = tuple(n for n in cfg.cf_removals if n < len(train_tokens))
        result = counterfactual(
            cfg.base,
            train_tokens,
            query_tokens,
            chosen,
            removals=removals,
            seeds=cfg.cf_seeds,
            num_queries=cfg.cf_queries,
            recipe=cfg.recipe,
            cache=out / COUNTERFACTUAL_FILE,
            log=log,
        )
        details["counterfactual"] = result.to_json()
        details["timings_s"]["counterfactual"] = time.perf_counter() - t0
        details["timings_s"]["counterfactual_runs_trained_now"] = result.num_trained
    return records, details


# --------------------------------------------------------------------------- output


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, Path):
        return str(value)
    return value


def _plot_counterfactual(cf: Dict[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    removals = [int(n) for n in cf["removals"]]
    for i, (name, values) in enumerate(cf["delta_ppl"].items()):
        ys = [0.0] + [values[str(n)] for n in removals]  # removing nothing changes nothing
        style = dict(color="black", linestyle="--") if "uncompressed" in name or name == "Random" else {}
        if name == "Random":
            style = dict(color="gray", linestyle=":")
        ax.plot([0] + removals, ys, marker="os^Dv<>P*"[i % 9], label=name, linewidth=1.4, markersize=4.5, **style)
    ax.set_xlabel("Training documents removed")
    ax.set_ylabel("Query perplexity increase")
    ax.set_title(f"Counterfactual removal ({len(cf['seeds'])} seeds, {cf['num_queries']} queries)")
    ax.grid(True, linestyle=":", linewidth=0.7)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=8)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def details_markdown(details: Dict[str, Any]) -> str:
    """The Markdown sections appended to ``results.md``: setup, dimensions, LDS references,
    counterfactual, skipped pairs and timings."""
    setup = details["setup"]
    lines = ["## Setup", ""]
    lines.append(
        f"- model `{setup['model']}`; {setup['num_train']} training documents, {setup['num_queries']} "
        f"queries, at most {setup['max_tokens']} tokens each"
    )
    num_params = sum(m["d_out"] * m["d_in"] for m in setup["modules"])
    lines.append(
        f"- {len(setup['modules'])} attributed modules, {num_params:,} parameters "
        f"(full FP16 gradient: {report.format_bytes(2 * num_params)} per example)"
    )
    lines.append(
        f"- index-side full-width EK-FAC vs kronfluence `compute_pairwise_scores`: relative error "
        f"{_fmt(setup['index_vs_kronfluence_rel_err'], '.2e')}"
    )
    lines += [
        "",
        "### Dimensions per module at each budget",
        "",
        "| Method | Budget | Actual bytes | k per module | m per module | rank | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in setup["configs"]:
        m = _span(c["m"]) if c["m"] else "—"
        rank = _span(c["rank"]) if c["rank"] else "—"
        lines.append(
            f"| {c['label']} | {c['budget']} | {c['bytes_per_example']} | {_span(c['k'])} | {m} | {rank} | "
            f"{len(c['seeds'])} |"
        )
    if setup.get("notes"):
        lines += ["", "Notes from the fits:", ""] + [f"- {note}" for note in setup["notes"]]
    if setup["skipped"]:
        lines += ["", "Not run (the curve ends there):", ""]
        lines += [f"- {registry.label(s['method'])} at {s['budget']} B: {s['reason']}" for s in setup["skipped"]]
    gap = (details.get("fidelity") or {}).get("one_bit_gap")
    if gap:
        lines += [
            "",
            "## 1-bit codes against FP16 at the same k",
            "",
            "EOGP and EOGP-rot in 1 bit, and EOGP's coordinates in FP16 at the same `k` (16 x the bytes). "
            "Query means ± standard error; Δ = EOGP-rot − EOGP ± the standard error of the paired "
            "per-query differences; closed = Δ / (FP16 − EOGP).",
            "",
        ]
        for metric in [key for key in gap[0] if key not in ("budget", "k", "m")]:
            lines += [
                f"| {report.metric_label(metric)} | k per module | EOGP | EOGP-rot | FP16, same k | Δ | closed |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for row in gap:
                v = row[metric]
                cells = [f"{_fmt(x)} ± {_fmt(se)}" for x, se in zip((v["base"], v["variant"], v["ceiling"]), v["se"])]
                closed = "—" if v["gap_closed"] is None else f"{100 * v['gap_closed']:.0f}%"
                lines.append(
                    f"| {report.format_bytes(row['budget'])} | {_span(row['k'])} | "
                    + " | ".join(cells)
                    + f" | {_fmt(v['diff'], '+.3f')} ± {_fmt(v['diff_se'])} | {closed} |"
                )
            lines.append("")
    lines += _auto_markdown(details.get("fidelity") or {})
    fidelity = details.get("fidelity") or {}
    if fidelity.get("rescoring"):
        from eogp_index.evaluation.rescoring import rescoring_markdown

        ndcg_k = setup["fidelity_config"]["ndcg_k"]
        lines += rescoring_markdown(fidelity["rescoring"], ndcg_k=ndcg_k, factor=fidelity["rescore"])
    lds = details.get("lds")
    if lds:
        lines += [
            "",
            "## LDS references (uncompressed)",
            "",
            f"{lds['num_subsets']} subsets of {lds['subset_size']} documents; 95% bootstrap intervals.",
            "",
            "| Reference | LDS | 95% CI |",
            "|---|---:|---:|",
        ]
        for name, v in lds["references"].items():
            lines.append(f"| {name} | {_fmt(v['lds'])} | [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] |")
        if lds.get("ensemble"):
            lines += ensemble_markdown(lds["ensemble"])
        cf = lds.get("counterfactual")
        if cf:
            removals = [str(n) for n in cf["removals"]]
            lines += [
                "",
                "## Counterfactual removal",
                "",
                f"Perplexity increase of the first {cf['num_queries']} queries after removing the top-N "
                f"documents and retraining (mean over seeds {list(cf['seeds'])}; no-removal perplexity "
                f"{', '.join(_fmt(p, '.2f') for p in cf['base_ppl'])}).",
                "",
                "| Ranking | " + " | ".join(f"N = {n}" for n in removals) + " |",
                "|---|" + "---:|" * len(removals),
            ]
            for name, values in cf["delta_ppl"].items():
                lines.append(
                    f"| {name} | "
                    + " | ".join(f"{_fmt(values[n], '+.3f')} ± {_fmt(cf['std'][name][n], '.3f')}" for n in removals)
                    + " |"
                )
    timings = {
        "scoring": setup["score_timings_s"],
        **({"lds": lds["timings_s"]} if lds else {}),
        "run": details.get("timings_s", {}),
    }
    lines += ["", "## Timings (seconds)", "", "```", json.dumps(_jsonable(timings), indent=1), "```", ""]
    return "\n".join(lines)


def _auto_markdown(fidelity: Dict[str, Any]) -> List[str]:
    """The ``auto`` sections: auto against the better fixed code per budget, and per budget and
    module the held-out measurement's choice next to the reference gain of rotating that module."""
    lines: List[str] = []
    best = fidelity.get("auto_vs_best")
    if best:
        lines += [
            "",
            "## EOGP auto against the better of EOGP and EOGP-rot",
            "",
            "Query means; Δ = auto − best ± the standard error of the paired per-query differences; "
            "never worse: Δ ≥ −SE.",
            "",
        ]
        for metric in [key for key in best[0] if key not in ("budget", "k")]:
            lines += [
                f"| {report.metric_label(metric)} | k per module | EOGP | EOGP-rot | auto | Δ (auto − best) "
                "| never worse |",
                "|---|---:|---:|---:|---:|---:|---|",
            ]
            for row in best:
                v = row[metric]
                lines.append(
                    f"| {report.format_bytes(row['budget'])} | {_span(row['k'])} | {_fmt(v['eogp'])} | "
                    f"{_fmt(v['eogp-rot'])} | {_fmt(v['auto'])} | {_fmt(v['diff'], '+.3f')} ± "
                    f"{_fmt(v['diff_se'])} | {'yes' if v['never_worse'] else 'NO'} |"
                )
            lines.append("")
    choices = fidelity.get("auto_choice")
    if choices:
        metric = next(key for key in choices[0]["reference_gain"] if key.startswith("ndcg@"))
        rotated = sum(1 for c in choices if c["code"] == registry.Auto.ROTATED)
        lines += [
            "",
            "## EOGP auto: the choice per module",
            "",
            f"{rotated} of {len(choices)} (budget, module) pairs chose EOGP-rot. Proxy: EOGP-rot − EOGP "
            "on the held-out fitting documents (mean of NDCG@20 and Spearman against their first-stage inner "
            "products, paired per "
            "pseudo-query, ± SE). Reference gain: fidelity to kronfluence's EK-FAC with only this module "
            "rotated, minus all-EOGP (± paired SE).",
            "",
            f"| Budget | module | k | code | proxy | gain {report.metric_label(metric)} | gain Spearman |",
            "|---|---|---:|---|---:|---:|---:|",
        ]
        for c in choices:
            gain = c["reference_gain"]
            lines.append(
                f"| {report.format_bytes(c['budget'])} | {c['module']} | {c['k']} | {c['code']} | "
                f"{_fmt(c['proxy_diff'], '+.3f')} ± {_fmt(c['proxy_diff_se'])} | "
                f"{_fmt(gain[metric], '+.4f')} ± {_fmt(gain[metric + '_se'], '.4f')} | "
                f"{_fmt(gain['spearman'], '+.4f')} ± {_fmt(gain['spearman_se'], '.4f')} |"
            )
        lines.append("")
    return lines


def _span(values) -> str:
    values = list(values)
    return str(values[0]) if len(set(values)) == 1 else f"{min(values)}–{max(values)}"


def _fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)
