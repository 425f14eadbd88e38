"""Batch work on Ray: ``eogp scores --ray`` and ``eogp select --ray`` over a table version's
fragments, split into shards.

The driver (the process that runs the command) checks the question, pins the table's latest
version, measures the queries once and puts their coordinates in Ray's object store; the
fragments of that version are split into balanced shards
(:func:`~eogp_index.cluster.runtime.fragment_shards`), and one Ray task per shard scores its
fragments with the one-process code (:mod:`eogp_index.search.select`, given the fragment
subset). What the driver writes is what one process writes:

* scores: one process scans the table fragment by fragment in table order, each record batch
  written as one row group per query (:func:`~eogp_index.search.select.write_scores`). Each
  shard task streams its fragments' batches (a Ray streaming generator), and the driver writes
  them in that same fragment order through the same writer: the same file. Batches of a
  fragment the writer has not reached yet wait in Ray's object store, which spills to disk.
* select: each shard keeps its own best ``keep`` rows by the one-process rule (key, then the
  lower row address); the best ``keep`` of the shards' best are the best ``keep`` of all rows
  (:func:`~eogp_index.search.select.merge_best`), so the selection, and the file written from it,
  are one process's.

Example:
    >>> written = scores_on_ray(index, ["a query"], "scores.parquet", shards=4)  # doctest: +SKIP
    >>> picked = select_on_ray(index, targets, SelectOptions(top="10%"), out="subset.jsonl")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from eogp_index.config import SelectOptions
from eogp_index.data.location import index_path
from eogp_index.errors import EOGPError
from eogp_index.search.question import Question
from eogp_index.search.searchers import STREAM_BATCH_BYTES
from eogp_index.search.select import (
    ScoresWork,
    Selection,
    SelectionWork,
    best_rows,
    finish_selection,
    merge_best,
    parquet_output,
    pinned_table,
    score_fragments,
    scores_work,
    selection_work,
    table_fragments,
    write_score_batches,
    write_selection,
)
from eogp_index.store.stored_index import StoredIndex

from .runtime import connect, fragment_shards

__all__ = ["scores_on_ray", "select_on_ray", "shard_split"]


def shard_split(stored: StoredIndex, version: Optional[int], shards: Optional[int], ray) -> List[List[int]]:
    """The fragment ids of ``version`` in ``shards`` balanced shards, the empty ones left out,
    each in table order (``shards`` None: one per CPU of the cluster)."""
    dataset = pinned_table(stored, version)
    if dataset is None:
        return []
    fragments = table_fragments(dataset)
    if shards is None:
        shards = max(1, int(ray.cluster_resources().get("CPU", 1)))
    split = fragment_shards([(f.fragment_id, f.count_rows()) for f in fragments], shards)
    position = {f.fragment_id: i for i, f in enumerate(fragments)}
    return [sorted(ids, key=position.__getitem__) for ids in split if ids]


def scores_on_ray(
    index,
    question: Union[Question, Sequence[Any]],
    out: Union[str, Path],
    *,
    address: Optional[str] = None,
    shards: Optional[int] = None,
    where: Optional[str] = None,
    precision: str = SelectOptions.precision,
    batch_bytes: int = STREAM_BATCH_BYTES,
) -> int:
    """:func:`~eogp_index.search.select.write_scores` with the fragments scored by Ray tasks, one
    per shard (``shards``; None: one per CPU of the cluster); the same file. ``address``:
    :func:`~eogp_index.cluster.runtime.connect`. Returns the rows written."""
    out = index_path(out)
    parquet_output(out)
    ray = connect(address)
    work = scores_work(index, question, where=where, precision=precision)
    stored: StoredIndex = index.stored
    split = shard_split(stored, work.version, shards, ray)
    if not split:
        return write_score_batches(out, iter(()))
    order = [f.fragment_id for f in table_fragments(pinned_table(stored, work.version))]
    task = ray.remote(_score_shard).options(num_returns="streaming", scheduling_strategy="SPREAD")
    shared = ray.put(work)
    streams = [task.remote(str(stored.path), shared, ids, batch_bytes) for ids in split]
    try:
        return write_score_batches(out, _in_table_order(ray, streams, split, order))
    finally:
        for stream in streams:  # a failed write stops the shards still scoring
            with contextlib.suppress(Exception):
                ray.cancel(stream)


def _score_shard(
    index_path: str, work: ScoresWork, fragment_ids: Sequence[int], batch_bytes: int
) -> Iterator[Tuple[int, Optional[pa.RecordBatch], Optional[np.ndarray]]]:
    """A shard's task: ``(fragment id, rows, scores (nq, b))`` per batch, in table order, and
    ``(fragment id, None, None)`` when a fragment is done."""
    stored = StoredIndex.open(index_path)
    for fragment_id, batches in score_fragments(stored, work, batch_bytes=batch_bytes, fragment_ids=fragment_ids):
        for rows, scores in batches:
            yield fragment_id, rows, scores
        yield fragment_id, None, None


def _in_table_order(
    ray, streams, split: List[List[int]], order: Sequence[int]
) -> Iterator[Tuple[pa.RecordBatch, np.ndarray]]:
    """The shards' batches in the table's fragment order: each fragment's from its shard's stream."""
    owner: Dict[int, int] = {fragment: s for s, ids in enumerate(split) for fragment in ids}
    for fragment in order:
        stream = streams[owner[fragment]]
        while True:
            got, rows, scores = _get(ray, next(stream))
            if got != fragment:  # each shard yields its fragments in table order
                raise RuntimeError(f"shard {owner[fragment]} sent fragment {got} before {fragment}")
            if rows is None:
                break
            yield rows, scores


def select_on_ray(
    index,
    question: Union[Question, Sequence[Any]],
    options: SelectOptions = SelectOptions(),
    *,
    address: Optional[str] = None,
    shards: Optional[int] = None,
    out: Union[str, Path, None] = None,
    batch_bytes: int = STREAM_BATCH_BYTES,
) -> Selection:
    """:func:`~eogp_index.search.select.select_documents` with the fragments scored by Ray tasks,
    one per shard, each keeping its best rows; merged exactly into one process's selection,
    written to ``out`` when given (:func:`~eogp_index.search.select.write_selection`)."""
    ray = connect(address)
    work = selection_work(index, question, options)
    stored: StoredIndex = index.stored
    split = shard_split(stored, work.version, shards, ray) if work.keep else []
    parts: List[Tuple[np.ndarray, np.ndarray]] = []
    if split:
        task = ray.remote(_select_shard).options(scheduling_strategy="SPREAD")
        shared = ray.put(work)
        refs = [task.remote(str(stored.path), shared, ids, batch_bytes) for ids in split]
        parts = [_get(ray, ref) for ref in refs]
    selection = finish_selection(work, *merge_best(parts, work.keep))
    if out is not None:
        write_selection(stored, selection, index_path(out))
    return selection


def _select_shard(
    index_path: str, work: SelectionWork, fragment_ids: Sequence[int], batch_bytes: int
) -> Tuple[np.ndarray, np.ndarray]:
    """A shard's task: its fragments' best ``work.keep`` rows ``(rowaddr, key)``."""
    return best_rows(StoredIndex.open(index_path), work, batch_bytes=batch_bytes, fragment_ids=fragment_ids)


def _get(ray, ref):
    """``ray.get``, with an eogp error raised in a task raised here as itself."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, EOGPError):
            raise cause from None
        raise
