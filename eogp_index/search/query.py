"""The query builder: a :class:`~eogp_index.search.question.Question` built step by step,
compiled to one searcher, ranked in one place.

Example:
    >>> (index.search("The Eiffel Tower is in Paris.")            # doctest: +SKIP
    ...       .where("source = 'news'").limit(10).direction("both")
    ...       .to_arrow())
    >>> (index.search(["Paris is in France.", "Rome is in Italy."], many=True)   # doctest: +SKIP
    ...       .aggregate("mean").normalize("unit").group_by("source").to_arrow())

A query goes through three steps, the same for every route:

1. **project** — the index's model turns the query (a text, a chat, token ids or a record) into
   ``y``, its projected gradient ``(nq, K)`` (:meth:`Encoder.query_coordinates
   <eogp_index.encode.encoder.Encoder.query_coordinates>`);
2. **search** — :meth:`InfluenceQuery.searcher` picks one searcher from the question's route
   (:mod:`eogp_index.search.searchers`), which returns the exact top ``k`` per side;
3. **rank** — :func:`~eogp_index.search.ranking.ranked_tables` orders the hits and reads the
   rows' metadata.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Union

import numpy as np
import pyarrow as pa

from eogp_index.config import Aggregate, Normalize
from eogp_index.errors import ConfigError
from eogp_index.search.explain import module_dicts, module_terms
from eogp_index.search.normalize import normalized_codes
from eogp_index.search.question import ROUTES, UNMEASURED_RESCORE, Question, Route, check_question
from eogp_index.search.ranking import Direction, Hits, of_their_sign, ranked_tables, sides_of
from eogp_index.search.rescore import rescored, rescored_count, tier_coordinates
from eogp_index.search.rollup import empty_roll_up, group_codes, roll_up, top_positions
from eogp_index.search.searchers import (
    CandidateSearcher,
    HotSearcher,
    ShardedSearcher,
    StreamSearcher,
    TorchSearcher,
)
from eogp_index.store.codecs import Encoded
from eogp_index.store.stored_index import StoredIndex
from eogp_index.store.table_recall import default_rescore_factor

#: A query: a text, a chat (list of ``{"role", "content"}``), token ids, or a record dict
#: (``{"text": ...}``, ``{"messages": ...}``, ``{"input_ids": ..., "labels": ...}``).
Query = Union[str, Sequence[Dict[str, str]], Sequence[int], Dict[str, Any]]

__all__ = ["InfluenceQuery", "Query", "Question", "Route", "ROUTES", "aggregate_coordinates", "rescore_factor"]


def aggregate_coordinates(y: np.ndarray, how: Aggregate) -> np.ndarray:
    """One measurement from several queries: ``(nq, K)`` projected gradients → ``(1, K)`` float32.

    The measurement is the mean (sum) of the queries' losses; its gradient, and so its
    projection (linear), is the mean (sum) of theirs. Summed in float64, rounded once.
    """
    if y.shape[0] == 0:
        raise ConfigError("aggregate needs at least one query")
    total = np.asarray(y, np.float64).sum(axis=0, keepdims=True)
    return (total / y.shape[0] if how == "mean" else total).astype(np.float32)


def rescore_factor(question: Question, stored: StoredIndex) -> int:
    """The rescoring factor ``question`` asks of ``stored``: its own ``rescore``, or, when it gives
    none, the factor measured on the index's table (after its last ingest, or by ``eogp
    optimize``), else the one its fit measured (``Manifest.rescore_factor``), else
    :data:`~eogp_index.search.question.UNMEASURED_RESCORE`
    (:func:`~eogp_index.store.table_recall.default_rescore_factor`); 0 (no rescoring) when the
    index has no tier. Every surface's question is resolved here."""
    if stored.tier is None:
        return 0
    if question.rescore is not None:
        return int(question.rescore)
    measured = default_rescore_factor(stored)
    return UNMEASURED_RESCORE if measured is None else int(measured)


#: Group codes kept per hot copy (that is, per table version; 4 bytes a row each): a page
#: re-asking a roll-up by the same column and filter skips encoding the column again.
_GROUP_CODES_KEPT = 4


