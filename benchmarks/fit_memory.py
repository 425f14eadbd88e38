#!/usr/bin/env python
"""Fit memory: does ``eogp plan`` predict the peaks of fit, ingest and query, in float32 and bf16?

GPT-2-shaped models (random init, built from configs, the shipped tokenizer's 2,048-token
vocabulary) of width 256 or 768 (``--width``), with 2 or 8 layers (``--layers``: 8 and 32
attributed modules), in float32 and bfloat16 (``--dtype``), are fitted with ``--m`` first-stage
coordinates per module (65,536) on ``--pca-examples`` PCA fitting examples of the default corpus
(512), at ``k = 64`` or at the largest ``k`` the plan allows (``--k 0``: ``k_max``). Into the
fitted index, ``--ingest`` documents are ingested (``P`` resident, one batch at a time), the same
documents are block-ingested into a copy of it (``P`` read in turn, once for one block of all of
them), and one batch of 8 queries runs (corpus documents of ``--max-tokens`` tokens: the batch the
plan counts).

Each run is its own subprocess, made twice:

* once for its peak RSS (``VmHWM``) and the process baseline (everything imported, no model
  built), and, for the fit, the peak of each phase and of kronfluence's three steps in its
  curvature phase (the peak is reset between them through ``/proc/self/clear_refs``);
* once under ``torch.profiler`` (``profile_memory=True``) for the peak of live tensor bytes,
  the running total of torch's CPU allocator: what a GPU's ``max_memory_allocated`` would show.
  It leaves out what is not a tensor (the interpreter, the allocator's and oneDNN's caches, NumPy
  and Arrow buffers), and the profiler's own records would inflate that run's RSS, hence the
  separate run. ``--no-tensors`` skips it.

``eogp plan``'s estimate (before the fit for the fit, of the fitted index for the rest) is set
beside both: whole, against the peak RSS; less its process term, against the live tensors. The
bfloat16 peaks are given as ratios of the float32 ones. Nothing is asserted: the figures are
printed.

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
from dataclasses import replace
from pathlib import Path
from typing import Optional

from common import add_json_argument, peak_rss_bytes, prints_json, write_json

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "default" / "model"
CORPUS = ROOT / "examples" / "default" / "corpus" / "train.jsonl.gz"
BATCH = 8
#: GB of P the block run may keep in memory: far below any P, so that it is read in turn.
IN_TURN_GB = 1e-6
#: The plan's memory keys beside the measured phases.
PHASES = {
    "fit_curvature": "_curvature",
    "fit_first_stage": "_first_stage_pass",
    "fit_pca": "_fit_modules",
    "fit_save": "save_projection",
}
#: kronfluence's steps within fit_curvature (``Analyzer`` methods), measured as stretches of their own.
KRONFLUENCE_STEPS = {
    "covariance pass": "fit_covariance_matrices",
    "eigendecomposition": "perform_eigendecomposition",
    "Λ pass": "fit_lambda_matrices",
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
        from kronfluence.analyzer import Analyzer

        for step, attr in KRONFLUENCE_STEPS.items():  # within fit_curvature
            measured(Analyzer, attr, f"fit_curvature/{step}")
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
    elif args.child in ("ingest", "block"):
        examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, args.ingest, seed=1)
        if args.child == "block":  # P read in turn, once per block of every ingested document
            gradients = replace(gradients, projection_memory_gb=IN_TURN_GB)
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        index.ingest(examples, progress=False, block_documents=args.ingest if args.child == "block" else None)
    else:
        # One batch of BATCH queries, each a corpus document of --max-tokens tokens: the query
        # phase the plan counts.
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, BATCH, seed=2)
        index.search([list(e.input_ids) for e in examples], many=True).limit(20).to_list()
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


def plans_for(layers: int, k: int, width: int, dtype: str, out: Optional[Path], args: argparse.Namespace) -> dict:
    """``eogp plan``'s accounting for each run (:mod:`eogp_index.fit.plan`), on the CPU with the
    run's batch of ``BATCH`` documents: before the fit for the fit (the kept eigenvector columns
    bounded), and of the fitted index ``out`` (``eogp plan INDEX``: exact) for ingest, block
    ingest (``P`` in turn, one block of every ingested document) and the query; ``out`` None:
    the fit's only. As JSON (``eogp plan --json``'s), as the results are saved and read back."""
    from transformers import AutoTokenizer

    from eogp_index.config import ProjectionConfig
    from eogp_index.fit.plan import make_plan, shape_of_config
    from eogp_index.store.index_plan import plan_of_index

    shape = shape_of_config(
        _gpt2(AutoTokenizer.from_pretrained(MODEL), layers, args.max_tokens, width), name="random-gpt2"
    )
    options = dict(batch_size=BATCH, max_tokens=args.max_tokens, documents=args.ingest, device="cpu")
    before = make_plan(
        shape,
        ProjectionConfig(k=k, m=args.m, num_fit_examples=args.pca_examples),
        curvature_examples=args.curvature_examples,
        dtype=dtype,
        **options,
    )
    if out is None:
        return {"fit": before.to_json()}
    fitted = plan_of_index(out, shape=shape, **options).to_json()
    in_turn = plan_of_index(out, shape=shape, projection_memory=0, block_documents=args.ingest, **options)
    return {"fit": before.to_json(), "ingest": fitted, "block": in_turn.to_json(), "query": fitted}


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


#: The measured runs and the plan's figure for each.
RUNS = {"fit": "fit_peak", "ingest": "ingest", "block": "ingest_block", "query": "query"}


def _stretch(phases: dict, phase: str):
    """A phase's peak from the stretches of a run: its own and those of the steps marked in it."""
    inside = [
        v
        for label, v in phases.items()
        if label == phase or label.startswith((f"{phase}/", f"after {phase}/"))  # not "after {phase}" itself
    ]
    return max(inside) if inside else None


