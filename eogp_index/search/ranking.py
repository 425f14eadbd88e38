"""Ranking: the one place where scored rows become an ordered answer.

Every search route (the hot copy on CPU or GPU, the streamed table, torchrun shards, FAISS
candidates) ends with :class:`Hits` per query and side. They are ordered here by one rule —
best score first, equal scores by ascending Lance row address (table order) — and turned into
the users' tables by :func:`ranked_tables`, which reads the rows' metadata (from the hot copy
when it is loaded).

A side holds only rows of its sign (:func:`of_their_sign`): a positive score on the positive
side (training on the document lowers the query's loss), a negative one on the negative side,
a zero on neither. A side with fewer than ``k`` such rows among those searched is shorter, or
empty, rather than filled with rows of the other sign.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from eogp_index.errors import ConfigError
from eogp_index.store.hot import numpy_to_arrow, strings_to_arrow
from eogp_index.store.stored_index import StoredIndex

Side = Literal["positive", "negative"]
Direction = Literal["positive", "negative", "both"]
DIRECTIONS: Tuple[str, ...] = ("positive", "negative", "both")


def sides_of(direction: str) -> Tuple[Side, ...]:
    """``"both"`` → ``("positive", "negative")``; a single side → itself; anything else is refused."""
    if direction not in DIRECTIONS:
        raise ConfigError(
            f"direction must be one of {list(DIRECTIONS)}, got {direction!r} "
            "(positive: documents that help the query; negative: that hurt it)"
        )
    return ("positive", "negative") if direction == "both" else (direction,)  # type: ignore[return-value]


@dataclass(frozen=True)
class Hits:
    """The best rows of one query on one side, best first.

    Attributes:
        rowaddr: ``(r,)`` uint64 Lance row addresses. scores: ``(r,)`` float32 exact scores.
        scores_1bit: ``(r,)`` float32, the one-bit scan's scores of rescored hits (whose
            ``scores`` are the rescoring tier's: :mod:`eogp_index.search.rescore`); None otherwise.
    """

    rowaddr: np.ndarray
    scores: np.ndarray
    scores_1bit: Optional[np.ndarray] = None

    @staticmethod
    def empty() -> "Hits":
        return Hits(np.zeros(0, np.uint64), np.zeros(0, np.float32))

    @staticmethod
    def best(rowaddr: np.ndarray, scores: np.ndarray, k: int, side: Side) -> "Hits":
        """The top ``k`` of ``(rowaddr (n,), scores (n,))``: largest for ``positive``, smallest for
        ``negative``; equal scores in ascending row address."""
        rowaddr = np.asarray(rowaddr, np.uint64)
        scores = np.asarray(scores, np.float32)
        order = np.lexsort((rowaddr, -scores if side == "positive" else scores))[:k]
        return Hits(rowaddr[order], scores[order])

    def of_sign(self, side: Side) -> "Hits":
        """The hits of ``side``'s sign (scores ``> 0`` positive, ``< 0`` negative), order kept.

        Exact on a side's top ``k``: its rows of the other sign can only stand after all of its
        own, so what remains is the top of the rows of that sign."""
        keep = self.scores > 0 if side == "positive" else self.scores < 0
        if keep.all():
            return self
        one_bit = None if self.scores_1bit is None else self.scores_1bit[keep]
        return Hits(self.rowaddr[keep], self.scores[keep], one_bit)

    @staticmethod
    def merge(parts: Sequence["Hits"], k: int, side: Side) -> "Hits":
        """Exact top ``k`` of the union of several top-k lists (e.g. one per shard or batch)."""
        if not parts:
            return Hits.empty()
        return Hits.best(np.concatenate([p.rowaddr for p in parts]), np.concatenate([p.scores for p in parts]), k, side)


def of_their_sign(found: Sequence[Dict[Side, Hits]]) -> List[Dict[Side, Hits]]:
    """Each query's sides keeping only the hits of that side's sign (:meth:`Hits.of_sign`)."""
    return [{side: hits.of_sign(side) for side, hits in by_side.items()} for by_side in found]


def ranked_tables(
    stored: StoredIndex,
    found: Sequence[Dict[Side, Hits]],
    *,
    with_direction: bool,
    modules: Optional[Sequence[Dict[Side, List[dict]]]] = None,
) -> List[pa.Table]:
    """Each query's answer: ``[direction,] rank, id, score[, score_1bit][, modules]`` leading (``score_1bit``:
    rescored hits' one-bit scores, :mod:`eogp_index.search.rescore`), then the stored
    metadata columns. The hits' rows are read once for all the queries: from the hot copy when it
    is loaded (an Arrow take, microseconds), else in one Lance take (milliseconds whatever its
    size: one per query would dominate a batch).

    Args:
        stored: the index's stored parts (:meth:`StoredIndex.rows` reads the rows).
        found: per query, ``{side: Hits}`` in the order the sides are shown.
        with_direction: add the ``direction`` column (for ``direction="both"``).
        modules: per query and side, one ``{module: term}`` dict per hit (``by_module``), shown as a
            struct column ``modules`` after ``score``.
    """
    addresses = [hits.rowaddr for by_side in found for hits in by_side.values()]
    wanted = np.unique(np.concatenate(addresses)) if addresses else np.zeros(0, np.uint64)
    if stored.store.version == 0:  # nothing ingested yet: empty answers with the id column
        rows = pa.table({"id": pa.array([], pa.string())})
    else:
        rows = stored.rows(wanted)
    answers = []
    for q, by_side in enumerate(found):
        parts = []
        for side, hits in by_side.items():
            # (Arrays from buffers: pa.array imports pandas on first use, a cost for a first query.)
            part = rows.take(numpy_to_arrow(np.searchsorted(wanted, hits.rowaddr).astype(np.int64)))
            if modules is not None:
                terms = modules[q][side]
                part = part.add_column(0, "modules", pa.array(terms) if terms else pa.nulls(0))
            if hits.scores_1bit is not None:
                part = part.add_column(0, "score_1bit", numpy_to_arrow(np.asarray(hits.scores_1bit, np.float32)))
            part = part.add_column(0, "score", numpy_to_arrow(np.asarray(hits.scores, np.float32)))
            part = part.add_column(0, "rank", numpy_to_arrow(np.arange(1, len(hits.scores) + 1, dtype=np.int32)))
            if with_direction:
                part = part.add_column(0, "direction", strings_to_arrow([side] * len(hits.scores)))
            parts.append(part)
        # An empty side's modules column has no type yet: it takes the other side's.
        result = pa.concat_tables(parts, promote_options="default")
        front = [c for c in ("direction", "rank", "id", "score", "score_1bit", "modules") if c in result.column_names]
        answers.append(result.select(front + [c for c in result.column_names if c not in front]))
    return answers
