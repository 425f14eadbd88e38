"""Measurements: the one place a query of any kind becomes projected coordinates.

A query is a text, a chat, token ids or a record dict (:func:`~eogp_index.data.records.query_record`):
``{"text"}``, ``{"messages"}``, ``{"input_ids"[, "labels"]}``, ``{"prompt", "completion"}`` (loss on
the completion only) or a preference ``{"prompt", "chosen", "rejected"}``. Its measurement is a
signed sum of tokenized examples: the query's one example (+1), or a preference query's chosen
(+1) and rejected (-1) prompt-completion records, so its coordinates are the chosen completion's
minus the rejected one's (scores are linear in them: a positive score raises
``log p(chosen | prompt) - log p(rejected | prompt)``).

:func:`measure` tokenizes each query on its own (a bad one fails alone, its error naming the record
field at fault in ``InputError.field``) and projects all good ones in one gradient pass. The
library (:meth:`~eogp_index.encode.encoder.Encoder.query_coordinates`), ``eogp query`` and the
server take it; the server only maps the errors to request fields and status codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from eogp_index.data.records import (
    PREFERENCE_FIELDS,
    Example,
    RecordSpec,
    location_of,
    preference_pair,
    query_record,
    tokenize_record,
)
from eogp_index.errors import ConfigError, InputError, QueryTooLongError

#: The fields that hold a query's loss, in the order a record is read: the field an error of its
#: content is reported under when the error names no other.
CONTENT_FIELDS = ("text", "messages", "input_ids", "completion")

#: A query's measurement: its tokenized examples, each with its sign.
Signed = Tuple[Tuple[Example, float], ...]


@dataclass(frozen=True)
class Tokenized:
    """Queries tokenized and checked, not projected yet.

    Attributes:
        parts: ``{position: ((example, sign), ...)}`` of each query that tokenized, in order.
        errors: ``{position: InputError}`` of each one that did not.
    """

    parts: Dict[int, Signed] = field(default_factory=dict)
    errors: Dict[int, InputError] = field(default_factory=dict)


@dataclass(frozen=True)
class Measured:
    """The coordinates of the queries that measured, and the errors of the others.

    Attributes:
        coordinates: ``(n_answered, K)`` float32, row ``j`` the query at ``answered[j]``.
        answered: positions (in the queries given) of the queries that measured, ascending.
        errors: ``{position: InputError}``; ``.field`` names the record field at fault (``text``,
            ``messages``, ``input_ids``, ``labels``, ``prompt``, ``completion``, ``chosen``,
            ``rejected``; ``query`` for a query of no known shape), and a query over
            ``max_query_tokens`` is a :class:`~eogp_index.errors.QueryTooLongError`.
    """

    coordinates: np.ndarray
    answered: Tuple[int, ...]
    errors: Dict[int, InputError]

    def raise_first(self) -> None:
        """Raise the error of the first query that did not measure, if any."""
        if self.errors:
            raise self.errors[min(self.errors)]


def measure(encoder, queries: Sequence[Any], *, max_query_tokens: Optional[int] = None) -> Measured:
    """Every query that measures, as coordinates from one gradient pass, and the error of each
    one that does not.

    Args:
        encoder: the opened index's :class:`~eogp_index.encode.encoder.Encoder`.
        queries: texts, chats, token ids or record dicts (any of the kinds above).
        max_query_tokens: refuse a query (or either completion of a preference query) longer than
            this many tokens, counted before the cut to the index's ``max_tokens``; None: no limit.
    """
    return measured(encoder, tokenize_queries(encoder, queries, max_query_tokens=max_query_tokens))


def tokenize_queries(encoder, queries: Sequence[Any], *, max_query_tokens: Optional[int] = None) -> Tokenized:
    """Each query tokenized and checked on its own (:func:`measure`'s first half, no gradient pass)."""
    out = Tokenized()
    for position, query in enumerate(queries):
        try:
            out.parts[position] = _signed(encoder, query, position, max_query_tokens)
        except InputError as exc:
            out.errors[position] = exc
    return out


def measured(encoder, tokenized: Tokenized) -> Measured:
    """The coordinates of tokenized queries, all projected in one gradient pass."""
    answered = sorted(tokenized.parts)
    parts = [part for position in answered for part in tokenized.parts[position]]
    x = encoder.project([example for example, _ in parts])
    if len(parts) == len(answered):
        y = x
    else:  # a preference query's two rows become its one: chosen minus rejected
        owner = np.repeat(np.arange(len(answered)), [len(tokenized.parts[position]) for position in answered])
        y = np.zeros((len(answered), x.shape[1]), np.float32)
        np.add.at(y, owner, x * np.asarray([sign for _, sign in parts], np.float32)[:, None])
    return Measured(coordinates=y, answered=tuple(answered), errors=dict(tokenized.errors))


def _signed(encoder, query: Any, position: int, limit: Optional[int]) -> Signed:
    """A query's signed examples; an :class:`InputError` naming the record field at fault."""
    record = query_record(query, position)
    try:
        pair = preference_pair(record)
    except InputError as exc:
        missing = [name for name in PREFERENCE_FIELDS if record.get(name) is None]
        extra = sorted(set(record) - set(PREFERENCE_FIELDS) - {"id"})
        raise _named(exc, exc.field or (missing or extra or ["query"])[0]) from None
    if pair is None:
        return ((_example(encoder, record, position, limit), 1.0),)
    out = []
    for half, name, sign in zip(pair, ("chosen", "rejected"), (1.0, -1.0)):
        try:
            out.append((_example(encoder, half, position, limit), sign))
        except InputError as exc:  # the half is a prompt-completion record: say which completion
            if exc.field != "completion":
                raise
            raise _named(exc, name, replace=("'completion'", f"'{name}'")) from None
    return tuple(out)


def _example(encoder, record: Dict[str, Any], position: int, limit: Optional[int]) -> Example:
    """The query record's example, as training records are tokenized (cut to the index's
    ``max_tokens``); refuses one of over ``limit`` tokens."""
    content = next((name for name in CONTENT_FIELDS if record.get(name) is not None), "query")
    location = location_of("query", position)
    ids = record.get("input_ids")
    if limit is not None and isinstance(ids, (list, tuple)) and len(ids) > limit:  # before tokenizing them
        raise _too_long("input_ids", len(ids), limit, location)
    try:
        example = tokenize_record(
            record, shard="query", position=position, spec=encoder.query_spec, tokenizer=encoder.tokenizer
        )
        length = example.num_tokens
        if limit is not None and example.truncated:  # cut to the index's max_tokens: count what was sent
            length = tokenize_record(
                record, shard="query", position=position, spec=RecordSpec(), tokenizer=encoder.tokenizer
            ).num_tokens
    except InputError as exc:
        raise _named(exc, exc.field or content) from None
    except ConfigError as exc:  # e.g. a chat for a tokenizer without a chat template: this query's error
        message = str(exc)
        message = message[len(location) + 2 :] if message.startswith(f"{location}: ") else message
        raise InputError(message, location=location, field=content) from None
    if limit is not None and length > limit:
        raise _too_long(content, length, limit, location)
    return example


def _too_long(name: str, length: int, limit: int, location: str) -> QueryTooLongError:
    return QueryTooLongError(
        f"field {name!r} has {length} tokens; at most {limit} are accepted (max_query_tokens): shorten the query",
        location=location,
        field=name,
    )


def _named(exc: InputError, name: str, *, replace: Optional[Tuple[str, str]] = None) -> InputError:
    """``exc`` (its class kept) naming the field ``name``; ``replace``: ``(old, new)`` in its message."""
    message = str(exc)
    if exc.location and message.startswith(f"{exc.location}: "):
        message = message[len(exc.location) + 2 :]
    reason = exc.reason
    if replace is not None:
        message, reason = message.replace(*replace), reason.replace(*replace)
    kind = QueryTooLongError if isinstance(exc, QueryTooLongError) else InputError
    return kind(message, location=exc.location, reason=reason, field=name)
