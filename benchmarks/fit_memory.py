#!/usr/bin/env python
"""Fit memory: does the peak RSS of ``eogp fit`` grow with the number of modules, and does
``eogp plan`` predict the peaks of fit, ingest and query?

GPT-2-shaped models (random init, built from configs, the shipped tokenizer's vocabulary) of
width 256 or 768 (``--width``), with 2 or 8 layers (``--layers``: 8 and 32 attributed modules),
in float32 and bfloat16 (``--dtype``), are fitted with ``m = 65,536`` first-stage coordinates
per module on 512 PCA fitting examples of the default corpus, at ``k = 64`` or at the largest
``k`` the plan allows (``--k 0``: ``k_max``; a PCA of 512 examples has at most 512 directions).
The bfloat16 ingest's peak is printed as a ratio of the float32 one's. Each fit, each ingest
of ``--ingest`` documents into the fitted index and each query run runs in its own subprocess,
which reports its own peak RSS (``VmHWM``), and, for the fit, the peak of each phase (the peak
is reset between phases through ``/proc/self/clear_refs``). ``eogp plan``'s estimate is printed
beside every measured peak.

Keeping every module's first-stage coordinates of the fitting set in memory as float32 (the fit
before the on-disk cache) would add ``24 modules × 512 × 65,536 × 4 B = 3.2 GB`` from 2 to 8
layers; measured then: 2.96 GB and 8.06 GB (growth 5.1 GB). What still grows with the layers is
the model and kronfluence's factors (held for every module at once while it fits them).
Nothing is asserted: the figures are printed.

    python benchmarks/fit_memory.py                      # width 256, 2 layers, k = 64, float32 and bf16
    python benchmarks/fit_memory.py --width 256 768 --layers 2 8 --k 64 0
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
M = 65536
PCA_EXAMPLES = 512
BATCH = 8
ALL_IN_RAM_GROWTH_GB = 24 * PCA_EXAMPLES * M * 4 / 1e9  # float32 coordinates of the 24 extra modules
#: The plan's memory keys beside the measured phases.
PHASES = {"fit_curvature": "_curvature", "fit_first_stage": "_first_stage_pass", "fit_pca": "_fit_modules",
          "fit_save": "save_projection"}


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


def _gpt2(tokenizer, layers: int, max_tokens: int, width: int):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=len(tokenizer), n_positions=max_tokens, n_embd=width, n_layer=layers,
                      n_head=width // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


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
    model = _model(tokenizer, args.layers, args.max_tokens, args.width[0], args.dtype[0])
    start = time.perf_counter()
    if args.child == "fit":
        import eogp_index.fit.fitting as fitting
        import eogp_index.store.projection_file as projection_file

        def measured(owner, attr, key):
            inner = getattr(owner, attr)

            def wrapper(*a, **kw):
                reset_hwm(key)
                try:
                    return inner(*a, **kw)
                finally:
                    reset_hwm(f"after {key}")
            setattr(owner, attr, wrapper)

        for key, attr in PHASES.items():
            measured(projection_file if attr == "save_projection" else fitting, attr, key)
        reset_hwm("sampling the fitting set")
        examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, PCA_EXAMPLES, seed=0)
        AttributionIndex.create(args.out, model, tokenizer, examples, model_name="random-gpt2",
                                projection=ProjectionConfig(k=args.k, m=M, num_fit_examples=PCA_EXAMPLES),
                                curvature=CurvatureConfig(num_examples=args.curvature_examples, batch_size=BATCH),
                                gradients=gradients, mode="overwrite", progress=False, dtype=args.dtype[0])
    elif args.child == "ingest":
        examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, args.ingest, seed=1)
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        index.ingest(examples, progress=False)
    else:
        index = AttributionIndex.open(args.out, model=model, tokenizer=tokenizer, gradients=gradients)
        queries = [json.loads(line)["text"] for line in QUERIES.read_text().splitlines()[:args.queries]]
        for query in queries:
            index.top_influential(query, k=20)
    reset_hwm("end")
    phases = {k: v / 1e9 for k, v in STRETCHES.items()}
    print(json.dumps({"run": args.child, "layers": args.layers, "k": args.k, "width": args.width[0],
                      "dtype": args.dtype[0], "peak_rss_gb": peak() / 1e9,
                      "process_gb": process / 1e9, "phases_gb": phases,
                      "seconds": time.perf_counter() - start, "modules": 4 * args.layers}))


def plan_for(layers: int, k: int, width: int, dtype: str, args: argparse.Namespace) -> dict:
    """``eogp plan``'s accounting for one run (:mod:`eogp_index.fit.plan`): on the CPU, with the
    run's batch of ``BATCH`` documents."""
    from transformers import AutoTokenizer

    from eogp_index.config import ProjectionConfig
    from eogp_index.fit.plan import make_plan, shape_of_config

    config = _gpt2(AutoTokenizer.from_pretrained(MODEL), layers, args.max_tokens, width)
    projection = ProjectionConfig(k=k, m=M, num_fit_examples=PCA_EXAMPLES)
    return make_plan(shape_of_config(config, name="random-gpt2"), projection,
                     curvature_examples=args.curvature_examples, batch_size=BATCH, max_tokens=args.max_tokens,
                     documents=args.ingest, dtype=dtype, device="cpu")


