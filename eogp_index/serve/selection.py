"""``POST /v1/select``: a training subset for a target set, downloaded as a file.

The request names the target queries and ``eogp select``'s options; the answer is the file
``eogp select --out selection.<format>`` writes (an attachment): the selected documents' original
records, each with a ``score``, or ids and scores only. It runs on the model thread like every
index call, under the server's timeout, and the file is removed once sent.
"""

from __future__ import annotations

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
from eogp_index.serve.engine import Engine, RequestError, _user_message

#: Target queries one request may hold.
MAX_TARGETS = 1000
MEDIA_TYPES = {
    "jsonl": "application/x-ndjson",
    "jsonl.gz": "application/gzip",
    "parquet": "application/vnd.apache.parquet",
}


class SelectRequest(BaseModel):
    """``POST /v1/select``: the target queries and ``eogp select``'s options."""

    model_config = ConfigDict(extra="forbid", strict=True)
    queries: List[Union[str, Dict[str, Any]]] = Field(
        description="Target queries: texts, or records {text | messages | input_ids | prompt+completion | "
        "prompt+chosen+rejected}.",
        examples=[["Return the sum of a and b."]],
    )
    top: str = Field("10%", description="How many documents: a count N or a share P% of the matching rows.")
    score: Literal["mean", "max"] = Field("mean", description="mean over the queries, or LESS's max.")
    direction: Literal["positive", "negative"] = Field("positive", description="Most helpful or most harmful.")
    where: Optional[str] = Field(None, description="SQL filter on stored columns.")
    ids_only: bool = Field(False, description="Only id and score, best first.")
    normalize: Literal["none", "unit"] = Field(
        "none", description="unit: score each document by its code divided by its norm (cosine); none: influence."
    )
    format: Literal["jsonl", "jsonl.gz", "parquet"] = Field("jsonl", description="The file's format.")


def _records(queries: List[Union[str, Dict[str, Any]]]) -> List[Dict[str, Any]]:
    if not queries:
        raise RequestError("queries", "give at least one target query")
    if len(queries) > MAX_TARGETS:
        raise RequestError(
            "queries",
            f"{len(queries)} target queries; the server takes at most {MAX_TARGETS} "
            "per request: use `eogp select` for more",
            status=413,
        )
    return [{"text": q} if isinstance(q, str) else dict(q) for q in queries]


def select_file(engine: Engine, body: SelectRequest, folder: Path) -> Path:
    """Select and write the file under ``folder`` (on the model thread); refusals as :class:`RequestError`."""
    from eogp_index.search.select import select_documents, write_selection

    records = _records(body.queries)
    try:
        engine.check(records, "queries")  # the server's limits on each query (and its preference halves)
        options = SelectOptions(
            top=body.top,
            score=body.score,
            direction=body.direction,
            where=body.where.strip() if body.where and body.where.strip() else None,
            ids_only=body.ids_only,
            normalize=body.normalize,
        )
        selection = select_documents(engine.index, records, options)
        out = folder / f"selection.{body.format}"
        write_selection(engine.index.stored, selection, out)
    except ConfigError as exc:
        raise RequestError("top" if "--top" in str(exc) else "queries", _user_message(exc)) from None
    except InputError as exc:
        field = "where" if "where filter" in str(exc) else "queries"
        raise RequestError(field, _user_message(exc)) from None
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
