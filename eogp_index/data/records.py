"""Records to tokenized examples (training documents and queries alike): which fields hold what, tokenization and the loss mask.

A record (one JSON line, Parquet row or dataset row, see :mod:`eogp_index.data.readers`) holds exactly
one kind of content:

* ``text`` (a string): tokenized with the tokenizer's defaults (``add_special_tokens=True``),
  so BOS/EOS are added exactly when the tokenizer adds them by default and never otherwise.
  Every token counts in the loss: ``labels == input_ids``.
* ``messages`` (a list of ``{"role": str, "content": str}``, extra keys passed to the template):
  rendered with ``tokenizer.apply_chat_template`` and tokenized with ``add_special_tokens=False``
  (the template writes its own BOS if it wants one). Only assistant turns count in the loss,
  Tülu / open-instruct style: for each assistant message ``i`` the tokens between the rendering
  of ``messages[:i]`` with ``add_generation_prompt=True`` and the rendering of
  ``messages[:i + 1]`` are labelled, i.e. the assistant content plus whatever the template
  writes after it for that turn (its end-of-turn token(s), e.g. ``eos_token``, and a trailing
  newline if the template emits one). Everything else is ``-100``. Each of those renderings
  must tokenize to a prefix of the full conversation's tokens, else the record is rejected.
* ``prompt`` and ``completion`` (TRL's prompt-completion format): both strings, or both lists of
  messages. Only the completion counts in the loss, as TRL's ``SFTTrainer`` does. Strings: the
  tokens of ``prompt + completion`` (``add_special_tokens=True``) whose position lies past the
  tokens of ``prompt`` alone are labelled. Messages: the tokens of the rendering of
  ``prompt + completion`` past the rendering of ``prompt`` with ``add_generation_prompt=True``
  are labelled. Either way the prompt's tokens must be a prefix of the whole's, else the record
  is rejected (a tokenizer that merges across the boundary: end the prompt with a space or
  newline that the completion does not start with).
* ``input_ids`` (a list of ints) with optional ``labels`` (same length, ``-100`` = not counted;
  default ``labels = input_ids``): used as given; ids must lie in ``[0, len(tokenizer))``.

Labels follow the Hugging Face causal-LM convention: the model shifts them by one, so
``labels[t]`` is predicted from ``input_ids[:t]`` and ``labels[0]`` is never used.
``Example.num_loss_tokens`` therefore counts ``labels[1:] != -100``.

Every record and every query is checked by one function, :func:`check_record`, driven by the
kinds' field lists (:data:`RECORD_KINDS`). Text must be Unicode text: every string the record
contributes (the text, prompt, completion, chosen and rejected, each message's role, content and
extra string values in any chat, the id, string metadata) is checked there, and a string
holding a lone UTF-16 surrogate (U+D800 to U+DFFF, which JSON's ``"\\ud800"`` escapes and
scraped data produce) is that record's error, naming the field and the character's offset. No
text is rewritten: a surrogate is not a character, so no replacement could be what the author
meant. Every other code point is accepted as it is, NUL and the non-characters (U+FFFE, U+FDD0)
included, since UTF-8, the tokenizers and the table store them unchanged.

A field whose value is ``None`` (JSON null, Arrow null) counts as absent. Every problem with a
record raises :class:`~eogp_index.errors.InputError` whose message starts with the record's
location (``"train.jsonl:17"``, see :func:`location_of`) and names the field;
:func:`iter_examples` can instead yield a :class:`Rejected` per bad record and go on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

from eogp_index.errors import ConfigError, InputError

__all__ = [
    "IGNORE_INDEX",
    "RECORD_KINDS",
    "RecordKind",
    "Example",
    "RecordSpec",
    "check_record",
    "check_text",
    "location_of",
    "query_record",
    "record_field",
    "stable_id",
    "tokenize_record",
]

#: Label of a position that does not count in the loss (PyTorch's cross-entropy ignore_index).
IGNORE_INDEX = -100

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_METADATA_SCALARS = (str, int, float, bool)
_ID_HEX_CHARS = 24  # 96 bits: collisions are negligible far beyond any corpus size


#: Separates a dataset directory from its split in a shard name (``"wiki::train"``).
SPLIT_SEPARATOR = "::"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def location_of(shard: str, position: int) -> str:
    """The human location of a record: ``"a.jsonl:18"`` (1-based line) or ``"b.parquet:row 17"``."""
    name = shard.rsplit(SPLIT_SEPARATOR, 1)[0].lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return f"{shard}:{position + 1}"
    return f"{shard}:row {position}"


@dataclass(frozen=True)
class RecordKind:
    """One kind of record content, by its canonical field names (a :class:`RecordSpec` may rename them).

    name: the kind (``Example.content_kind`` for documents). fields: the fields that make a record
    of this kind, all required. optional: fields it may also hold. text_fields: its fields that
    hold text: a string, or a chat (a list of ``{"role", "content"}`` messages) where its kind
    allows one. query_only: a kind that is asked, never stored.
    """

    name: str
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()
    text_fields: tuple[str, ...] = ()
    chat_fields: tuple[str, ...] = ()
    query_only: bool = False


#: Every kind of record content, for documents and queries alike: the record checker, the query
#: description and the surfaces' fuzzer are driven by this list. Besides its content, every record
#: may hold an ``id`` and metadata fields (strings, numbers, booleans or lists of them).
RECORD_KINDS: tuple[RecordKind, ...] = (
    RecordKind("text", ("text",), text_fields=("text",)),
    RecordKind("chat", ("messages",), chat_fields=("messages",)),
    RecordKind("tokens", ("input_ids",), optional=("labels",)),
    RecordKind(
        "completion",
        ("prompt", "completion"),
        text_fields=("prompt", "completion"),
        chat_fields=("prompt", "completion"),
    ),
    RecordKind(
        "preference",
        ("prompt", "chosen", "rejected"),
        text_fields=("prompt", "chosen", "rejected"),
        chat_fields=("prompt", "chosen", "rejected"),
        query_only=True,
    ),
)


LongDocuments = Literal["truncate", "windows"]
#: The metadata columns ``long_documents="windows"`` gives every row: the document's id and the
#: window's number in it (0 for a document that fits in one).
WINDOW_COLUMNS = ("parent_id", "window")


@dataclass(frozen=True)
class RecordSpec:
    """Where a record keeps its content, id and metadata, and how long an example may be.

    text_field, messages_field, input_ids_field, labels_field, prompt_field, completion_field:
        the record keys of the four content kinds (text, chat, token ids with their optional
        labels, prompt with completion); all distinct.
    id_field: when given, the example id is this field's value (a non-empty str, or an int,
        stored as its decimal string); it must be present in every record and unique in the
        run. When None, ids are :func:`stable_id` of shard name, position and content.
    metadata_fields: record keys copied into ``Example.metadata`` (typed, nullable columns in
        the store). A value is a str, an int (within int64), a float, a bool, or a list of one of
        these (an Arrow list column; its items may be null); a record without the field, or with
        null, holds None (a null in the column). Each field keeps the type of its first non-null
        value in the run (for lists, of its first item), except that an int is accepted in a
        float field (and stored as a float). A float in an int field is an error: write the
        first value as a float (``3.0``).
    max_tokens: keep only the first ``max_tokens`` tokens (and labels) of longer examples and
        mark them ``truncated``; None keeps everything. At least 2 (one loss position).
    long_documents: what becomes of a document longer than ``max_tokens``: ``truncate`` (as
        above) or ``windows`` (:func:`split_windows`: one example per window, every row with
        ``parent_id`` and ``window`` metadata).
    """

    text_field: str = field(default="text", metadata={"help": "Field holding plain text."})
    messages_field: str = field(
        default="messages",
        metadata={"help": "Field holding a chat (list of {role, content}); loss on assistant turns only."},
    )
    input_ids_field: str = field(default="input_ids", metadata={"help": "Field of pre-tokenized ids."})
    labels_field: str = field(default="labels", metadata={"help": "Field of labels for the ids (-100 = ignored)."})
    prompt_field: str = field(
        default="prompt", metadata={"help": "Field holding a prompt (text or messages) not counted in the loss."}
    )
    completion_field: str = field(
        default="completion",
        metadata={"help": "Field holding the completion of prompt_field (text or messages); loss on it only."},
    )
    id_field: str | None = field(
        default=None, metadata={"help": "Field to use as the example id (default: a stable hash)."}
    )
    metadata_fields: tuple[str, ...] = field(
        default=(), metadata={"help": "Record field stored as a typed column, usable in --where (repeatable)."}
    )
    max_tokens: int | None = field(default=None, metadata={"help": "Truncate examples to this many tokens.", "min": 2})
    long_documents: LongDocuments = field(
        default="truncate",
        metadata={
            "help": "A document longer than max_tokens: truncate (keep its start; the row is flagged "
            "`truncated`) or windows (split it into windows of max_tokens tokens, one row each; "
            "every row gets a parent_id column, the document's id, and a window column)."
        },
    )

    def __post_init__(self) -> None:
        content = {
            "text_field": self.text_field,
            "messages_field": self.messages_field,
            "input_ids_field": self.input_ids_field,
            "labels_field": self.labels_field,
            "prompt_field": self.prompt_field,
            "completion_field": self.completion_field,
        }
        for name, value in content.items():
            if not isinstance(value, str) or not value:
                raise ConfigError(f"RecordSpec.{name} must be a non-empty string, got {value!r}")
        if len(set(content.values())) != len(content):
            raise ConfigError(f"RecordSpec content fields must be distinct record keys, got {content}")
        if self.id_field is not None:
            if not isinstance(self.id_field, str) or not self.id_field:
                raise ConfigError(f"RecordSpec.id_field must be None or a non-empty string, got {self.id_field!r}")
            if self.id_field in content.values():
                raise ConfigError(
                    f"RecordSpec.id_field {self.id_field!r} is also a content field; "
                    "name the record key that holds the document id"
                )
        fields = self.metadata_fields
        if isinstance(fields, (str, bytes)) or not isinstance(fields, Sequence):
            raise ConfigError(
                f"RecordSpec.metadata_fields must be a tuple of field names, e.g. ('source',), got {fields!r}"
            )
        fields = tuple(fields)
        for name in fields:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"RecordSpec.metadata_fields entries must be non-empty strings, got {name!r}")
            if name in content.values():
                raise ConfigError(
                    f"RecordSpec.metadata_fields has {name!r}, which is a content field; "
                    "content is not copied into metadata"
                )
        duplicates = sorted({name for name in fields if fields.count(name) > 1})
        if duplicates:
            raise ConfigError(f"RecordSpec.metadata_fields lists {duplicates} more than once")
        object.__setattr__(self, "metadata_fields", fields)  # a list given by a caller -> tuple
        if self.long_documents not in ("truncate", "windows"):
            raise ConfigError(f"RecordSpec.long_documents must be 'truncate' or 'windows', got {self.long_documents!r}")
        clash = [name for name in WINDOW_COLUMNS if name in fields]
        if self.long_documents == "windows" and clash:
            raise ConfigError(
                f"RecordSpec.metadata_fields has {clash}, the columns that long_documents='windows' "
                "fills; rename those record fields or drop them from metadata_fields (--metadata)"
            )
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2
        ):
            raise ConfigError(
                "RecordSpec.max_tokens must be None or an int >= 2 (an example needs two tokens "
                f"for one prediction), got {self.max_tokens!r}"
            )


@dataclass(frozen=True)
class Example:
    """One tokenized training document, ready for per-example gradients.

    id: the example id (``RecordSpec.id_field``'s value, or :func:`stable_id`).
    shard: shard name (see :func:`eogp_index.data.readers.shard_names`); position: 0-based line / row.
    input_ids: token ids, a tuple of Python ints of length ``num_tokens``.
    labels: same length; ``labels[t]`` is predicted from ``input_ids[:t]`` (the model shifts
        by one), ``-100`` = not counted. ``labels[0]`` is never used.
    metadata: ``{field: value}`` for ``RecordSpec.metadata_fields``, in that order.
    num_tokens: ``len(input_ids)`` after truncation.
    num_loss_tokens: number of ``labels[1:]`` that are not ``-100`` (always >= 1).
    truncated: whether the document was cut to ``RecordSpec.max_tokens``.
    content: what was tokenized, keyed by kind: ``{"text": str}``, ``{"messages": [...]}`` or
        ``{"input_ids": [...], "labels": [...] | None}`` (None for examples made from ids). A
        window keeps its whole document's (its hash is the row's ``content_sha256``).
    span: a window's own text, what :attr:`display_text` shows and ``--store-text`` stores.
    """

    id: str
    shard: str
    position: int
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    metadata: dict[str, Any]
    num_tokens: int
    num_loss_tokens: int
    truncated: bool
    content: dict[str, Any] | None = None
    #: A window's own text (:func:`tokenize_windows`): the span of the document its tokens cover;
    #: None for an example that is its whole document.
    span: str | None = None

    @property
    def content_sha256(self) -> str:
        """SHA-256 of the content as canonical JSON (of the token ids when ``content`` is None):
        stored per row, so that a document read back from a changed shard is recognised."""
        content = (
            self.content
            if self.content is not None
            else {"input_ids": list(self.input_ids), "labels": list(self.labels)}
        )
        return content_sha256(content)

    @property
    def content_kind(self) -> str:
        """``text``, ``chat``, ``completion`` or ``tokens``: how the stored text (or the shard's
        record) is read back."""
        content = self.content or {}
        if "completion" in content:
            return "completion"
        return "text" if "text" in content else "chat" if "messages" in content else "tokens"

    @property
    def display_text(self) -> str:
        """The document as a person reads it: the text, or the chat / token ids as JSON; for a
        window, the span of the document it covers."""
        if self.span is not None:
            return self.span
        content = self.content or {"input_ids": list(self.input_ids), "labels": list(self.labels)}
        if "text" in content:
            return content["text"]
        return json.dumps(content.get("messages", content), ensure_ascii=False)

    @classmethod
    def from_ids(
        cls,
        id: str,
        input_ids: Sequence[int],
        labels: Sequence[int] | None = None,
        *,
        shard: str = "",
        position: int = 0,
        metadata: dict[str, Any] | None = None,
        truncated: bool = False,
    ) -> "Example":
        """An example from token ids made elsewhere (tests, benchmarks, custom pipelines);
        ``labels`` default to the ids, counts are derived."""
        labels = tuple(int(t) for t in (input_ids if labels is None else labels))
        return cls(
            id=id,
            shard=shard,
            position=position,
            input_ids=tuple(int(t) for t in input_ids),
            labels=labels,
            metadata=dict(metadata or {}),
            num_tokens=len(input_ids),
            num_loss_tokens=sum(1 for t in labels[1:] if t != IGNORE_INDEX),
            truncated=truncated,
        )


def split_windows(example: Example, max_tokens: int | None) -> list[Example]:
    """The windows of an untruncated document, ``max_tokens`` tokens each, in order.

    Consecutive windows share one token (a stride of ``max_tokens - 1``): a window's first label
    is never predicted, so every counted label of the document is counted in exactly one window.
    A window with no counted label has no gradient and is left out. A document that fits is one
    window and keeps its id; the windows of a longer one have ids ``ID#0``, ``ID#1``, … Every
    window keeps the document's shard, position and content (so that it is read back and
    checked like the whole document) and gets metadata ``parent_id`` (the document's id) and
    ``window`` (its number).
    """
    metadata = dict(example.metadata)
    if max_tokens is None or example.num_tokens <= max_tokens:
        return [replace(example, metadata={**metadata, "parent_id": example.id, "window": 0})]
    out = []
    for number, start in enumerate(range(0, example.num_tokens - 1, max_tokens - 1)):
        input_ids = example.input_ids[start : start + max_tokens]
        labels = example.labels[start : start + max_tokens]
        counted = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
        if counted:
            out.append(
                replace(
                    example,
                    id=f"{example.id}#{number}",
                    input_ids=input_ids,
                    labels=labels,
                    num_tokens=len(input_ids),
                    num_loss_tokens=counted,
                    truncated=False,
                    metadata={**metadata, "parent_id": example.id, "window": number},
                )
            )
    return out


def tokenize_windows(record: Any, *, shard: str, position: int, spec: RecordSpec, tokenizer: Any) -> list[Example]:
    """:func:`tokenize_record`, as ``spec.long_documents`` asks: one (maybe truncated) example, or
    the document's windows (:func:`split_windows`), each of a split document with its own text
    (:attr:`Example.span`, see :func:`window_spans`)."""
    if spec.long_documents == "truncate":
        return [tokenize_record(record, shard=shard, position=position, spec=spec, tokenizer=tokenizer)]
    whole = tokenize_record(
        record, shard=shard, position=position, spec=replace(spec, max_tokens=None), tokenizer=tokenizer
    )
    windows = split_windows(whole, spec.max_tokens)
    if spec.max_tokens is None or whole.num_tokens <= spec.max_tokens:
        return windows  # the document is its one window: its text is the whole
    starts = [window.metadata["window"] * (spec.max_tokens - 1) for window in windows]
    spans = window_spans(
        whole, [(start, start + window.num_tokens) for start, window in zip(starts, windows)], tokenizer
    )
    return [replace(window, span=span) for window, span in zip(windows, spans)]


def window_spans(example: Example, bounds: Sequence[tuple[int, int]], tokenizer: Any) -> list[str]:
    """The text each token range ``[start, end)`` of ``example`` covers.

    A text document with a fast tokenizer: the characters from the first to the last of the
    range's tokens, by the tokenizer's offsets (special tokens cover none), exactly as written.
    Otherwise (a chat, a slow tokenizer, offsets that do not line up with the tokens): the
    range's tokens decoded (a text's without its special tokens); token ids without a
    tokenizer: the range's ids and labels as JSON.
    """
    content = example.content or {}
    offsets = None
    if "text" in content and getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(content["text"], add_special_tokens=True, return_offsets_mapping=True, verbose=False)
        if list(encoded["input_ids"]) == list(example.input_ids):
            offsets = encoded["offset_mapping"]
    out = []
    for start, end in bounds:
        if offsets is not None:
            covered = [(a, b) for a, b in offsets[start:end] if b > a]
            out.append(content["text"][covered[0][0] : covered[-1][1]] if covered else "")
        elif getattr(tokenizer, "decode", None) is not None:
            # (A text's special tokens, BOS, are no part of it; a chat's are its template's.)
            out.append(tokenizer.decode(list(example.input_ids[start:end]), skip_special_tokens="text" in content))
        else:
            out.append(
                json.dumps({"input_ids": list(example.input_ids[start:end]), "labels": list(example.labels[start:end])})
            )
    return out


def stable_id(shard: str, position: int, content: bytes | str) -> str:
    """A deterministic example id: 24 hex chars of SHA-256 over shard, position and content.

    The same shard name, position and content give the same id on every machine and run;
    changing any of them changes it. The parts are separated by NUL bytes so that
    ``("a1", 2, ...)`` and ``("a", 12, ...)`` cannot collide.
    """
    if isinstance(content, str):
        content = content.encode("utf-8")
    digest = hashlib.sha256()
    digest.update(b"eogp-example-id-v1\0")
    digest.update(shard.encode("utf-8"))
    digest.update(b"\0")
    digest.update(str(int(position)).encode("ascii"))
    digest.update(b"\0")
    digest.update(content)
    return digest.hexdigest()[:_ID_HEX_CHARS]


def content_sha256(content: dict[str, Any]) -> str:
    """The hex SHA-256 of a record's content (:attr:`Example.content`) as canonical JSON."""
    return hashlib.sha256(_canonical_json(content)).hexdigest()


