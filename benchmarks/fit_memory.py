#!/usr/bin/env python
"""Fit memory: does ``eogp plan`` predict the peaks of fit, ingest and query, in float32 and bf16?

GPT-2-shaped models (random init, built from configs, the shipped tokenizer's 2,048-token
vocabulary) of width 256 or 768 (``--width``), with 2 or 8 layers (``--layers``: 8 and 32
attributed modules), in float32 and bfloat16 (``--dtype``), are fitted with ``--m`` first-stage
coordinates per module (65,536) on ``--pca-examples`` PCA fitting examples of the default corpus
(512), at ``k = 64`` or at the largest ``k`` the plan allows (``--k 0``: ``k_max``). Then
``--ingest`` documents are ingested into the fitted index (``P`` resident, one batch at a time)
and ``--queries`` queries run against it.

Each fit, ingest and query runs in its own subprocess, twice:

* once for its peak RSS (``VmHWM``) above the process baseline (everything imported, no model
  built), and, for the fit, the peak of each phase (the peak is reset between phases through
  ``/proc/self/clear_refs``);
* once under ``torch.profiler`` (``profile_memory=True``) for the peak of live tensor bytes,
  the running total of torch's CPU allocator: what the plan models. It leaves out what is not a
  tensor (the interpreter, the allocator's and oneDNN's caches, NumPy and Arrow buffers), and the
  profiler's own records would inflate that run's RSS, hence the separate run.
  ``--no-tensors`` skips it.

``eogp plan``'s estimate, less its process term, is printed beside both, with the ratios, and
the bfloat16 peaks as ratios of the float32 ones. Nothing is asserted: the figures are printed.

    python benchmarks/fit_memory.py                      # width 256, 2 layers, k = 64, float32 and bf16
    python benchmarks/fit_memory.py --width 256 768 --layers 2 8
    python benchmarks/fit_memory.py --dtype bfloat16 --json fit-memory.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_json_argument, peak_rss_bytes, prints_json, write_json

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "default" / "model"
CORPUS = ROOT / "examples" / "default" / "corpus" / "train.jsonl.gz"
QUERIES = ROOT / "examples" / "default" / "queries.jsonl"
BATCH = 8
#: The plan's memory keys beside the measured phases.
PHASES = {
    "fit_curvature": "_curvature",
    "fit_first_stage": "_first_stage_pass",
    "fit_pca": "_fit_modules",
    "fit_save": "save_projection",
}


def hwm() -> int:
    """This process's peak resident set since start or the last :func:`reset_hwm`, in bytes."""
    return peak_rss_bytes()


PEAK = [0]  # the run's peak: the largest of every stretch's, since resets lose the earlier ones
#: Peak RSS of each stretch of the fit: a phase, or the time between two ("after fit_pca", ...).
STRETCHES = {}
CURRENT = ["start"]


def reset_hwm(label: str) -> None:
    """End the current stretch (recording its peak) and start ``label``'s."""
    now = hwm()
    PEAK[0] = max(PEAK[0], now)
    STRETCHES[CURRENT[0]] = max(STRETCHES.get(CURRENT[0], 0), now)
    CURRENT[0] = label
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets the peak RSS to the current RSS (Linux >= 4.0)


def peak() -> int:
    """The peak resident set of the whole run, across resets."""
    return max(PEAK[0], hwm())


MARKS = []  # (time.time_ns(), stretch label): where each stretch starts, to split the tensor timeline


def mark(label: str) -> None:
    """Start stretch ``label``: its peak RSS (:func:`reset_hwm`) and its start on the tensor timeline."""
    reset_hwm(label)
    MARKS.append((time.time_ns(), label))


