#!/usr/bin/env python
"""A roll-up over every row against one full-scores pass, in the same run.

A group-by query (``eogp query --group-by COLUMN``, ``.group_by(column)``) scores every row
matching its filter once and aggregates the scores by a column's values
(:mod:`eogp_index.search.rollup`). This measures, on ``--rows`` rows of random 1-bit codes held
in memory as the hot copy holds them (signs uint8, scales float32; ``--modules`` x ``--k`` bits,
by default 32 x 64 = 256 bytes per row, the size of the demo index's rows):

* **full scores**: :func:`~eogp_index.search.searchers.exact_scores` of one query over every
  row, what ``HotSearcher.scores`` (``AttributionIndex.scores``) runs;
* **group-by**: the same pass, then :func:`~eogp_index.search.rollup.roll_up` by a
  dictionary-coded ``source`` column of ``--groups`` values (the hot copy's form of a string
  column with few values), and by an int64 ``parent_id`` column (``--rows / 8`` documents, as
  windows roll up to documents); *first* encodes the column's groups, *repeated* reuses them
  (the query builder keeps them with the hot copy per column and filter).

Each line prints the best wall time of ``--repeat`` runs, that run's process CPU time, and the
ratio of wall times to the full-scores pass (target: at most 1.5). Targets are reported, never
asserted.

Usage: python benchmarks/rollup.py [--rows 1000000] [--groups 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from eogp_index.search.rollup import group_codes, roll_up  # noqa: E402
from eogp_index.search.searchers import exact_scores  # noqa: E402
from eogp_index.store.codecs import Encoded, SignLayout  # noqa: E402


def best_of(fn, repeat: int) -> tuple:
    """Best wall time of ``repeat`` runs and that run's process CPU time (about threads x wall when
    nothing else competes for the cores; much less means the wall times are pessimistic)."""
    best, best_cpu = float("inf"), 0.0
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        if t < best:
            best, best_cpu = t, c
    return best, best_cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=float, default=1e6)
    ap.add_argument("--modules", type=int, default=32)
    ap.add_argument("--k", type=int, default=64, help="coordinates (bits) per module")
    ap.add_argument("--groups", type=int, default=1000, help="distinct values of the source column")
    ap.add_argument("--topk", type=int, default=20, help="k of the top-k counts")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    n = int(args.rows)
    layout = SignLayout((args.k,) * args.modules)
    rng = np.random.default_rng(args.seed)
    encoded = Encoded(signs=rng.integers(0, 256, size=(n, layout.nbytes), dtype=np.uint8),
                      scales=rng.lognormal(0.0, 1.0, size=(n, layout.num_modules)).astype(np.float16)
                      .astype(np.float32))
    y = rng.standard_normal((1, layout.num_coords)).astype(np.float32)
    names = pa.array([f"source-{i}" for i in range(args.groups)])
    source = pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, args.groups, n).astype(np.int32)), names)
    parent_id = pa.array(np.arange(n, dtype=np.int64) // 8)

    exact_scores(encoded.take(np.arange(256)), y, layout)  # compile (or load) the kernels
    scores = exact_scores(encoded, y, layout)[0]
    full, full_cpu = best_of(lambda: exact_scores(encoded, y, layout), args.repeat)
    lines = [f"{n} rows x {layout.nbytes} B of signs ({args.modules} modules x k={args.k}), "
             f"{int(__import__('numba').get_num_threads())} threads, load average {os.getloadavg()[0]:.2f}",
             f"full scores (one query, every row):      {full * 1e3:8.1f} ms (cpu {full_cpu * 1e3:.0f} ms)"]
    for column, values in (("source", source), ("parent_id", parent_id)):
        groups = roll_up(values, scores, args.topk, column).num_rows
        codes = group_codes(values)
        for when, given in (("first", values), ("repeated", codes)):
            t, cpu = best_of(lambda: roll_up(given, exact_scores(encoded, y, layout)[0], args.topk, column),
                             args.repeat)
            ratio = t / full
            lines.append(f"group-by {column:<10} ({groups:>7} groups), {when:<8}: {t * 1e3:8.1f} ms "
                         f"(cpu {cpu * 1e3:.0f} ms) = {ratio:.2f} x full scores (target <= 1.5) "
                         f"[{'ok' if ratio <= 1.5 else 'MISSED'}]")
    lines.append(f"load average after: {os.getloadavg()[0]:.2f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