#: The fields of a preference query (TRL's preference format, strings or message lists).
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


def preference_pair(record: Any, location: Optional[str] = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The chosen and rejected prompt-completion records of a preference query, else None.

    A preference query ``{"prompt", "chosen", "rejected"}`` measures
    ``loss(chosen | prompt) - loss(rejected | prompt)`` = ``-(log p(chosen | prompt) -
    log p(rejected | prompt))``, completion tokens only: its gradient is the chosen record's
    minus the rejected record's, and a document with a positive score raises the margin.
    The query is checked whole (:func:`check_record`), so an error names ``chosen`` or
    ``rejected``, not the completion of a half; ``location`` leads its message.
    """
    if not isinstance(record, dict) or not any(record.get(name) is not None for name in PREFERENCE_FIELDS[1:]):
        return None
    check_record(record, RecordSpec(), location, query=True)
    prompt = record["prompt"]
    return ({"prompt": prompt, "completion": record["chosen"]}, {"prompt": prompt, "completion": record["rejected"]})


def query_record(query: Any, position: int = 0) -> dict[str, Any]:
    """A query as a record dict: a text ``{"text"}``, a chat ``{"messages"}``, token ids
    ``{"input_ids"}``, or a record dict as it is (any of :data:`RECORD_KINDS`).

    Raises:
        InputError: a query of none of these shapes (naming ``query {position}``).
    """
    if isinstance(query, str):
        return {"text": query}
    if isinstance(query, dict):
        return dict(query)
    if isinstance(query, (list, tuple)) and query and isinstance(query[0], dict):
        return {"messages": list(query)}
    if isinstance(query, (list, tuple)) and query:
        return {"input_ids": list(query)}
    raise InputError(
        f"query {position}: expected a text, a chat (list of role/content dicts), token ids or a "
        f"record dict, got {'an empty list' if isinstance(query, (list, tuple)) else _type_name(query)}",
        field="query",
    )


def record_content(record: dict[str, Any], spec: "RecordSpec") -> dict[str, Any] | None:
    """The content of a record as :func:`tokenize_record` hashes it (:attr:`Example.content`),
    without tokenizing; None when the record has no content field. For checking a record read
    back against its stored ``content_sha256``."""

    def get(name: str) -> Any:
        return record.get(name) if isinstance(record, dict) else None

    if get(spec.completion_field) is not None and get(spec.prompt_field) is not None:
        return {"prompt": get(spec.prompt_field), "completion": get(spec.completion_field)}
    if get(spec.text_field) is not None:
        return {"text": get(spec.text_field)}
    if get(spec.messages_field) is not None:
        return {"messages": get(spec.messages_field)}
    if get(spec.input_ids_field) is not None:
        return {"input_ids": list(get(spec.input_ids_field)), "labels": get(spec.labels_field)}
    return None


def record_of(content: dict[str, Any], spec: "RecordSpec") -> dict[str, Any]:
    """A record holding ``content`` under ``spec``'s field names (the inverse of tokenizing's read)."""
    if "text" in content:
        return {spec.text_field: content["text"]}
    if "messages" in content:
        return {spec.messages_field: content["messages"]}
    if "completion" in content:
        return {spec.prompt_field: content["prompt"], spec.completion_field: content["completion"]}
    record = {spec.input_ids_field: content["input_ids"]}
    if content.get("labels") is not None:
        record[spec.labels_field] = content["labels"]
    return record


def _canonical_json(value: Any) -> bytes:
    # default=str: extra message keys read from Parquet may hold dates and the like.
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode("utf-8")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_text(value: str, field_name: str, location: Optional[str] = None, *, field: Optional[str] = None) -> str:
    """``value`` unchanged when it is Unicode text, else :class:`InputError` naming ``field_name``.

    Text is a sequence of Unicode scalar values: what UTF-8 can encode. A Python string may also
    hold lone UTF-16 surrogates (``json.loads('"\\ud800"')``); they are refused here, where
    records and queries are read, rather than failing in the tokenizer or the table.
    ``field``: the record field the error's ``field`` names (default ``field_name``; for a
    message's content, the chat's field).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"field {field_name!r}: character {exc.start} is U+{ord(value[exc.start]):04X}, a lone UTF-16 "
            "surrogate, which is not Unicode text; fix the source text (a surrogate pair written as two "
            "escapes, e.g. \\ud83d\\ude00, is read as one character and is fine)",
            location=location,
            field=field or field_name,
        ) from None
    return value


