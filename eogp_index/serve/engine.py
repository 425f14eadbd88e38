"""The server's work on the index, run on the model thread (never on the event loop).

:meth:`Engine.run_queries` answers a micro-batch of query requests: their queries are measured
together (:func:`eogp_index.encode.measurements.measure`: each tokenized and checked on its own,
so a bad one fails alone, all good ones projected in one gradient pass; a preference query's two
completions become its one row), and requests whose questions differ only in their queries, ``k``
and ``aggregate`` share one scan — asked for the largest ``k`` among them, then each cut to its own
``k`` (a top-k list is a prefix of a longer one: same order, ties in table order; on an index with
a rescoring tier, only requests of the same ``k`` share one), so every request gets what
``eogp query --json`` prints. A behaviour request's queries become its one (mean or
summed) row; a ``group_by`` request also gets its roll-up. The engine's own part in a measurement
is the mapping of its errors to request fields and status codes (:meth:`Engine.request_error`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eogp_index.data.records import Example, check_text
from eogp_index.encode.measurements import measure, tokenize_queries
from eogp_index.errors import (
    ConfigError,
    EOGPError,
    IncompatibleIndexError,
    IndexNotFoundError,
    InputError,
    QueryTooLongError,
    ShardUnavailableError,
)
from eogp_index.search.query import InfluenceQuery, aggregate_coordinates
from eogp_index.search.question import Question
from eogp_index.serve.config import ServeConfig
from eogp_index.store.stored_ids import sql_string
from eogp_index.store.table import CODE_COLUMNS

log = logging.getLogger("eogp.serve")


class RequestError(Exception):
    """A request the server refuses (4xx), naming the request field at fault and what to fix."""

    def __init__(self, field: str, message: str, *, status: int = 400):
        self.field = field
        self.message = message
        self.status = status
        super().__init__(message)


@dataclass(frozen=True)
class QueryJob:
    """One ``/v1/query`` request: its :class:`~eogp_index.search.question.Question` and the
    request field that holds its query.

    Attributes:
        question: the question, its queries as record dicts: one query, or a behaviour's
            (``aggregate``).
        field: the request field holding the query (``text``, ``messages``, ``input_ids``,
            ``completion``, ``chosen``), named in errors about it; ``queries`` for a behaviour,
            whose errors name ``queries[i]``.
    """

    question: Question
    field: str

    @property
    def k(self) -> int:
        return self.question.k

    @property
    def aggregate(self) -> Optional[str]:
        return self.question.aggregate

    @property
    def group(self) -> Question:
        """Requests with the same key share one scan: the question without its queries, ``k``
        and ``aggregate`` (its measurement is made before the scan)."""
        return self.question.replace(queries=(), k=1, aggregate=None)

    @property
    def queries(self) -> Tuple[Dict[str, Any], ...]:
        """The job's query records: its one query, or its behaviour's."""
        return self.question.queries

    def field_of(self, i: int) -> str:
        """The request field an error of query ``i`` of :attr:`queries` is reported under."""
        return f"queries[{i}]" if self.field == "queries" else self.field


class Answer(NamedTuple):
    """One answered query: its ranked hits and, with ``group_by``, its roll-up; on an index served
    in shards, which shards answered (``{"answered": [ids], "missing": [{shard, reason}]}``)."""

    results: pa.Table
    groups: Optional[pa.Table] = None
    shards: Optional[Dict[str, Any]] = None


def _user_message(exc: EOGPError, field: Optional[str] = None) -> str:
    """The library's message without the ``query:0:`` location it gives queries (one per request
    here), led by the request field when the message does not name it."""
    text = str(exc)
    location = getattr(exc, "location", None)
    text = text[len(location) + 2 :] if location and text.startswith(f"{location}: ") else text
    return text if field is None or f"'{field}'" in text or text.startswith(field) else f"{field}: {text}"


def cut_to_k(table: pa.Table, k: int) -> pa.Table:
    """The first ``k`` ranks of each side of an answer table, in its order."""
    return table if table.num_rows == 0 else table.filter(pc.less_equal(table["rank"], k))


class Engine:
    """Queries, explanations and lookups on one opened :class:`~eogp_index.client.AttributionIndex`.

    With ``shards`` (a :class:`~eogp_index.cluster.shards.ShardPool`), the queries' scans run on
    the shards (:class:`~eogp_index.cluster.query.ClusterQuery`): the engine projects each batch's
    queries once, and before each batch brings the shards to the table's current version.

    Not thread-safe: the server calls it from its single model thread only.
    """

    def __init__(self, index, config: ServeConfig, shards=None):
        self.index = index
        self.config = config
        self.shards = shards
        self.vocab_size = len(index.tokenizer) if index.tokenizer is not None else None

    def _query(self, question: Question) -> InfluenceQuery:
        """The query of ``question``: on this process's hot copy, or on the shards."""
        if self.shards is None:
            return InfluenceQuery(self.index.encoder, question=question)
        from eogp_index.cluster.query import ClusterQuery

        return ClusterQuery(self.index.encoder, self.shards, question)

    def refresh(self) -> None:
        """On an index served in shards: split a new table version (an ingest, an optimize) among
        the shards, which take up its new fragments and drop its deleted rows."""
        if self.shards is not None and self.shards.refresh(self.index.stored):
            log.info("shards", extra={"fields": {"event": "shards", "version": self.shards.version}})

    # -- start-up ---------------------------------------------------------------------------------
    def warm(self) -> None:
        """Load the hot copy and compile the scan kernels before the first request."""
        started = time.perf_counter()
        stored = self.index.stored
        self.refresh()
        zeros = np.zeros((1, stored.coordinates.num_coords), np.float32)
        if stored.store.count() and self.shards is None:
            stored.hot_codes()
            self.index.search(["warm-up"], many=True).limit(1).direction("both").to_list(coordinates=zeros)
        elif stored.store.count():  # each shard compiles its kernels on its own node
            self._query(Question(queries=("warm-up",), k=1, allow_partial=True)).to_list(coordinates=zeros)
        try:  # the first backward pass allocates and initialises; do it now rather than in a request
            self.index.project([Example.from_ids(id="warm-up", input_ids=[1, 2, 3, 1], shard="warm-up")])
        except Exception as exc:  # a tokenizer with fewer than 4 ids: the first query pays instead
            log.info("warm-up pass skipped", extra={"fields": {"event": "warmup", "reason": str(exc)[:200]}})
        log.info(
            "ready",
            extra={
                "fields": {
                    "event": "ready",
                    "rows": stored.store.count(),
                    "warm_ms": round(1000 * (time.perf_counter() - started), 1),
                }
            },
        )

    # -- queries ----------------------------------------------------------------------------------
    def request_error(self, exc: InputError, field: str) -> RequestError:
        """A measurement's error as the refusal of request ``field``: a single query's own field
        (``text``, ``labels``, ``prompt``, ``chosen``, ...) is the one the error names; ``query``,
        ``queries`` and ``queries[i]`` stand for the whole query. 413 for a query over
        ``max_query_tokens``, else 400."""
        whole = field in ("query", "queries") or field.startswith("queries[")
        name = field if whole or not exc.field else exc.field
        status = 413 if isinstance(exc, QueryTooLongError) else 400
        return RequestError(name, _user_message(exc, name), status=status)

    def check(self, records: Sequence[Dict[str, Any]], field: str) -> None:
        """Refuse the first query (or preference completion) that does not tokenize or is over
        ``max_query_tokens``, as :meth:`run_queries` would; no gradient pass."""
        errors = tokenize_queries(self.index.encoder, records, max_query_tokens=self.config.max_query_tokens).errors
        if errors:
            raise self.request_error(errors[min(errors)], field)

    def run_queries(self, jobs: Sequence[QueryJob]) -> List[Any]:
        """One answer per job, in order: an :class:`Answer` (its ranked hits, and its roll-up with
        ``group_by``) or a :class:`RequestError`."""
        started = time.perf_counter()
        out: List[Any] = [None] * len(jobs)
        self.refresh()
        # One gradient pass for the whole batch: every query of every job (a behaviour's several).
        owner = [(i, j) for i, job in enumerate(jobs) for j in range(len(job.queries))]
        measured = measure(
            self.index.encoder,
            [query for job in jobs for query in job.queries],
            max_query_tokens=self.config.max_query_tokens,
        )
        for position in sorted(measured.errors, reverse=True):  # a job's first failing query is the one named
            i, j = owner[position]
            out[i] = self.request_error(measured.errors[position], jobs[i].field_of(j))
        live = [i for i in range(len(jobs)) if out[i] is None]
        if not live:
            return out
        row = {position: r for r, position in enumerate(measured.answered)}
        rows_of: Dict[int, List[int]] = defaultdict(list)
        for position, (i, _) in enumerate(owner):
            if position in row:
                rows_of[i].append(row[position])
        y = np.concatenate(
            [
                measured.coordinates[rows_of[i]]
                if jobs[i].aggregate is None
                else aggregate_coordinates(measured.coordinates[rows_of[i]], jobs[i].aggregate)
                for i in live
            ]
        )
        row_of = {i: j for j, i in enumerate(live)}
        projected = time.perf_counter()
        groups: Dict[Question, List[int]] = defaultdict(list)
        for i in live:
            groups[jobs[i].group].append(i)
        for key, members in groups.items():
            rows = y[[row_of[i] for i in members]]
            try:
                answers = self._scan(key, [jobs[i] for i in members], rows)
            except (InputError, ConfigError) as exc:  # the question's filter or column, named by its field
                error = RequestError(exc.field or "where", _user_message(exc))
                answers = [error] * len(members)
            except (IndexNotFoundError, IncompatibleIndexError) as exc:
                if key.candidates is None:  # the index itself: not the request's fault
                    raise
                answers = [RequestError("first_pass", str(exc))] * len(members)  # the first pass it names
            except ShardUnavailableError as exc:  # not the request's fault: 503, naming the shards
                answers = [RequestError(None, str(exc), status=503)] * len(members)
            for i, answer in zip(members, answers):
                out[i] = answer
        log.info(
            "batch",
            extra={
                "fields": {
                    "event": "batch",
                    "queries": len(jobs),
                    "projected": len(live),
                    "scans": len(groups),
                    "project_ms": round(1000 * (projected - started), 1),
                    "scan_ms": round(1000 * (time.perf_counter() - projected), 1),
                }
            },
        )
        return out

    def _scan(self, key: Question, jobs: Sequence[QueryJob], rows: np.ndarray) -> List[Answer]:
        """The answers of ``jobs`` (sharing the scan ``key``) from their measurements ``rows``
        ``(n, K)``: one scan for the largest ``k`` among them, each cut to its own ``k``; with
        ``group_by``, each job's roll-up too (its own ``k`` counts its rows among the top ones).

        On an index with a rescoring tier the jobs share a scan only with jobs of their own ``k``:
        a rescored top ``k`` is the best ``k`` of the one-bit top ``rescore · k``, which a
        larger ``k`` widens, so it is not a prefix of a rescored longer list."""
        if self.index.stored.tier is not None and len({job.k for job in jobs}) > 1:
            answers: Dict[int, Answer] = {}
            by_k: Dict[int, List[int]] = defaultdict(list)
            for i, job in enumerate(jobs):
                by_k[job.k].append(i)
            for members in by_k.values():
                answers.update(zip(members, self._scan(key, [jobs[i] for i in members], rows[members])))
            return [answers[i] for i in range(len(jobs))]
        placeholders = tuple(job.question.queries[0] for job in jobs)  # the rows are measured already
        hits = key.replace(queries=placeholders, k=max(job.k for job in jobs), group_by=None)
        if self.shards is not None:
            self.shards.begin()
        tables = self._query(hits).to_list(coordinates=rows)
        out = []
        for j, (job, table) in enumerate(zip(jobs, tables)):
            grouped = None
            if key.group_by is not None:
                rolled = key.replace(queries=placeholders[j : j + 1], k=job.k)
                grouped = self._query(rolled).to_list(coordinates=rows[j : j + 1])[0]
            report = None if self.shards is None else dict(self.shards.report)
            out.append(Answer(cut_to_k(table, job.k), grouped, report))
        return out

    # -- explanations and lookups -----------------------------------------------------------------
    @staticmethod
    def _id_filter(example_id: str) -> str:
        """The filter selecting ``example_id``'s row; an id that is not Unicode text names no row."""
        try:
            check_text(example_id, "id")
        except InputError as exc:
            raise RequestError("id", _user_message(exc)) from None
        return f"id = {sql_string(example_id)}"

    def _require_row(self, example_id: str) -> None:
        if not self.index.store.count(self._id_filter(example_id)):
            raise RequestError(
                "id", f"no stored document has id {example_id!r}; take ids from /v1/query results", status=404
            )

    def explain(self, record: Dict[str, Any], field: str, example_id: str) -> Dict[str, Any]:
        """Why document ``example_id`` ranks for the query: ``Explanation.to_json()``."""
        self.check([record], field)
        self._require_row(example_id)
        try:
            return self.index.explain(record, example_id).to_json()
        except (InputError, ConfigError) as exc:
            raise RequestError(field, _user_message(exc, field)) from None

    def example(self, example_id: str) -> Dict[str, Any]:
        """The stored row of ``example_id``, its code columns left out."""
        store = self.index.store
        where = self._id_filter(example_id)
        rows = store.read(self.metadata_columns(), where=where) if store.table else None
        if rows is None or rows.num_rows == 0:
            raise RequestError("id", f"no stored document has id {example_id!r}", status=404)
        return rows.slice(0, 1).to_pylist()[0]

    def metadata_columns(self) -> List[str]:
        return [c for c in self.index.store.metadata_columns() if c not in CODE_COLUMNS]

    def columns(self) -> List[Dict[str, str]]:
        """The filterable columns and their Arrow types, for the page's filter box."""
        schema = self.index.store.schema
        if schema is None:
            return []
        return [{"name": f.name, "type": str(f.type)} for f in schema if f.name not in CODE_COLUMNS]

    def info(self) -> Dict[str, Any]:
        data = self.index.info()
        data["columns"] = self.columns()
        data["has_text"] = any(c["name"] == "text" for c in data["columns"])
        data["explain"] = hasattr(self.index, "explain")
        cfg = self.config
        if self.shards is not None:
            data["shards"] = {"count": len(self.shards), "table_version": self.shards.version}
        data["limits"] = {
            "max_k": cfg.max_k,
            "max_query_tokens": cfg.max_query_tokens,
            "max_request_bytes": cfg.max_request_bytes,
            "timeout_s": cfg.timeout_s,
            "max_batch": cfg.max_batch,
            "batch_window_ms": cfg.batch_window_ms,
            "max_queries": cfg.max_queries,
            "shard_timeout_s": cfg.shard_timeout_s,
        }
        return data
