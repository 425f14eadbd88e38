"""``DELETE /v1/examples``: a takedown over HTTP, only on a server started with a write token.

The request body is ``eogp delete``'s options (``ids`` or ``where``, ``reason``, ``purge``); the
answer is its report (:class:`~eogp_index.search.takedown.TakedownReport`). The request carries
the write token as ``Authorization: Bearer TOKEN`` (``eogp serve --write-token``, or
``$EOGP_WRITE_TOKEN``). A server started without one answers 403 and says how to enable it; a
missing or wrong token is 401. The takedown runs on the model thread like every index call, so
no query reads the index halfway through it; the next query answers from the new table version.
"""

from __future__ import annotations

import secrets
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from eogp_index.errors import ConfigError, InputError
from eogp_index.serve.config import ServeConfig
from eogp_index.serve.engine import Engine, RequestError, _user_message

#: Seconds a takedown may run (a purge rewrites the table, the hot copy and the first passes).
DELETE_TIMEOUT_S = 3600.0


class DeleteRequest(BaseModel):
    """``DELETE /v1/examples``: the documents to take down, by ``ids`` or by ``where``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ids: Optional[List[str]] = Field(None, description="Example ids to delete (an id stored nowhere is recorded too).")
    where: Optional[str] = Field(None, description="Delete the rows matching this SQL filter over the stored columns.")
    reason: Optional[str] = Field(None, description="Why, recorded in deletions.jsonl with each id (never the text).")
    purge: bool = Field(False, description="Also erase the rows from every file of the index (slow: rewrites them).")


def check_write_token(request: Request, config: ServeConfig) -> None:
    """Refuse a request without the server's write token (403 when the server has none)."""
    if config.write_token is None:
        raise RequestError(
            "authorization",
            "this server takes no deletes: it was started without a write token. Start it with "
            "`eogp serve INDEX --write-token TOKEN` (or $EOGP_WRITE_TOKEN) and send "
            "'Authorization: Bearer TOKEN', or run `eogp delete` on the index",
            status=403,
        )
    given = request.headers.get("authorization", "")
    scheme, _, credentials = given.strip().partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        credentials.strip().encode(), config.write_token.encode()
    ):
        raise RequestError(
            "authorization",
            "deletes need 'Authorization: Bearer <write token>' (the one `eogp serve --write-token` was given); "
            + ("the request has none" if not given else "this one is not it"),
            status=401,
        )


def run_delete(engine: Engine, body: DeleteRequest) -> Dict[str, Any]:
    """The takedown ``body`` asks for, on the engine's index; its report as JSON."""
    if body.ids is None and body.where is None and not body.purge:
        raise RequestError("ids", "give ids (a list of example ids) or where (an SQL filter) to delete")
    try:
        report = engine.index.delete(where=body.where, ids=body.ids, reason=body.reason, purge=body.purge)
    except (InputError, ConfigError) as exc:
        field = exc.field or ("where" if body.where is not None else "ids")
        status = 409 if "another ingest" in str(exc) else 400  # the index lock: retry once it is free
        raise RequestError(field, _user_message(exc, field), status=status) from None
    return report.to_json()


def add_delete_route(app: FastAPI, engine: Engine, batcher, config: ServeConfig, guarded, errors) -> None:
    """``DELETE /v1/examples`` (always routed, so that a server without a write token says why it refuses)."""

    @app.delete("/v1/examples", responses={**errors, 403: errors[401], 409: errors[401]}, tags=["index"])
    async def delete_examples(body: DeleteRequest, request: Request) -> Dict[str, Any]:
        """Take documents down (``eogp delete``): needs the server's write token."""
        check_write_token(request, config)
        return await guarded(request, batcher.call(run_delete, engine, body, timeout=DELETE_TIMEOUT_S))