def _check_strings(value: Any, field_name: str, location: Optional[str], field: str) -> None:
    """:func:`check_text` on every string inside a JSON-like value (keys included)."""
    if isinstance(value, str):
        check_text(value, field_name, location, field=field)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(key, field_name, location, field=field)
            _check_strings(item, f"{field_name}.{key}", location, field)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_strings(item, f"{field_name}[{index}]", location, field)


def record_field(spec: RecordSpec, canonical: str) -> str:
    """The record key of a canonical field of :data:`RECORD_KINDS` under ``spec`` (``chosen`` and
    ``rejected``, which a spec does not rename, keep their names)."""
    return {
        "text": spec.text_field,
        "messages": spec.messages_field,
        "input_ids": spec.input_ids_field,
        "labels": spec.labels_field,
        "prompt": spec.prompt_field,
        "completion": spec.completion_field,
    }.get(canonical, canonical)


def _odd_one(names: Sequence[str], values: Sequence[Any]) -> str:
    """Of fields that must all be strings or all chats, the one at fault: the first that is
    neither, else the first whose type differs from the first field's."""
    for name, value in zip(names, values):
        if not isinstance(value, (str, list)):
            return name
    return next((n for n, v in zip(names, values) if type(v) is not type(values[0])), names[0])


def check_record(record: Any, spec: RecordSpec, location: Optional[str] = None, *, query: bool = False) -> RecordKind:
    """The kind of ``record`` among :data:`RECORD_KINDS`, once every field it holds is checked.

    The one check of records and queries alike, driven by the kinds' field lists: the record is
    an object holding the fields of exactly one kind (a query-only kind, a preference, only with
    ``query=True``); each of its text fields is a string or, where the kind allows, a chat (a
    non-empty list of ``{"role", "content"}`` messages), and the fields the loss is taken on are
    not empty; every string (text, prompt, completion, chosen, rejected, each message's role,
    content and extra values and keys, the id, string metadata and metadata list items) is
    Unicode text (:func:`check_text`); token ids are lists of non-negative ints, and labels go
    with them; the id and metadata fields are well typed (a query's ``id``, when a string, is
    checked as text too). Checks against the tokenizer (ids within its vocabulary, a chat
    template) are :func:`tokenize_record`'s, and checks across records (unique ids, metadata
    types) ``ingest.records.RunState``'s.

    location: what error messages start with (``"train.jsonl:17"``); None for none.
    Raises :class:`InputError` naming the field, with ``field`` the record field (for anything
    inside a chat, the chat's field: ``messages``, ``prompt``, ...).
    """
    if not isinstance(record, dict):
        raise InputError(f"a record must be an object, got {_type_name(record)}", location=location)
    kind = _record_kind(record, spec, location, query)
    texts = [name for name in kind.fields if name in kind.text_fields or name in kind.chat_fields]
    values = [record[record_field(spec, name)] for name in texts]
    if len(texts) > 1 and not (all(isinstance(v, str) for v in values) or all(isinstance(v, list) for v in values)):
        count = _COUNTS.get(len(texts), str(len(texts)))
        got = [_type_name(v) for v in values]
        raise InputError(
            f"fields {[record_field(spec, name) for name in texts]}: expected {count} strings or {count} lists of "
            f"messages, got {', '.join(got[:-1])} and {got[-1]}",
            location=location,
            field=record_field(spec, _odd_one(texts, values)),
        )
    for canonical, value in zip(texts, values):
        _check_text_field(value, canonical, kind, record_field(spec, canonical), location)
    if kind.name == "tokens":
        _check_token_ids(record, spec, location, None)
    elif record.get(spec.labels_field) is not None:
        raise InputError(
            f"field {spec.labels_field!r} is only allowed with {spec.input_ids_field!r}; labels of "
            f"{record_field(spec, kind.fields[-1])!r} records are derived from the content",
            location=location,
            field=spec.labels_field,
        )
    _record_id(record, spec, location)
    if query and isinstance(record.get("id"), str):
        check_text(record["id"], "id", location)
    _metadata(record, spec, location)
    return kind


