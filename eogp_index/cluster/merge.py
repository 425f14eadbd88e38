"""The one place where the shards' answers become one process's answer.

Every shard scans its own rows (disjoint fragments of one table version) with the one-process
kernels and returns, per query, what its rows contribute:

* hits: its exact top ``n`` per side (:class:`~eogp_index.search.ranking.Hits`, ``n`` = ``k``, or
  the ``rescore · k`` one-bit rows a rescoring keeps); the union's top ``n`` is the top ``n`` of
  all rows, ordered by :meth:`Hits.merge` as one process orders them (best score first, equal
  scores by ascending row address, which is one process's table order);
* a roll-up part (:class:`RollUpPart`): per group of its rows the partial sums of
  :func:`~eogp_index.search.rollup.group_sums` (they add up over disjoint rows; the max is the
  max) and its top ``n`` rows per side with their groups, from which the ranked answer's top
  rows, and so each group's ``top_positive`` / ``top_negative`` counts, are found.

Normalized scores need nothing here: a unit-normalized row is divided by its own norm, on its
shard. Aggregated queries arrive as one row of coordinates, computed once by the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from eogp_index.search.ranking import Hits, Side
from eogp_index.search.rollup import empty_roll_up, rolled_up

#: ``{side: Hits}`` for each query.
Found = List[Dict[Side, Hits]]


@dataclass(frozen=True)
class RollUpPart:
    """One shard's share of one query's roll-up.

    Attributes:
        keys: ``(G,)`` the distinct values of the group column among the shard's matching rows
            (:func:`~eogp_index.search.rollup.group_codes`: a null group last).
        sums: :func:`~eogp_index.search.rollup.group_sums` of its rows, ``(G,)`` each.
        top: per side, its best ``n`` rows: ``(rowaddr (t,) uint64, scores (t,) float32,
            group (t,) int32)``; ``positive`` the largest scores, ``negative`` the smallest, of
            either sign (the roll-up counts the extreme rows, as one process does).
    """

    keys: pa.Array
    sums: Tuple[np.ndarray, ...]
    top: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]


def merged_hits(parts: Sequence[Found], queries: int, k: int, sides: Sequence[Side]) -> Found:
    """Each query's exact top ``k`` per side over every shard's top ``k`` (``parts``: one
    :data:`Found` per shard that answered; none: every side empty)."""
    return [{side: Hits.merge([part[q][side] for part in parts], k, side) for side in sides} for q in range(queries)]


def _merged_keys(parts: Sequence[RollUpPart]) -> Tuple[pa.Array, List[np.ndarray]]:
    """The union of the parts' groups (non-null values in first-seen order, a null group last)
    and, per part, where each of its groups lands in the union."""
    position: Dict[object, int] = {}
    values: List[object] = []
    has_null = False
    for part in parts:
        for value in part.keys.to_pylist():
            if value is None:
                has_null = True
            elif value not in position:
                position[value] = len(values)
                values.append(value)
    null_at = len(values)
    mapping = [
        np.array([null_at if v is None else position[v] for v in part.keys.to_pylist()], np.int64) for part in parts
    ]
    keys = pa.array(values + ([None] if has_null else []), type=parts[0].keys.type)
    return keys, mapping


def merged_roll_up(
    parts: Sequence[Optional[RollUpPart]],
    n: int,
    column: str,
    column_type: pa.DataType,
    *,
    descending: bool,
    rescore: Optional[Callable[[Dict[Side, Hits]], Dict[Side, Hits]]] = None,
) -> pa.Table:
    """One query's roll-up from its shards' parts (None: a shard without matching rows).

    Args:
        n: the top rows kept per side: the ranked answer's ``k``, or the ``rescore · k``
            one-bit rows ``rescore`` rescores to it.
        column, column_type: the group column's name and Arrow type (for a roll-up without rows).
        descending: order the groups by ``sum``, largest first.
        rescore: on an index with a rescoring tier, the ranked answer's hits from the merged
            one-bit top rows (:func:`~eogp_index.search.rescore.rescored` of the one query);
            None: the top ``k`` one-bit rows are the ranked answer's.
    """
    present = [part for part in parts if part is not None and len(part.keys)]
    if not present:
        return empty_roll_up(column, column_type)
    keys, mapping = _merged_keys(present)
    size = len(keys)
    rows, total, positive, negative = (np.zeros(size, np.int64), np.zeros(size), np.zeros(size), np.zeros(size))
    best = np.full(size, -np.inf)
    for part, at in zip(present, mapping):
        part_rows, part_total, part_positive, part_negative, part_best = part.sums
        rows[at] += part_rows
        total[at] += part_total
        positive[at] += part_positive
        negative[at] += part_negative
        best[at] = np.maximum(best[at], part_best)
    # Every shard's best rows, their groups in the union: the ranked answer's top rows are among them.
    rowaddr = {side: np.concatenate([part.top[side][0] for part in present]) for side in ("positive", "negative")}
    scores = {side: np.concatenate([part.top[side][1] for part in present]) for side in ("positive", "negative")}
    groups = {
        side: np.concatenate([at[part.top[side][2]] for part, at in zip(present, mapping)])
        for side in ("positive", "negative")
    }
    found = {side: Hits.best(rowaddr[side], scores[side], n, side) for side in ("positive", "negative")}
    if rescore is not None:
        found = rescore(found)
    counts = []
    for side in ("positive", "negative"):
        order = np.argsort(rowaddr[side], kind="stable")
        at = order[np.searchsorted(rowaddr[side][order], found[side].rowaddr)]
        counts.append(np.bincount(groups[side][at], minlength=size))
    return rolled_up(
        keys, (rows, total, positive, negative, best), (counts[0], counts[1]), column, descending=descending
    )
