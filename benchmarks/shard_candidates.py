#!/usr/bin/env python
"""First passes on shards (``eogp serve --ray`` with ``candidates``): recall@k of the merged
answer against the exact scan, on 1, 2 and 4 shards, on real gradient codes.

The index is the one ``benchmarks/real_codes.py build`` makes (the shipped model over about
100k real documents, ``-k 256``) with its first pass ``--first-pass`` (``bench-flat``, which
``real_codes.py measure`` builds). Nothing is written to it: its ids and one-bit codes are copied
to a scratch index in fragments of ``--fragment-rows`` rows (its table is mostly one compacted
fragment, and fragments are what shards split), with its manifest and the first pass's JSON;
the queries are projected by the index itself. Each shard here is what a shard actor holds (:class:`~eogp_index.cluster.shards.ShardIndex`, its fragments of the table's
latest version split as ``eogp serve --ray`` splits them), in this one process, and builds its
first pass over its own rows (:meth:`ShardIndex.first_pass`); one shard is one process's first
pass built the same way over every row. Per shard count and budget ``C`` (``--budgets``,
multiples of ``k``), one line: the share of the exact one-bit top ``k`` (every row scanned) in
the merged answer, averaged over the queries (held-out documents) and both sides, and the
seconds the largest shard took to build its first pass::

    python benchmarks/shard_candidates.py                   # 20 queries, k 20, C = 1, 2, 5 x k
    python benchmarks/shard_candidates.py --json out.json   # and the figures as JSON
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import common
import numpy as np
from real_codes import MODEL, _queries, default_cache


def scratch_copy(source: Path, target: Path, fragment_rows: int, first_pass: str) -> Path:
    """``target``: the manifest of ``source``, its first pass's JSON, and its table's ids and
    one-bit codes in fragments of ``fragment_rows`` rows (made once)."""
    import shutil

    import lance

    if not (target / "examples.lance").exists():
        (target / "faiss").mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "manifest.json", target / "manifest.json")
        shutil.copy(source / "faiss" / f"{first_pass}.json", target / "faiss" / f"{first_pass}.json")
        table = lance.dataset(str(source / "examples.lance")).to_table(columns=["id", "signs", "scales"])
        lance.write_dataset(table, str(target / "examples.lance"), max_rows_per_file=fragment_rows)
    return target


def _exact(shards, y: np.ndarray, k: int, sides: Sequence[str]):
    from eogp_index.cluster.merge import merged_hits
    from eogp_index.search.searchers import HotSearcher

    parts = [HotSearcher(shard).top_k(y, k, sides) for shard in shards]
    return merged_hits(parts, y.shape[0], k, sides)


def _recall(found, exact, k: int, sides: Sequence[str]) -> float:
    shares = [
        len(set(f[side].rowaddr.tolist()) & set(e[side].rowaddr.tolist())) / k
        for f, e in zip(found, exact)
        for side in sides
    ]
    return float(np.mean(shares))


def measure(args) -> Dict[str, Any]:
    from eogp_index import AttributionIndex
    from eogp_index.cluster.merge import merged_hits
    from eogp_index.cluster.runtime import fragment_shards
    from eogp_index.cluster.shards import ShardIndex, _fragments

    source = Path(args.cache) / "index"
    texts = _queries(Path(args.cache), args.queries)
    y = AttributionIndex.open(str(source), model_name=args.model).query_coordinates(texts)
    y = np.ascontiguousarray(y, np.float32)
    scratch = Path(args.scratch) / f"fragments-{args.fragment_rows}"
    path = str(scratch_copy(source, scratch, args.fragment_rows, args.first_pass))
    k, sides = args.k, ("positive", "negative")
    version, fragments = _fragments(ShardIndex.open(path))
    exact = None
    lines: List[Dict[str, Any]] = []
    for count in args.shards:
        shards = []
        for ids in fragment_shards(fragments, count):
            shard = ShardIndex.open(path)
            shard.assign(version, ids)
            shards.append(shard)
        if exact is None:
            exact = _exact(shards, y, k, sides)
        build_s = []
        for shard in shards:
            started = time.perf_counter()
            shard.first_pass(args.first_pass)
            build_s.append(time.perf_counter() - started)
        for mult in args.budgets:
            C = mult * k
            parts = [shard.candidates_top_k(y, k, C, sides, None, args.first_pass) for shard in shards]
            found = merged_hits(parts, y.shape[0], k, sides)
            line = {
                "shards": count,
                "rows_per_shard": max(shard.hot_codes().num_rows for shard in shards),
                "C": C,
                "recall": _recall(found, exact, k, sides),
                "build_s": max(build_s),
            }
            lines.append(line)
            print(
                f"shards {count}  rows/shard {line['rows_per_shard']:>7}  C {C:>4}  recall@{k} {line['recall']:.3f}  "
                f"first pass built in {line['build_s']:.1f} s",
                flush=True,
            )
        del shards
    return {"rows": sum(r for _, r in fragments), "queries": len(y), "k": k, "load": os.getloadavg()[0], "lines": lines}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=str(default_cache()), help="real_codes.py's cache folder")
    parser.add_argument("--model", default=str(MODEL), help="the index's model")
    parser.add_argument("--first-pass", default="bench-flat", help="the index's first pass to copy on each shard")
    parser.add_argument("--fragment-rows", type=int, default=4096, help="rows per fragment of the scratch copy")
    parser.add_argument(
        "--scratch", default=str(Path(default_cache()).parent / "shard-candidates"), help="where the copy is made"
    )
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 5], help="C as multiples of k")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    common.add_json_argument(parser)
    args = parser.parse_args(argv)
    common.write_json(args.json, measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
