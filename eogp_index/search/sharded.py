"""Scans that do not fit one machine's memory: streamed from the table, or split over workers.

:func:`fragment_top_k` streams the code columns of some Lance fragments in record batches sized
in bytes (only ``signs``/``scales`` or ``coords`` and the row address are read), scans each batch
with the exact kernel and keeps a running top-k. One process over all fragments is the
larger-than-memory path; ``torchrun`` workers each taking every ``world_size``-th fragment, with
rank 0 merging their top-k lists, is the scale-out path:

    torchrun --nproc_per_node 4 -m eogp_index.search.sharded --index my-index --text "..." -k 20
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence

import numpy as np

from eogp_index.store.hot import BATCH_BYTES
from eogp_index.store.codecs import SignLayout
from eogp_index.store.table import Store, list_column_to_numpy

Direction = Literal["positive", "negative"]


@dataclass(frozen=True)
class RowScores:
    """Best rows of one query in one direction: ``rowaddr`` ``(r,)`` uint64, ``scores`` ``(r,)`` float32,
    best first (largest for ``positive``, smallest for ``negative``)."""

    rowaddr: np.ndarray
    scores: np.ndarray

    @staticmethod
    def merge(parts: Sequence["RowScores"], k: int, direction: Direction) -> "RowScores":
        """Exact top-k of the union of several top-k lists (ties: lower row address first)."""
        rowaddr = np.concatenate([p.rowaddr for p in parts]) if parts else np.zeros(0, np.uint64)
        scores = np.concatenate([p.scores for p in parts]) if parts else np.zeros(0, np.float32)
        key = -scores if direction == "positive" else scores
        order = np.lexsort((rowaddr, key))[:k]
        return RowScores(rowaddr=rowaddr[order], scores=scores[order])


def batch_scores(batch, y: np.ndarray, layout: SignLayout, precision: str) -> np.ndarray:
    """Exact scores ``(nq, rows)`` float32 of a record batch holding the code columns."""
    if precision == "1bit":
        from eogp_index.search.scan import scan_scores

        codes = list_column_to_numpy(batch.column("signs"), layout.nbytes, np.uint8)
        scales = list_column_to_numpy(batch.column("scales"), layout.num_modules, np.float32)
        return scan_scores(codes, scales, y, layout)
    coords = list_column_to_numpy(batch.column("coords"), layout.num_coords, np.float32)
    return (y.astype(np.float32) @ coords.T).astype(np.float32)


def fragment_top_k(
    store: Store,
    layout: SignLayout,
    precision: str,
    y: np.ndarray,
    k: int,
    *,
    directions: Sequence[Direction] = ("positive", "negative"),
    fragment_ids: Optional[Sequence[int]] = None,
    where: Optional[str] = None,
    batch_bytes: int = BATCH_BYTES,
) -> List[dict]:
    """Stream fragments (all, or ``fragment_ids``) and keep each query's top-k per direction.

    Returns:
        one ``{direction: RowScores}`` per query row of ``y`` ``(nq, K)``.
    """
    best: List[dict] = [{d: RowScores(np.zeros(0, np.uint64), np.zeros(0, np.float32)) for d in directions}
                        for _ in range(y.shape[0])]
    if store.table is None:
        return best
    dataset = store.dataset()
    fragments = dataset.get_fragments()
    if fragment_ids is not None:
        wanted = set(fragment_ids)
        fragments = [f for f in fragments if f.fragment_id in wanted]
    if not fragments:
        return best
    columns = ["signs", "scales"] if precision == "1bit" else ["coords"]
    scanner = dataset.scanner(columns=columns, filter=where, fragments=fragments, with_row_address=True,
                              batch_size_bytes=batch_bytes)
    for batch in scanner.to_batches():
        if batch.num_rows == 0:
            continue
        rowaddr = batch.column("_rowaddr").to_numpy().astype(np.uint64)
        scores = batch_scores(batch, y, layout, precision)
        for q in range(y.shape[0]):
            for d in directions:
                part = RowScores(rowaddr, scores[q])
                best[q][d] = RowScores.merge([best[q][d], part], k, d)
    return best


def _main(argv: Optional[List[str]] = None) -> int:
    import torch.distributed as dist

    from eogp_index.client import AttributionIndex

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m eogp_index.search.sharded",
        description="Exact top-k over an index's Lance fragments, split across torchrun workers; "
                    "rank 0 merges and prints JSON. Example: torchrun --standalone --nproc_per_node 2 "
                    "-m eogp_index.search.sharded --index my-index --text 'Parse a CSV file.' -k 10",
    )
    parser.add_argument("--index", required=True, help="index directory")
    parser.add_argument("--text", action="append", default=[], help="a query text (repeatable)")
    parser.add_argument("--input-ids", action="append", default=[],
                        help="a pre-tokenized query as comma-separated ids (repeatable)")
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--where", default=None, help="SQL filter on stored columns")
    args = parser.parse_args(argv)
    queries: List[object] = list(args.text) + [[int(t) for t in s.split(",")] for s in args.input_ids]
    if not queries:
        parser.error("give --text or --input-ids")

    distributed = "RANK" in __import__("os").environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    index = AttributionIndex.open(args.index)
    y = index.query_coordinates(queries)
    fragment_ids = sorted(f.fragment_id for f in index.store.dataset().get_fragments()) if index.store.table else []
    mine = fragment_ids[rank::world]
    local = fragment_top_k(index.store, index.layout, index.manifest.precision, y, args.k,
                           fragment_ids=mine, where=args.where)
    gathered = [None] * world
    if distributed:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    if rank == 0:
        results = []
        for q, query in enumerate(queries):
            entry = {"query": query}
            for d in ("positive", "negative"):
                merged = RowScores.merge([g[q][d] for g in gathered], args.k, d)
                rows = index.store.take_rows(merged.rowaddr.tolist(), index.store.metadata_columns()).to_pylist()
                entry[d] = [dict(row, score=float(s)) for row, s in zip(rows, merged.scores)]
            results.append(entry)
        json.dump(results, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through torchrun in tests
    sys.exit(_main())
