#!/usr/bin/env python
"""FAISS candidates + exact rescoring against the exact scan: recall@20 and speed-up.

For each FAISS kind (flat, IVF, HNSW) and each number of candidates ``C``, one line:

* **recall@20**: the share of the exact top-20 (most positive scores, exact scan over every row)
  that the candidate path returns (FAISS ``C`` Hamming-nearest rows to ``pack_signs(y)``, rescored
  exactly, top-20), averaged over the held-out queries; also for the most negative side
  (``pack_signs(-y)`` against the exact bottom-20), for information;
* **speed-up**: time of the exact full scan of one query (``scan.scan_top_k``, the packed-bit
  kernel, or unpack + matmul in numpy chunks if that module is missing) over time of the
  candidate path for one query (FAISS search + key→row mapping + exact rescoring of the ``C``
  rows + top-20), both averaged over the queries, single query at a time.

Target (issue 4): recall@20 >= 0.95 at >= 5x speed-up, on a store of at least 1M rows whose codes
come from a real model's gradients.

The store: real codes of ``--docs`` documents (projected by an EOGP index fitted on the model,
1-bit encoded), replicated to ``--rows`` rows; every copy flips each sign bit independently with
probability ``--flip`` (padding bits stay 0) and multiplies each module scale by
``exp(--scale-jitter · N(0,1))``. Queries are ``--queries`` held-out documents, projected. The
1M-row store is built in memory with numpy and FAISS is built from those arrays with the
library's own construction code (``CandidateIndex.from_codes``); LanceDB is bypassed (both the
exact scan and the rescoring read the in-memory arrays), so the Lance fetch of the candidates'
codes is not in the timings.

Default workload: ``examples/default/model`` and its training corpus when they exist, else a
randomly initialized GPT-2 of the default shape (``tinylm.default_config``) on random token
documents (the header says which). Runs in about 5 minutes on 2 CPU cores::

    python benchmarks/candidates.py                 # table
    python benchmarks/candidates.py --json          # machine-readable
    python benchmarks/candidates.py --rows 200000 --kinds flat,ivf   # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eogp_index.candidates import CandidateIndex, FaissConfig, rescore  # noqa: E402
from eogp_index.client import AttributionIndex, TokenizedExample, load_model  # noqa: E402
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig  # noqa: E402
from eogp_index.quantization import SignLayout, encode, pack_signs  # noqa: E402

TARGET_RECALL = 0.95
TARGET_SPEEDUP = 5.0
TOP = 20
DEFAULT_ROOT = REPO / "examples" / "default"


def load_documents(args):
    """Model, tokenizer, documents (fit + stored + queries) and a description of the source."""
    need = args.fit_examples + args.docs + args.queries
    model_dir = Path(args.model) if args.model else DEFAULT_ROOT / "model"
    # The pretraining docstrings (792) are enough for fitting set + store + queries; train has 512.
    corpus = args.corpus or str(DEFAULT_ROOT / "corpus" / "pretrain.jsonl.gz")
    if (model_dir / "config.json").is_file() and Path(corpus).exists():
        from ingest.records import Example, RecordSpec, iter_examples

        model, tokenizer = load_model(str(model_dir))
        docs = [ex for ex in iter_examples([corpus], RecordSpec(max_tokens=args.max_tokens), tokenizer,
                                           on_error="skip") if isinstance(ex, Example)][:need]
        return model, tokenizer, docs, f"{model_dir} on {corpus} ({len(docs)} documents)"
    if args.model:
        raise SystemExit(f"{model_dir}: no config.json or no corpus {corpus}")
    from transformers import GPT2LMHeadModel

    from eogp_index.evaluation.tinylm import default_config

    torch.manual_seed(0)
    config = default_config()
    model = GPT2LMHeadModel(config).eval()
    rng = random.Random(0)
    docs = []
    for i in range(need):
        n = rng.randint(args.max_tokens // 4, args.max_tokens)
        ids = [rng.randrange(1, config.vocab_size) for _ in range(n)]
        docs.append(TokenizedExample(id=f"doc-{i}", input_ids=ids, labels=ids, shard="random", position=i,
                                     num_tokens=n))
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0, name_or_path="random")
    return model, tokenizer, docs, ("random-init GPT-2 (tinylm.default_config), random token documents "
                                    "(examples/default/model not found)")


def real_codes(args):
    """Projected codes of real documents: ``(signs, scales, y_queries, layout, source, seconds)``."""
    t0 = time.perf_counter()
    model, tokenizer, docs, source = load_documents(args)
    if len(docs) < args.fit_examples + args.docs + args.queries:
        raise SystemExit(f"only {len(docs)} documents, need {args.fit_examples + args.docs + args.queries}")
    fit = docs[: args.fit_examples]
    stored = docs[args.fit_examples: args.fit_examples + args.docs]
    queries = docs[args.fit_examples + args.docs: args.fit_examples + args.docs + args.queries]
    with tempfile.TemporaryDirectory(prefix="eogp-bench-cand-") as tmp:
        index = AttributionIndex.create(
            Path(tmp) / "index", model, tokenizer, fit, model_name=source,
            projection=ProjectionConfig(k=args.k, num_fit_examples=len(fit)),
            curvature=CurvatureConfig(num_examples=min(64, len(fit)), batch_size=8),
            gradients=GradientConfig(batch_size=16, device="cpu"), progress=False)
        x = index.project(stored)
        y = index.project(queries)
        layout = index.layout
    encoded = encode(x, layout, "1bit")
    return encoded.signs, encoded.scales, y.astype(np.float32), layout, source, time.perf_counter() - t0


def replicate(signs: np.ndarray, scales: np.ndarray, layout: SignLayout, rows: int, flip: float, jitter: float,
              seed: int = 0):
    """``rows`` perturbed copies of the real codes (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n, nbytes = signs.shape
    base = np.arange(rows) % n
    out = np.empty((rows, nbytes), np.uint8)
    # Only real coordinates may flip: padding bits stay 0 as pack_signs writes them.
    valid = pack_signs(np.ones((1, layout.num_coords), np.float32), layout)[0]
    threshold = int(round(flip * 256))
    step = 1 << 16
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        bits = np.frombuffer(rng.bytes((stop - start) * nbytes * 8), np.uint8).reshape(stop - start, nbytes * 8)
        flips = np.packbits(bits < threshold, axis=1, bitorder="little") & valid
        out[start:stop] = signs[base[start:stop]] ^ flips
    out[: min(rows, n)] = signs[: min(rows, n)]  # the first copy of each document is the real code
    factor = np.exp(jitter * rng.standard_normal((rows, layout.num_modules), dtype=np.float32))
    factor[: min(rows, n)] = 1.0
    new_scales = (scales[base].astype(np.float32) * factor).astype(np.float16)
    return out, new_scales, float(threshold / 256)


def proxy_correlations(signs, scales, y, layout) -> Dict[str, float]:
    """On the real documents: Pearson correlation of the exact score with what Hamming sees.

    ``sign_agreement`` = ``Σ_j sign(y_j)·b_j`` (what FAISS ranks by), ``weighted_agreement`` =
    ``Σ_j y_j·b_j`` (no scales; not available to a Hamming index), averaged over the queries.
    """
    from eogp_index.quantization import unpack_signs

    b = unpack_signs(signs, layout)
    score = rescore(signs, scales, y, layout).astype(np.float64)
    out = {}
    for name, proxy in (("sign_agreement", np.sign(y) @ b.T), ("weighted_agreement", y @ b.T)):
        out[name] = round(float(np.mean([np.corrcoef(proxy[q], score[q])[0, 1] for q in range(y.shape[0])])), 3)
    return out


def exact_top(codes, scales, y, layout, k):
    """Exact top-k (largest and smallest) per query, and the mean seconds of the largest-only scan."""
    try:
        from eogp_index.scan import scan_top_k
    except ImportError:
        scan_top_k = None
    nq = y.shape[0]
    largest = np.empty((nq, k), np.int64)
    smallest = np.empty((nq, k), np.int64)
    times = []
    if scan_top_k is not None:
        scan_top_k(codes[:4096], scales[:4096], y[:1], layout, k)  # compile / warm up, not timed
        for q in range(nq):
            t0 = time.perf_counter()
            top = scan_top_k(codes, scales, y[q:q + 1], layout, k, smallest=False)
            times.append(time.perf_counter() - t0)
            largest[q] = top.largest_indices[0]
            smallest[q] = scan_top_k(codes, scales, y[q:q + 1], layout, k, largest=False).smallest_indices[0]
        return largest, smallest, float(np.mean(times)), "eogp_index.scan.scan_top_k"
    for q in range(nq):
        t0 = time.perf_counter()
        s = rescore(codes, scales, y[q:q + 1], layout)[0]
        largest[q] = np.argsort(-s, kind="stable")[:k]
        times.append(time.perf_counter() - t0)
        smallest[q] = np.argsort(s, kind="stable")[:k]
    return largest, smallest, float(np.mean(times)), "numpy unpack + matmul (eogp_index.scan missing)"


def candidate_top(cand: CandidateIndex, codes, scales, yq: np.ndarray, layout, C: int, k: int, negative: bool):
    """One query through the candidate path: ``(top-k rows, seconds)``."""
    t0 = time.perf_counter()
    code = pack_signs(-yq if negative else yq, layout)
    _, pos = cand.search_with_distances(code, C)
    rows = pos[0][pos[0] >= 0]
    s = rescore(codes, scales, yq, layout, rows=rows)[0]
    order = np.argsort(s if negative else -s, kind="stable")[:k]
    top = rows[order]
    return top, time.perf_counter() - t0


def run(args) -> Dict[str, Any]:
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    signs, scales, y, layout, source, model_seconds = real_codes(args)
    proxy = proxy_correlations(signs, scales, y, layout)
    t0 = time.perf_counter()
    codes, big_scales, flip = replicate(signs, scales, layout, args.rows, args.flip, args.scale_jitter)
    replicate_seconds = time.perf_counter() - t0
    largest, smallest, exact_seconds, exact_method = exact_top(codes, big_scales, y, layout, TOP)
    ids = [f"row-{i}" for i in range(args.rows)]
    results: List[Dict[str, Any]] = []
    builds: Dict[str, float] = {}
    for kind in args.kinds.split(","):
        config = FaissConfig(kind=kind, nlist=args.nlist, nprobe=args.nprobe[0], hnsw_m=args.hnsw_m,
                             ef_search=args.ef_search, ef_construction=args.ef_construction,
                             train_points_per_list=args.train_points_per_list, use_gpu="auto")
        t0 = time.perf_counter()
        cand = CandidateIndex.from_codes(codes, ids, config)
        builds[kind] = round(time.perf_counter() - t0, 1)
        candidate_top(cand, codes, big_scales, y[:1], layout, 10, TOP, False)  # warm-up
        for nprobe, C in [(p, c) for p in (args.nprobe if kind == "ivf" else [None]) for c in args.C]:
            if C > args.rows:
                continue
            if nprobe is not None:
                cand.set_search(nprobe=nprobe)
            recall, recall_neg, times = [], [], []
            for q in range(y.shape[0]):
                top, seconds = candidate_top(cand, codes, big_scales, y[q:q + 1], layout, C, TOP, False)
                times.append(seconds)
                recall.append(len(np.intersect1d(top, largest[q])) / TOP)
                top_neg, _ = candidate_top(cand, codes, big_scales, y[q:q + 1], layout, C, TOP, True)
                recall_neg.append(len(np.intersect1d(top_neg, smallest[q])) / TOP)
            seconds = float(np.mean(times))
            row = {"kind": kind, "C": C, "recall_at_20": round(float(np.mean(recall)), 4),
                   "min_recall_at_20": round(float(np.min(recall)), 4),
                   "recall_at_20_negative": round(float(np.mean(recall_neg)), 4),
                   "ms_per_query": round(1000 * seconds, 2), "speedup": round(exact_seconds / seconds, 2),
                   "params": {**cand.meta["params"], **({"nprobe": nprobe} if nprobe else {})}}
            row["meets_target"] = row["recall_at_20"] >= TARGET_RECALL and row["speedup"] >= TARGET_SPEEDUP
            results.append(row)
            if args.verbose:
                print(render_row(row), file=sys.stderr, flush=True)
        del cand
    return {
        "workload": source,
        "documents": int(signs.shape[0]), "queries": int(y.shape[0]), "rows": int(args.rows),
        "k_per_module": list(layout.k)[0] if len(set(layout.k)) == 1 else list(layout.k),
        "modules": layout.num_modules, "bits_per_row": layout.nbytes * 8,
        "flip_probability": flip, "scale_jitter_sigma": args.scale_jitter,
        "proxy_correlation": proxy,
        "exact_method": exact_method, "exact_ms_per_query": round(1000 * exact_seconds, 2),
        "exact_gb_per_s": round(codes.nbytes / exact_seconds / 1e9, 2),
        "build_seconds": builds, "model_seconds": round(model_seconds, 1),
        "replicate_seconds": round(replicate_seconds, 1),
        "threads": torch.get_num_threads(),
        "targets": {"recall_at_20": TARGET_RECALL, "speedup": TARGET_SPEEDUP},
        "results": results,
        "meets_target_somewhere": any(r["meets_target"] for r in results),
        "total_seconds": round(time.perf_counter() - started, 1),
    }


def render_row(r: Dict[str, Any]) -> str:
    shown = ("nlist", "nprobe", "hnsw_m", "ef_construction")
    params = ",".join(f"{k}={v}" for k, v in r["params"].items() if k in shown)
    return (f"{r['kind']:<5} {params:<28} C={r['C']:<6} recall@20 {r['recall_at_20']:.3f} "
            f"(min {r['min_recall_at_20']:.2f}, negative {r['recall_at_20_negative']:.3f})  "
            f"{r['ms_per_query']:8.2f} ms  speed-up {r['speedup']:6.2f}x  "
            f"{'ok' if r['meets_target'] else 'MISSED'}")


def render(result: Dict[str, Any]) -> str:
    lines = [
        f"workload: {result['workload']}",
        f"store: {result['rows']} rows in memory (LanceDB bypassed) = {result['documents']} real documents' codes "
        f"(k={result['k_per_module']} x {result['modules']} modules, {result['bits_per_row']} bits), each copy "
        f"flipping every sign bit with p={result['flip_probability']:.4f} and scaling every module scale by "
        f"exp({result['scale_jitter_sigma']}*N(0,1)); {result['queries']} held-out documents as queries",
        f"exact scan: {result['exact_method']}, {result['exact_ms_per_query']} ms/query "
        f"({result['exact_gb_per_s']} GB/s of signs); {result['threads']} threads",
        f"FAISS build seconds: {result['build_seconds']}",
        f"on the real documents, corr(score, sign agreement) = {result['proxy_correlation']['sign_agreement']} "
        f"(what Hamming ranks by); corr(score, |y|-weighted agreement) = "
        f"{result['proxy_correlation']['weighted_agreement']}",
        f"target: recall@20 >= {result['targets']['recall_at_20']} at speed-up >= {result['targets']['speedup']}x",
        "",
    ]
    lines += [render_row(r) for r in result["results"]]
    lines.append(f"(codes {result['model_seconds']}s, replication {result['replicate_seconds']}s, "
                 f"total {result['total_seconds']}s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HuggingFace model directory (default: examples/default/model)")
    parser.add_argument("--corpus", default=None, help="shard to read documents from (default: the default pretraining corpus)")
    parser.add_argument("--docs", type=int, default=512, help="real documents replicated into the store")
    parser.add_argument("--queries", type=int, default=16, help="held-out documents used as queries")
    parser.add_argument("--fit-examples", type=int, default=160, help="documents the projection is fitted on")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per document at most")
    parser.add_argument("--k", type=int, default=128, help="coordinates per module")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the replicated store")
    parser.add_argument("--flip", type=float, default=0.05, help="per-bit flip probability of each copy")
    parser.add_argument("--scale-jitter", type=float, default=0.1, help="sigma of the log-normal scale jitter")
    parser.add_argument("--C", type=int, nargs="+", default=[200, 1000, 5000, 20000], help="candidates")
    parser.add_argument("--kinds", default="flat,ivf,hnsw")
    parser.add_argument("--nlist", type=int, default=512,
                        help="IVF lists (library default 4*sqrt(n) = 4000 at 1M rows takes too long to train here)")
    parser.add_argument("--train-points-per-list", type=int, default=40, help="IVF k-means sample per list")
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 64], help="IVF lists probed (one line each)")
    parser.add_argument("--hnsw-m", type=int, default=16)
    parser.add_argument("--ef-search", type=int, default=128)
    parser.add_argument("--ef-construction", type=int, default=20, help="HNSW build beam (library default 40)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--verbose", action="store_true", help="print each line as it is measured (stderr)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when no line meets the target")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if args.check and not result["meets_target_somewhere"] else 0


if __name__ == "__main__":
    sys.exit(main())
