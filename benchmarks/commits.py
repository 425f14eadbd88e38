#!/usr/bin/env python
"""What small commits cost as fragments pile up, with and without the compaction ingest runs.

Each `eogp ingest` commit (256 rows by default) adds one Lance fragment and one table version, and
every commit writes a manifest that lists every fragment. 10M rows in 256-row commits are 39,063
fragments. This writes ``--commits`` commits of ``--rows`` rows of 1-bit codes (``--code-bytes``,
272 B: 256 bytes of signs + 8 FP16 scales) plus the bookkeeping columns
ingest writes, through :meth:`Store.add <eogp_index.store.table.Store.add>`, twice in one run:

* **piling up**: nothing compacts; every ``--every`` commits a line gives the fragments, the mean
  milliseconds per commit over the last ``--every``, the time to open the table afresh
  (``lance.dataset``: reads the latest manifest) and to list its fragments, and a filtered count;
* **compacting as ingest does**: after each commit
  :func:`~eogp_index.store.maintenance.maybe_optimize` (past 256 small fragments it compacts,
  refreshes indexes and drops versions older than the retention); the same lines, the compaction
  time included in the commits' mean.

Then the per-commit time of the first run is fitted linearly in the number of fragments and
extrapolated to 39,063 fragments (10M rows). The rows are random: a commit's cost does not
depend on their values. ``--json PATH`` also writes the figures as one JSON object.

    python benchmarks/commits.py                       # 8,000 commits each way
    python benchmarks/commits.py --commits 2000 --every 250   # quicker
    python benchmarks/commits.py --commits 14000 --every 2000 --only piling   # one way only
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from common import add_json_argument, write_json

from eogp_index.store.maintenance import DEFAULT_FRAGMENT_THRESHOLD, maybe_optimize
from eogp_index.store.table import Store, fixed_size_list


class _Stored:
    """The part of a StoredIndex that maybe_optimize uses, for a table without an index directory."""

    def __init__(self, store: Store):
        self.store = store


def _rows(rng: np.random.Generator, start: int, n: int, code_bytes: int) -> pa.Table:
    signs = rng.integers(0, 256, (n, code_bytes - 16), dtype=np.uint8)
    scales = rng.random((n, 8)).astype(np.float16)
    i = np.arange(start, start + n)
    return pa.table(
        {
            "id": pa.array([f"doc-{j}" for j in i]),
            "signs": fixed_size_list(signs),
            "scales": fixed_size_list(scales),
            "shard": pa.array(["part-0.jsonl"] * n),
            "position": pa.array(i, pa.int64()),
            "num_tokens": pa.array(rng.integers(10, 512, n), pa.int32()),
            "num_loss_tokens": pa.array(rng.integers(10, 512, n), pa.int32()),
            "truncated": pa.array(np.zeros(n, bool)),
            "n_chars": pa.array(rng.integers(0, 10000, n), pa.int64()),
        }
    )


def _probe(store: Store) -> tuple[float, float, float]:
    """Milliseconds to open the table afresh, to list its fragments, and for a filtered count."""
    import lance

    t = time.perf_counter()
    dataset = lance.dataset(store.path)
    opened = time.perf_counter() - t
    t = time.perf_counter()
    dataset.get_fragments()
    listed = time.perf_counter() - t
    t = time.perf_counter()
    dataset.count_rows(filter="n_chars < 10")
    counted = time.perf_counter() - t
    return opened * 1e3, listed * 1e3, counted * 1e3


def run(root: Path, *, commits: int, rows: int, code_bytes: int, every: int, compact: bool) -> list[dict]:
    store = Store(root, "examples")
    rng = np.random.default_rng(0)
    lines, window, compaction = [], 0.0, 0.0
    for c in range(commits):
        table = _rows(rng, c * rows, rows, code_bytes)
        t = time.perf_counter()
        store.add(table)
        if compact:
            t2 = time.perf_counter()
            if maybe_optimize(_Stored(store), threshold=DEFAULT_FRAGMENT_THRESHOLD) is not None:
                compaction += time.perf_counter() - t2
        window += time.perf_counter() - t
        if (c + 1) % every == 0:
            opened, listed, counted = _probe(store)
            line = {
                "commits": c + 1,
                "fragments": len(store.dataset().get_fragments()),
                "versions_dir": len(list(Path(store.path, "_versions").iterdir())),
                "ms_per_commit": 1e3 * window / every,
                "open_ms": opened,
                "fragments_ms": listed,
                "count_ms": counted,
                "compaction_s": compaction,
            }
            print(
                ("  compacting " if compact else "  piling up  ")
                + f"{line['commits']:6d} commits  {line['fragments']:6d} fragments  "
                f"{line['versions_dir']:6d} manifests  {line['ms_per_commit']:6.1f} ms/commit  "
                f"open {opened:6.1f} ms  list fragments {listed:6.1f} ms  filtered count {counted:6.1f} ms"
                + (f"  (compactions so far {compaction:.1f} s)" if compact else ""),
                flush=True,
            )
            lines.append(line)
            window = 0.0
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=256, help="rows per commit (eogp ingest's default)")
    parser.add_argument("--code-bytes", type=int, default=272)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", choices=["piling", "compacting"], default=None, help="run one of the two ways")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eogp-commits-"))
    print(f"{args.commits} commits of {args.rows} rows of {args.code_bytes}-byte codes; in {work}")
    piled = compacted = None
    try:
        if args.only != "compacting":
            piled = run(
                work / "piled",
                commits=args.commits,
                rows=args.rows,
                code_bytes=args.code_bytes,
                every=args.every,
                compact=False,
            )
        if args.only != "piling":
            compacted = run(
                work / "compacted",
                commits=args.commits,
                rows=args.rows,
                code_bytes=args.code_bytes,
                every=args.every,
                compact=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        "commits": args.commits,
        "rows": args.rows,
        "code_bytes": args.code_bytes,
        "piling_up": piled,
        "compacting": compacted,
    }
    if piled is None or compacted is None:
        write_json(args.json, figures)
        return
    frags = np.array([line["fragments"] for line in piled], float)
    per = np.array([line["ms_per_commit"] for line in piled])
    slope, intercept = np.polyfit(frags, per, 1)
    target = 10_000_000 // args.rows
    print(
        f"\npiling up: ms/commit ≈ {intercept:.1f} + {slope * 1000:.2f} per 1,000 fragments "
        f"→ {intercept + slope * target:.0f} ms/commit at {target:,} fragments (10M rows, extrapolated); "
        f"open {piled[-1]['open_ms']:.0f} ms at {piled[-1]['fragments']:,} fragments"
    )
    last = compacted[-1]
    total_piled = sum(line["ms_per_commit"] for line in piled) * args.every / 1e3
    total_compacted = sum(line["ms_per_commit"] for line in compacted) * args.every / 1e3
    print(
        f"compacting: {last['fragments']} fragments and {last['versions_dir']} manifests after {last['commits']:,} "
        f"commits; {last['ms_per_commit']:.1f} ms/commit in the last window; all commits {total_compacted:.0f} s "
        f"(compactions {last['compaction_s']:.0f} s) vs {total_piled:.0f} s piling up = "
        f"{total_compacted / total_piled:.2f}x"
    )
    figures.update(
        fit_ms_per_commit={"intercept": intercept, "per_1000_fragments": slope * 1000},
        extrapolated_fragments=target,
        extrapolated_ms_per_commit=intercept + slope * target,
        seconds_piling_up=total_piled,
        seconds_compacting=total_compacted,
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