def tensor_peaks(prof, marks) -> dict:
    """The peak of live tensor bytes of a profiled run, from the CPU allocator's running total
    (``torch.profiler`` with ``profile_memory=True``): the whole run's and each stretch's, and the
    tensors alive at the whole run's peak, in bytes by the operator that allocated them.

    The running total counts what torch's CPU allocator holds for tensors (weights included, from
    the model's construction on); not NumPy or Arrow buffers, the allocator's or oneDNN's caches,
    or the interpreter.
    """
    import torch

    allocation = torch._C._profiler._EventType.Allocation
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == allocation:
            fields = node.typed[1]
            op = node.parent.name if node.parent is not None else "(outside an op)"
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated, op))
    events.sort(key=lambda e: e[0])
    before = events[0][3] - events[0][2] if events else 0  # the running total's count before the profile
    live, at_peak, peak_bytes = {}, {}, 0
    stretches, bounds = {}, sorted(marks)
    for when, ptr, size, total, op in events:
        if size > 0:
            live[ptr] = (size, op)
        else:
            live.pop(ptr, None)
        total -= before
        label = next((lab for t, lab in reversed(bounds) if t <= when), "start")
        stretches[label] = max(stretches.get(label, 0), total)
        if total > peak_bytes:
            peak_bytes = total
            at_peak = dict(live)
    by_op = {}
    for size, op in at_peak.values():
        by_op[op] = by_op.get(op, 0) + size
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:8]
    return {
        "peak_gb": peak_bytes / 1e9,
        "stretches_gb": {k: v / 1e9 for k, v in stretches.items()},
        "at_peak_by_op_gb": {op: b / 1e9 for op, b in top},
    }


def loss_bytes() -> None:
    """Bytes per logit element that the loss's forward and backward passes hold on top of the
    logits, by torch's CPU allocator: ``F.cross_entropy`` on logits upcast to float32 (what the
    loss did before it upcast a chunk of tokens at a time) against ``gradients.loss``, and the
    plan's figure (``fit.plan.logits_bytes``, which counts the logits themselves too)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from eogp_index.fit.plan import logits_bytes
    from eogp_index.gradients.loss import per_example_loss

    def upcast(logits, labels):
        shifted = logits[:, :-1].float()
        return (
            F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), labels[:, 1:].reshape(-1), reduction="none")
            .view(labels[:, 1:].shape)
            .sum(1)
        )

    batch, tokens, vocab = 8, 128, 50257  # GPT-2's vocabulary
    print(f"loss over {batch} x {tokens} tokens x {vocab:,} logits: bytes held per logit element beyond the logits")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(batch, tokens, vocab).to(dtype).requires_grad_()
        labels = torch.randint(0, vocab, (batch, tokens))
        row = []
        for name, loss in (("cross_entropy(logits.float())", upcast), ("gradients.loss", per_example_loss)):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                loss(logits, labels).sum().backward()
            logits.grad = None
            peak = max(0, max(tensor_peaks(prof, [])["stretches_gb"].values()) * 1e9)
            row.append(f"{name} {peak / logits.numel():.1f}")
        planned = logits_bytes(logits.numel(), logits.element_size()) - logits.nbytes
        print(f"  {str(dtype).removeprefix('torch.'):<9} " + ", ".join(row) + f"; plan {planned / logits.numel():.1f}")


def _gpt2(tokenizer, layers: int, max_tokens: int, width: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max_tokens,
        n_embd=width,
        n_layer=layers,
        n_head=width // 64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _model(tokenizer, layers: int, max_tokens: int, width: int, dtype: str):
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)  # the same weights in the fit, ingest and query processes
    return GPT2LMHeadModel(_gpt2(tokenizer, layers, max_tokens, width)).to(getattr(torch, dtype)).eval()


def child(args: argparse.Namespace) -> None:
    """One fit, ingest or query run; prints its peaks as JSON on the last line."""
    import warnings

    warnings.simplefilter("ignore")
    import kronfluence.analyzer  # noqa: F401  (the libraries every run has loaded by its peak, so that
    import lancedb  # noqa: F401   "process" is comparable between runs and with the plan's PROCESS_BYTES)
    import numba  # noqa: F401
    from transformers import AutoTokenizer

    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
    from eogp_index.data.records import RecordSpec
    from eogp_index.fit.sampling import sample_shards

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    gradients = GradientConfig(batch_size=BATCH, max_tokens=args.max_tokens, device="cpu")
    process = hwm()  # everything imported, nothing built
    profiler = None
    if args.tensors:  # a run of its own: the profiler's event records would add to the RSS
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        profiler.__enter__()
    model = _model(tokenizer, args.layers, args.max_tokens, args.width[0], args.dtype[0])
    start = time.perf_counter()
    if args.child == "fit":
        import eogp_index.fit.fitting as fitting
        import eogp_index.store.projection_file as projection_file

        def measured(owner, attr, key):
            inner = getattr(owner, attr)

            def wrapper(*a, **kw):
                mark(key)
                try:
                    return inner(*a, **kw)
                finally:
                    mark(f"after {key}")

            setattr(owner, attr, wrapper)

        for key, attr in PHASES.items():
            measured(projection_file if attr == "save_projection" else fitting, attr, key)
        mark("sampling the fitting set")
        examples, _ = sample_shards(
            [CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, args.pca_examples, seed=0
        )
        AttributionIndex.create(
            args.out,
            model,
            tokenizer,
            examples,
            model_name="random-gpt2",
            projection=ProjectionConfig(k=args.k, m=args.m, num_fit_examples=args.pca_examples),
            curvature=CurvatureConfig(num_examples=args.curvature_examples, batch_size=BATCH),
            gradients=gradients,
            mode="overwrite",
            progress=False,
            dtype=args.dtype[0],
        )
    elif args.child == "ingest":
        examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, args.ingest, seed=1)
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        index.ingest(examples, progress=False)
    else:
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        queries = [json.loads(line)["text"] for line in QUERIES.read_text().splitlines()[: args.queries]]
        for query in queries:
            index.top_influential(query, k=20)
    seconds = time.perf_counter() - start
    mark("end")
    result = {
        "run": args.child,
        "layers": args.layers,
        "k": args.k,
        "width": args.width[0],
        "dtype": args.dtype[0],
        "seconds": seconds,
        "modules": 4 * args.layers,
    }
    if profiler is not None:
        profiler.__exit__(None, None, None)
        result["tensors"] = tensor_peaks(profiler, MARKS)
    else:
        result.update(
            {
                "peak_rss_gb": peak() / 1e9,
                "process_gb": process / 1e9,
                "phases_gb": {k: v / 1e9 for k, v in STRETCHES.items()},
            }
        )
    print(json.dumps(result))


def plan_for(layers: int, k: int, width: int, dtype: str, args: argparse.Namespace) -> dict:
    """``eogp plan``'s accounting for one run (:mod:`eogp_index.fit.plan`): on the CPU, with the
    run's batch of ``BATCH`` documents."""
    from transformers import AutoTokenizer

    from eogp_index.config import ProjectionConfig
    from eogp_index.fit.plan import make_plan, shape_of_config

    config = _gpt2(AutoTokenizer.from_pretrained(MODEL), layers, args.max_tokens, width)
    projection = ProjectionConfig(k=k, m=args.m, num_fit_examples=args.pca_examples)
    return make_plan(
        shape_of_config(config, name="random-gpt2"),
        projection,
        curvature_examples=args.curvature_examples,
        batch_size=BATCH,
        max_tokens=args.max_tokens,
        documents=args.ingest,
        dtype=dtype,
        device="cpu",
    )


