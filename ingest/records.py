"""Records of a corpus run: reading shards into examples, with checks across records.

Turning one record into an :class:`~eogp_index.data.records.Example` (text, chat or ids,
and the loss mask) is the library core's job, because queries need it too
(:mod:`eogp_index.data.records`); this module adds what only a corpus run needs: reading
shards in order, unique ids and consistent metadata types across records, and
:class:`Rejected` records in ``on_error="skip"`` mode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Optional

from eogp_index.data.readers import ParseError, expand_shards, iter_raw_records, shard_names
from eogp_index.data.records import (  # noqa: F401  (re-exported: the ingest layer's vocabulary)
    IGNORE_INDEX,
    Example,
    RecordSpec,
    _is_int,
    _type_name,
    check_text,
    location_of,
    stable_id,
    tokenize_record,
    tokenize_windows,
)
from eogp_index.errors import ConfigError, InputError

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "OnError",
    "RecordSpec",
    "Rejected",
    "RunState",
    "iter_examples",
    "stable_id",
    "tokenize_record",
    "tokenize_windows",
]

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class Rejected:
    """A record left out in ``on_error="skip"`` mode, and why.

    location: ``"train.jsonl:17"`` / ``"train.parquet:row 16"``; reason: the error message
    without the location. record_id: the ``id_field`` value when the record has a usable one,
    else None (stable ids are not computed for rejected records).
    """

    shard: str
    position: int
    location: str
    reason: str
    record_id: str | None = None


class RunState:
    """Checks across the records of one run: unique ids and consistent metadata types.

    :func:`iter_examples` uses one; a caller tokenizing records itself (e.g. in parallel) feeds
    every accepted :class:`Example` through one :meth:`admit` in the final order. It keeps each
    id seen (about 150 bytes per example).
    """

    def __init__(self) -> None:
        self._ids: dict[str, tuple[str, int]] = {}
        #: each metadata field's (is a list, scalar or item type, where it was fixed)
        self._types: dict[str, tuple[bool, Optional[type], str]] = {}

    def admit(self, example: Example) -> Example:
        """Check ``example`` against the earlier ones and register it.

        Returns the example, with int metadata converted to float in float fields.
        Raises :class:`InputError` (nothing is registered then) for a duplicate id or a
        metadata value whose type differs from the field's earlier values.
        """
        location = location_of(example.shard, example.position)
        first = self._ids.get(example.id)
        if first is not None:
            raise InputError(
                f"duplicate id {example.id!r}: already used by the record at "
                f"{location_of(*first)}; ids must be unique in a run",
                location=location,
                field="id",
            )
        metadata = dict(example.metadata)
        promoted = False
        new_types: dict[str, tuple[bool, Optional[type], str]] = {}
        for name, value in metadata.items():
            if value is None:
                continue  # a null fits every type
            is_list, kind = _kind_of(value)
            if kind is object:
                raise InputError(
                    f"field {name!r}: metadata list {value!r} mixes item types; the items of a list field "
                    "share one type (str, int, float or bool)",
                    location=location,
                    field=name,
                )
            known = self._types.get(name)
            if known is None:
                new_types[name] = (is_list, kind, location)
                continue
            expected_list, expected, where = known
            if is_list == expected_list:
                if kind is None or kind is expected:
                    continue  # (an empty or all-null list fits every list field)
                if expected is None:  # a list field's first typed items
                    new_types[name] = (is_list, kind, location)
                    continue
                if expected is float and kind is int:  # documented promotion: int -> float only
                    metadata[name] = [None if v is None else float(v) for v in value] if is_list else float(value)
                    promoted = True
                    continue
            hint = (
                " (write the first value as a float, e.g. 3.0, to make the field a float)"
                if expected is int and kind is float and is_list == expected_list
                else ""
            )
            raise InputError(
                f"field {name!r}: metadata value {value!r} is {_kind_name(is_list, kind)}, but the field is "
                f"{_kind_name(expected_list, expected)} (fixed by its first value, at {where}); every record "
                f"must use the same type{hint}",
                location=location,
                field=name,
            )
        self._types.update(new_types)
        self._ids[example.id] = (example.shard, example.position)
        if promoted:
            example = replace(example, metadata=metadata)
        return example


def _kind_of(value: Any) -> tuple[bool, Optional[type]]:
    """(is a list, the type of its scalars) of a metadata value; None for a null or an all-null list."""
    if isinstance(value, list):
        kinds = [type(item) for item in value if item is not None]
        for kind in kinds:
            if kind is not kinds[0] and {kind, kinds[0]} != {int, float}:
                return True, object  # mixed items: no field type takes them
        return True, (float if float in kinds else kinds[0]) if kinds else None
    return False, None if value is None else type(value)


def _kind_name(is_list: bool, kind: Optional[type]) -> str:
    name = "mixed" if kind is object else kind.__name__ if kind is not None else "null"
    return f"a list of {name}" if is_list else name


def iter_examples(
    paths: Sequence[str | Path] | str | Path,
    spec: RecordSpec,
    tokenizer: Any,
    *,
    on_error: OnError = "raise",
    shard_root: str | Path | None = None,
) -> Iterator[Example | Rejected]:
    """Read, tokenize and check every record of the given shards, in order.

    paths: shard paths or globs (see :func:`eogp_index.data.readers.expand_shards`); read in sorted
        path order, records in file order.
    spec: the :class:`RecordSpec`; tokenizer: see :func:`tokenize_record`.
    on_error: "raise" raises the :class:`InputError` of the first bad record; "skip" yields a
        :class:`Rejected` for each bad record (malformed line, bad field, duplicate id,
        metadata type clash) and goes on. A compressed shard that breaks off (truncated or
        corrupt) is that shard's error: its records read before the break are kept, the first
        line not read is the error (rejected, naming the lines lost), and the next shards are
        read. Problems with a whole shard (missing, unsupported) and :class:`ConfigError`
        (e.g. no chat template) raise in both modes.
    shard_root: None names shards by file name; a directory names them by their path
        relative to it (see :func:`eogp_index.data.readers.shard_names`). Shard names go into ids.
    Yields :class:`Example` (and :class:`Rejected` in skip mode).
    """
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if not isinstance(spec, RecordSpec):
        raise ConfigError(f"spec must be a RecordSpec, got {_type_name(spec)}")
    if isinstance(paths, (str, Path)):
        paths = [paths]
    shards = expand_shards(paths)
    names = shard_names(shards, root=shard_root)
    state = RunState()
    for path, name in zip(shards, names):
        for shard, position, record in iter_raw_records(path, shard=name):
            try:
                if isinstance(record, ParseError):
                    raise record.to_error()
                examples = [
                    state.admit(example)
                    for example in tokenize_windows(
                        record, shard=shard, position=position, spec=spec, tokenizer=tokenizer
                    )
                ]
            except InputError as exc:
                if on_error == "raise":
                    raise
                yield Rejected(
                    shard=shard,
                    position=position,
                    location=exc.location or location_of(shard, position),
                    reason=exc.reason,
                    record_id=_peek_id(record, spec),
                )
                continue
            yield from examples


def _peek_id(record: Any, spec: RecordSpec) -> str | None:
    if spec.id_field is None or not isinstance(record, dict):
        return None
    value = record.get(spec.id_field)
    if _is_int(value):
        return str(value)
    if isinstance(value, str) and value:
        try:
            return check_text(value, spec.id_field)
        except InputError:  # not text: the rejects file names the record by its location only
            return None
    return None
