#!/usr/bin/env python
"""A served index in shards (``eogp serve --ray``) on this machine: query time, the merge's
overhead and each shard's memory, on 1, 2 and 4 shards in one run.

Writes an index of ``--rows`` synthetic rows (random sign bits and scales of ``--modules``
modules of ``--k`` coordinates; no model: the shards only scan codes) in ``--fragments``
commits, starts a local Ray, and for each shard count starts the shard actors
(:class:`~eogp_index.cluster.shards.ShardPool`: each builds the in-memory copy of its fragments)
and answers ``--nq`` random queries, ``k`` per side, through the ingress's query
(:class:`~eogp_index.cluster.query.ClusterQuery`, what ``/v1/query`` runs after projecting), best
of ``--repeat``. It prints, per shard count:

* **load**: seconds until every shard holds its copy;
* **query**: the ingress's time for the batch (the shards' scans, the transfers, the merge of
  their top-k and the hits' rows read from the table);
* **slowest scan**: the slowest shard's own scan time in that run;
* **overhead**: query minus slowest scan, and its ratio to the slowest scan (target: at most 0.1);
  split into **calls** (sending the queries to the shards and their answers back, past the
  slowest scan) and **merge** (the rest: merging the top-k lists and reading the hits' rows);
* **memory**: each shard's resident memory against the plan, the codes it holds (in scanning
  dtypes, with row addresses and metadata) plus a fixed part: the resident memory of a shard
  holding one row after a query, measured in the same run.

Targets are reported, never asserted. The machine's other processes make wall times
pessimistic. ``--json PATH`` also writes the figures as one JSON object.

Usage: python benchmarks/cluster.py [--rows 10000000] [--shards 1 2 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import common
import numpy as np

MIB = 2**20


def write_index(path: Path, rows: int, modules: int, k: int, fragments: int, seed: int = 0) -> None:
    """A 1-bit index of ``rows`` random rows in ``fragments`` commits (manifest and table only)."""
    import pyarrow as pa

    from eogp_index.store.codecs import SignLayout, codec_for
    from eogp_index.store.manifest import Manifest, ModuleEntry
    from eogp_index.store.stored_index import StoredIndex
    from eogp_index.store.table import fixed_size_list

    layout = SignLayout((k,) * modules)
    manifest = Manifest(
        model={"name": "synthetic", "weights_sha256": "0" * 64, "num_parameters": 1, "tokenizer": None},
        projection={"file": "projection.safetensors", "sha256": "0" * 64, "variant": "eogp", "seed": 0},
        modules=[ModuleEntry(name=f"m{u}", d_out=k, d_in=k, m=k, k=k, damping=1.0) for u in range(modules)],
        precision="1bit",
        damping_ratio=0.1,
        bytes_per_example=codec_for("1bit", layout).bytes_per_example,
        curvature={"num_examples": 1, "seed": 0},
    )
    path.mkdir(parents=True)
    manifest.save(path)
    stored = StoredIndex.open(path)
    rng = np.random.default_rng(seed)
    step = -(-rows // fragments)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        stored.store.add(
            pa.table(
                {
                    "id": pa.array([f"row-{i}" for i in range(start, start + n)]),
                    "shard": pa.array(["synthetic"] * n),
                    "position": pa.array(np.arange(start, start + n), pa.int64()),
                    "signs": fixed_size_list(rng.integers(0, 256, (n, layout.nbytes), dtype=np.uint8)),
                    "scales": fixed_size_list(rng.uniform(0.5, 1.5, (n, modules)).astype(np.float16)),
                }
            )
        )


def fixed_bytes(work: Path, modules: int, k: int, address) -> int:
    """Resident memory of a shard actor holding one row of the same layout after a query: its
    imports, the table opened, the kernels loaded; what every shard holds besides its rows."""
    from eogp_index.cluster.query import ClusterQuery
    from eogp_index.cluster.shards import ShardPool
    from eogp_index.search.question import Question
    from eogp_index.store.stored_index import StoredIndex

    path = work / "one-row"
    if not (path / "manifest.json").exists():
        write_index(path, 1, modules, k, 1)
    stored = StoredIndex.open(path)
    pool = ShardPool(str(path), 1, address=address, timeout_s=600.0)
    try:
        pool.refresh(stored)
        y = np.zeros((1, stored.layout.num_coords), np.float32)
        index = SimpleNamespace(stored=stored, device="cpu")
        ClusterQuery(index, pool, Question(queries=({"text": "q"},), k=1)).to_list(coordinates=y)
        return int(pool.health()[0]["rss_bytes"] or 0)
    finally:
        pool.close()


def measure(path: Path, shards: int, address, nq: int, k: int, repeat: int, fixed: int) -> dict:
    """One shard count's figures (see the module docstring)."""
    from eogp_index.cluster.query import ClusterQuery
    from eogp_index.cluster.shards import ShardPool
    from eogp_index.search.question import Question
    from eogp_index.store.stored_index import StoredIndex

    stored = StoredIndex.open(path)
    started = time.perf_counter()
    pool = ShardPool(str(path), shards, address=address, timeout_s=600.0)
    try:
        pool.refresh(stored)
        load_s = time.perf_counter() - started
        index = SimpleNamespace(stored=stored, device="cpu")
        y = np.random.default_rng(1).standard_normal((nq, stored.layout.num_coords)).astype(np.float32)
        question = Question(queries=tuple({"text": f"q{i}"} for i in range(nq)), k=k)
        runs = []
        for _ in range(repeat + 1):  # the first run warms the shards' kernels
            pool.begin()
            t0 = time.perf_counter()
            ClusterQuery(index, pool, question).to_list(coordinates=y)
            runs.append((time.perf_counter() - t0, pool.shard_seconds, pool.call_seconds))
        query_s, scan_s, call_s = min(runs[1:])
        health = pool.health()
        memory = [
            {
                "shard": s["shard"],
                "rows": s["rows"],
                "rss_mib": (s["rss_bytes"] or 0) / MIB,
                "plan_mib": (s["hot_bytes"] + fixed) / MIB,
            }
            for s in health
        ]
        return {
            "shards": shards,
            "load_s": load_s,
            "query_ms": 1000 * query_s,
            "slowest_scan_ms": 1000 * scan_s,
            "overhead_ms": 1000 * (query_s - scan_s),
            "overhead_ratio": (query_s - scan_s) / scan_s if scan_s > 0 else float("nan"),
            "calls_ms": 1000 * (call_s - scan_s),
            "merge_ms": 1000 * (query_s - call_s),
            "memory": memory,
        }
    finally:
        pool.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000, help="synthetic rows in the index")
    ap.add_argument("--modules", type=int, default=32)
    ap.add_argument("--k", type=int, default=512, help="coordinates (bits) per module: 2 KB of signs a row")
    ap.add_argument("--fragments", type=int, default=16, help="commits writing the rows (the table's fragments)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--nq", type=int, default=1, help="queries in one batch")
    ap.add_argument("--topk", type=int, default=20, help="hits per side")
    ap.add_argument("--repeat", type=int, default=5, help="best of this many batches")
    ap.add_argument("--address", default=None, help="a Ray cluster to join (default: start a local Ray)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the index here (reused when present)")
    common.add_json_argument(ap)
    args = ap.parse_args(argv)

    from eogp_index.cluster.runtime import connect

    work = args.workdir or Path(tempfile.mkdtemp(prefix="eogp-cluster-"))
    path = work / "index"
    try:
        if not (path / "manifest.json").exists():
            t0 = time.perf_counter()
            write_index(path, args.rows, args.modules, args.k, args.fragments)
            print(
                f"wrote {args.rows:,} rows in {args.fragments} fragments: {time.perf_counter() - t0:.0f} s", flush=True
            )
        ray = connect(args.address)
        fixed = fixed_bytes(work, args.modules, args.k, args.address)
        lines = [measure(path, s, args.address, args.nq, args.topk, args.repeat, fixed) for s in args.shards]
        figures = {
            "rows": args.rows,
            "bytes_per_row": args.modules * args.k // 8 + 2 * args.modules,
            "nq": args.nq,
            "k": args.topk,
            "fixed_mib": fixed / MIB,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],
            "runs": lines,
        }
        if not common.prints_json(args):
            report(figures)
        common.write_json(args.json, figures)
        ray.shutdown()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(figures: dict) -> None:
    print(
        f"\n{figures['rows']:,} rows; {figures['nq']} query(ies), k={figures['k']} per side; {figures['cpus']} CPUs, "
        f"load average {figures['load_average']:.1f}; a shard holding one row: {figures['fixed_mib']:.0f} MiB"
    )
    print(
        f"{'shards':>6s} {'load s':>7s} {'query ms':>9s} {'slowest scan ms':>16s} {'overhead ms':>12s} "
        f"{'calls ms':>9s} {'merge ms':>9s} {'overhead/scan':>14s} {'target':>7s}   memory per shard: RSS / plan MiB"
    )
    for line in figures["runs"]:
        memory = ", ".join(f"{m['rss_mib']:.0f}/{m['plan_mib']:.0f}" for m in line["memory"])
        print(
            f"{line['shards']:>6d} {line['load_s']:>7.1f} {line['query_ms']:>9.1f} {line['slowest_scan_ms']:>16.1f} "
            f"{line['overhead_ms']:>12.1f} {line['calls_ms']:>9.1f} {line['merge_ms']:>9.1f} "
            f"{line['overhead_ratio']:>14.2f} {'<=0.10':>7s}   {memory}"
        )


if __name__ == "__main__":
    sys.exit(main())
