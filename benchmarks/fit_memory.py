#!/usr/bin/env python
"""Fit memory: does the peak RSS of ``eogp fit`` grow with the number of modules?

GPT-2-shaped models of width 256 (random init, built from configs, the shipped tokenizer's
vocabulary), with 2 and 8 layers (8 and 32 attributed modules), are fitted with
``m = 65,536`` first-stage coordinates per module on 512 PCA fitting examples of the default
corpus, at ``k = 64`` and at a larger ``k``. Each fit runs in its own subprocess, which reports
its own peak RSS (``ru_maxrss``), so that the peaks are separate; they are printed side by side.

Keeping every module's first-stage coordinates of the fitting set in memory as float32 (the fit
before the on-disk cache) would add ``24 modules × 512 × 65,536 × 4 B = 3.2 GB`` from 2 to 8
layers; measured then: 2.96 GB and 8.06 GB (growth 5.1 GB). With the cache, what still grows
with the layers is the model, kronfluence's factors (held for every module at once), and the
fitted ``P`` matrices, which are read from their memory maps (page cache, counted in RSS) while
the projection file is written. Nothing is asserted: the figures are printed.

    python benchmarks/fit_memory.py                      # both depths, k = 64 and k = 256
    python benchmarks/fit_memory.py --k 64 --max-tokens 64 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "default" / "model"
CORPUS = ROOT / "examples" / "default" / "corpus" / "train.jsonl.gz"
ALL_IN_RAM_GROWTH_GB = 24 * 512 * 65536 * 4 / 1e9  # float32 coordinates of the 24 extra modules


def child(args: argparse.Namespace) -> None:
    """One fit; prints its peak RSS as JSON on the last line."""
    import warnings

    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
    from eogp_index.data.records import RecordSpec
    from eogp_index.fit.sampling import sample_shards

    warnings.simplefilter("ignore")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.max_tokens, n_embd=256, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    examples, _ = sample_shards([CORPUS], RecordSpec(max_tokens=args.max_tokens), tokenizer, 512, seed=0)
    start = time.perf_counter()
    AttributionIndex.create(args.out, model, tokenizer, examples, model_name="random-gpt2",
                            projection=ProjectionConfig(k=args.k, m=65536, num_fit_examples=512),
                            curvature=CurvatureConfig(num_examples=args.curvature_examples, batch_size=8),
                            gradients=GradientConfig(batch_size=8, max_tokens=args.max_tokens, device="cpu"),
                            mode="overwrite", progress=False)
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"layers": args.layers, "k": args.k, "peak_rss_gb": peak_kb * 1024 / 1e9,
                      "fit_seconds": seconds, "modules": 4 * args.layers}))


def plan_estimate(layers: int, k: int, max_tokens: int, curvature_examples: int) -> str:
    """``eogp plan``'s estimate of the fit's peak memory (``eogp_index.fit.plan``), when it exists here."""
    try:
        from transformers import AutoTokenizer, GPT2Config

        from eogp_index.config import ProjectionConfig
        from eogp_index.fit.plan import make_plan, shape_of_config
    except ImportError:
        return "-"
    config = GPT2Config(vocab_size=len(AutoTokenizer.from_pretrained(MODEL)), n_positions=max_tokens, n_embd=256,
                        n_layer=layers, n_head=4)
    plan = make_plan(shape_of_config(config, name="random-gpt2"),
                     ProjectionConfig(k=k, m=65536, num_fit_examples=512), curvature_examples=curvature_examples,
                     batch_size=8, max_tokens=max_tokens)
    return f"{plan['memory']['fit_peak']['bytes'] / 1e9:.2f}GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[64, 256], help="k values (default 64 and 256)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--curvature-examples", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.layers, args.k = args.layers[0], args.k[0]
        child(args)
        return
    results = []
    work = Path(tempfile.mkdtemp(prefix="fit-memory-"))
    try:
        for k in args.k:
            for layers in args.layers:
                out = work / f"L{layers}-k{k}"
                command = [sys.executable, __file__, "--child", "--layers", str(layers), "--k", str(k),
                           "--max-tokens", str(args.max_tokens), "--curvature-examples",
                           str(args.curvature_examples), "--out", str(out)]
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"fit of {layers} layers, k={k} failed:\n{done.stderr[-3000:]}")
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{layers} layers, k = {k}: peak RSS {results[-1]['peak_rss_gb']:.2f} GB", file=sys.stderr,
                      flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"m = 65,536 per module, 512 PCA fitting examples, {args.curvature_examples} curvature examples, "
          f"max {args.max_tokens} tokens, width 256; peak RSS of each fit in its own process")
    print(f"{'k':>5} {'layers':>6} {'modules':>7} {'peak RSS':>9} {'fit time':>9} {'plan est.':>10}")
    for r in results:
        print(f"{r['k']:>5} {r['layers']:>6} {r['modules']:>7} {r['peak_rss_gb']:>7.2f}GB {r['fit_seconds']:>8.0f}s "
              f"{plan_estimate(r['layers'], r['k'], args.max_tokens, args.curvature_examples):>10}")
    for k in args.k:
        rows = {r["layers"]: r["peak_rss_gb"] for r in results if r["k"] == k}
        if len(rows) >= 2:
            lo, hi = min(rows), max(rows)
            print(f"k = {k}: growth from {lo} to {hi} layers {rows[hi] - rows[lo]:.2f} GB (target < 1.0 GB; "
                  f"every module's float32 coordinates in RAM would add {ALL_IN_RAM_GROWTH_GB:.1f} GB; "
                  "measured before the cache: 2.96 -> 8.06 GB, +5.1 GB)")


if __name__ == "__main__":
    main()
