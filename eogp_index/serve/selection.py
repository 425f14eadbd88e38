"""``POST /v1/select``: a training subset for a target set, downloaded as a file.

The request names the target queries and ``eogp select``'s options; the answer is the file
``eogp select --out selection.<format>`` writes (an attachment): the selected documents' original
records, each with a ``score``, or ids and scores only. It runs on the model thread like every
index call, under the server's timeout, and the file is removed once sent.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from eogp_index.config import SelectOptions
from eogp_index.errors import ConfigError, InputError
from eogp_index.search.question import Question
from eogp_index.serve.engine import Engine, RequestError, _user_message
from eogp_index.serve.schemas import Message, _question


def _select_field(name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(SelectOptions)}[name]


#: Target queries one request may hold.
MAX_TARGETS = 1000
MEDIA_TYPES = {
    "jsonl": "application/x-ndjson",
    "jsonl.gz": "application/gzip",
    "parquet": "application/vnd.apache.parquet",
}


class SelectRequest(BaseModel):
    """``POST /v1/select``: the target queries and ``eogp select``'s options: the
    :class:`~eogp_index.search.question.Question`'s ``queries``, ``where`` and ``normalize``, and
    :class:`~eogp_index.config.SelectOptions`' fields, by the same names with the same defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    queries: List[Union[str, List[Message], Dict[str, Any]]] = Field(
        description="Target queries: texts, chats, or records {text | messages | input_ids | prompt+completion | "
        "prompt+chosen+rejected}.",
        examples=[["Return the sum of a and b."]],
    )
    where: Optional[str] = _question("where")
    normalize: Literal["none", "unit"] = _question("normalize")
    top: Union[int, str] = Field(
        _select_field("top").default,
        description='How many documents: a count N (5 or "5") or a share P% of the matching rows ("10%").',
    )
    score: Literal["mean", "max"] = Field(
        _select_field("score").default, description="mean over the queries, or LESS's max."
    )
    direction: Literal["positive", "negative"] = Field(
        _select_field("direction").default, description="Most helpful or most harmful."
    )
    ids_only: bool = Field(_select_field("ids_only").default, description="Only id and score, best first.")
    precision: Literal["1bit", "rescore"] = Field(
        _select_field("precision").default, description=_select_field("precision").metadata["help"]
    )
    format: Literal["jsonl", "jsonl.gz", "parquet"] = Field("jsonl", description="The file's format.")


def _records(queries: List[Any]) -> List[Dict[str, Any]]:
    if not queries:
        raise RequestError("queries", "give at least one target query")
    if len(queries) > MAX_TARGETS:
        raise RequestError(
            "queries",
            f"{len(queries)} target queries; the server takes at most {MAX_TARGETS} "
            "per request: use `eogp select` for more",
            status=413,
        )
    return [
        {"text": q}
        if isinstance(q, str)
        else {"messages": [m.model_dump() for m in q]}
        if isinstance(q, list)
        else dict(q)
        for q in queries
    ]


def select_file(engine: Engine, body: SelectRequest, folder: Path) -> Path:
    """Select and write the file under ``folder`` (on the model thread); refusals as :class:`RequestError`."""
    from eogp_index.search.select import select_documents, write_selection

    records = _records(body.queries)
    try:
        question = Question(queries=tuple(records), where=body.where, normalize=body.normalize)
        options = SelectOptions(
            **{f.name: getattr(body, f.name) for f in dataclasses.fields(SelectOptions)} | {"top": str(body.top)}
        )
        engine.check(records, "queries")  # each query tokenizes, within the server's limits (no gradient pass)
        question.check(engine.index.stored)  # and the filter, before the queries are measured
        selection = select_documents(engine.index.encoder, question, options)
        out = folder / f"selection.{body.format}"
        write_selection(engine.index.stored, selection, out)
    except (ConfigError, InputError) as exc:
        raise RequestError(exc.field or "queries", _user_message(exc)) from None
    return out


def add_select_route(app: FastAPI, engine: Engine, batcher, config, guarded, responses) -> None:
    """Register ``POST /v1/select`` on ``app`` (see :func:`eogp_index.serve.app.create_app`)."""

    @app.post("/v1/select", responses=responses, tags=["query"], response_class=FileResponse)
    async def select(body: SelectRequest, request: Request):
        """The documents most influential for the target queries, as a file to download (``eogp select``)."""
        folder = Path(tempfile.mkdtemp(prefix="eogp-select-"))
        try:
            out = await guarded(request, batcher.call(select_file, engine, body, folder, timeout=config.timeout_s))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return FileResponse(
            out,
            media_type=MEDIA_TYPES[body.format],
            filename=out.name,
            background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
        )