def _cached_group_codes(hot, column: str, where: Optional[str], rows: Optional[np.ndarray]):
    """:func:`~eogp_index.search.rollup.group_codes` of ``column`` over the hot rows matching
    ``where`` (positions ``rows``; None: all), kept with the hot copy."""
    kept = hot.cache.setdefault("group_codes", {})
    key = (column, where)
    if key not in kept:
        values = hot.filterable.column(column)
        if len(kept) >= _GROUP_CODES_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = group_codes(values if rows is None else values.take(rows))
    return kept[key]


class Projects(Protocol):
    """What a query needs from the index: its stored parts, a device, and the queries' measurement
    (an :class:`~eogp_index.encode.encoder.Encoder`, :mod:`eogp_index.encode.measurements`)."""

    stored: StoredIndex
    device: str

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray: ...


class InfluenceQuery:
    """A :class:`~eogp_index.search.question.Question` being built against an index. Each method
    returns a new builder; :meth:`to_query_object` is the question built so far.

    Args:
        index: the index's :class:`~eogp_index.encode.encoder.Encoder` (anything :class:`Projects`).
        queries: one query, or a list of them (``many=True``): each answered on its own, or all
            as one behaviour with :meth:`aggregate`.
        question: the question to start from (its queries are kept unless ``queries`` is given).
    """

    def __init__(
        self,
        index: Projects,
        queries: Union[Query, List[Query], None] = None,
        *,
        many: bool = False,
        question: Optional[Question] = None,
    ):
        self._index = index
        if question is None or queries is not None:
            asked = tuple(queries) if many else (queries,)
            question = Question(queries=asked) if question is None else question.replace(queries=asked)
        self.question = question

    def _with(self, **changes) -> "InfluenceQuery":
        return InfluenceQuery(self._index, question=self.question.replace(**changes))

    def to_query_object(self) -> Question:
        """The question built so far (what every surface answers)."""
        return self.question

    # -- building ---------------------------------------------------------------------------------
    def limit(self, k: int) -> "InfluenceQuery":
        """Return ``k`` rows per side."""
        return self._with(k=k)

    def where(self, sql: Optional[str]) -> "InfluenceQuery":
        """Score only the rows matching an SQL filter on stored columns (``"source = 'news'"``)."""
        return self._with(where=sql)

    def direction(self, direction: Direction) -> "InfluenceQuery":
        """``positive``, ``negative`` or ``both``."""
        return self._with(direction=direction)

    def candidates(
        self, C: int, *, first_pass: Optional[str] = None, faiss_name: Optional[str] = None
    ) -> "InfluenceQuery":
        """Score ``C`` first-pass candidates per side (``eogp build-candidates``) instead of every row;
        ``first_pass`` (or its older name ``faiss_name``): which one (``--name``; default ``default``)."""
        name = first_pass or faiss_name or Question.first_pass
        return self._with(route="candidates", candidates=C, first_pass=name)

    def rescore(self, factor: Optional[int]) -> "InfluenceQuery":
        """On an index with a rescoring tier: rescore the one-bit top ``factor · k`` rows per side
        from the tier (0: the one-bit ranking; None: the index's measured default, :func:`rescore_factor`)."""
        return self._with(rescore=factor)

    def by_module(self, enabled: bool = True) -> "InfluenceQuery":
        """Split each hit's score into its per-module terms (a ``modules`` column)."""
        return self._with(by_module=enabled)

    def checkpoint_weights(self, weights: Optional[Sequence[float]]) -> "InfluenceQuery":
        """On an index of several checkpoints, each one's weight in the score (None: the index's)."""
        return self._with(checkpoint_weights=weights)  # checked (and made a tuple) by the Question

    def route(self, route: Route) -> "InfluenceQuery":
        """Choose where codes are read from: ``hot``, ``stream``, ``sharded`` (see :class:`Question`)."""
        return self._with(route=route)

    def aggregate(self, how: Optional[Aggregate] = "mean") -> "InfluenceQuery":
        """Answer the queries as one behaviour: scores of their ``mean`` (or ``sum``) loss, exact,
        in one scan (``index.search([...], many=True).aggregate("mean").to_arrow()``)."""
        return self._with(aggregate=how)

    def normalize(self, how: Normalize = "unit") -> "InfluenceQuery":
        """``unit``: score each training code divided by its norm (cosine); ``none``: influence."""
        return self._with(normalize=how)

    def group_by(self, column: Optional[str]) -> "InfluenceQuery":
        """Roll the scores of every matching row up by a stored column (``.group_by("source")``):
        :meth:`to_arrow` then answers one row per group (:mod:`eogp_index.search.rollup`)."""
        return self._with(group_by=column)

    # -- running ----------------------------------------------------------------------------------
    def searcher(self):
        """The searcher the question's route compiles to (one per route)."""
        stored, opts = self._index.stored, self.question
        if opts.route == "candidates":
            return CandidateSearcher(stored, opts.candidates, faiss_name=opts.first_pass)
        if opts.route == "stream":
            return StreamSearcher(stored, normalize=opts.normalize)
        if opts.route == "sharded":
            return ShardedSearcher(stored, normalize=opts.normalize)
        if self._index.device.startswith("cuda"):
            return TorchSearcher(stored, self._index.device, normalize=opts.normalize)
        return HotSearcher(stored, normalize=opts.normalize)

    def coordinates(self, coordinates: Optional[np.ndarray] = None) -> np.ndarray:
        """The projected queries ``(nq, K)`` float32, or their one aggregated row ``(1, K)``.

        Args:
            coordinates: the queries' projected gradients when already computed.
        """
        if coordinates is None:
            y = self._index.query_coordinates(list(self.question.queries))
        else:
            y = np.asarray(coordinates, np.float32)
        # an ensemble's checkpoints weighted in the query: the one scan sums w_c * score_c
        y = self._index.stored.weigh(y, self.question.checkpoint_weights)
        return y if self.question.aggregate is None else aggregate_coordinates(y, self.question.aggregate)

    def to_list(self, *, coordinates: Optional[np.ndarray] = None) -> List[pa.Table]:
        """One answer table per query, or one for aggregated queries (see :meth:`to_arrow`); with
        :meth:`group_by`, their roll-ups (:meth:`roll_ups`).

        Args:
            coordinates: the queries' projected gradients ``(nq, K)`` float32 when already
                computed (a server projects the queries of many requests in one pass).

        Raises:
            InputError: what :func:`~eogp_index.search.question.check_question` refuses (a
                filter, a ``group_by`` column, a query's text), before any query is projected.
        """
        opts = self.question
        if opts.group_by is not None:
            return self.roll_ups(coordinates=coordinates)
        check_question(opts, self._index.stored)
        sides = sides_of(opts.direction)
        y = self.coordinates(coordinates)
        found = self._top(y, sides)
        modules = [self._module_terms(hits, y[q]) for q, hits in enumerate(found)] if opts.by_module else None
        return ranked_tables(self._index.stored, found, with_direction=opts.direction == "both", modules=modules)

    @property
    def _rescore(self) -> int:
        """The rescoring factor of this question on this index (:func:`rescore_factor`; 0: none)."""
        return rescore_factor(self.question, self._index.stored)

    def _rescored_count(self, candidates: Optional[int]) -> int:
        """The one-bit rows kept per side for rescoring (:func:`~eogp_index.search.rescore.rescored_count`)."""
        return rescored_count(self._rescore, self.question.k, candidates)

    def _top(self, y: np.ndarray, sides) -> List[Dict[str, Hits]]:
        """Each query's hits per side, of their sign: the route's exact one-bit top ``k`` (every
        route comes here), or, rescoring, its top ``F · k`` (``F``: :func:`rescore_factor`)
        rescored from the tier and cut to ``k`` (:mod:`eogp_index.search.rescore`)."""
        opts = self.question
        factor = self._rescore
        if not factor:
            return of_their_sign(self.searcher().top_k(y, opts.k, sides, opts.where))
        found = self.searcher().top_k(y, self._rescored_count(opts.candidates), sides, opts.where)
        return rescored(self._index.stored, found, y, opts.k, opts.normalize)

    def _module_terms(self, hits, y: np.ndarray):
        """``{side: [{module: term}, ...]}`` of the hits of one query, from their stored codes
        (the tier's, for rescored hits: the terms sum to the score shown)."""
        stored = self._index.stored
        out = {}
        for side, found in hits.items():
            if found.rowaddr.size == 0:
                out[side] = []
                continue
            hot = stored.loaded_hot()
            if found.scores_1bit is not None:
                tier = tier_coordinates(stored, found.rowaddr, self.question.normalize)
                out[side] = module_dicts(
                    module_terms(Encoded(coords=tier), y, stored.coordinates), stored.manifest.module_names
                )
                continue
            if hot is not None:
                codes = hot.encoded.take(hot.positions(found.rowaddr))
            else:
                codes = stored.codec.from_arrow(
                    stored.store.take_rows(found.rowaddr.tolist(), list(stored.codec.columns))
                )
            codes = normalized_codes(codes, stored.layout, self.question.normalize)
            out[side] = module_dicts(
                module_terms(codes, stored.one_bit(y[None])[0], stored.layout), stored.manifest.module_names
            )
        return out

    def roll_ups(self, *, coordinates: Optional[np.ndarray] = None) -> List[pa.Table]:
        """One roll-up table per query (one in all when aggregated) by ``group_by``'s column, over
        every row matching ``where``: see :func:`~eogp_index.search.rollup.roll_up` for its columns.

        Args:
            coordinates: the queries' projected gradients ``(nq, K)`` when already computed.
        """
        opts = self.question
        if opts.group_by is None:
            raise ConfigError("roll_ups needs a column: .group_by(column)")
        stored = self._index.stored
        check_question(opts, stored)
        hot = stored.hot_codes()
        y = self.coordinates(coordinates)
        searcher = self.searcher()
        rows = stored.matching_rows(opts.where, hot)
        if hot.num_rows == 0 or (rows is not None and rows.size == 0):
            type_ = stored.store.schema.field(opts.group_by).type
            return [empty_roll_up(opts.group_by, type_) for _ in range(y.shape[0])]
        rowaddr, scores = searcher.scores(y, opts.where)
        codes = _cached_group_codes(hot, opts.group_by, opts.where, rows)
        tops = self._rescored_tops(rowaddr, scores, y) if self._rescore else [None] * len(scores)
        descending = opts.direction != "negative"
        return [
            roll_up(codes, row, opts.k, opts.group_by, descending=descending, tops=top)
            for row, top in zip(scores, tops)
        ]

    def _rescored_tops(self, rowaddr: np.ndarray, scores: np.ndarray, y: np.ndarray):
        """Per query, the positions in ``rowaddr`` ``(r,)`` of its rescored positive and negative
        hits (the ranked answer's), from every row's one-bit scores ``(nq, r)``: their top
        ``rescore · k`` per side rescored from the tier."""
        count = self._rescored_count(None)
        found = []
        for row in scores:
            largest, smallest = top_positions(row, count)
            found.append(
                {"positive": Hits(rowaddr[largest], row[largest]), "negative": Hits(rowaddr[smallest], row[smallest])}
            )
        best = rescored(self._index.stored, found, y, self.question.k, self.question.normalize)
        order = np.argsort(rowaddr, kind="stable")

        def at(hits: Hits) -> np.ndarray:
            return order[np.searchsorted(rowaddr[order], hits.rowaddr)]

        return [(at(b["positive"]), at(b["negative"])) for b in best]

    def to_arrow(self) -> pa.Table:
        """The answer to a single query (or to aggregated ones): ``[direction,] rank, id, score`` and
        the stored metadata columns, best first; no rows when nothing is stored (or nothing
        matches ``where``). With :meth:`group_by`: one row per group."""
        if len(self.question.queries) != 1 and self.question.aggregate is None:
            raise ConfigError(
                f"this builder holds {len(self.question.queries)} queries; use to_list() for one table per "
                "query, or .aggregate('mean') to answer them as one",
                field="queries",
            )
        return self.to_list()[0]
