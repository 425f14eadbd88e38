"""The ASGI app of ``eogp serve``: FastAPI routes over an :class:`~eogp_index.serve.engine.Engine`.

==========================  ===============================================================
``POST /v1/query``          ranked hits of one query or behaviour (the rows of ``eogp query --json``)
``POST /v1/explain``        why one stored document ranks: per module and per token
``POST /v1/select``         a training subset for target queries, as a file (``eogp select``)
``GET /v1/info``            the manifest, row count, filterable columns, the server's limits
``GET /v1/examples/{id}``   one stored row (metadata, and text when stored)
``DELETE /v1/examples``     a takedown (``eogp delete``), with the write token only (serve/takedown.py)
``GET /healthz``            liveness and queue depth (and the shards, served with ``--ray``)
``GET /openapi.json``       the API's schema
``GET /``                   the web page (assets shipped in the package, no CDN)
==========================  ===============================================================

Every refusal is a 4xx shaped ``{"error": {"status", "field", "message", "errors"}}`` naming the
field at fault; an unexpected failure is a 500 with a request id, its traceback in the log only.

Example:
    >>> app = create_app(AttributionIndex.open("default-index"))   # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)               # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from eogp_index.errors import ConfigError, InputError
from eogp_index.search.question import Question
from eogp_index.serve.batching import MicroBatcher, QueueFull
from eogp_index.serve.config import ServeConfig
from eogp_index.serve.engine import Engine, QueryJob, RequestError
from eogp_index.serve.middleware import AccessLog, BearerToken, BodyLimit, JsonBody, error_payload
from eogp_index.serve.schemas import QUESTION_OPTIONS, ErrorResponse, ExplainRequest, QueryRequest, QueryResponse
from eogp_index.serve.selection import add_select_route
from eogp_index.serve.takedown import add_delete_route
from eogp_index.version import __version__

log = logging.getLogger("eogp.serve")
STATIC = Path(__file__).resolve().parent / "static"
_CONTENT = ("text", "messages", "input_ids")
#: A prompt-completion query is prompt + completion; a preference query prompt + chosen + rejected.
_TURNS = ("prompt", "completion", "chosen", "rejected")
_ONE_QUERY = "text, messages, input_ids, prompt + completion or prompt + chosen + rejected"
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 503, 504)}


class InternalError(Exception):
    """An unexpected failure, already logged with its traceback; the client sees its request id only."""

    def __init__(self, request_id: Any):
        self.request_id = request_id


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN and infinities (possible in float metadata) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class JSON(Response):
    """JSON as ``eogp query --json`` writes it (``default=str`` for dates and the like), NaN-free."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(_clean(content), default=str, allow_nan=False, ensure_ascii=False).encode("utf-8")


def _error(status: int, field: Optional[str], message: str, errors=None, headers=None) -> JSON:
    return JSON(error_payload(status, field, message, errors), status_code=status, headers=headers)


def _query_record(body: QueryRequest) -> Tuple[Dict[str, Any], str]:
    """The query of a request as a record dict, and the field that holds it."""
    given = [name for name in _CONTENT + _TURNS if getattr(body, name) is not None]
    if not given:
        raise RequestError("text", f"give the query as one of {_ONE_QUERY}")
    whole = [name for name in given if name in _CONTENT]
    if len(whole) > 1 or (whole and len(given) > 1):
        raise RequestError(given[1], f"give exactly one of {_ONE_QUERY}, not {' and '.join(given)}")
    if body.labels is not None and given[0] != "input_ids":
        raise RequestError("labels", "labels go with input_ids only; the labels of a text or chat come from it")
    if not whole:
        return _turns_record(body, given)
    field = given[0]
    if field == "messages":
        record: Dict[str, Any] = {"messages": [m.model_dump() for m in body.messages or []]}
    else:
        record = {field: getattr(body, field)}
        if body.labels is not None:
            record["labels"] = body.labels
    return record, field


