"""Request and response bodies of the HTTP API (pydantic models; they make the OpenAPI schema).

Types are strict (``"5"`` is not a k) and unknown fields are refused, so a typo is named in
the 422 rather than silently ignored. Range checks that depend on the server's limits
(k, query tokens) are made by the app and the engine, with the same error shape.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)


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
    k: int = Field(10, description="Hits per direction (at most the server's max_k).")
    where: Optional[str] = Field(None, description="SQL filter on stored columns, e.g. \"kind = 'function'\".")
    direction: Literal["positive", "negative", "both"] = Field(
        "both", description="positive: documents whose training lowers the query's loss; negative: raises it."
    )
    by_module: bool = Field(False, description="Add each hit's per-module score terms (`modules`).")
    queries: Optional[List[Union[str, List[Message], Dict[str, Any]]]] = Field(
        None,
        description="A behaviour shown by several queries (texts, chats or records {text | messages | "
        "input_ids | prompt+completion | prompt+chosen+rejected}), answered as one measurement "
        "with `aggregate` instead of a single query.",
    )
    aggregate: Optional[Literal["mean", "sum"]] = Field(
        None, description="How `queries` make one measurement: the mean (or sum) of their losses."
    )
    normalize: Literal["none", "unit"] = Field(
        "none", description="unit: each training code divided by its norm (cosine); none: the paper's influence."
    )
    group_by: Optional[str] = Field(
        None, description="Also roll the scores of every row matching `where` up by this stored column (`groups`)."
    )


class ExplainRequest(BaseModel):
    """``POST /v1/explain``: why stored document ``id`` ranks for ``query``."""

    model_config = _STRICT
    query: Union[str, List[Message], List[int], Dict[str, Any]] = Field(
        description="A text, a chat, token ids, or a record {text | messages | input_ids[, labels]}."
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
    took_ms: float


class ErrorBody(BaseModel):
    status: int
    field: Optional[str] = Field(description="The request field at fault (body: the body as a whole).")
    message: str = Field(description="What is wrong and what to fix.")
    errors: List[Dict[str, Any]] = Field(default_factory=list, description="Every problem found, when several.")


class ErrorResponse(BaseModel):
    error: ErrorBody
