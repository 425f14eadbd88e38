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
asserted. ``--json PATH`` also writes the figures as one JSON object.

Usage: python benchmarks/rollup.py [--rows 1000000] [--groups 1000] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyarrow as pa
from common import add_json_argument, best_of, prints_json, write_json

from eogp_index.search.rollup import group_codes, roll_up
from eogp_index.search.searchers import exact_scores
from eogp_index.store.codecs import Encoded, SignLayout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=float, default=1e6)
    ap.add_argument("--modules", type=int, default=32)
    ap.add_argument("--k", type=int, default=64, help="coordinates (bits) per module")
    ap.add_argument("--groups", type=int, default=1000, help="distinct values of the source column")
    ap.add_argument("--topk", type=int, default=20, help="k of the top-k counts")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    add_json_argument(ap)
    args = ap.parse_args(argv)

    n = int(args.rows)
    layout = SignLayout((args.k,) * args.modules)
    rng = np.random.default_rng(args.seed)
    encoded = Encoded(
        signs=rng.integers(0, 256, size=(n, layout.nbytes), dtype=np.uint8),
        scales=rng.lognormal(0.0, 1.0, size=(n, layout.num_modules)).astype(np.float16).astype(np.float32),
    )
    y = rng.standard_normal((1, layout.num_coords)).astype(np.float32)
    names = pa.array([f"source-{i}" for i in range(args.groups)])
    source = pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, args.groups, n).astype(np.int32)), names)
    parent_id = pa.array(np.arange(n, dtype=np.int64) // 8)

    exact_scores(encoded.take(np.arange(256)), y, layout)  # compile (or load) the kernels
    scores = exact_scores(encoded, y, layout)[0]
    full, full_cpu, _ = best_of(lambda: exact_scores(encoded, y, layout), args.repeat)
    threads = int(__import__("numba").get_num_threads())
    figures = {
        "rows": n,
        "nbytes_per_row": layout.nbytes,
        "modules": args.modules,
        "k": args.k,
        "threads": threads,
        "load_average": os.getloadavg()[0],
        "full_seconds": full,
        "full_cpu_seconds": full_cpu,
        "group_by": [],
    }
    lines = [
        f"{n} rows x {layout.nbytes} B of signs ({args.modules} modules x k={args.k}), "
        f"{int(__import__('numba').get_num_threads())} threads, load average {os.getloadavg()[0]:.2f}",
        f"full scores (one query, every row):      {full * 1e3:8.1f} ms (cpu {full_cpu * 1e3:.0f} ms)",
    ]
    for column, values in (("source", source), ("parent_id", parent_id)):
        groups = roll_up(values, scores, args.topk, column).num_rows
        codes = group_codes(values)
        for when, given in (("first", values), ("repeated", codes)):
            t, cpu, _ = best_of(
                lambda: roll_up(given, exact_scores(encoded, y, layout)[0], args.topk, column), args.repeat
            )
            ratio = t / full
            figures["group_by"].append(
                {
                    "column": column,
                    "groups": groups,
                    "when": when,
                    "seconds": t,
                    "cpu_seconds": cpu,
                    "ratio": ratio,
                    "target_met": ratio <= 1.5,
                }
            )
            lines.append(
                f"group-by {column:<10} ({groups:>7} groups), {when:<8}: {t * 1e3:8.1f} ms "
                f"(cpu {cpu * 1e3:.0f} ms) = {ratio:.2f} x full scores (target <= 1.5) "
                f"[{'ok' if ratio <= 1.5 else 'MISSED'}]"
            )
    lines.append(f"load average after: {os.getloadavg()[0]:.2f}")
    figures["load_average_after"] = os.getloadavg()[0]
    if not prints_json(args):
        print("\n".join(lines))
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