def _turns_record(body: QueryRequest, given: List[str]) -> Tuple[Dict[str, Any], str]:
    """A prompt-completion or preference query (``given``: its fields present, in ``_TURNS``'s
    order) as a record dict, and the field that holds its loss."""
    preference = [name for name in ("chosen", "rejected") if name in given]
    if "prompt" not in given:
        raise RequestError(
            "prompt", f"{given[0]} needs its prompt: a query is prompt + completion or prompt + chosen + rejected"
        )
    if "completion" in given and preference:
        raise RequestError(
            preference[0],
            "give completion (a prompt-completion query) or chosen and rejected (a preference query), not both",
        )
    if given == ["prompt"]:
        raise RequestError(
            "completion",
            "prompt goes with completion (a prompt-completion query) or with chosen and rejected (a preference query)",
        )
    if len(preference) == 1:
        missing = "rejected" if preference == ["chosen"] else "chosen"
        raise RequestError(missing, f"a preference query holds prompt, chosen and rejected; {missing} is missing")
    record: Dict[str, Any] = {}
    for name in given:
        value = getattr(body, name)
        record[name] = value if isinstance(value, str) else [m.model_dump() for m in value]
    return record, "completion" if "completion" in given else "chosen"


def _behaviour_records(body: QueryRequest, config: ServeConfig) -> Tuple[Dict[str, Any], ...]:
    """The records of a behaviour query (``queries`` with ``aggregate``); none for a single query."""
    if body.queries is None:
        if body.aggregate is not None:
            raise RequestError("aggregate", "aggregate goes with queries: give the behaviour's queries as a list")
        return ()
    given = [name for name in _CONTENT + _TURNS if getattr(body, name) is not None]
    if given:
        raise RequestError(given[0], f"give either queries (a behaviour) or {given[0]} (one query), not both")
    if body.aggregate is None:
        raise RequestError(
            "aggregate",
            'queries are answered as one measurement: add "aggregate": "mean" '
            '(or "sum"); send one request per query to rank each on its own',
        )
    if not 1 <= len(body.queries) <= config.max_queries:
        raise RequestError(
            "queries", f"queries must hold 1 to {config.max_queries} queries (max_queries), got {len(body.queries)}"
        )
    records = []
    for i, query in enumerate(body.queries):
        try:
            records.append(_explain_record(query, turns=True))
        except RequestError as exc:
            raise RequestError(f"queries[{i}]", exc.message) from None
    return tuple(records)


def _explain_record(query: Any, *, turns: bool = False) -> Dict[str, Any]:
    """A query as a record dict; ``turns``: prompt-completion and preference records too."""
    if isinstance(query, str):
        return {"text": query}
    if isinstance(query, dict):
        unknown = sorted(set(query) - {"text", "messages", "input_ids", "labels", *(_TURNS if turns else ())})
        if unknown:
            holds = (
                "text, messages, input_ids (with optional labels), prompt + completion or prompt + chosen + rejected"
                if turns
                else "text, messages or input_ids (with optional labels)"
            )
            raise RequestError("query", f"query has unknown keys {unknown}; a record holds {holds}")
        return dict(query)
    if not query:
        raise RequestError("query", "query is empty; give a text, a chat or token ids")
    if isinstance(query[0], int):
        return {"input_ids": list(query)}
    return {"messages": [m.model_dump() for m in query]}


def _validation_error(exc: RequestValidationError) -> JSON:
    """pydantic's findings as a 422 that names the field and says what to fix."""
    found = []
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            reason = err.get("ctx", {}).get("error", "")
            found.append(
                (
                    "body",
                    f"the request body is not valid JSON ({reason}); send a JSON object such as "
                    '{"text": "...", "k": 10}',
                )
            )
            continue
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
        top = str(loc[0]) if loc else "body"
        if top in _TURNS and len(loc) > 1:  # a union: one error per alternative; say what the alternatives are
            found.append((top, f"{top} must be a text or a chat (a list of {{role, content}} messages)"))
        elif err.get("type") == "extra_forbidden":
            found.append((path, f"unknown field {path!r}; see /openapi.json for the fields this endpoint takes"))
        elif err.get("type") == "missing":
            found.append((path, f"{path} is required"))
        elif top == "query":  # a union: one error per alternative; say what the alternatives are
            found.append(
                (
                    "query",
                    "query must be a text, a chat (a list of {role, content}), a list of token ids "
                    "or a record {text | messages | input_ids}",
                )
            )
        elif path == "body":
            found.append(("body", f"the request body must be a JSON object of fields, got: {err.get('msg')}"))
        else:
            shown = json.dumps(err.get("input"), default=str)
            found.append((path, f"{path}: {err.get('msg')} (got {shown[:80]})"))
    unique = list(dict.fromkeys(found))
    field, message = unique[0] if unique else ("body", "invalid request")
    if len(unique) > 1:
        message += f" (and {len(unique) - 1} more: " + "; ".join(m for _, m in unique[1:4]) + ")"
    return _error(422, field, message, [{"field": f, "message": m} for f, m in unique])


