"""``where`` filters evaluated on the hot copy, in the SQL dialect Lance uses.

Lance evaluates a filter with DataFusion: it parses the string with sqlparser in a MySQL-like
dialect (backticks quote names, ``"double quotes"`` are strings) and plans it with DataFusion.
Here the same string goes to DataFusion's own parser, in the MySQL dialect and without
lower-casing names, over the hot copy's columns (:class:`~eogp_index.store.hot.HotCodes`,
memory-mapped Arrow). A filter then costs one pass over the columns it names: no round trip
through Lance, no search of row addresses. The answer is the sorted positions of the matching
rows in the hot copy, which the scan takes as they are.

Filters that DataFusion cannot plan or run here are handed to Lance, which reads the table:
Lance's own extensions (unquoted names in any case, its ``_rowid``/``_rowaddr`` columns,
``regexp_match`` as a predicate) and filters neither accepts, whose error Lance words
(:meth:`~eogp_index.store.table.Store.filter_error`). Either way the answer is cached on the hot
copy, that is per table version: a repeated filter costs a dictionary lookup.

Example:
    >>> positions = matching_positions(stored.hot_codes(), "module = 'json' AND n_chars < 100", stored.store)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import List, Optional

import numpy as np
import pyarrow as pa

from eogp_index.store.hot import HotCodes, numpy_to_arrow
from eogp_index.store.table import Store

#: The position column added to the columns DataFusion sees (not a stored column).
ROW_COLUMN = "_eogp_row"
#: Filters remembered per hot copy (most recently used kept), and the bytes their answers may hold.
CACHE_ENTRIES = 64
CACHE_BYTES = 256 << 20
#: DataFusion's settings for Lance's dialect: MySQL's quoting, names kept as written.
DATAFUSION_SETTINGS = {
    "datafusion.sql_parser.dialect": "MySQL",
    "datafusion.sql_parser.enable_ident_normalization": "false",
}


class UnplannedFilter(Exception):
    """DataFusion could not plan or run a filter over the hot columns (Lance evaluates it)."""


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


class HotFilter:
    """DataFusion over one hot copy's columns; made once per copy, on its first filter.

    Args:
        columns: the copy's non-code columns (``HotCodes.filterable``), ``n >= 1`` rows.
    """

    def __init__(self, columns: pa.Table):
        from datafusion import SessionConfig, SessionContext

        n = columns.num_rows
        row_type = pa.uint32() if n < (1 << 32) else pa.uint64()
        batches: List[pa.RecordBatch] = []
        at = 0
        for batch in columns.to_batches():
            if batch.num_rows == 0:
                continue
            rows = numpy_to_arrow(np.arange(at, at + batch.num_rows, dtype=np.uint32 if n < (1 << 32) else np.uint64))
            batches.append(pa.RecordBatch.from_arrays([*batch.columns, rows],
                                                      names=[*batch.schema.names, ROW_COLUMN]))
            at += batch.num_rows
        # Contiguous runs of batches, one per core: each partition's matches come out in row order,
        # so the answer is sorted without sorting it.
        parts = max(1, min(_cpu_count(), len(batches)))
        size = -(-len(batches) // parts) if batches else 1
        partitions = [batches[i:i + size] for i in range(0, len(batches), size)]
        config = SessionConfig().with_target_partitions(parts)
        for key, value in DATAFUSION_SETTINGS.items():
            config = config.set(key, value)
        self._context = SessionContext(config)
        self._context.register_record_batches("hot", partitions)
        self._frame = self._context.table("hot")

    def positions(self, where: str) -> np.ndarray:
        """Sorted ``(m,)`` int64 positions of the rows matching ``where``.

        Raises:
            UnplannedFilter: DataFusion refused the filter (or failed running it).
        """
        from datafusion import col

        try:
            frame = self._frame.filter(self._frame.parse_sql_expr(where)).select(col(ROW_COLUMN))
            partitions = frame.collect_partitioned()
        except Exception as exc:  # DataFusion raises plain Exceptions for parse, plan and run errors
            raise UnplannedFilter(str(exc)) from exc
        parts = [batch.column(0).to_numpy() for part in partitions for batch in part if batch.num_rows]
        if not parts:
            return np.zeros(0, np.int64)
        return np.concatenate(parts).astype(np.int64)


def _cache(hot: HotCodes) -> "OrderedDict[str, np.ndarray]":
    return hot.cache.setdefault("filters", OrderedDict())


def cached_positions(hot: HotCodes, where: str) -> Optional[np.ndarray]:
    """The remembered answer of ``where`` on this copy, or None."""
    found = _cache(hot).get(where)
    if found is not None:
        _cache(hot).move_to_end(where)
    return found


def _remember(hot: HotCodes, where: str, positions: np.ndarray) -> None:
    cache = _cache(hot)
    cache[where] = positions
    while len(cache) > CACHE_ENTRIES or (len(cache) > 1 and sum(v.nbytes for v in cache.values()) > CACHE_BYTES):
        cache.popitem(last=False)


def matching_positions(hot: HotCodes, where: str, store: Store) -> np.ndarray:
    """Sorted ``(m,)`` int64 positions in ``hot`` of the rows matching the SQL filter ``where``.

    DataFusion evaluates it over the hot columns; a filter it refuses is evaluated by Lance on
    ``store`` (at the copy's version), whose error is raised when Lance refuses it too.

    Raises:
        InputError: a filter neither engine accepts, naming it and the columns.
    """
    found = cached_positions(hot, where)
    if found is not None:
        return found
    if hot.num_rows == 0:
        return np.zeros(0, np.int64)
    try:
        engine = hot.cache.get("engine")
        if engine is None:
            engine = hot.cache["engine"] = HotFilter(hot.filterable)
        positions = engine.positions(where)
    except UnplannedFilter:
        matching = store.read([], where, with_row_address=True)  # raises the InputError of a bad filter
        positions = hot.positions(np.sort(matching.column("_rowaddr").to_numpy()))
    _remember(hot, where, positions)
    return positions
