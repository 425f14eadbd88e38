"""ASGI middleware of the server: request size limit, bearer token, JSON bodies, structured access log.

Plain ASGI (no ``BaseHTTPMiddleware``): nothing is buffered, and each layer is a few lines.
Refusals use the API's error shape, ``{"error": {"status", "field", "message"}}``.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from typing import Any, Dict, Optional

log = logging.getLogger("eogp.serve")
_request_ids = itertools.count(1)


def error_payload(status: int, field: Optional[str], message: str, errors: Optional[list] = None) -> Dict[str, Any]:
    return {"error": {"status": status, "field": field, "message": message, "errors": errors or []}}


async def send_error(send, status: int, field: Optional[str], message: str, headers: Optional[dict] = None) -> None:
    body = json.dumps(error_payload(status, field, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413: by Content-Length, or, for a chunked
    body, by reading it (up to the limit) before the app sees it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than {self.max_bytes} bytes (max_request_bytes); send a shorter query"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await send_error(send, 413, "body", message)
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:  # no length given: read what comes, at most max_bytes, then replay it
            event = await receive()
            if event["type"] != "http.request":
                return
            chunks.append(event.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                return await send_error(send, 413, "body", message)
            if not event.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class BearerToken:
    """With a token set, ``/v1/`` endpoints need ``Authorization: Bearer TOKEN`` (401 otherwise).

    The scheme is read in any case (``bearer``, ``BEARER``: RFC 7235 makes it case-insensitive);
    the token is compared exactly. The page, its assets, ``/healthz`` and the OpenAPI schema stay
    open: they hold no data.
    """

    def __init__(self, app, token: Optional[str], write_token: Optional[str] = None):
        self.app = app
        self.expected = token.encode() if token else None
        # The write token (DELETE /v1/examples, checked by its route) reads too.
        self.writer = write_token.encode() if write_token else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, credentials = given.strip().partition(b" ")
        given_token = credentials.strip()
        known = secrets.compare_digest(given_token, self.expected) or (
            self.writer is not None and secrets.compare_digest(given_token, self.writer)
        )
        if scheme.lower() != b"bearer" or not known:
            what = (
                "no Authorization header"
                if not given
                else "a wrong token"
                if scheme.lower() == b"bearer"
                else f"the scheme {scheme.decode('latin-1')[:20]!r}"
            )
            return await send_error(
                send,
                401,
                "authorization",
                f"this server needs 'Authorization: Bearer <token>' and got {what}; "
                "ask whoever started `eogp serve --token` for it",
                headers={"WWW-Authenticate": "Bearer"},
            )
        await self.app(scope, receive, send)


class JsonBody:
    """Request bodies of ``/v1/`` are JSON whatever their Content-Type claims.

    ``curl -d`` sends ``application/x-www-form-urlencoded``, for which FastAPI would not parse
    the body at all; here the header is set to ``application/json``, so a JSON body is read as
    one and anything else is refused as invalid JSON, with that parser's message.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


class AccessLog:
    """One structured log record per request: method, path, status, latency, request id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        request_id = next(_request_ids)
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500

        async def tracking_send(event):
            nonlocal status
            if event["type"] == "http.response.start":
                status = event["status"]
                event["headers"] = list(event.get("headers", [])) + [(b"x-request-id", str(request_id).encode())]
            await send(event)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            log.info(
                "request",
                extra={
                    "fields": {
                        "event": "request",
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status,
                        "latency_ms": round(1000 * (time.perf_counter() - started), 2),
                    }
                },
            )


class JsonFormatter(logging.Formatter):
    """A log record as one JSON object per line: time, level, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        data = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        data.update(getattr(record, "fields", {}))
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    """Structured logs on stderr for the ``eogp.serve`` logger (called by ``eogp serve``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