_COUNTS = {2: "two", 3: "three"}
#: What an empty string in a field the loss is taken on is called.
_EMPTY = {"text": "empty document"}


def _check_text_field(value: Any, canonical: str, kind: RecordKind, name: str, location: Optional[str]) -> None:
    """One text field of a record of ``kind``: a string or (where the kind allows) a chat."""
    if isinstance(value, str) and canonical in kind.text_fields:
        if not value and canonical != "prompt":  # the prompt is not in the loss: it may be empty
            raise InputError(
                f"field {name!r}: {_EMPTY.get(canonical, 'empty completion')}", location=location, field=name
            )
        check_text(value, name, location)
    elif canonical in kind.chat_fields and (isinstance(value, list) or canonical not in kind.text_fields):
        _check_messages(value, name, location)
        _check_strings(value, name, location, name)
    else:
        raise InputError(
            f"field {name!r}: expected a string{' or a list of messages' if canonical in kind.chat_fields else ''}, "
            f"got {_type_name(value)}",
            location=location,
            field=name,
        )


def _record_kind(record: dict[str, Any], spec: RecordSpec, location: Optional[str], query: bool) -> RecordKind:
    """The one kind whose fields ``record`` holds, by the fields that tell the kinds apart."""
    kinds = [kind for kind in RECORD_KINDS if query or not kind.query_only]
    # A field of several kinds (the prompt) tells none apart: beside another kind it is an ordinary field.
    shared = {name for kind in RECORD_KINDS for name in kind.fields if sum(name in k.fields for k in RECORD_KINDS) > 1}
    matched = []
    for kind in kinds:
        own = [record_field(spec, name) for name in kind.fields if name not in shared]
        if any(record.get(name) is not None for name in own):
            matched.append((kind, [name for name in own if record.get(name) is not None]))
    choices = ", ".join(" + ".join(repr(record_field(spec, name)) for name in kind.fields) for kind in kinds)
    prompt = spec.prompt_field
    if not matched and record.get(prompt) is not None:
        others = (
            "or 'chosen' and 'rejected' (a preference query)"
            if query
            else ("(a preference record, with 'chosen' and 'rejected', is a query only)")
        )
        raise InputError(
            f"field {prompt!r} without {spec.completion_field!r}: a prompt-completion record holds both {others}",
            location=location,
            field=spec.completion_field,
        )
    if not matched:
        raise InputError(
            f"missing content: the record has none of the fields {choices} (present keys: {sorted(record)[:20]})",
            location=location,
            field=spec.text_field,
        )
    if len(matched) > 1:
        present = [name for _, names in matched for name in names]
        raise InputError(
            f"more than one content field: {present}; a record holds exactly one of {choices}",
            location=location,
            field=present[1],
        )
    kind, present = matched[0]
    names = [record_field(spec, name) for name in kind.fields]
    missing = [name for name in names if record.get(name) is None]
    extra = sorted(set(record) - set(names) - {"id"}) if kind.query_only else []
    if kind.query_only and (missing or extra):
        raise InputError(
            f"a {kind.name} query holds exactly the fields {names}; this one "
            + (f"lacks {missing}" if missing else f"also has {extra}"),
            location=location,
            field=(missing or [names[-1]])[0],
        )
    if missing:
        raise InputError(
            f"field {present[0]!r} without {missing[0]!r}: a {present[0]} needs its {missing[0]} (a whole document "
            f"with no {missing[0]} is a {spec.text_field!r} record)",
            location=location,
            field=missing[0],
        )
    return kind