def run_child(
    kind: str, layers: int, k: int, width: int, dtype: str, out: Path, args: argparse.Namespace, tensors: bool = False
) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--layers",
        str(layers),
        "--k",
        str(k),
        "--width",
        str(width),
        "--dtype",
        dtype,
        "--max-tokens",
        str(args.max_tokens),
        "--m",
        str(args.m),
        "--pca-examples",
        str(args.pca_examples),
        "--curvature-examples",
        str(args.curvature_examples),
        "--ingest",
        str(args.ingest),
        "--queries",
        str(args.queries),
        "--out",
        str(out),
    ]
    if tensors:
        command.append("--tensors")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{kind} of {layers} layers, k={k} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    what = (
        f"tensor peak {result['tensors']['peak_gb']:.2f} GB" if tensors else f"peak RSS {result['peak_rss_gb']:.2f} GB"
    )
    print(
        f"width {width}, {layers} layers, k = {k}, {dtype}, {kind}: {what} in {result['seconds']:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return result


#: The measured runs and the plan's figure for each: the fit's peak, ingest and query.
RUNS = {"fit": "fit_peak", "ingest": "ingest", "query": "query"}


def lines_of(r: dict) -> list:
    """``(run, RSS above the process baseline, live tensor peak, the plan above its process)`` in
    bytes/1e9, for the runs and the fit's phases (a phase's tensor peak is its stretch's)."""
    from eogp_index.fit.plan import PROCESS_BYTES

    memory, out = r["plan"]["memory"], []
    for kind, key in RUNS.items():
        if kind not in r:
            continue
        run = r[kind]
        tensors = run.get("tensors", {})
        out.append(
            (
                kind,
                run["peak_rss_gb"] - run["process_gb"],
                tensors.get("peak_gb"),
                (memory[key]["bytes"] - PROCESS_BYTES) / 1e9,
            )
        )
        if kind == "fit":
            for phase in PHASES:
                rss = run["phases_gb"].get(phase)
                out.append(
                    (
                        f"  {phase}",
                        None if rss is None else rss - run["process_gb"],
                        tensors.get("stretches_gb", {}).get(phase),
                        (memory[phase]["bytes"] - PROCESS_BYTES) / 1e9,
                    )
                )
    return out


def summary(results: list) -> dict:
    """Worst plan/measured factors and the bf16/float32 ratios, for the text and ``--json``."""
    factors = {"rss": [], "tensors": []}
    for r in results:
        for name, rss, tensors, planned in lines_of(r):
            if name.startswith(" "):
                continue
            for what, measured in (("rss", rss), ("tensors", tensors)):
                if measured:
                    factors[what].append(max(planned / measured, measured / planned))
    ratios = []
    for r in results:
        base = next(
            (
                o
                for o in results
                if o["dtype"] == "float32"
                and r["dtype"] != "float32"
                and (o["width"], o["k"], o["layers"]) == (r["width"], r["k"], r["layers"])
            ),
            None,
        )
        if base is None:
            continue
        mine, theirs = lines_of(r), lines_of(base)
        for (name, rss, tensors, planned), (_, rss0, tensors0, planned0) in zip(mine, theirs):
            if name.startswith(" "):
                continue
            ratios.append(
                {
                    "width": r["width"],
                    "layers": r["layers"],
                    "k": r["k"],
                    "dtype": r["dtype"],
                    "run": name,
                    "rss": rss / rss0,
                    "tensors": tensors / tensors0 if tensors and tensors0 else None,
                    "plan": planned / planned0,
                }
            )
    return {
        "worst_factor_rss": max(factors["rss"], default=None),
        "worst_factor_tensors": max(factors["tensors"], default=None),
        "dtype_ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[64], help="k values (0: the plan's k_max)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2])
    parser.add_argument("--width", type=int, nargs="+", default=[256], help="hidden sizes (the issue's: 256 768)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
        help="the model's precision in every run",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--m", type=int, default=65536, help="first-stage coordinates per module")
    parser.add_argument("--pca-examples", type=int, default=512, help="PCA fitting examples")
    parser.add_argument("--curvature-examples", type=int, default=128)
    parser.add_argument("--ingest", type=int, default=256, help="documents ingested after each fit")
    parser.add_argument("--queries", type=int, default=8, help="queries run after the ingest")
    parser.add_argument("--no-ingest", action="store_true", help="measure the fits only")
    parser.add_argument(
        "--no-tensors",
        action="store_true",
        help="skip the profiled runs that measure live tensor bytes (each run is then made once)",
    )
    add_json_argument(parser)
    parser.add_argument(
        "--loss",
        action="store_true",
        help="only print the bytes per logit element the loss holds, against the plan's figure",
    )
    parser.add_argument("--child", choices=("fit", "ingest", "query"), help=argparse.SUPPRESS)
    parser.add_argument("--tensors", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss:
        loss_bytes()
        return
    if args.child:
        args.layers, args.k = args.layers[0], args.k[0]
        child(args)
        return
    k_max = plan_for(args.layers[0], 64, args.width[0], "float32", args)["limits"]["k_max"]
    ks = [k or k_max for k in args.k]
    results = []
    work = Path(tempfile.mkdtemp(prefix="fit-memory-"))
    try:
        for width, k, layers, dtype in itertools.product(args.width, ks, args.layers, args.dtype):
            out = work / f"W{width}-L{layers}-k{k}-{dtype}"
            runs = ["fit"] if args.no_ingest else ["fit", "ingest", "query"]
            row = {"width": width, "layers": layers, "k": k, "dtype": dtype, "modules": 4 * layers}
            for kind in runs:
                row[kind] = run_child(kind, layers, k, width, dtype, out, args)
            if not args.no_tensors:  # again, profiled: the fit into a second directory, ingest and query into it
                for kind in runs:
                    row[kind]["tensors"] = run_child(
                        kind, layers, k, width, dtype, out.with_name(out.name + "-t"), args, tensors=True
                    )["tensors"]
            row["plan"] = plan_for(layers, k, width, dtype, args)
            results.append(row)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + "-t"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    totals = summary(results)
    figures = {
        "settings": {
            "m": args.m,
            "pca_examples": args.pca_examples,
            "batch": BATCH,
            "curvature_examples": args.curvature_examples,
            "max_tokens": args.max_tokens,
            "ingest": args.ingest,
            "queries": args.queries,
        },
        "runs": results,
        "summary": totals,
    }
    write_json(args.json, figures)
    if prints_json(args):
        return
    report(results, totals, args, ks)


def report(results: list, totals: dict, args: argparse.Namespace, ks: list) -> None:
    """The figures as text: a row per run and fit phase, then the worst factors and dtype ratios."""
    print(
        f"m = {args.m:,} per module, {args.pca_examples} PCA fitting examples, {args.curvature_examples} curvature examples, "
        f"max {args.max_tokens} tokens, batch {BATCH}; ingest of {args.ingest} documents and {args.queries} queries "
        "into the fitted index; each run in its own process"
    )
    print(
        "rss: peak RSS (VmHWM) above the process baseline (imports, no model); tensors: peak of live tensor bytes "
        "(torch's CPU allocator, a profiled run of its own); plan: eogp plan's estimate less its process term"
    )
    print(f"process baseline: {results[0]['fit']['process_gb']:.2f} GB measured")
    print(
        f"{'width':>5} {'k':>4} {'layers':>6} {'dtype':<9} {'run':<17} {'rss':>8} {'tensors':>8} {'plan':>8} "
        f"{'plan/rss':>9} {'plan/tensors':>13}"
    )

    def gb(x):
        return f"{x:.3f}" if x is not None else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "-"

    for r in results:
        for name, rss, tensors, planned in lines_of(r):
            print(
                f"{r['width']:>5} {r['k']:>4} {r['layers']:>6} {r['dtype']:<9} {name:<17} {gb(rss):>8} "
                f"{gb(tensors):>8} {gb(planned):>8} {ratio(planned, rss):>9} {ratio(planned, tensors):>13}"
            )
        at_peak = r["fit"].get("tensors", {}).get("at_peak_by_op_gb", {})
        if at_peak:
            print(
                f"{'':>12} tensors alive at the fit's peak, by allocating op: "
                + ", ".join(f"{op} {b:.3f}" for op, b in at_peak.items())
            )
        for kind in ("ingest", "query"):
            at_peak = r.get(kind, {}).get("tensors", {}).get("at_peak_by_op_gb", {})
            if at_peak:
                print(f"{'':>12} at the {kind} peak: " + ", ".join(f"{op} {b:.3f}" for op, b in at_peak.items()))
    for width, k, dtype in itertools.product(args.width, ks, args.dtype):
        fits = {
            r["layers"]: r["fit"]["peak_rss_gb"]
            for r in results
            if (r["width"], r["k"], r["dtype"]) == (width, k, dtype)
        }
        if len(fits) >= 2:
            lo, hi = min(fits), max(fits)
            print(
                f"width {width}, k = {k}, {dtype}: the fit's peak RSS grows by {fits[hi] - fits[lo]:.2f} GB from "
                f"{lo} to {hi} layers"
            )
    print(
        f"plan vs measured peaks (fit, ingest, query), worst factor: rss {ratio(totals['worst_factor_rss'], 1)}, "
        f"tensors {ratio(totals['worst_factor_tensors'], 1)} (target within 1.5x)"
    )
    for q in totals["dtype_ratios"]:
        print(
            f"width {q['width']}, {q['layers']} layers, k = {q['k']}: {q['dtype']} / float32 {q['run']}: "
            f"rss {q['rss']:.2f}, tensors {ratio(q['tensors'], 1)}, plan {q['plan']:.2f}"
            + (" (target <= 0.6)" if q["run"] == "ingest" else "")
        )


if __name__ == "__main__":
    main()