def lines_of(r: dict) -> list:
    """A dict per run and fit phase (and kronfluence step): ``rss`` (peak RSS, the whole process),
    ``process`` (its baseline), ``tensors`` (live tensor peak), ``plan`` (the plan's estimate,
    its process term included); bytes/1e9."""
    from eogp_index.fit.plan import PROCESS_BYTES

    out = []
    for kind, key in RUNS.items():
        if kind not in r:
            continue
        run, memory = r[kind], r["plans"][kind]["memory"]
        # Figures saved by --json are set against the current process term (--report).
        shift = PROCESS_BYTES - memory["process"]["bytes"]
        tensors = run.get("tensors", {})
        out.append(
            {
                "name": kind,
                "rss": run["peak_rss_gb"],
                "process": run["process_gb"],
                "tensors": tensors.get("peak_gb"),
                "plan": (memory[key]["bytes"] + shift) / 1e9,
            }
        )
        if kind != "fit":
            continue
        weights = r["plans"]["fit"]["model"]["weights_bytes"]
        phases = {p: memory[p]["bytes"] + shift for p in PHASES}
        for step in KRONFLUENCE_STEPS:
            phases[f"fit_curvature/{step}"] = PROCESS_BYTES + weights + memory["fit_curvature"]["steps"][step]
        for phase, planned in phases.items():
            rss = _stretch(run["phases_gb"], phase)
            out.append(
                {
                    "name": ("    " if "/" in phase else "  ") + phase.split("/")[-1],
                    "rss": rss,
                    "process": run["process_gb"],
                    "tensors": _stretch(tensors.get("stretches_gb", {}), phase),
                    "plan": planned / 1e9,
                }
            )
    return out


def _factor(planned, measured):
    return max(planned / measured, measured / planned) if planned and measured else None