def _record_id(record: dict[str, Any], spec: RecordSpec, location: Optional[str]) -> str | None:
    """The ``id_field`` value as a string, or None when ids are derived from content."""
    if spec.id_field is None:
        return None
    value = record.get(spec.id_field)
    if value is None:
        raise InputError(
            f"missing id field {spec.id_field!r} (RecordSpec.id_field)", location=location, field=spec.id_field
        )
    if _is_int(value):
        return str(value)
    if isinstance(value, str) and value:
        return check_text(value, spec.id_field, location)
    raise InputError(
        f"field {spec.id_field!r}: an id must be a non-empty string or an int, got {_type_name(value)} {value!r}",
        location=location,
        field=spec.id_field,
    )


def _metadata_scalar(value: Any, where: str, location: Optional[str], name: str) -> Any:
    if isinstance(value, str):
        return check_text(value, where, location, field=name)
    if _is_int(value) and not _INT64_MIN <= value <= _INT64_MAX:
        raise InputError(f"field {where!r}: int {value} does not fit in int64", location=location, field=name)
    return value


def _metadata(record: dict[str, Any], spec: RecordSpec, location: Optional[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in spec.metadata_fields:
        value = record.get(name)
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if item is not None and not isinstance(item, _METADATA_SCALARS):
                    raise InputError(
                        f"field {name!r}: a metadata list holds str, int, float, bool or null items, item "
                        f"{index} is {_type_name(item)}",
                        location=location,
                        field=name,
                    )
            value = [_metadata_scalar(item, f"{name}[{index}]", location, name) for index, item in enumerate(value)]
        elif value is not None:
            if not isinstance(value, _METADATA_SCALARS):
                raise InputError(
                    f"field {name!r}: metadata values must be str, int, float, bool, null or a list of "
                    f"these, got {_type_name(value)}",
                    location=location,
                    field=name,
                )
            value = _metadata_scalar(value, name, location, name)
        out[name] = value  # absent and null alike: a null in the column
    return out


def _check_token_list(
    value: Any, field_name: str, location: Optional[str], vocab_size: int | None, *, allow_ignore: bool
) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InputError(
            f"field {field_name!r}: expected a list of ints, got {_type_name(value)}",
            location=location,
            field=field_name,
        )
    for index, token in enumerate(value):
        if not _is_int(token):
            raise InputError(
                f"field {field_name!r}: expected a list of ints, item {index} is {_type_name(token)} {token!r}",
                location=location,
                field=field_name,
            )
        if allow_ignore and token == IGNORE_INDEX:
            continue
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            extra = f" or {IGNORE_INDEX}" if allow_ignore else ""
            raise InputError(
                f"field {field_name!r}: item {index} is {token}, outside the tokenizer's ids {allowed}{extra}",
                location=location,
                field=field_name,
            )
    return list(value)


def _check_token_ids(
    record: dict[str, Any], spec: RecordSpec, location: Optional[str], vocab_size: int | None
) -> tuple[list[int], list[int] | None]:
    """A tokens record's ids and its labels as given (None: none given), checked."""
    input_ids = _check_token_list(
        record[spec.input_ids_field], spec.input_ids_field, location, vocab_size, allow_ignore=False
    )
    raw_labels = record.get(spec.labels_field)
    if raw_labels is None:
        return input_ids, None
    labels = _check_token_list(raw_labels, spec.labels_field, location, vocab_size, allow_ignore=True)
    if len(labels) != len(input_ids):
        raise InputError(
            f"field {spec.labels_field!r}: {len(labels)} labels for {len(input_ids)} "
            f"{spec.input_ids_field!r}; they must have the same length",
            location=location,
            field=spec.labels_field,
        )
    return input_ids, labels


def _check_messages(messages: Any, field_name: str, location: Optional[str]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise InputError(
            f"field {field_name!r}: expected a list of {{role, content}} messages, got {_type_name(messages)}",
            location=location,
            field=field_name,
        )
    if not messages:
        raise InputError(f"field {field_name!r}: empty conversation", location=location, field=field_name)
    for index, message in enumerate(messages):
        where = f"{field_name}[{index}]"
        if not isinstance(message, dict):
            raise InputError(
                f"field {where!r}: expected an object with 'role' and 'content', got {_type_name(message)}",
                location=location,
                field=field_name,
            )
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str) or (key == "role" and not value):
                raise InputError(
                    f"field '{where}.{key}': expected a{' non-empty' if key == 'role' else ''} "
                    f"string, got {_type_name(value)} {value!r}",
                    location=location,
                    field=field_name,
                )
    return messages


#: Text is cut to this many characters per token of ``max_tokens`` (plus the margin below) before
#: it is tokenized, so that a huge record costs what its first tokens cost. No character count
#: bounds a token for every tokenizer (a word-level tokenizer maps a word of any length to one
#: unknown token, a normalizer may drop whole runs of characters), so the cut is checked rather
#: than trusted: it stands when its tokens run at least the margin past ``max_tokens``, else the
#: bound grows (x4) up to the whole text. A cut changes only the tokens of the word it splits
#: (tokenizers split on whitespace and punctuation first, and BPE merges are local), which lie
#: past ``max_tokens`` then: the tokens kept equal the whole text's first ``max_tokens``.
#: English runs about 4 characters per BPE token, so 32 leaves a wide berth for the first try.
_CUT_CHARS_PER_TOKEN = 32
_CUT_MARGIN_TOKENS = 32


def _encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool, max_tokens: int | None = None) -> list[int]:
    """The token ids of ``text``; with ``max_tokens``, maybe only of a prefix of it, whose ids
    start with the whole text's first ``max_tokens`` ids and run past them (see ``_CUT_CHARS_PER_TOKEN``)."""
    bound = None if max_tokens is None else _CUT_CHARS_PER_TOKEN * (max_tokens + _CUT_MARGIN_TOKENS)
    while bound is not None and bound < len(text):
        ids = _tokenize(tokenizer, text[:bound], add_special_tokens)
        if len(ids) >= max_tokens + _CUT_MARGIN_TOKENS:
            return ids
        bound *= 4
    return _tokenize(tokenizer, text, add_special_tokens)


def _tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # verbose=False: long documents are expected here (they are truncated by max_tokens, not by
    # the tokenizer), so the "longer than model_max_length" warning would only be noise.
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)
    return list(encoded["input_ids"])


