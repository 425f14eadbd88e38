"""The query builder: what to ask, compiled to one searcher, ranked in one place.

Example:
    >>> (index.search("The Eiffel Tower is in Paris.")            # doctest: +SKIP
    ...       .where("source = 'news'").limit(10).direction("both")
    ...       .to_arrow())

A query goes through three steps, the same for every route:

1. **project** — the index's model turns the query (a text, a chat, token ids or a record) into
   ``y``, its projected gradient ``(nq, K)`` (:meth:`AttributionIndex.query_coordinates
   <eogp_index.client.AttributionIndex.query_coordinates>`);
2. **search** — :meth:`InfluenceQuery.searcher` picks one searcher from the options
   (:mod:`eogp_index.search.searchers`), which returns the exact top ``k`` per side;
3. **rank** — :func:`~eogp_index.search.ranking.ranked_tables` orders the hits and reads the
   rows' metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Literal, Optional, Protocol, Sequence, Union

import numpy as np
import pyarrow as pa

from eogp_index.errors import ConfigError
from eogp_index.search.explain import module_dicts, module_terms
from eogp_index.search.ranking import Direction, of_their_sign, ranked_tables, sides_of
from eogp_index.search.searchers import (
    CandidateSearcher,
    HotSearcher,
    ShardedSearcher,
    StreamSearcher,
    TorchSearcher,
)
from eogp_index.store.stored_index import StoredIndex

#: A query: a text, a chat (list of ``{"role", "content"}``), token ids, or a record dict
#: (``{"text": ...}``, ``{"messages": ...}``, ``{"input_ids": ..., "labels": ...}``).
Query = Union[str, Sequence[Dict[str, str]], Sequence[int], Dict[str, Any]]

Route = Literal["auto", "hot", "stream", "sharded", "candidates"]
ROUTES = ("auto", "hot", "stream", "sharded", "candidates")


class Projects(Protocol):
    """What a query needs from the index: its stored parts, a device, and the query projection."""

    stored: StoredIndex
    device: str

    def query_coordinates(self, queries: Sequence[Query]) -> np.ndarray: ...


@dataclass(frozen=True)
class QueryOptions:
    """The options of one query; validated where they are set.

    Attributes:
        k: rows per side. where: SQL filter on the stored columns (Lance's dialect).
        direction: ``positive`` (documents whose training lowers the query's loss; for a
            preference query, raises ``log p(chosen | prompt) - log p(rejected | prompt)``),
            ``negative`` (the opposite) or ``both``; a side holds only scores of its sign, so it may
            hold fewer than ``k`` rows, or none. route: ``auto`` (the hot copy, on the index's device), ``hot``,
            ``stream`` (the table in batches, for stores larger than memory), ``sharded``
            (torchrun workers share the fragments), ``candidates`` (FAISS first pass).
        candidates: FAISS candidates per side, for the ``candidates`` route.
        faiss_name: which FAISS index of the index directory.
        by_module: add each hit's per-module terms ``s_iu⟨y_u, b_iu⟩`` (they sum to its score).
    """

    k: int = 20
    where: Optional[str] = None
    direction: Direction = "positive"
    route: Route = "auto"
    candidates: Optional[int] = None
    faiss_name: str = "default"
    by_module: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ConfigError(f"k must be a positive integer, got {self.k!r}")
        sides_of(self.direction)
        if self.route not in ROUTES:
            raise ConfigError(f"route must be one of {list(ROUTES)}, got {self.route!r}")
        if self.route == "candidates" and self.candidates is None:
            raise ConfigError("the candidates route needs a candidate count: .candidates(C) or --candidates C")
        if self.candidates is not None and self.candidates < self.k:
            raise ConfigError(f"candidates C={self.candidates} must be at least k={self.k}")
        if self.where is not None and not isinstance(self.where, str):
            raise ConfigError(f"where must be an SQL string, got {type(self.where).__name__}")


class InfluenceQuery:
    """A query being built against an index. Each method returns a new builder.

    Args:
        index: the :class:`~eogp_index.client.AttributionIndex` (anything :class:`Projects`).
        queries: one query, or a list of them (each answered on its own).
    """

    def __init__(self, index: Projects, queries: Union[Query, List[Query]], *, many: bool = False,
                 options: QueryOptions = QueryOptions()):
        self._index = index
        self._queries: List[Query] = list(queries) if many else [queries]
        self._many = many
        self.options = options

    def _with(self, **changes) -> "InfluenceQuery":
        return InfluenceQuery(self._index, self._queries if self._many else self._queries[0], many=self._many,
                              options=replace(self.options, **changes))

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

    def candidates(self, C: int, *, faiss_name: str = "default") -> "InfluenceQuery":
        """Rescore ``C`` FAISS candidates per side (``eogp build-faiss``) instead of every row."""
        return self._with(route="candidates", candidates=C, faiss_name=faiss_name)

    def by_module(self, enabled: bool = True) -> "InfluenceQuery":
        """Split each hit's score into its per-module terms (a ``modules`` column)."""
        return self._with(by_module=enabled)

    def route(self, route: Route) -> "InfluenceQuery":
        """Choose where codes are read from: ``hot``, ``stream``, ``sharded`` (see :class:`QueryOptions`)."""
        return self._with(route=route)

    # -- running ----------------------------------------------------------------------------------
    def searcher(self):
        """The searcher the options compile to (one per route)."""
        stored, opts = self._index.stored, self.options
        if opts.route == "candidates":
            return CandidateSearcher(stored, opts.candidates, faiss_name=opts.faiss_name)
        if opts.route == "stream":
            return StreamSearcher(stored)
        if opts.route == "sharded":
            return ShardedSearcher(stored)
        if self._index.device.startswith("cuda"):
            return TorchSearcher(stored, self._index.device)
        return HotSearcher(stored)

    def to_list(self, *, coordinates: Optional[np.ndarray] = None) -> List[pa.Table]:
        """One answer table per query (see :meth:`to_arrow`).

        Args:
            coordinates: the queries' projected gradients ``(nq, K)`` float32 when already
                computed (a server projects the queries of many requests in one pass).
        """
        opts = self.options
        sides = sides_of(opts.direction)
        y = self._index.query_coordinates(self._queries) if coordinates is None else np.asarray(coordinates, np.float32)
        found = of_their_sign(self.searcher().top_k(y, opts.k, sides, opts.where))  # every route
        modules = [self._module_terms(hits, y[q]) for q, hits in enumerate(found)] if opts.by_module else None
        return ranked_tables(self._index.stored, found, with_direction=opts.direction == "both",
                             modules=modules)

    def _module_terms(self, hits, y: np.ndarray):
        """``{side: [{module: term}, ...]}`` of the hits of one query, from their stored codes."""
        stored = self._index.stored
        out = {}
        for side, found in hits.items():
            if found.rowaddr.size == 0:
                out[side] = []
                continue
            hot = stored.loaded_hot()
            if hot is not None:
                codes = hot.encoded.take(hot.positions(found.rowaddr))
            else:
                codes = stored.codec.from_arrow(stored.store.take_rows(found.rowaddr.tolist(),
                                                                       list(stored.codec.columns)))
            out[side] = module_dicts(module_terms(codes, y, stored.layout), stored.manifest.module_names)
        return out

    def to_arrow(self) -> pa.Table:
        """The answer to a single query: ``[direction,] rank, id, score`` and the stored metadata
        columns, best first; no rows when nothing is stored (or nothing matches ``where``)."""
        if self._many:
            raise ConfigError("this builder holds several queries; use to_list() for one table per query")
        return self.to_list()[0]
