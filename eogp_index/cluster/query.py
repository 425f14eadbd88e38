"""A question answered by the shards: the one-process query with its scan sent to every shard.

:class:`ClusterQuery` is :class:`~eogp_index.search.query.InfluenceQuery` whose searcher is
:class:`ShardSearcher`: the ingress keeps everything a question does after its scan (keeping each
side to rows of its sign, rescoring the merged one-bit top rows from the tier, per-module terms,
reading the hits' metadata from the table), so an answer is one process's answer. Roll-ups merge
the shards' partial sums (:func:`~eogp_index.cluster.merge.merged_roll_up`). The candidates
route (:class:`ShardCandidateSearcher`) has each shard run a first pass over its own rows.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa

from eogp_index.cluster.merge import Found, merged_hits, merged_roll_up
from eogp_index.cluster.shards import ShardPool
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError
from eogp_index.search.first_pass.base import require_signs
from eogp_index.search.query import InfluenceQuery, Projects
from eogp_index.search.question import Question, check_question
from eogp_index.search.ranking import Side
from eogp_index.search.rescore import rescored


class ShardSearcher:
    """Every shard's exact top ``k`` (its :class:`~eogp_index.search.searchers.HotSearcher`),
    merged: the exact top ``k`` of all rows, as one process's searcher returns it."""

    def __init__(self, pool: ShardPool, *, normalize: str = "none", allow_partial: bool = False):
        self.pool = pool
        self.normalize = normalize
        self.allow_partial = allow_partial

    def top_k(self, y: np.ndarray, k: int, sides: Sequence[Side], where: Optional[str] = None) -> Found:
        y = np.ascontiguousarray(y, np.float32)
        parts = self.pool.call("top_k", y, k, tuple(sides), where, self.normalize, allow_partial=self.allow_partial)
        return merged_hits([found for found, _ in parts], y.shape[0], k, sides)


class ShardCandidateSearcher:
    """The candidates route on the shards: each shard's first pass (of the kind and build
    parameters of the index's first pass ``name``, over the shard's own rows) picks ``C``
    candidates per side among its rows, which it scores exactly and keeps its best ``k`` of; the
    merge keeps the best ``k`` of their union (:func:`~eogp_index.cluster.merge.merged_hits`).

    Every hit's score is exact. Each shard looks at ``C`` of its own rows per side, so the union
    scored holds up to ``shards · C`` rows; when ``C`` is at least a shard's rows, every row is
    scored and the answer is the exact scan's.

    Raises:
        ConfigError: the index has no first pass ``name``, or one made from other codes (``field``
            ``first_pass``: the request's, answered 400).
    """

    def __init__(self, pool: ShardPool, candidates: int, *, name: str = "default", allow_partial: bool = False):
        self.pool = pool
        self.candidates = int(candidates)
        self.name = name
        self.allow_partial = allow_partial

    def top_k(self, y: np.ndarray, k: int, sides: Sequence[Side], where: Optional[str] = None) -> Found:
        if self.candidates < k:
            raise ConfigError(f"candidates C={self.candidates} must be at least k={k}", field="candidates")
        y = np.ascontiguousarray(y, np.float32)
        args = (y, k, self.candidates, tuple(sides), where, self.name)
        try:
            parts = self.pool.call("candidates", *args, allow_partial=self.allow_partial)
        except (IndexNotFoundError, IncompatibleIndexError) as exc:  # the question's first pass: its field
            raise ConfigError(str(exc), field="first_pass") from None
        return merged_hits([found for found, _ in parts], y.shape[0], k, sides)


class ClusterQuery(InfluenceQuery):
    """An :class:`InfluenceQuery` over the shards of ``pool``.

    Args:
        index: the ingress's encoder (it projects the queries once, and reads the hits' rows).
        pool: the shards.
        question: the question (its ``allow_partial`` says whether missing shards are an error).
    """

    def __init__(self, index: Projects, pool: ShardPool, question: Question):
        super().__init__(index, question=question)
        self.pool = pool

    def searcher(self):
        opts = self.question
        if opts.route == "candidates":
            require_signs(self._index.stored)  # refused here, before any shard is asked
            return ShardCandidateSearcher(
                self.pool, opts.candidates, name=opts.first_pass, allow_partial=opts.allow_partial
            )
        # Every exact route gives the same answer: each shard scans its copy (hot, stream or sharded alike).
        return ShardSearcher(self.pool, normalize=opts.normalize, allow_partial=opts.allow_partial)

    def roll_ups(self, *, coordinates: Optional[np.ndarray] = None) -> List[pa.Table]:
        """:meth:`InfluenceQuery.roll_ups`, each shard rolling up its rows and the parts merged."""
        opts = self.question
        if opts.group_by is None:
            raise ConfigError("roll_ups needs a column: .group_by(column)")
        stored = self._index.stored
        check_question(opts, stored)
        y = np.ascontiguousarray(self.coordinates(coordinates), np.float32)
        n = self._rescored_count(None) if self._rescore else opts.k
        parts = self.pool.call(
            "roll_up", y, opts.where, opts.normalize, opts.group_by, n, allow_partial=opts.allow_partial
        )
        column_type = stored.store.schema.field(opts.group_by).type
        out = []
        for q in range(y.shape[0]):
            rescore = None
            if self._rescore:

                def rescore(found, q=q):
                    return rescored(stored, [found], y[q : q + 1], opts.k, opts.normalize)[0]

            out.append(
                merged_roll_up(
                    [shard[q] for shard, _ in parts],
                    n,
                    opts.group_by,
                    column_type,
                    descending=opts.direction != "negative",
                    rescore=rescore,
                )
            )
        return out