def _render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    field_name: str,
    location: str,
) -> list[int]:
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors and raise_exception() calls inside templates
        raise InputError(
            f"field {field_name!r}: the chat template failed on this conversation: {type(exc).__name__}: {exc}",
            location=location,
            field=field_name,
        ) from exc
    if not isinstance(rendered, str):
        raise ConfigError(
            f"{location}: tokenizer.apply_chat_template(tokenize=False) returned {_type_name(rendered)}, not a string"
        )
    # The template writes the special tokens it wants (BOS included); adding them again here
    # would put a second BOS in front.
    return _encode_text(tokenizer, rendered, add_special_tokens=False)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def _chat_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], field_name: str, location: str
) -> tuple[list[int], list[int]]:
    """Token ids and assistant-only labels of a conversation (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{location}: field {field_name!r} holds a chat, but the tokenizer has no chat "
            "template; pass a tokenizer with one (tokenizer.chat_template = '...')"
        )

    def render(part: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        return _render_chat(
            tokenizer,
            part,
            add_generation_prompt=generation_prompt,
            field_name=field_name,
            location=location,
        )

    full = render(messages, False)
    labels = [IGNORE_INDEX] * len(full)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise InputError(
                f"field '{field_name}[0]': the conversation starts with an assistant message; "
                "its loss mask needs the template's rendering of the messages before it, so "
                "start with a system or user message",
                location=location,
                field=field_name,
            )
        start = render(messages[:index], True)
        end = render(messages[: index + 1], False)
        for shorter, longer, what in (
            (start, end, f"messages[:{index}] with add_generation_prompt=True"),
            (end, full, f"messages[:{index + 1}]"),
        ):
            _check_prefix(
                shorter,
                longer,
                field_name,
                location,
                f"the chat template is not prefix-stable at assistant message {index}: the tokens of {what}",
                "use a template that renders earlier turns the same way whatever "
                "follows them (and that tokenizes cleanly at turn boundaries)",
            )
        labels[len(start) : len(end)] = full[len(start) : len(end)]
    return full, labels


def _check_prefix(
    shorter: Sequence[int], longer: Sequence[int], field_name: str, location: str, what: str, fix: str
) -> None:
    """Refuse a record whose loss mask cannot be placed: ``shorter`` must start ``longer``."""
    if list(longer[: len(shorter)]) != list(shorter):
        at = _first_difference(shorter, longer)
        raise InputError(
            f"field {field_name!r}: {what} are not a prefix of the longer rendering (they differ from "
            f"token {at}), so the loss mask cannot be placed; {fix}",
            location=location,
            field=field_name,
        )


def _completion_tokens(
    tokenizer: Any, prompt: Any, completion: Any, spec: RecordSpec, location: str
) -> tuple[list[int], list[int], dict[str, Any]]:
    """Token ids, completion-only labels and the hashed content of a checked prompt-completion record."""
    fields = (spec.prompt_field, spec.completion_field)
    if isinstance(prompt, str):
        start = _encode_text(tokenizer, prompt, add_special_tokens=True, max_tokens=spec.max_tokens)
        full = _encode_text(tokenizer, prompt + completion, add_special_tokens=True, max_tokens=spec.max_tokens)
        fix = (
            "end the prompt where the tokenizer splits (e.g. with the space or newline before the "
            "completion) so that the prompt tokenizes the same alone and followed by its completion"
        )
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"{location}: fields {list(fields)} hold messages, but the tokenizer has no chat template; "
                "pass a tokenizer with one (tokenizer.chat_template = '...')"
            )
        start = _render_chat(tokenizer, prompt, add_generation_prompt=True, field_name=fields[0], location=location)
        full = _render_chat(
            tokenizer, prompt + completion, add_generation_prompt=False, field_name=fields[1], location=location
        )
        fix = "use a template that renders the prompt's turns the same way whatever follows them"
    # Past max_tokens every position of the prompt is unlabelled anyway (and the ids of a cut text
    # are exact up to there only, see _encode_text): the prefix is compared as far as it is kept.
    compared = len(start) if spec.max_tokens is None else min(len(start), spec.max_tokens)
    _check_prefix(start[:compared], full, spec.completion_field, location, "the tokens of the prompt alone", fix)
    labels = [IGNORE_INDEX] * len(start) + full[len(start) :]
    return full, labels[: len(full)], {"prompt": prompt, "completion": completion}


def _token_labels(
    record: dict[str, Any], spec: RecordSpec, tokenizer: Any, location: str
) -> tuple[list[int], list[int], dict[str, Any]]:
    """Token ids, labels and the hashed content of a checked tokens record (ids within the vocabulary)."""
    vocab_size = len(tokenizer) if tokenizer is not None else None
    input_ids, labels = _check_token_ids(record, spec, location, vocab_size)
    hashed = {"input_ids": input_ids, "labels": labels}
    return input_ids, list(input_ids) if labels is None else labels, hashed


def tokenize_record(
    record: dict[str, Any],
    *,
    shard: str,
    position: int,
    spec: RecordSpec,
    tokenizer: Any,
) -> Example:
    """Turn one raw record into an :class:`Example`.

    record: a decoded JSON object / row. shard, position: where it came from (see
    :class:`eogp_index.data.readers.RawRecord`). tokenizer: a Hugging Face tokenizer (callable returning
    ``{"input_ids": list[int]}``, ``len()`` = vocabulary size, and ``apply_chat_template`` for
    chats); it may be None only for pre-tokenized records.
    Checks that do not depend on other records only (:func:`check_record`, then the tokenizer's):
    id uniqueness and metadata types across a run are :class:`RunState`'s job. A text longer
    than ``spec.max_tokens`` is cut by characters before it is tokenized (see ``_encode_text``).
    Raises :class:`InputError` (message starts with the location, names the field) for a bad
    record, :class:`ConfigError` when the tokenizer cannot handle the record at all (no chat
    template, no tokenizer for text).
    """
    location = location_of(shard, position)
    kind = check_record(record, spec, location)
    content_field = record_field(spec, kind.fields[-1])  # the field the loss is taken on
    if tokenizer is None and kind.name != "tokens":
        raise ConfigError(f"{location}: field {content_field!r} needs a tokenizer; none was given")
    value = record[content_field]
    hashed: dict[str, Any]
    if kind.name == "text":
        input_ids = _encode_text(tokenizer, value, add_special_tokens=True, max_tokens=spec.max_tokens)
        labels, hashed = list(input_ids), {"text": value}
    elif kind.name == "completion":
        input_ids, labels, hashed = _completion_tokens(tokenizer, record[spec.prompt_field], value, spec, location)
    elif kind.name == "chat":
        input_ids, labels = _chat_tokens(tokenizer, value, content_field, location)
        hashed = {"messages": value}
    else:
        input_ids, labels, hashed = _token_labels(record, spec, tokenizer, location)
    if not input_ids:
        raise InputError(
            f"field {content_field!r}: empty document (it tokenizes to no tokens)",
            location=location,
            field=content_field,
        )
    truncated = spec.max_tokens is not None and len(input_ids) > spec.max_tokens
    if truncated:
        # Keep the first tokens; labels are cut at the same index so the mask stays aligned.
        input_ids = input_ids[: spec.max_tokens]
        labels = labels[: spec.max_tokens]
    num_loss_tokens = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
    if num_loss_tokens == 0:
        if truncated:
            why = f"after truncation to max_tokens={spec.max_tokens}"
        elif kind.name == "chat":
            why = "the conversation has no assistant turn with tokens"
        elif kind.name == "completion":
            why = "the completion adds no tokens to the prompt's"
        elif len(input_ids) < 2:
            why = "a single token has nothing before it to be predicted from"
        else:
            why = f"every label in {spec.labels_field!r} after the first is {IGNORE_INDEX}"
        raise InputError(
            f"field {content_field!r}: no loss tokens ({why}); the document cannot be attributed",
            location=location,
            field=content_field,
        )
    record_id = _record_id(record, spec, location)
    return Example(
        id=record_id if record_id is not None else stable_id(shard, position, _canonical_json(hashed)),
        shard=shard,
        position=position,
        input_ids=tuple(input_ids),
        labels=tuple(labels),
        metadata=_metadata(record, spec, location),
        num_tokens=len(input_ids),
        num_loss_tokens=num_loss_tokens,
        truncated=truncated,
        content=hashed,
    )