def summary(results: list) -> dict:
    """Worst plan/measured factors (whole process against RSS; the plan less its process term
    against live tensors), the memory besides tensors, and the bf16/float32 ratios."""
    from eogp_index.fit.plan import PROCESS_BYTES

    totals, terms, besides = [], [], []
    for r in results:
        for line in lines_of(r):
            if line["name"].startswith(" "):
                continue
            totals.append(_factor(line["plan"], line["rss"]))
            if line["tensors"]:
                terms.append(_factor(line["plan"] - PROCESS_BYTES / 1e9, line["tensors"]))
                besides.append(line["rss"] - line["tensors"])
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
        for mine, theirs in zip(lines_of(r), lines_of(base)):
            if mine["name"].startswith(" "):
                continue
            ratios.append(
                {
                    "width": r["width"],
                    "layers": r["layers"],
                    "k": r["k"],
                    "dtype": r["dtype"],
                    "run": mine["name"],
                    "rss": mine["rss"] / theirs["rss"],
                    "rss_above_process": (mine["rss"] - mine["process"]) / (theirs["rss"] - theirs["process"]),
                    "tensors": mine["tensors"] / theirs["tensors"] if mine["tensors"] and theirs["tensors"] else None,
                    "plan": (mine["plan"] - PROCESS_BYTES / 1e9) / (theirs["plan"] - PROCESS_BYTES / 1e9),
                }
            )
    return {
        "worst_factor_rss": max(filter(None, totals), default=None),
        "worst_factor_tensors": max(filter(None, terms), default=None),
        "besides_tensors_gb": [min(besides), max(besides)] if besides else None,
        "process_bytes": PROCESS_BYTES,
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
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the figures of earlier runs (their --json files) together, against the current plan's "
        "process term, instead of measuring",
    )
    parser.add_argument("--child", choices=("fit", "ingest", "block", "query"), help=argparse.SUPPRESS)
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
    if args.report:
        saved = [json.loads(path.read_text()) for path in args.report]
        results = [r for figures in saved for r in figures["runs"]]
        for key, value in saved[0]["settings"].items():
            setattr(args, key.replace("-", "_"), value)
        args.width = sorted({r["width"] for r in results})
        args.dtype = sorted({r["dtype"] for r in results}, reverse=True)
        report(results, summary(results), args, sorted({r["k"] for r in results}))
        return
    k_max = plans_for(args.layers[0], 64, args.width[0], "float32", None, args)["fit"]["limits"]["k_max"]
    ks = [k or k_max for k in args.k]
    results = []
    work = Path(tempfile.mkdtemp(prefix="fit-memory-"))
    try:
        for width, k, layers, dtype in itertools.product(args.width, ks, args.layers, args.dtype):
            name = f"W{width}-L{layers}-k{k}-{dtype}"
            runs = ["fit"] if args.no_ingest else list(RUNS)
            row = {"width": width, "layers": layers, "k": k, "dtype": dtype, "modules": 4 * layers}
            # Measured for RSS, then again under the profiler for tensors (into a fit of its own).
            for tensors in (False,) if args.no_tensors else (False, True):
                out = work / (name + ("-t" if tensors else ""))
                block = out.with_name(out.name + "-block")  # the fitted index again, for the block run
                for kind in runs:
                    result = run_child(kind, layers, k, width, dtype, block if kind == "block" else out, args, tensors)
                    if kind == "fit" and not args.no_ingest:
                        shutil.copytree(out, block)
                    if tensors:
                        row[kind]["tensors"] = result["tensors"]
                    else:
                        row[kind] = result
                if not tensors:
                    row["plans"] = plans_for(layers, k, width, dtype, None if args.no_ingest else out, args)
            results.append(row)
            for path in work.glob(name + "*"):
                shutil.rmtree(path, ignore_errors=True)
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
            "queries": BATCH,
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
    from eogp_index.fit.plan import PROCESS_BYTES

    print(
        f"m = {args.m:,} per module, {args.pca_examples} PCA fitting examples, {args.curvature_examples} curvature "
        f"examples, max {args.max_tokens} tokens, batch {BATCH}; into the fitted index: ingest of {args.ingest} "
        f"documents (P resident), block ingest of them (P in turn, one block) and one batch of {BATCH} queries; "
        "each run in its own process"
    )
    print(
        "rss: peak RSS (VmHWM) of the whole process; base: its baseline (imports, no model); tensors: peak of live "
        "tensor bytes (torch's CPU allocator, a profiled run of its own); plan: eogp plan's estimate, its process "
        f"term ({PROCESS_BYTES / 1e9:.2f} GB) included; plan/rss: whole process; terms/tensors: the plan less its "
        "process term against the tensors; rss-tensors: what the process holds besides tensors"
    )
    print(
        f"{'width':>5} {'k':>4} {'layers':>6} {'dtype':<9} {'run':<22} {'rss':>6} {'base':>6} {'tensors':>8} "
        f"{'plan':>6} {'plan/rss':>9} {'terms/tensors':>14} {'rss-tensors':>12}"
    )

    def gb(x):
        return f"{x:.3f}" if x is not None else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "-"

    for r in results:
        for line in lines_of(r):
            terms = line["plan"] - PROCESS_BYTES / 1e9
            besides = line["rss"] - line["tensors"] if line["rss"] is not None and line["tensors"] else None
            print(
                f"{r['width']:>5} {r['k']:>4} {r['layers']:>6} {r['dtype']:<9} {line['name']:<22} {gb(line['rss']):>6} "
                f"{gb(line['process']):>6} {gb(line['tensors']):>8} {gb(line['plan']):>6} "
                f"{ratio(line['plan'], line['rss']):>9} {ratio(terms, line['tensors']):>14} {gb(besides):>12}"
            )
        for kind in RUNS:
            at_peak = r.get(kind, {}).get("tensors", {}).get("at_peak_by_op_gb", {})
            if at_peak:
                print(f"{'':>12} at the {kind} peak: " + ", ".join(f"{op} {b:.3f}" for op, b in at_peak.items()))
    print(
        f"plan vs measured peaks (fit, ingest, block, query), worst factor: whole process against RSS "
        f"{ratio(totals['worst_factor_rss'], 1)}, terms against tensors {ratio(totals['worst_factor_tensors'], 1)} "
        "(target within 1.5x)"
    )
    if totals["besides_tensors_gb"]:
        lo, hi = totals["besides_tensors_gb"]
        print(
            f"held besides tensors (rss - tensors): {lo:.2f}-{hi:.2f} GB; the plan's process term {PROCESS_BYTES / 1e9:.2f} GB"
        )
    for q in totals["dtype_ratios"]:
        print(
            f"width {q['width']}, {q['layers']} layers, k = {q['k']}: {q['dtype']} / float32 {q['run']}: "
            f"tensors {ratio(q['tensors'], 1)}, rss above baseline {q['rss_above_process']:.2f}, rss {q['rss']:.2f}, "
            f"plan terms {q['plan']:.2f}" + (" (target <= 0.6)" if q["run"] in ("ingest", "block") else "")
        )


if __name__ == "__main__":
    main()
