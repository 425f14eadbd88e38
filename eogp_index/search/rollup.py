"""Roll-ups: influence summed by a metadata column (which sources, licenses, documents carry it).

Every row matching the query's filter is scored exactly once (the full-scores pass of the hot
copy); the rows are then grouped by the values of one stored column (its dictionary codes, or
Arrow's dictionary encoding of it) and summed per group in one pass. Each group gets:

==================  ================================================================
``<column>``        the group's value (null rows form one group)
``rows``            how many matching rows it holds
``sum``             the sum of its rows' scores (float64)
``mean``, ``max``   the mean and the largest of its rows' scores
``top_positive``    how many of its rows are among the ``k`` most positive of all rows
``top_negative``    how many are among the ``k`` most negative
``share_positive``  its part of the total positive influence, ``Σ max(score, 0)`` (0 to 1)
``share_negative``  its part of the total negative influence, ``Σ min(score, 0)`` (0 to 1)
==================  ================================================================

The top-k rows are the ranked answer's (best score first, ties by table order): on an index with
a rescoring tier, the rescored hits (the one-bit top ``rescore · k`` rescored from the tier, of
their sign), while the sums stay the one-bit scores of every row. Groups are
sorted by ``sum``, most positive first (most negative first for ``direction="negative"``),
ties by their value. A column of window rows' ``parent_id`` rolls windows up to documents.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eogp_index.errors import InputError

#: The roll-up's columns after the group's own, in order.
ROLLUP_COLUMNS = ("rows", "sum", "mean", "max", "top_positive", "top_negative", "share_positive", "share_negative")


def check_group_column(column: str, available: Sequence[str]) -> None:
    """Refuse a column the rows do not hold, naming the ones they do."""
    if column not in available:
        raise InputError(
            f"group_by: no stored column {column!r}; group by one of {sorted(available)} "
            "(metadata columns are named at ingest with --metadata)"
        )


def top_positions(scores: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Positions ``(min(k, n),)`` int64 of the ``k`` largest and the ``k`` smallest of ``scores``
    ``(n,)`` float32, best first, equal scores in position order (the ranked answer's rule).

    The scan's heap pass (``kernels.select._top_positions``) finds ``k`` rows holding the ``k``
    best values, ties at the edge in any order; every row strictly better than the edge value is
    among them, and the rows equal to it are then taken in position order.
    """
    from eogp_index.search.kernels.select import _top_positions

    scores = np.ascontiguousarray(scores, np.float32)
    kk = min(int(k), scores.shape[0])
    out = []
    for sign in (1.0, -1.0):
        if kk == 0:
            out.append(np.zeros(0, np.int64))
            continue
        kept = _top_positions(scores, sign, kk)
        edge = (sign * scores[kept]).min()
        better = kept[sign * scores[kept] > edge]
        tied = np.flatnonzero(sign * scores == edge)[: kk - better.size]
        pick = np.concatenate([better, tied])
        out.append(pick[np.lexsort((pick, -sign * scores[pick]))])
    return out[0], out[1]


def _group_sums(index, scores, size):
    """One pass over the rows: per group ``(rows, sum, positive sum, negative sum, max)``, float64
    sums in row order. ``index`` ``(n,)`` int32 group of each row; ``scores`` ``(n,)`` float32."""
    rows = np.zeros(size, np.int64)
    total = np.zeros(size)
    positive = np.zeros(size)
    negative = np.zeros(size)
    best = np.full(size, -np.inf)
    for i in range(index.shape[0]):
        g = index[i]
        value = np.float64(scores[i])
        rows[g] += 1
        total[g] += value
        if value > 0:
            positive[g] += value
        elif value < 0:
            negative[g] += value
        if value > best[g]:
            best[g] = value
    return rows, total, positive, negative, best


_COMPILED: dict = {}


def _kernel(name: str, function):
    """``function`` compiled by numba, on first use (importing this module loads no numba)."""
    if name not in _COMPILED:
        from numba import njit

        _COMPILED[name] = njit(cache=True, boundscheck=False)(function)
    return _COMPILED[name]