def run_child(kind: str, layers: int, k: int, width: int, dtype: str, out: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--layers", str(layers), "--k", str(k),
               "--width", str(width), "--dtype", dtype,
               "--max-tokens", str(args.max_tokens), "--curvature-examples", str(args.curvature_examples),
               "--ingest", str(args.ingest), "--queries", str(args.queries), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{kind} of {layers} layers, k={k} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"width {width}, {layers} layers, k = {k}, {dtype}, {kind}: peak RSS {result['peak_rss_gb']:.2f} GB "
          f"in {result['seconds']:.0f}s",
          file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[64], help="k values (0: the plan's k_max)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2])
    parser.add_argument("--width", type=int, nargs="+", default=[256], help="hidden sizes (the issue's: 256 768)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"], help="the model's precision in every run")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--curvature-examples", type=int, default=128)
    parser.add_argument("--ingest", type=int, default=256, help="documents ingested after each fit")
    parser.add_argument("--queries", type=int, default=8, help="queries run after the ingest")
    parser.add_argument("--no-ingest", action="store_true", help="measure the fits only")
    add_json_argument(parser)
    parser.add_argument("--child", choices=("fit", "ingest", "query"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
            row["plan"] = plan_for(layers, k, width, dtype, args)
            results.append(row)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, results)
    if prints_json(args):
        return
    print(f"m = {M:,} per module, {PCA_EXAMPLES} PCA fitting examples, {args.curvature_examples} curvature examples, "
          f"max {args.max_tokens} tokens, batch {BATCH}; peak RSS (VmHWM) of each run in its own process; "
          f"ingest of {args.ingest} documents and {args.queries} queries into the fitted index")
    print(f"process baseline (imports, no model): {results[0]['fit']['process_gb']:.2f} GB")
    print(f"{'width':>5} {'k':>5} {'layers':>6} {'dtype':<9} {'run':<16} {'measured':>9} {'plan':>9} "
          f"{'plan/measured':>14}")
    for r in results:
        memory = r["plan"]["memory"]
        lines = [("fit (peak)", r["fit"]["peak_rss_gb"], memory["fit_peak"]["bytes"] / 1e9)]
        lines += [(f"  {key}", r["fit"]["phases_gb"].get(key), memory[key]["bytes"] / 1e9) for key in PHASES]
        between = {k: v for k, v in r["fit"]["phases_gb"].items() if k not in PHASES and k != "end"}
        for kind in ("ingest", "query"):
            if kind in r:
                lines.append((kind, r[kind]["peak_rss_gb"], memory[kind]["bytes"] / 1e9))
        for name, measured, planned in lines:
            ratio = f"{planned / measured:.2f}" if measured else "-"
            shown = f"{measured:.2f}GB" if measured is not None else "-"
            print(f"{r['width']:>5} {r['k']:>5} {r['layers']:>6} {r['dtype']:<9} {name:<16} {shown:>9} "
                  f"{planned:>7.2f}GB {ratio:>14}")
        print(f"{'':>12} between the fit's phases: " + ", ".join(f"{k} {v:.2f}GB" for k, v in between.items()))
    for width, k, dtype in itertools.product(args.width, ks, args.dtype):
        rows = {r["layers"]: r["fit"]["peak_rss_gb"] for r in results
                if (r["width"], r["k"], r["dtype"]) == (width, k, dtype)}
        if len(rows) >= 2:
            lo, hi = min(rows), max(rows)
            print(f"width {width}, k = {k}, {dtype}: fit growth from {lo} to {hi} layers {rows[hi] - rows[lo]:.2f} GB "
                  "(target < 1.0 GB; "
                  f"every module's float32 coordinates in RAM would add {ALL_IN_RAM_GROWTH_GB:.1f} GB; "
                  "measured before the cache: 2.96 -> 8.06 GB, +5.1 GB)")
    worst = max(max(p / m, m / p) for r in results for _, m, p in
                [("fit", r["fit"]["peak_rss_gb"], r["plan"]["memory"]["fit_peak"]["bytes"] / 1e9)]
                + [(kind, r[kind]["peak_rss_gb"], r["plan"]["memory"][kind]["bytes"] / 1e9)
                   for kind in ("ingest", "query") if kind in r])
    print(f"plan vs measured peaks (fit, ingest, query): worst factor {worst:.2f} (target within 1.5x)")
    for r in results:
        other = next((o for o in results if o["dtype"] == "float32" and r["dtype"] != "float32"
                      and (o["width"], o["k"], o["layers"]) == (r["width"], r["k"], r["layers"])), None)
        if other is not None and "ingest" in r:
            print(f"width {r['width']}, {r['layers']} layers, k = {r['k']}: {r['dtype']} ingest / float32 ingest "
                  f"{r['ingest']['peak_rss_gb'] / other['ingest']['peak_rss_gb']:.2f} (target <= 0.6; both "
                  f"include the {r['fit']['process_gb']:.2f} GB process baseline)")


if __name__ == "__main__":
    main()