def create_app(index, config: ServeConfig = ServeConfig(), shards=None) -> FastAPI:
    """The ASGI app over an opened :class:`~eogp_index.client.AttributionIndex`.

    The model thread and the batcher start with the app's lifespan (uvicorn, or
    ``with TestClient(app)``), which also warms the hot copy and the scan kernels.

    Args:
        shards: a :class:`~eogp_index.cluster.shards.ShardPool` whose actors scan the index in
            shards (``eogp serve --ray``); None: this process holds the hot copy.
    """
    engine = Engine(index, config, shards)
    batcher = MicroBatcher(
        engine.run_queries, window_s=config.window_s, max_batch=config.max_batch, queue_size=config.queue_size
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        await batcher.call(engine.warm, timeout=3600.0)
        yield
        await batcher.stop()

    app = FastAPI(
        title="eogp-index",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        description="Which training documents influence a model's output: ranked influence queries "
        "over an EOGP attribution index.",
    )
    app.state.engine = engine
    app.state.batcher = batcher

    async def guarded(request: Request, work):
        """Await index work, turning the expected failures into responses and logging the rest."""
        try:
            return await work
        except (RequestError, QueueFull, TimeoutError):
            raise
        except Exception:
            request_id = request.scope.get("state", {}).get("request_id")
            log.exception(
                "internal error",
                extra={"fields": {"event": "error", "request_id": request_id, "path": request.url.path}},
            )
            raise InternalError(request_id) from None

    _add_error_handlers(app, config)
    _add_query_routes(app, engine, batcher, config, guarded)
    add_select_route(app, engine, batcher, config, guarded, _ERRORS)
    _add_index_routes(app, engine, batcher, config, guarded)
    add_delete_route(app, engine, batcher, config, guarded, _ERRORS)
    # Outermost first: the log sees every response, then the size limit, the token, the JSON body.
    app.add_middleware(JsonBody)
    app.add_middleware(BearerToken, token=config.token, write_token=config.write_token)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(AccessLog)
    return app


def _add_error_handlers(app: FastAPI, config: ServeConfig) -> None:
    """Every refusal as ``{"error": {"status", "field", "message", "errors"}}``."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return _error(exc.status, exc.field, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(QueueFull)
    async def _busy(_: Request, exc: QueueFull):
        return _error(
            503,
            None,
            f"the server is busy ({config.queue_size} requests queued); retry in a second",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(TimeoutError)
    async def _timeout(_: Request, exc: TimeoutError):
        return _error(
            504,
            None,
            f"the request took longer than {config.timeout_s:g} s (timeout_s); the server "
            "is overloaded or the query too long",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(InternalError)
    async def _internal(_: Request, exc: InternalError):
        return _error(500, None, f"internal error; the server log has its details under request_id {exc.request_id}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        field = {404: "path", 405: "method"}.get(exc.status_code)
        detail = {
            404: f"no endpoint {request.url.path}; see /openapi.json",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return _error(exc.status_code, field, detail)


def question_of(body: QueryRequest, config: ServeConfig) -> QueryJob:
    """The :class:`Question` a ``/v1/query`` body asks (each request field is the question field of
    its name), with the field that holds its query; refusals name the request field."""
    records = _behaviour_records(body, config)
    record, field = ({}, "queries") if records else _query_record(body)
    if not 1 <= body.k <= config.max_k:
        raise RequestError("k", f"k must be between 1 and {config.max_k} (max_k), got {body.k}")
    if body.route == "sharded":
        raise RequestError("route", "the sharded route splits a scan over torchrun workers; use auto, hot or stream")
    try:
        question = Question(queries=records or (record,), **{name: getattr(body, name) for name in QUESTION_OPTIONS})
    except (ConfigError, InputError) as exc:
        named = exc.field or "body"
        raise RequestError(field if named.startswith("queries") and field != "queries" else named, str(exc)) from None
    return QueryJob(question=question, field=field)


def _add_query_routes(app: FastAPI, engine: Engine, batcher: MicroBatcher, config: ServeConfig, guarded) -> None:
    """``POST /v1/query`` and ``POST /v1/explain``."""

    @app.post("/v1/query", response_model=QueryResponse, responses=_ERRORS, tags=["query"])
    async def query(body: QueryRequest, request: Request):
        """The stored documents that most influence the query, best first (``eogp query --json``'s rows)."""
        started = time.perf_counter()
        job = question_of(body, config)
        answer = await guarded(request, batcher.submit(job, timeout=config.timeout_s))
        if isinstance(answer, RequestError):
            raise answer
        if job.field == "queries":
            query_as_sent: Any = {"queries": body.queries, "aggregate": body.aggregate}
        else:
            record = job.question.queries[0]
            query_as_sent = (
                body.text if job.field == "text" else record[job.field] if job.field == "messages" else record
            )
        extra = {"groups": answer.groups.to_pylist()} if answer.groups is not None else {}
        if answer.shards is not None:
            extra["shards"] = answer.shards
        return JSON(
            {
                "query": query_as_sent,
                "results": answer.results.to_pylist(),
                **extra,
                "took_ms": round(1000 * (time.perf_counter() - started), 2),
            }
        )

    @app.post("/v1/explain", responses=_ERRORS, tags=["query"])
    async def explain(body: ExplainRequest, request: Request) -> Dict[str, Any]:
        """Why document ``id`` ranks for ``query``: its score per module and per token."""
        record = _explain_record(body.query, turns=True)  # the query kinds `eogp explain` takes
        return JSON(
            await guarded(request, batcher.call(engine.explain, record, "query", body.id, timeout=config.timeout_s))
        )


def _add_index_routes(app: FastAPI, engine: Engine, batcher: MicroBatcher, config: ServeConfig, guarded) -> None:
    """The index's facts and rows, liveness, and the page."""

    @app.get("/v1/info", tags=["index"])
    async def info(request: Request) -> Dict[str, Any]:
        """The manifest, row count, filterable columns (name and type) and the server's limits."""
        return JSON(await guarded(request, batcher.call(engine.info, timeout=config.timeout_s)))

    @app.get("/v1/examples/{example_id:path}", responses=_ERRORS, tags=["index"])
    async def example(example_id: str, request: Request) -> Dict[str, Any]:
        """One stored document's row: id, shard, position, token counts, metadata (and text when stored)."""
        return JSON(await guarded(request, batcher.call(engine.example, example_id, timeout=config.timeout_s)))

    @app.get("/healthz", tags=["server"])
    async def healthz() -> Dict[str, Any]:
        """Liveness: answered without touching the model; on an index served in shards, each shard
        (id, fragments, rows, table version, node, alive), asked on a worker thread."""
        health = {"status": "ok", "queued": batcher.depth, "version": __version__}
        if engine.shards is not None:
            shards = await asyncio.get_running_loop().run_in_executor(None, engine.shards.health)
            health["shards"] = shards
            if not all(shard["alive"] for shard in shards):
                health["status"] = "degraded"
        return health

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def open_index(
    path,
    *,
    device: str = "auto",
    batch_size: int = 32,
    model_name: Optional[str] = None,
    projection_memory_gb: Optional[float] = None,
    dtype: str = "auto",
):
    """Open an index for serving: its model on ``device`` in ``dtype`` (auto: the one it was built
    in), ``batch_size`` queries per forward pass, at most ``projection_memory_gb`` of P held at
    once (see ``GradientConfig``)."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    return AttributionIndex.open(
        path,
        model_name=model_name,
        gradients=GradientConfig(
            device=device, batch_size=batch_size, dtype=dtype, projection_memory_gb=projection_memory_gb
        ),
    )