def group_codes(values) -> Tuple[pa.Array, np.ndarray]:
    """The distinct values ``(G,)`` (a null one last, when there are nulls) and each row's group
    ``(n,)`` int32: a dictionary column's own codes, else Arrow's dictionary encoding. They
    depend on the rows only, not on the query: callers may keep them per table version."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        encoded = values if pa.types.is_dictionary(values.type) else pc.dictionary_encode(values)
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise InputError(
            f"group_by: a column of type {values.type} cannot be grouped ({exc}); group by a column "
            "of strings, numbers, dates or booleans"
        ) from None
    keys = encoded.dictionary
    index = encoded.indices.fill_null(len(keys)).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    if encoded.null_count:
        keys = pa.concat_arrays([keys, pa.nulls(1, keys.type)])
    return keys, index


def roll_up(
    values,
    scores: np.ndarray,
    k: int,
    column: str,
    *,
    descending: bool = True,
    tops: Optional[Tuple[np.ndarray, np.ndarray]] = None,
) -> pa.Table:
    """The roll-up of one query's scores by a column's values (see the module docstring).

    Args:
        values: ``(n,)`` the column's values of the scored rows (Arrow array or chunked array,
            dictionary-coded or not), or their :func:`group_codes`.
        scores: ``(n,)`` their scores, in the same order. k: rows per side counted as top hits.
        column: the name of the group column in the result.
        descending: sort the groups by ``sum``, largest first (else smallest first).
        tops: positions ``(≤k,)`` int64 of the ranked answer's positive and negative hits, when
            they are not the top ``k`` of ``scores`` (rescored hits: the tier's ranking).

    Returns:
        ``<column>`` then :data:`ROLLUP_COLUMNS`, one row per group.
    """
    scores = np.ascontiguousarray(scores, np.float32)
    keys, index = values if isinstance(values, tuple) else group_codes(values)
    size = len(keys)
    top_positive, top_negative = top_positions(scores, k) if tops is None else tops
    sums = group_sums(index, scores, size)
    counts = (np.bincount(index[top_positive], minlength=size), np.bincount(index[top_negative], minlength=size))
    return rolled_up(keys, sums, counts, column, descending=descending)


def group_sums(index: np.ndarray, scores: np.ndarray, size: int) -> Tuple[np.ndarray, ...]:
    """Per group ``(G,)``: ``(rows, sum, positive sum, negative sum, max)`` (int64, then float64),
    summed in row order. ``index`` ``(n,)`` int32 group of each row; ``scores`` ``(n,)`` float32.
    Partial sums of disjoint rows add up (the max is the max): a sharded roll-up merges them."""
    return _kernel("sums", _group_sums)(index, np.ascontiguousarray(scores, np.float32), size)


def rolled_up(
    keys: pa.Array,
    sums: Sequence[np.ndarray],
    top_counts: Tuple[np.ndarray, np.ndarray],
    column: str,
    *,
    descending: bool = True,
) -> pa.Table:
    """The roll-up table of groups ``keys`` ``(G,)`` from their :func:`group_sums` and their rows'
    counts among the top positive and negative hits ``(G,)`` each; groups without rows are left out."""
    rows, total, positive, negative, best = sums
    total_pos, total_neg = float(positive.sum()), float(negative.sum())
    used = np.flatnonzero(rows)  # a dictionary may hold values no matching row has
    out = pa.table(
        {
            column: keys.take(pa.array(used)),
            "rows": rows[used],
            "sum": total[used],
            "mean": total[used] / rows[used],
            "max": best[used],
            "top_positive": np.asarray(top_counts[0])[used],
            "top_negative": np.asarray(top_counts[1])[used],
            # (+ 0.0: a group without negative scores has a share of 0, not -0)
            "share_positive": positive[used] / total_pos + 0.0 if total_pos > 0 else np.zeros(used.size),
            "share_negative": negative[used] / total_neg + 0.0 if total_neg < 0 else np.zeros(used.size),
        }
    )
    return out.take(_group_order(out, column, descending))


def _group_order(groups: pa.Table, column: str, descending: bool) -> np.ndarray:
    """Positions ordering ``groups`` by ``sum`` (largest first when ``descending``), equal sums by
    the group's value, nulls last. One numpy sort of the sums; Arrow's two-key sort, twice as slow
    on many groups, only when two sums are equal."""
    sums = groups.column("sum").to_numpy()
    order = np.argsort(-sums if descending else sums)
    ordered = sums[order]
    if np.any(ordered[1:] == ordered[:-1]):
        keys_order = [("sum", "descending" if descending else "ascending"), (column, "ascending")]
        return pc.sort_indices(groups, sort_keys=keys_order).to_numpy()
    return order


def empty_roll_up(column: str, type_: pa.DataType) -> pa.Table:
    """A roll-up with no groups (nothing matched), with the roll-up's columns and types."""
    types: List[pa.DataType] = [
        pa.int64(),
        pa.float64(),
        pa.float64(),
        pa.float64(),
        pa.int64(),
        pa.int64(),
        pa.float64(),
        pa.float64(),
    ]
    return pa.table({column: pa.array([], type_), **{name: pa.array([], t) for name, t in zip(ROLLUP_COLUMNS, types)}})
