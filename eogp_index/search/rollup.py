"""Roll-ups: influence summed by a metadata column (which sources, licenses, documents carry it).

Every row matching the query's filter is scored exactly once (the full-scores pass of the hot
copy); the rows are then grouped by the values of one stored column with Arrow's hash
aggregation. Each group gets:

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

The top-k rows are the ranked answer's (best score first, ties by table order). Groups are
sorted by ``sum``, most positive first (most negative first for ``direction="negative"``),
ties by their value. A column of window rows' ``parent_id`` rolls windows up to documents.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eogp_index.errors import InputError

#: The roll-up's columns after the group's own, in order.
ROLLUP_COLUMNS = ("rows", "sum", "mean", "max", "top_positive", "top_negative", "share_positive", "share_negative")


def check_group_column(column: str, available: Sequence[str]) -> None:
    """Refuse a column the rows do not hold, naming the ones they do."""
    if column not in available:
        raise InputError(f"group_by: no stored column {column!r}; group by one of {sorted(available)} "
                         "(metadata columns are named at ingest with --metadata)")


def top_mask(scores: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """``(n,)`` bool: the ``k`` best of ``scores`` (largest or smallest), equal scores in position order."""
    n = scores.shape[0]
    mask = np.zeros(n, bool)
    if n == 0:
        return mask
    key = -scores if largest else scores
    if k < n:
        kth = np.partition(key, k - 1)[k - 1]
        cand = np.flatnonzero(key <= kth)  # every row that may be among the k, ties at the edge included
    else:
        cand = np.arange(n)
    order = np.lexsort((cand, key[cand]))[:k]
    mask[cand[order]] = True
    return mask


def roll_up(values, scores: np.ndarray, k: int, column: str, *, descending: bool = True) -> pa.Table:
    """The roll-up of one query's scores by a column's values (see the module docstring).

    Args:
        values: ``(n,)`` the column's values of the scored rows (Arrow array or chunked array).
        scores: ``(n,)`` their scores, in the same order. k: rows per side counted as top hits.
        column: the name of the group column in the result.
        descending: sort the groups by ``sum``, largest first (else smallest first).

    Returns:
        ``<column>`` then :data:`ROLLUP_COLUMNS`, one row per group.
    """
    s = np.asarray(scores, np.float64)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    table = pa.table({"key": values, "score": s, "positive": np.maximum(s, 0.0), "negative": np.minimum(s, 0.0),
                      "top_positive": top_mask(s, k, True).astype(np.int64),
                      "top_negative": top_mask(s, k, False).astype(np.int64)})
    try:
        grouped = table.group_by("key").aggregate([
            ("score", "count"), ("score", "sum"), ("score", "mean"), ("score", "max"), ("top_positive", "sum"),
            ("top_negative", "sum"), ("positive", "sum"), ("negative", "sum")])
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise InputError(f"group_by: column {column!r} of type {values.type} cannot be grouped ({exc}); group by "
                         "a column of strings, numbers, dates or booleans") from None
    total_pos, total_neg = float(table["positive"].to_numpy().sum()), float(table["negative"].to_numpy().sum())
    pos = grouped["positive_sum"].to_numpy()
    neg = grouped["negative_sum"].to_numpy()
    out = pa.table({
        column: grouped["key"],
        "rows": grouped["score_count"],
        "sum": grouped["score_sum"],
        "mean": grouped["score_mean"],
        "max": grouped["score_max"],
        "top_positive": grouped["top_positive_sum"],
        "top_negative": grouped["top_negative_sum"],
        # (+ 0.0: a group without negative scores has a share of 0, not -0)
        "share_positive": pos / total_pos + 0.0 if total_pos > 0 else np.zeros_like(pos),
        "share_negative": neg / total_neg + 0.0 if total_neg < 0 else np.zeros_like(neg),
    })
    keys = [("sum", "descending" if descending else "ascending"), (column, "ascending")]
    return out.take(pc.sort_indices(out, sort_keys=keys))  # (nulls last)


def empty_roll_up(column: str, type_: pa.DataType) -> pa.Table:
    """A roll-up with no groups (nothing matched), with the roll-up's columns and types."""
    types: List[pa.DataType] = [pa.int64(), pa.float64(), pa.float64(), pa.float64(), pa.int64(), pa.int64(),
                                pa.float64(), pa.float64()]
    return pa.table({column: pa.array([], type_), **{name: pa.array([], t) for name, t in zip(ROLLUP_COLUMNS, types)}})
