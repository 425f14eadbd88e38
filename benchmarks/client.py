#!/usr/bin/env python
"""Queries over millions of rows as users make them: open, first query, filters, batches, candidates.

For each store size of ``--rows`` (default ``1e6``; ``--rows 1e6,1e7`` adds 10M rows: 2.7 GB of
codes plus the table on disk; ``--first-pass-only`` measures just the flat first pass on
the drawn codes) one run:

1. **A store of modelled codes.** Real codes come from the demo index (``--demo``, made by
   ``make demo INDEX=...``): its model and projection turn the demo corpus into projected
   gradients, the 1304 documents of ``examples/default/corpus`` (at most 128 tokens, as the demo
   ingests them) and their 64- and 32-token windows (12669 in all). A statistical model is fitted
   to them (:class:`CodeModel`): a mixture of ``--groups`` low-rank Gaussians over each row's
   per-module *directions* (``x_u/‖x_u‖``; k-means for the groups, a shared within-group PCA of
   rank ``--rank`` plus per-coordinate residual noise), jointly Gaussian with the row's
   per-module log-norms. A drawn ``x`` is 1-bit encoded as ingest encodes: signs and
   ``s_u = ‖x_u‖₁/k_u``. Every row is a fresh draw (no row copies another), so the sign rates
   and correlations, the per-module scales and the row-norm spread follow the real codes'; the
   run prints them side by side with held-out real codes of the same count, and the top-20
   scores' distance from the mean in standard deviations (the tail that decides which rows a
   first pass must find). The model has no near-duplicates of the queries (the real codes'
   top-1 is ~10 sd out on the positive side, the model's ~6.5; the negative side matches).
2. **Written through the table's documented format** (schemas/store.md, ``build_rows`` and
   ``Store.add``) in ingest-sized commits of ``--commit-rows`` (256) rows, compacting as ingest
   does (:func:`~eogp_index.store.maintenance.maybe_optimize` after each commit, a final
   :func:`~eogp_index.store.maintenance.optimize` that also rebuilds the hot copy). Metadata for
   filters: ``bucket`` (int, uniform over 0..999) and ``topic`` (``t0``..``t3``, 25% each).
3. **Measured in a fresh process through** :class:`~eogp_index.client.AttributionIndex`, the
   queries being the demo's held-out ``queries.jsonl``: import; loading the model, then ``open``
   given that model (the target is opening apart from the model's load); the first query after
   it; warm queries;
   filters selecting 0.1%, 1% and 25% of the rows, each fresh (a filter string the process has
   not seen) and repeated, without and then with scalar indexes (BTREE on ``bucket``, BITMAP on
   ``topic``); a batch of 64 queries; the ``flat`` candidates (build time, recall@20
   against the exact scan of the same rows and speed-up, in both directions); the process's
   peak RSS. Every figure is given end to end and as *search* (everything after the query's
   projected gradient exists: filter, scan, top-k, the rows' metadata), each also as a ratio
   to the warm unfiltered query: per query against the same query's warm time (a query's
   gradient costs more the longer it is), then the median. Times are medians over ``--queries``
   queries (filters: 4 queries, the same ones fresh and repeated; candidates: best of
   ``--repeat`` per query, exact and candidates alike). The batch's ratio is printed next to its
   arithmetic floor on this CPU (:func:`batch_floor_seconds`).
4. **Duplicates check.** For each query's exact top-20: how many distinct sign codes, and the
   smallest Hamming distance between two of them next to the median distance of random pairs.

The real codes (``real-codes.npz``), the fitted model (``model-<key>.pkl``) and the drawn codes
(``codes-<key>-<n>.npy``, memory-mapped, drawn and encoded in blocks of 32,768 rows: decoded
rows never all in memory) are kept in ``--work`` and reused by later runs. Drawing dominates a
10M-row run (docs/benchmarks.md, "Queries at scale", gives the times).

Targets: a filter of share f costs at most (f + 0.1)× the unfiltered search at 1M
rows; candidates reach recall@20 >= 0.95 at >= 5× the exact scan's speed at 10M rows, in both
directions. ``--json PATH`` also writes every figure as one JSON object (as ``result.json`` in
``--work``). Examples::

    make demo INDEX=/tmp/demo-index
    nice python benchmarks/client.py --demo /tmp/demo-index                      # 1M rows
    nice python benchmarks/client.py --demo /tmp/demo-index --rows 1e6,1e7 --work /tmp/bench
    python benchmarks/client.py --demo /tmp/demo-index --rows 2e5 --queries 8     # quick
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from common import add_json_argument, best_of, peak_rss_bytes, prints_json, write_json

REPO = Path(__file__).resolve().parents[1]

DEFAULT_ROOT = REPO / "examples" / "default"
CORPORA = [DEFAULT_ROOT / "corpus" / "train.jsonl.gz", DEFAULT_ROOT / "corpus" / "pretrain.jsonl.gz"]
QUERIES = DEFAULT_ROOT / "queries.jsonl"
TOP = 20
TARGET_RECALL, TARGET_SPEEDUP = 0.95, 5.0
#: Files of the demo index a modelled store shares (same model, projection and settings).
INDEX_FILES = ("manifest.json", "projection.safetensors", "sources.json")


# ---------------------------------------------------------------------------------------------
# real codes and their model
# ---------------------------------------------------------------------------------------------


def real_coordinates(demo: Path, cache: Path) -> Dict[str, np.ndarray]:
    """Projected gradients of the demo corpus's documents and windows (cached in ``cache``)."""
    if cache.exists():
        with np.load(cache) as z:
            return {key: z[key] for key in z.files}
    import torch

    torch.set_num_threads(1)  # a shared machine: two threads fighting over busy cores run much slower
    from eogp_index.client import AttributionIndex
    from eogp_index.data.records import Example
    from ingest.records import RecordSpec, iter_examples

    index = AttributionIndex.open(demo)

    def docs(max_tokens):
        spec = RecordSpec(max_tokens=max_tokens)
        return [
            ex
            for ex in iter_examples([str(p) for p in CORPORA], spec, index.tokenizer, on_error="skip")
            if isinstance(ex, Example)
        ]

    def windows(full, width):
        out = []
        for doc in full:
            ids = list(doc.input_ids)
            for start in range(0, len(ids), width):
                w = ids[start : start + width]
                if len(w) >= max(2, width // 2):
                    out.append(
                        Example.from_ids(
                            id=f"{doc.id}@{start}", input_ids=w, labels=w, shard=doc.shard, position=doc.position
                        )
                    )
        return out

    def project(examples, chunk=256):
        # In chunks, collecting garbage between them: without, memory grows by ~2 GB per 1000 examples.
        out = []
        for a in range(0, len(examples), chunk):
            out.append(index.project(examples[a : a + chunk]))
            gc.collect()
            print(f"  projected {min(len(examples), a + chunk)}/{len(examples)}", file=sys.stderr, flush=True)
        return np.concatenate(out)

    full = docs(None)
    parts = {
        "docs": project(docs(128)),
        "w64": project(windows(full, 64)),
        "w32": project(windows(full, 32)),
        "k": np.array(index.layout.k),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **parts)
    return parts


class CodeModel:
    """A mixture of low-rank Gaussians over per-module directions, joint with log module norms.

    Fit on real projected gradients ``X`` ``(n, K)``: ``V`` = each module's ``x_u/‖x_u‖``
    (modules concatenated), ``L`` = ``log ‖x_u‖`` ``(n, U)``. ``groups`` k-means centroids of
    ``V`` (one group: the mean); within groups a shared PCA of rank ``rank`` plus per-coordinate
    residual standard deviations; the within-group log-norms and PCA scores are jointly Gaussian
    (full covariance), so norms and directions stay correlated as in the data. A draw: a group
    by its weight, ``(L, scores)`` from the joint Gaussian, ``v = μ_g + W·scores + σ ⊙ ε``, each
    module rescaled to norm ``exp(L_u)``.
    """

    def __init__(self, X: np.ndarray, layout, *, groups: int = 256, rank: int = 256, seed: int = 0):
        import faiss

        self.layout = layout
        offsets, ks = layout.coord_offsets, layout.k
        X = np.asarray(X, np.float32)
        N = np.stack([np.linalg.norm(X[:, o : o + k], axis=1) for o, k in zip(offsets, ks)], 1)
        V = np.concatenate([X[:, o : o + k] / N[:, [u]] for u, (o, k) in enumerate(zip(offsets, ks))], 1)
        L = np.log(N)
        if groups > 1:
            km = faiss.Kmeans(V.shape[1], groups, niter=20, seed=seed)
            km.train(V)
            group = km.index.search(V, 1)[1][:, 0]
        else:
            group = np.zeros(len(V), np.int64)
        self.weights = np.bincount(group, minlength=groups) / len(group)
        self.mu = np.stack([V[group == g].mean(0) if self.weights[g] else V.mean(0) for g in range(groups)])
        self.lmu = np.stack([L[group == g].mean(0) if self.weights[g] else L.mean(0) for g in range(groups)])
        R, LR = V - self.mu[group], L - self.lmu[group]
        _, _, vt = np.linalg.svd(R - R.mean(0), full_matrices=False)
        self.W = np.ascontiguousarray(vt[:rank].T, np.float32)  # (K, r)
        scores = R @ self.W
        self.resid_std = (R - scores @ self.W.T).std(0).astype(np.float32)
        joint = np.cov(np.concatenate([LR, scores], 1).T)
        self.chol = np.linalg.cholesky(joint + 1e-9 * np.eye(len(joint))).astype(np.float32)
        self.U, self.rank, self.groups, self.fit_rows = L.shape[1], self.W.shape[1], groups, len(X)

    def sample_x(self, n: int, rng) -> np.ndarray:
        """``n`` drawn projected gradients ``(n, K)`` float32."""
        g = rng.choice(len(self.weights), size=n, p=self.weights)
        z = rng.standard_normal((n, self.U + self.rank), dtype=np.float32) @ self.chol.T
        L = self.lmu[g] + z[:, : self.U]
        v = z[:, self.U :] @ self.W.T
        v += self.mu[g].astype(np.float32)
        noise = rng.standard_normal(v.shape, dtype=np.float32)
        noise *= self.resid_std
        v += noise
        for u, (o, k) in enumerate(zip(self.layout.coord_offsets, self.layout.k)):
            block = v[:, o : o + k]
            block *= (np.exp(L[:, u]) / np.linalg.norm(block, axis=1)).astype(np.float32)[:, None]
        return v

    def sample(self, n: int, rng, *, block: int = 1 << 15):
        """``n`` encoded rows: signs ``(n, nbytes)`` uint8, scales ``(n, U)`` float16."""
        from eogp_index.store.codecs import encode

        codes = np.empty((n, self.layout.nbytes), np.uint8)
        scales = np.empty((n, self.layout.num_modules), np.float16)
        for a in range(0, n, block):
            e = encode(self.sample_x(min(block, n - a), rng), self.layout, "1bit")
            codes[a : a + len(e.signs)], scales[a : a + len(e.signs)] = e.signs, e.scales
        return codes, scales


def code_statistics(codes, scales, y, layout) -> Dict[str, Any]:
    """What the comparison of real and modelled codes looks at (module docstring)."""
    from eogp_index.search.scan import scan_scores
    from eogp_index.store.codecs import unpack_signs

    b = unpack_signs(codes, layout)
    sub = b[:, ::16]
    S = scan_scores(codes, scales, y, layout).astype(np.float64)
    z = np.sort((S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True), 1)
    s = scales.astype(np.float32)
    norm = np.sqrt((s**2 * np.array(layout.k)).sum(1))
    return {
        "rate": (b > 0).mean(0),
        "corr": np.corrcoef(sub.T)[np.triu_indices(sub.shape[1], 1)],
        "log_scale_sd": float(np.log(s).std(0).mean()),
        "norm_quantiles": np.round(np.quantile(norm, [0.01, 0.5, 0.99, 1.0]) / norm.mean(), 2).tolist(),
        "top1_z": float(z[:, -1].mean()),
        "top20_z": float(z[:, -TOP:].mean()),
        "bottom1_z": float(-z[:, 0].mean()),
        "bottom20_z": float(-z[:, :TOP].mean()),
    }


def compare_model(real: Dict[str, np.ndarray], y: np.ndarray, layout, args) -> Dict[str, Any]:
    """Fit on 10k real rows, compare with the held-out rest and with as many modelled rows."""
    from eogp_index.store.codecs import encode

    X = np.concatenate([real["docs"], real["w64"], real["w32"]])
    X = X[np.random.default_rng(1).permutation(len(X))]
    fit, held = X[:10000], X[10000:]
    model = CodeModel(fit, layout, groups=args.groups, rank=args.rank)
    e = encode(held, layout, "1bit")
    a = code_statistics(e.signs, e.scales, y, layout)
    b = code_statistics(*model.sample(len(held), np.random.default_rng(5)), y, layout)
    # What sampling noise alone gives: two halves of the held-out real rows.
    half = len(held) // 2
    h1 = code_statistics(e.signs[:half], e.scales[:half], y, layout)
    h2 = code_statistics(e.signs[half:], e.scales[half:], y, layout)
    out = {"rows": len(held)}
    for key in ("log_scale_sd", "norm_quantiles", "top1_z", "top20_z", "bottom1_z", "bottom20_z"):
        out[key] = {"real": a[key], "model": b[key]}
    out["sign_rate_corr"] = {
        "model_vs_real": float(np.corrcoef(a["rate"], b["rate"])[0, 1]),
        "real_half_vs_half": float(np.corrcoef(h1["rate"], h2["rate"])[0, 1]),
    }
    out["bit_corr_corr"] = {
        "model_vs_real": float(np.corrcoef(a["corr"], b["corr"])[0, 1]),
        "real_half_vs_half": float(np.corrcoef(h1["corr"], h2["corr"])[0, 1]),
    }
    return out


def modelled_codes(model: CodeModel, n: int, work: Path, key: str):
    """``n`` modelled rows, drawn once and kept as ``codes-<key>-<n>.npy`` (memory-mapped).

    Rows are independent draws, so the first ``n`` rows of a larger kept draw are a draw of ``n``
    rows: they are used when there is one (a memory-mapped view)."""
    codes_path, scales_path = work / f"codes-{key}-{n}.npy", work / f"scales-{key}-{n}.npy"
    larger = sorted(
        (int(p.stem.rsplit("-", 1)[1]), p)
        for p in work.glob(f"codes-{key}-*.npy")
        if int(p.stem.rsplit("-", 1)[1]) > n and (work / p.name.replace("codes-", "scales-", 1)).exists()
    )
    if not codes_path.exists() and larger:
        size, path = larger[0]
        print(f"  the first {n} rows of the kept draw of {size}", file=sys.stderr, flush=True)
        return (
            np.load(path, mmap_mode="r")[:n],
            np.load(work / path.name.replace("codes-", "scales-", 1), mmap_mode="r")[:n],
        )
    if not (codes_path.exists() and scales_path.exists()):
        codes = np.lib.format.open_memmap(
            codes_path.with_suffix(".tmp"), mode="w+", dtype=np.uint8, shape=(n, model.layout.nbytes)
        )
        scales = np.empty((n, model.layout.num_modules), np.float16)
        rng = np.random.default_rng(7)
        step = 1 << 18
        for a in range(0, n, step):
            codes[a : a + step], scales[a : a + step] = model.sample(min(step, n - a), rng)
            print(f"  drawn {min(n, a + step)}/{n} rows", file=sys.stderr, flush=True)
        codes.flush()
        del codes
        with open(scales_path, "wb") as fh:
            np.save(fh, scales)
        codes_path.with_suffix(".tmp").replace(codes_path)
    return np.load(codes_path, mmap_mode="r"), np.load(scales_path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------


def bucket_of(i: np.ndarray) -> np.ndarray:
    """A filter column uniform over 0..999 and uncorrelated with the row order or the codes."""
    return (np.asarray(i, np.int64) * 7919 + 13) % 1000


def build_store(demo: Path, path: Path, codes, scales, commit_rows: int) -> Dict[str, Any]:
    """An index sharing the demo's model and projection whose table holds the modelled rows,
    written as ingest writes: ``build_rows`` + ``Store.add`` per commit, compacted as ingest does."""
    from eogp_index.store.codecs import Encoded
    from eogp_index.store.maintenance import maybe_optimize, optimize
    from eogp_index.store.stored_index import StoredIndex
    from eogp_index.store.table import RowInfo, build_rows

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    for name in INDEX_FILES:
        if (demo / name).exists():
            shutil.copy2(demo / name, path / name)
    stored = StoredIndex.open(path)
    n = codes.shape[0]
    topics = np.array([f"t{b % 4}" for b in range(1000)], dtype=object)
    started = time.perf_counter()
    commit_seconds, optimizations = [], []
    for a in range(0, n, commit_rows):
        i = np.arange(a, min(n, a + commit_rows))
        bucket = bucket_of(i)
        ids = [f"m{j:09d}" for j in i]
        info = RowInfo(
            ids=ids,
            shards=["modelled"] * len(i),
            positions=i.tolist(),
            num_tokens=[128] * len(i),
            num_loss_tokens=[127] * len(i),
            truncated=[False] * len(i),
            metadata=[{"bucket": int(b), "topic": topics[b]} for b in bucket],
            content_sha256=[hashlib.sha256(x.encode()).hexdigest() for x in ids],
            content_kind=["tokens"] * len(i),
        )
        rows = build_rows(
            info,
            Encoded(signs=np.asarray(codes[a : a + len(i)]), scales=np.asarray(scales[a : a + len(i)])),
            schema=stored.store.schema,
        )
        t = time.perf_counter()
        stored.store.add(rows)
        report = maybe_optimize(stored)
        commit_seconds.append(time.perf_counter() - t)
        if report is not None:
            optimizations.append(report.seconds)
        if (a // commit_rows) % 2000 == 0:
            print(
                f"  {a + len(i)}/{n} rows, {len(commit_seconds)} commits, {time.perf_counter() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    t = time.perf_counter()
    final = optimize(stored)
    final_seconds = time.perf_counter() - t
    c = np.array(commit_seconds)
    return {
        "rows": n,
        "commits": len(c),
        "seconds": round(time.perf_counter() - started, 1),
        "commit_ms_first_1000": round(1000 * float(np.median(c[:1000])), 1),
        "commit_ms_last_1000": round(1000 * float(np.median(c[-1000:])), 1),
        "optimizations_during_ingest": len(optimizations),
        "optimize_seconds_during_ingest": round(float(np.sum(optimizations)), 1),
        "final_optimize_seconds": round(final_seconds, 1),
        "fragments": final.fragments_after,
    }


# ---------------------------------------------------------------------------------------------
# measuring (a fresh process)
# ---------------------------------------------------------------------------------------------


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def measure(path: Path, args) -> Dict[str, Any]:
    """Everything a user sees, through AttributionIndex (module docstring, step 3)."""
    t0 = time.perf_counter()
    from eogp_index.client import AttributionIndex

    imported = time.perf_counter() - t0
    import torch

    torch.set_num_threads(args.torch_threads)
    texts = [json.loads(line)["text"] for line in QUERIES.read_text().splitlines() if line.strip()]
    nq = min(args.queries, len(texts))
    out: Dict[str, Any] = {"import_s": round(imported, 3)}
    from eogp_index.gradients.model import load_model
    from eogp_index.store.manifest import Manifest

    # The target is opening apart from loading the model: the model is loaded first, on its own.
    t = time.perf_counter()
    model, tokenizer = load_model(Manifest.load(path).model["name"])
    out["model_load_ms"] = _ms(time.perf_counter() - t)
    t = time.perf_counter()
    index = AttributionIndex.open(path, model=model, tokenizer=tokenizer)
    out["open_ms"] = _ms(time.perf_counter() - t)
    t = time.perf_counter()
    index.top_influential(texts[0], k=TOP)
    out["first_query_ms"] = _ms(time.perf_counter() - t)
    n = index.store.count()
    out["rows"] = n
    t = time.perf_counter()
    Y = index.query_coordinates(texts)
    out["project_64_queries_ms"] = _ms(time.perf_counter() - t)

    def search(q, **opts):
        """(end-to-end seconds, search seconds, answer) of query ``q`` with the builder's options."""
        builder = index.search(texts[q]).limit(opts.get("k", TOP)).direction(opts.get("direction", "positive"))
        if opts.get("where"):
            builder = builder.where(opts["where"])
        if opts.get("C"):
            builder = builder.candidates(opts["C"], faiss_name=opts.get("faiss_name", "default"))
        t = time.perf_counter()
        y = index.query_coordinates([texts[q]])
        t1 = time.perf_counter()
        table = builder.to_list(coordinates=y)[0]
        t2 = time.perf_counter()
        return t2 - t, t2 - t1, table

    warm = [search(q) for q in range(nq)]
    e2e, base = float(np.median([w[0] for w in warm])), float(np.median([w[1] for w in warm]))
    out["warm_query_ms"], out["warm_search_ms"] = _ms(e2e), _ms(base)
    rows: List[Dict[str, Any]] = []

    def record(name, results, share=None):
        """Medians of ``results`` (query ``q`` = position ``q``); each ratio is taken per query
        against the same query's warm unfiltered time (the query's gradient varies with its
        length), then the median."""
        e, s = float(np.median([r[0] for r in results])), float(np.median([r[1] for r in results]))
        qr = float(np.median([r[0] / warm[q][0] for q, r in enumerate(results)]))
        sr = float(np.median([r[1] / warm[q][1] for q, r in enumerate(results)]))
        row = {
            "name": name,
            "query_ms": _ms(e),
            "search_ms": _ms(s),
            "query_ratio": round(qr, 2),
            "search_ratio": round(sr, 3),
        }
        if share is not None:
            row["target_search_ratio"] = round(share + 0.1, 3)
        rows.append(row)

    record("warm unfiltered", warm)
    filters = {
        0.001: lambda j: f"bucket = {j}",
        1 / 100: lambda j: f"bucket >= {10 * j} AND bucket < {10 * j + 10}",
        0.25: lambda j: f"topic = 't{j % 4}'" if j < 4 else f"topic IN ('t{j % 4}')",
    }
    used = {share: 0 for share in filters}

    def fresh(share):
        used[share] += 1
        return filters[share](used[share] * 7 % 97 if share < 0.25 else used[share] - 1)

    for indexed in (False, True):
        if indexed:
            t = time.perf_counter()
            index.store.create_scalar_index("bucket", "BTREE")
            index.store.create_scalar_index("topic", "BITMAP")
            out["scalar_index_s"] = round(time.perf_counter() - t, 1)
        label = "with scalar indexes" if indexed else "no scalar index"
        for share in filters:
            wheres = [fresh(share) for _ in range(min(nq, 4))]
            record(f"filter {100 * share:g}% fresh, {label}", [search(q, where=w) for q, w in enumerate(wheres)], share)
            # The same queries again, each with the filter it ran with: the filter is now seen.
            record(
                f"filter {100 * share:g}% repeated, {label}", [search(q, where=w) for q, w in enumerate(wheres)], share
            )
    # A batch of 64 queries: one pass, against 64 single searches.
    batch = min(64, len(texts))
    t = time.perf_counter()
    Yb = index.query_coordinates(texts[:batch])
    t1 = time.perf_counter()
    index.search(texts[:batch], many=True).limit(TOP).to_list(coordinates=Yb)
    t2 = time.perf_counter()
    rows.append(
        {
            "name": f"batch of {batch}",
            "query_ms": _ms(t2 - t),
            "search_ms": _ms(t2 - t1),
            "query_ratio": round((t2 - t) / e2e, 2),
            "search_ratio": round((t2 - t1) / base, 2),
            "search_per_query_ratio": round((t2 - t1) / batch / base, 3),
            "floor_ratio": round(batch_floor_seconds(batch, n, index.layout.nbytes) / base, 2),
        }
    )
    out["figures"] = rows
    out["duplicates"] = duplicates(index, Y[:nq])
    if not args.no_candidates:
        out["candidates"] = candidates(index, texts, nq, n, args)
    out["peak_rss_gb"] = round(peak_rss_bytes() / 2**30, 2)
    return out


#: The batch floor's assumptions: one 64-wide int8 VPDPBUSD per cycle and core, at this clock.
VNNI_PRODUCTS_PER_CYCLE, CLOCK_HZ = 64, 3.0e9


def batch_floor_seconds(batch: int, rows: int, nbytes: int) -> float:
    """The CPU's arithmetic floor for ``batch`` queries over ``rows`` rows: the exactness bound
    needs int8 query × 1-bit code products, ``batch · rows · 8·nbytes`` of them, on every core."""
    return batch * rows * 8 * nbytes / (VNNI_PRODUCTS_PER_CYCLE * CLOCK_HZ * (os.cpu_count() or 1))


def duplicates(index, Y) -> Dict[str, Any]:
    """Distinct codes and Hamming distances within each query's exact top-20 (module docstring)."""
    hot = index.hot_codes()
    searcher = index.search("").searcher()
    distinct, closest, typical = [], [], []
    rng = np.random.default_rng(0)
    for q in range(Y.shape[0]):
        hits = searcher.top_k(Y[q : q + 1], TOP, ("positive",))[0]["positive"]
        codes = np.asarray(hot.codes[np.sort(hot.positions(np.sort(hits.rowaddr)))])
        bits = np.unpackbits(codes, axis=1)
        d = (bits[:, None, :] != bits[None, :, :]).sum(2)
        distinct.append(len({c.tobytes() for c in codes}))
        closest.append(int(d[np.triu_indices(len(codes), 1)].min()))
        other = np.unpackbits(np.asarray(hot.codes[np.sort(rng.choice(hot.num_rows, 2 * TOP, replace=False))]), axis=1)
        typical.append(float(np.median((other[:TOP] != other[TOP:]).sum(1))))
    return {
        "distinct_codes_in_top20": {"min": int(min(distinct)), "mean": round(float(np.mean(distinct)), 1)},
        "closest_pair_hamming": {"min": int(min(closest)), "median": float(np.median(closest))},
        "random_pair_hamming_median": float(np.median(typical)),
        "bits": int(index.layout.nbytes * 8),
    }


def first_pass_line(
    z: int,
    side: str,
    exact_s: Sequence[float],
    cand_s: Sequence[float],
    recall: Sequence[float],
    scanned: Sequence[float],
) -> Dict[str, Any]:
    """One line of the first pass's table from per-query figures: the exact scan's and the
    candidates' seconds, recall@20 and the share of rows scanned."""
    speedup = float(np.mean(exact_s)) / float(np.mean(cand_s))
    return {
        "query_bits": z,
        "side": side,
        "recall_at_20": round(float(np.mean(recall)), 4),
        "min_recall": round(float(np.min(recall)), 2),
        "exact_search_ms": _ms(float(np.mean(exact_s))),
        "candidates_search_ms": _ms(float(np.mean(cand_s))),
        "speedup": round(speedup, 2),
        "rows_scanned_share": round(float(np.mean(scanned)), 4),
        "meets_target": bool(np.mean(recall) >= TARGET_RECALL and speedup >= TARGET_SPEEDUP),
    }


def candidates(index, texts, nq, n, args) -> Dict[str, Any]:
    """Build the flat candidates; recall@20 and speed-up against the exact scan, both sides,
    for each ``--query-bits`` (the exact answers and times are measured once per query and side)."""
    from eogp_index.search.first_pass import FlatConfig, build, open_first_pass

    t = time.perf_counter()
    build(index.stored, "bench", FlatConfig(), progress=False)
    build_s = time.perf_counter() - t
    C = max(TOP, int(args.candidate_share * n))
    cand = open_first_pass(index.stored, "bench")
    out: Dict[str, Any] = {
        "build_s": round(build_s, 1),
        "C": C,
        "kind": "flat",
        "params": cand.build_params,
        "lines": [],
    }
    Y = index.query_coordinates(texts[:nq])

    def timed(builder, y):
        seconds, _, table = best_of(lambda: builder.to_list(coordinates=y)[0], args.repeat)
        return seconds, set(table.column("id").to_pylist())

    # Untimed first runs: the copy's pages and the kernels' compiled forms are loaded once.
    for side in ("positive", "negative"):
        index.search("").limit(TOP).direction(side).candidates(C, faiss_name="bench").to_list(coordinates=Y[:1])
    exact = {
        (side, q): timed(index.search("").limit(TOP).direction(side), Y[q : q + 1])
        for side in ("positive", "negative")
        for q in range(nq)
    }
    for z in args.query_bits:
        cand.set_search(query_bits=z)
        for side in ("positive", "negative"):
            cand_t, recall, scanned = [], [], []
            for q in range(nq):
                y = Y[q : q + 1]
                seconds, ids = timed(index.search("").limit(TOP).direction(side).candidates(C, faiss_name="bench"), y)
                cand_t.append(seconds)
                recall.append(len(exact[(side, q)][1] & ids) / TOP)
                scanned.append(cand.top_k(index.stored, y, TOP, C, [side])[side][2] / n)
            exact_s = [exact[(side, q)][0] for q in range(nq)]
            out["lines"].append(first_pass_line(z, side, exact_s, cand_t, recall, scanned))
    return out


def first_pass_only(codes, scales, layout, Y: np.ndarray, work: Path, args) -> Dict[str, Any]:
    """``--first-pass-only``: the flat first pass straight over the drawn codes (no table).

    The same :class:`~eogp_index.search.first_pass.FlatFirstPass` as ``build-candidates``
    builds, made with :meth:`~FlatFirstPass.from_codes` from the memory-mapped codes (row ``i``
    has position ``i``): FAISS's ``C`` best estimates, rescored by the exact kernel
    (:func:`~eogp_index.search.scan.scan_scores`), against the exact kernel the hot searcher
    runs (:func:`~eogp_index.search.scan.scan_top_k`) over the same rows; per query and side, the
    best of ``--repeat`` times each. Neither side fetches the rows' metadata (the full run's
    lines do, on both sides alike), so the speed-up here is the kernels' alone.
    """
    from eogp_index.search.first_pass import FlatConfig, FlatFirstPass
    from eogp_index.search.scan import scan_scores, scan_top_k

    n = codes.shape[0]
    C = max(TOP, int(args.candidate_share * n))
    t = time.perf_counter()
    cand = FlatFirstPass.from_codes(codes, scales, layout, [str(i) for i in range(n)], FlatConfig(), name="bench")
    out: Dict[str, Any] = {
        "rows": n,
        "build_s": round(time.perf_counter() - t, 1),
        "C": C,
        "params": cand.build_params,
        "lines": [],
    }

    def top(y: np.ndarray, side: str):
        _, positions = cand.search_with_distances(y if side == "positive" else -y, C)
        rows = np.sort(positions[0][positions[0] >= 0])
        scores = scan_scores(codes, scales, y, layout, rows=rows)[0]
        return rows[np.argsort(-scores if side == "positive" else scores, kind="stable")[:TOP]], rows.size

    nq = min(args.queries, Y.shape[0])
    exact = {}
    for side in ("positive", "negative"):
        largest = side == "positive"
        for q in range(nq):
            seconds, _, found = best_of(
                lambda: scan_top_k(codes, scales, Y[q : q + 1], layout, TOP, largest=largest, smallest=not largest),
                args.repeat,
            )
            exact[(side, q)] = (
                seconds,
                set((found.largest_indices if largest else found.smallest_indices)[0].tolist()),
            )
        print(f"  exact {side} done", file=sys.stderr, flush=True)
    for z in args.query_bits:
        cand.set_search(query_bits=z)
        for side in ("positive", "negative"):
            times, recall, scanned = [], [], []
            for q in range(nq):
                seconds, _, (rows, scored) = best_of(lambda: top(Y[q : q + 1], side), args.repeat)
                times.append(seconds)
                recall.append(len(exact[(side, q)][1] & set(rows.tolist())) / TOP)
                scanned.append(scored / n)
            exact_s = [exact[(side, q)][0] for q in range(nq)]
            out["lines"].append(first_pass_line(z, side, exact_s, times, recall, scanned))
            print(f"  query_bits={z} {side}: {out['lines'][-1]}", file=sys.stderr, flush=True)
    shutil.rmtree(work / f"first-pass-{n}", ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def render(result: Dict[str, Any]) -> str:
    m = result["model"]
    cmp = result["model_check"]
    lines = [
        f"codes: {m['description']}",
        f"model check on {cmp['rows']} held-out real rows vs as many modelled rows (real | model): "
        f"sign-rate corr {cmp['sign_rate_corr']['model_vs_real']:.3f} (two real halves: "
        f"{cmp['sign_rate_corr']['real_half_vs_half']:.3f}); bit-correlation corr "
        f"{cmp['bit_corr_corr']['model_vs_real']:.3f} (halves {cmp['bit_corr_corr']['real_half_vs_half']:.3f}); "
        f"log-scale sd {cmp['log_scale_sd']['real']:.3f} | {cmp['log_scale_sd']['model']:.3f}; row norm / mean at "
        f"1%, 50%, 99%, max {cmp['norm_quantiles']['real']} | {cmp['norm_quantiles']['model']}; score z of top-1 "
        f"{cmp['top1_z']['real']:.1f} | {cmp['top1_z']['model']:.1f}, top-20 {cmp['top20_z']['real']:.1f} | "
        f"{cmp['top20_z']['model']:.1f}, bottom-1 {cmp['bottom1_z']['real']:.1f} | {cmp['bottom1_z']['model']:.1f}, "
        f"bottom-20 {cmp['bottom20_z']['real']:.1f} | {cmp['bottom20_z']['model']:.1f}",
    ]
    for run in result["runs"]:
        s, r = run["store"], run["measured"]
        d = r["duplicates"]
        lines += [
            "",
            f"== {s['rows']:,} rows: {s['commits']} commits of <= {result['commit_rows']} rows in {s['seconds']}s "
            f"(median commit {s['commit_ms_first_1000']} ms first 1000, {s['commit_ms_last_1000']} ms last 1000; "
            f"{s['optimizations_during_ingest']} compactions during ingest, {s['optimize_seconds_during_ingest']}s; "
            f"final optimize {s['final_optimize_seconds']}s, {s['fragments']} fragments)",
            f"import {r['import_s']}s, model load {r.get('model_load_ms', '-')} ms, open (model given) "
            f"{r['open_ms']} ms ({r['open_ms'] / r['warm_query_ms']:.2f}x the warm query), "
            f"first query {r['first_query_ms']} ms ({r['first_query_ms'] / r['warm_query_ms']:.2f}x); "
            f"warm query {r['warm_query_ms']} ms of which search {r['warm_search_ms']} ms; "
            f"scalar indexes built in {r.get('scalar_index_s', '-')}s; peak RSS {r['peak_rss_gb']} GB",
            f"top-20 duplicates: distinct codes min {d['distinct_codes_in_top20']['min']} of {TOP}; closest pair "
            f"{d['closest_pair_hamming']['min']} bits apart (median {d['closest_pair_hamming']['median']}) vs "
            f"{d['random_pair_hamming_median']} for random pairs, of {d['bits']}",
            f"{'':44s} {'query ms':>9s} {'ratio':>6s} {'search ms':>10s} {'ratio':>6s} {'target':>7s}",
        ]
        for f in r["figures"]:
            target = f.get("target_search_ratio")
            extra = (
                f"  per query {f['search_per_query_ratio']}, arithmetic floor {f['floor_ratio']}x"
                if "search_per_query_ratio" in f
                else ""
            )
            lines.append(
                f"{f['name']:44s} {f['query_ms']:9.1f} {f['query_ratio']:6.2f} {f['search_ms']:10.1f} "
                f"{f['search_ratio']:6.2f} {'' if target is None else f'<= {target:.2f}':>7s}{extra}"
            )
        c = r.get("candidates")
        if c:
            lines.append(f"candidates ({c['kind']}, {c['params']}), built in {c['build_s']}s, C = {c['C']:,} rows:")
            for x in c["lines"]:
                lines.append(
                    f"  query_bits={x['query_bits']:<2} {x['side']:8s} recall@20 {x['recall_at_20']:.3f} "
                    f"(min {x['min_recall']:.2f}), "
                    f"{x['rows_scanned_share']:.1%} of rows scanned, {x['candidates_search_ms']} ms "
                    f"({x['candidates_search_ms'] / r['warm_search_ms']:.3f}x the warm search) vs exact "
                    f"{x['exact_search_ms']} ms: speed-up {x['speedup']}x  "
                    f"{'ok' if x['meets_target'] else 'MISSED'} (target recall >= {TARGET_RECALL} at >= "
                    f"{TARGET_SPEEDUP}x)"
                )
    return "\n".join(lines)


def render_first_pass(runs: List[Dict[str, Any]]) -> str:
    lines = []
    for c in runs:
        lines.append(
            f"first pass alone on {c['rows']:,} modelled rows (no table; {c['params']}), built in "
            f"{c['build_s']}s, C = {c['C']:,} rows:"
        )
        for x in c["lines"]:
            lines.append(
                f"  query_bits={x['query_bits']:<2} {x['side']:8s} recall@20 {x['recall_at_20']:.3f} "
                f"(min {x['min_recall']:.2f}), "
                f"{x['rows_scanned_share']:.1%} of rows scanned, {x['candidates_search_ms']} ms vs exact "
                f"{x['exact_search_ms']} ms: speed-up {x['speedup']}x  "
                f"{'ok' if x['meets_target'] else 'MISSED'} (target recall >= {TARGET_RECALL} at >= "
                f"{TARGET_SPEEDUP}x)"
            )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--demo",
        type=Path,
        default=REPO / "default-index",
        help="a demo index (make demo INDEX=...): its model, projection and real codes",
    )
    parser.add_argument("--rows", default="1e6", help="store sizes, comma separated (1e7 is slow: see above)")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/eogp-bench-client"), help="where the stores and the cached codes go"
    )
    parser.add_argument("--keep", action="store_true", help="keep the stores (default: remove each after it)")
    parser.add_argument("--commit-rows", type=int, default=256)
    parser.add_argument("--groups", type=int, default=256, help="mixture groups of the code model")
    parser.add_argument("--rank", type=int, default=256, help="rank of the code model's within-group PCA")
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="timings per candidate query; the best counts")
    parser.add_argument(
        "--candidate-share",
        type=float,
        default=0.1,
        help="C, the candidates' budget of rows per side, as a share of the rows",
    )
    parser.add_argument(
        "--query-bits",
        type=int,
        nargs="+",
        default=[8],
        help="the flat first pass's query bits to measure (the default is 8)",
    )
    parser.add_argument("--no-candidates", action="store_true")
    parser.add_argument(
        "--first-pass-only",
        action="store_true",
        help="only the flat first pass against the exact kernel, straight over the drawn codes "
        "(no table, no AttributionIndex; first_pass_only)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the measuring process (the query gradient; 1 on a shared machine)",
    )
    add_json_argument(parser)
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args)))
        return 0
    if not (args.demo / "manifest.json").exists():
        raise SystemExit(f"{args.demo}: no demo index; make one with `make demo INDEX={args.demo}`")
    from eogp_index.client import AttributionIndex
    from eogp_index.store.codecs import SignLayout

    args.work.mkdir(parents=True, exist_ok=True)
    real = real_coordinates(args.demo, args.work / "real-codes.npz")
    layout = SignLayout(tuple(int(k) for k in real["k"]))
    texts = [json.loads(line)["text"] for line in QUERIES.read_text().splitlines() if line.strip()]
    import torch

    torch.set_num_threads(1)
    X = np.concatenate([real["docs"], real["w64"], real["w32"]])
    key = hashlib.sha256(X.tobytes() + f"{args.groups},{args.rank}".encode()).hexdigest()[:10]
    fitted = args.work / f"model-{key}.pkl"  # the fit and its check, kept with the codes they drew
    if fitted.exists():
        model, check, fit_seconds = pickle.loads(fitted.read_bytes())
    else:
        y = AttributionIndex.open(args.demo).query_coordinates(texts)
        t = time.perf_counter()
        check = compare_model(real, y, layout, args)
        model = CodeModel(X, layout, groups=args.groups, rank=args.rank)
        fit_seconds = round(time.perf_counter() - t, 1)
        fitted.write_bytes(pickle.dumps((model, check, fit_seconds)))
    result: Dict[str, Any] = {
        "model": {
            "description": (
                f"mixture of {args.groups} low-rank (rank {args.rank}) Gaussians over per-module directions, joint with "
                f"the log module norms, fitted to {len(X)} real projected gradients of the demo index "
                f"({len(real['docs'])} documents, {len(real['w64'])} 64-token and {len(real['w32'])} 32-token windows; "
                f"layout {len(layout.k)} modules x k={layout.k[0]}), every row a fresh draw, 1-bit encoded"
            ),
            "fit_seconds": fit_seconds,
        },
        "model_check": check,
        "commit_rows": args.commit_rows,
        "runs": [],
    }
    for n in [int(float(r)) for r in args.rows.split(",")]:
        print(f"{n} rows: drawing codes", file=sys.stderr, flush=True)
        codes, scales = modelled_codes(model, n, args.work, key)
        if args.first_pass_only:
            Y = AttributionIndex.open(args.demo).query_coordinates(texts[: args.queries])
            result.setdefault("first_pass", []).append(first_pass_only(codes, scales, layout, Y, args.work, args))
            print(render_first_pass(result["first_pass"]), file=sys.stderr, flush=True)
            write_json(str(args.work / "result-first-pass.json"), result)
            continue
        path = args.work / f"store-{n}"
        store = build_store(args.demo, path, codes, scales, args.commit_rows)
        print(f"{n} rows: measuring", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--measure",
            str(path),
            "--queries",
            str(args.queries),
            "--repeat",
            str(args.repeat),
            "--candidate-share",
            str(args.candidate_share),
            "--torch-threads",
            str(args.torch_threads),
            "--query-bits",
            *[str(z) for z in args.query_bits],
        ] + (["--no-candidates"] if args.no_candidates else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"measuring failed:\n{proc.stderr[-4000:]}")
        result["runs"].append({"store": store, "measured": json.loads(proc.stdout.strip().splitlines()[-1])})
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
        print(render(result), file=sys.stderr, flush=True)
        write_json(str(args.work / "result.json"), result)
    if not prints_json(args):
        print(render_first_pass(result["first_pass"]) if args.first_pass_only else render(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
