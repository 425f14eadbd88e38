"""Request and response bodies of the HTTP API (pydantic models; they make the OpenAPI schema).

Types are strict (``"5"`` is not a k) and unknown fields are refused, so a typo is named in
the 422 rather than silently ignored. The question's fields are
:class:`~eogp_index.search.question.Question`'s, by the same names with the same defaults, and
are checked by it; range checks that depend on the server's limits (k, query tokens) are made
by the app and the engine, with the same error shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from eogp_index.search.question import Question, question_field

_STRICT = ConfigDict(extra="forbid", strict=True)


def _question(name: str, *, description: Optional[str] = None) -> Any:
    """A request field for the :class:`~eogp_index.search.question.Question` field ``name``: its
    default, and its help unless ``description`` words it for the API."""
    found = question_field(name)
    return Field(found.default, description=description or found.metadata["help"])


#: The Question's fields a request names as they are (all but ``queries``, which a request may
#: also give as one query under its own field).
QUESTION_OPTIONS = tuple(f.name for f in dataclasses.fields(Question) if f.name != "queries")


class Message(BaseModel):
    """One chat turn; the loss is taken on assistant turns."""

    model_config = _STRICT
    role: str = Field(description="system, user or assistant")
    content: str


class QueryRequest(BaseModel):
    """``POST /v1/query``: exactly one of ``text``, ``messages``, ``input_ids`` (with optional ``labels``),
    ``prompt`` with ``completion`` (a prompt-completion query) or ``prompt`` with ``chosen`` and
    ``rejected`` (a preference query); or ``queries`` with ``aggregate`` (a behaviour)."""

    model_config = _STRICT
    text: Optional[str] = Field(None, description="A query text.", examples=["Return the sum of a and b."])
    messages: Optional[List[Message]] = Field(None, description="A chat; loss on the assistant turns.")
    input_ids: Optional[List[int]] = Field(None, description="Pre-tokenized query ids.")
    labels: Optional[List[int]] = Field(None, description="Labels for input_ids (-100 = not counted).")
    prompt: Optional[Union[str, List[Message]]] = Field(
        None,
        description="A prompt (a text or a chat), not counted in the loss: with completion, or with chosen "
        "and rejected.",
        examples=["Q: 2+2?\nA:"],
    )
    completion: Optional[Union[str, List[Message]]] = Field(
        None, description="The prompt's completion (TRL's prompt-completion format): the loss on its tokens only."
    )
    chosen: Optional[Union[str, List[Message]]] = Field(
        None,
        description="A preference query (with prompt and rejected): scores of the margin "
        "log p(chosen | prompt) - log p(rejected | prompt); positive raises it.",
    )
    rejected: Optional[Union[str, List[Message]]] = Field(
        None, description="The preference query's rejected completion."
    )
    queries: Optional[List[Union[str, List[Message], Dict[str, Any]]]] = Field(
        None,
        description="A behaviour shown by several queries (texts, chats or records {text | messages | "
        "input_ids | prompt+completion | prompt+chosen+rejected}), answered as one measurement "
        "with `aggregate` instead of a single query.",
    )
    aggregate: Optional[Literal["mean", "sum"]] = _question(
        "aggregate", description="How `queries` make one measurement: the mean (or sum) of their losses."
    )
    k: int = _question("k", description="Hits per direction (at most the server's max_k).")
    where: Optional[str] = _question("where")
    direction: Literal["positive", "negative", "both"] = _question("direction")
    normalize: Literal["none", "unit"] = _question("normalize")
    group_by: Optional[str] = _question(
        "group_by",
        description="Also roll the scores of every row matching `where` up by this stored column (`groups`).",
    )
    by_module: bool = _question("by_module", description="Add each hit's per-module score terms (`modules`).")
    route: Literal["auto", "hot", "stream", "sharded", "candidates"] = _question(
        "route", description="Where codes are read from: auto, hot, stream or candidates (sharded needs torchrun)."
    )
    candidates: Optional[int] = _question("candidates")
    first_pass: str = _question("first_pass")
    rescore: Optional[int] = _question("rescore")
    checkpoint_weights: Optional[List[float]] = _question("checkpoint_weights")
    allow_partial: bool = _question("allow_partial")


class ExplainRequest(BaseModel):
    """``POST /v1/explain``: why stored document ``id`` ranks for ``query``."""

    model_config = _STRICT
    query: Union[str, List[Message], List[int], Dict[str, Any]] = Field(
        description="A text, a chat, token ids, or a record {text | messages | input_ids[, labels] | "
        "prompt+completion}, as `eogp explain` takes it."
    )
    id: str = Field(description="A stored document id (from /v1/query results).")


class QueryResponse(BaseModel):
    """The hits of one query: ``results`` are the rows ``eogp query --json`` prints, in its order."""

    query: Any = Field(description="The query as sent (text, messages or a record).")
    results: List[Dict[str, Any]] = Field(
        description="[direction,] rank, id, score[, modules] and the stored metadata columns, best first."
    )
    groups: Optional[List[Dict[str, Any]]] = Field(
        None,
        description="With group_by: one row per group (rows, sum, mean, max, top_positive, top_negative, "
        "share_positive, share_negative), sorted by sum.",
    )
    shards: Optional[Dict[str, Any]] = Field(
        None,
        description="On an index served in shards (eogp serve --ray): which shards answered (answered: their "
        "ids; missing: id and reason of each that did not, possible with allow_partial).",
    )
    took_ms: float


class ErrorBody(BaseModel):
    status: int
    field: Optional[str] = Field(description="The request field at fault (body: the body as a whole).")
    message: str = Field(description="What is wrong and what to fix.")
    errors: List[Dict[str, Any]] = Field(default_factory=list, description="Every problem found, when several.")


class ErrorResponse(BaseModel):
    error: ErrorBody
