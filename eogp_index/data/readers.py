"""Shard readers: find corpus shards and read their raw records, one at a time.

A *shard* is one file or one dataset directory of training documents. This module turns the
shard patterns a user passes into concrete paths (:func:`expand_shards`), names them in a way
that is stable across machines (:func:`shard_names`), and streams their records
(:func:`iter_raw_records`) without loading a whole shard into memory. Turning records into
token ids is :mod:`eogp_index.data.records`' job.

Supported formats (decided by the file name, see :func:`detect_format`):

* JSON Lines: ``.jsonl``, ``.json`` (one JSON object per line, *not* a JSON array), ``.ndjson``,
  each optionally compressed: ``.gz`` (gzip) or ``.zst`` / ``.zstd`` (Zstandard, multi-frame ok).
* Parquet: ``.parquet``, read with pyarrow one record batch at a time.
* A directory written by Hugging Face ``datasets.Dataset.save_to_disk``. A directory written
  by ``DatasetDict.save_to_disk`` must be given with a split: ``path/to/dir::train``.
* A dataset as Hugging Face users name it, read with ``datasets.load_dataset(..., streaming=True)``
  (format ``"dataset"``): a hub repository (``owner/name``, or ``hf://datasets/owner/name``), or
  a local dataset repository (a directory of data files, with or without a dataset card) that is
  not ``save_to_disk`` output. It is given with its split, and its config when it has several:
  ``owner/name::train`` or ``owner/name::config/train`` (:func:`with_split`).
* From Python, a ``datasets.Dataset`` or ``datasets.IterableDataset`` object (format
  ``"memory"``), read in its iteration order and named by :func:`dataset_shard`. Its documents
  cannot be read back later from anywhere but their stored text.

Positions and locations:

* ``position`` is 0-based: the line index for JSON Lines (blank lines are skipped but still
  counted, so ``position`` is always the physical line index), the row index for Parquet and
  Hugging Face datasets.
* A *location* (what error messages show, :func:`location_of`) is ``"<shard>:<line>"`` with a
  **1-based** line number for JSON Lines, as editors and ``sed -n`` show it, and
  ``"<shard>:row <position>"`` with the 0-based row index for Parquet and datasets directories,
  as pyarrow and ``datasets`` index them.

Errors: a malformed JSON line (invalid JSON, invalid UTF-8, a JSON value that is not an
object) does not stop reading: the reader yields a :class:`ParseError` for that position, naming
the column where the line goes wrong, and goes on. A compressed stream that breaks off
(truncated or corrupt) ends the shard: the records read so far are yielded, then one
:class:`ParseError` at the first line not read, saying that it and every line after it could
not be read. Problems with a whole shard (missing, unsupported format, unreadable Parquet, a
``DatasetDict`` without a split) raise :class:`~eogp_index.errors.InputError`.

Fields whose value is JSON ``null`` / Arrow null are passed through as ``None``; the record
layer treats them as absent (a Parquet file mixing text and chat rows has nulls in the
columns a row does not use).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NamedTuple

from eogp_index.data.records import (  # noqa: F401  (location_of re-exported)
    COMPRESSION_SUFFIXES as _COMPRESSION_SUFFIXES,
)
from eogp_index.data.records import (
    JSONL_SUFFIXES as _JSONL_SUFFIXES,
)
from eogp_index.data.records import (
    SPLIT_SEPARATOR,
    location_of,
)
from eogp_index.errors import InputError

__all__ = [
    "DatasetShard",
    "ShardFormat",
    "ParseError",
    "RawRecord",
    "dataset_shard",
    "detect_format",
    "expand_shards",
    "is_dataset_object",
    "iter_raw_records",
    "location_of",
    "shard_list",
    "shard_names",
    "split_shard_spec",
]

ShardFormat = Literal["jsonl", "parquet", "hf", "dataset", "memory"]

#: How the hub's file system names a dataset repository (``huggingface_hub``'s ``HfFileSystem``).
HUB_PREFIX = "hf://datasets/"
_REPO_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

#: Separates a ``DatasetDict`` directory from the split to read: ``data/dd::train``.

_PARQUET_BATCH_ROWS = 1024
_HF_BATCH_ROWS = 1024


@dataclass(frozen=True)
class ParseError:
    """A record that could not be read (not an exception: readers yield it and go on).

    ``location`` is ``"<shard>:<line>"`` (1-based line); ``reason`` says what is wrong with it.
    """

    location: str
    reason: str

    def to_error(self) -> InputError:
        """The :class:`InputError` to raise for this record."""
        return InputError(self.reason, location=self.location, reason=self.reason)


class RawRecord(NamedTuple):
    """One record as read from a shard, before tokenization.

    shard: the shard name (see :func:`shard_names`; by default the file or directory name).
    position: 0-based line index (JSON Lines) or row index (Parquet, datasets directory).
    record: the decoded JSON object / row as a ``dict``, or a :class:`ParseError`.
    """

    shard: str
    position: int
    record: dict[str, Any] | ParseError


#: The ``datasets`` iterables that keep a stream's records in its order and count, one per record
#: (anything else, such as a shuffle, skip, take or filter, gives other positions than the dataset's
#: info names).
_ORDER_KEEPING_ITERABLES = frozenset(
    {
        "ExamplesIterable",
        "ArrowExamplesIterable",
        "RebatchedArrowExamplesIterable",
        "MappedExamplesIterable",
        "SelectColumnsIterable",
        "FormattedExamplesIterable",
        "TypedExamplesIterable",
    }
)


@dataclass(frozen=True, eq=False)
class DatasetShard:
    """A ``datasets.Dataset`` or ``datasets.IterableDataset`` passed from Python, read as one shard.

    dataset: the dataset object, streamed record by record in its iteration order (a record's
        position is its index in that order). name: the shard name, which goes into ids,
        locations and ``sources.json`` in place of a file name (see :func:`dataset_shard`).
    """

    dataset: Any
    name: str

    def __fspath__(self) -> str:  # what messages show for it
        return f"<{type(self.dataset).__name__} {self.name}>"

    def describe(self) -> dict[str, Any]:
        """What is known of the dataset, for ``sources.json``: its type, the name, config and split
        its info records, and for a ``Dataset`` its row count and ``datasets`` fingerprint."""
        info = getattr(self.dataset, "info", None)
        split = getattr(self.dataset, "split", None)
        known = {
            "type": type(self.dataset).__name__,
            "dataset_name": getattr(info, "dataset_name", None),
            "config_name": getattr(info, "config_name", None),
            "split": None if split is None else str(split),
        }
        if hasattr(self.dataset, "num_rows"):
            known["num_rows"] = int(self.dataset.num_rows)
            known["fingerprint"] = getattr(self.dataset, "_fingerprint", None)
        return known


def is_dataset_object(value: Any) -> bool:
    """Whether ``value`` is a ``datasets.Dataset`` or ``datasets.IterableDataset`` (without
    importing ``datasets``: an object of it exists only once it is imported)."""
    import sys

    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(value, (datasets.Dataset, datasets.IterableDataset))


def dataset_shard(dataset: Any, name: str | None = None) -> DatasetShard:
    """A dataset object as a shard: ``run_ingest(index, [dataset_shard(ds, "my-corpus")])``.

    dataset: a ``datasets.Dataset`` or ``datasets.IterableDataset``; passed as it is in a shard
        list, it is named from its info.
    name: the shard name. None names it from the dataset's info as a dataset read by name is
        named (``c4::en/train``: ``info.dataset_name``, then ``config_name`` unless ``default``,
        then ``split``), when the info has a name and a split and the dataset holds the split as it
        was loaded (no shuffle, filter, skip, take or select: those give other records at the
        info's positions, or fewer).
    Raises :class:`InputError` for anything else, or a dataset with no stable name: it must be
    given one, as the same name must name the same records in every run (it goes into ids and
    what "already stored" means).
    """
    if isinstance(dataset, DatasetShard):
        return dataset if name is None else DatasetShard(dataset.dataset, _checked_name(name))
    if _is_dataset_dict(dataset):
        raise InputError(
            f"a {type(dataset).__name__} holds several splits [{', '.join(dataset)}]; pass one of them, "
            "e.g. dataset['train']"
        )
    if not is_dataset_object(dataset):
        raise InputError(
            f"a shard is a path, a glob or a datasets.Dataset / IterableDataset, not a {type(dataset).__name__}"
        )
    if name is not None:
        return DatasetShard(dataset, _checked_name(name))
    derived, why = _name_from_info(dataset)
    if derived is None:
        raise InputError(
            f"this {type(dataset).__name__} has no stable name ({why}); a shard name goes into ids and "
            "what a rerun skips as already stored, so name it, the same in every run: "
            "dataset_shard(dataset, 'my-corpus') from eogp_index.data.readers"
        )
    return DatasetShard(dataset, derived)


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        raise InputError(f"a dataset's shard name must be a non-empty one-line str, got {name!r}")
    return name


def _name_from_info(dataset: Any) -> tuple[str | None, str]:
    """The name the dataset's info gives it, or None and why it gives none."""
    info = getattr(dataset, "info", None)
    dataset_name, config = getattr(info, "dataset_name", None), getattr(info, "config_name", None)
    split = getattr(dataset, "split", None)
    if not dataset_name or split is None:
        return None, (
            "its info records no dataset name and split, as for one built with from_list or to_iterable_dataset"
        )
    split = str(split)
    if hasattr(dataset, "num_rows"):
        sizes = getattr(info, "splits", None) or {}
        recorded = sizes.get(split)
        if (
            getattr(dataset, "_indices", None) is not None
            or recorded is None
            or recorded.num_examples != dataset.num_rows
        ):
            return None, (
                f"it is not split {split!r} of {dataset_name} as loaded (shuffled, filtered or a "
                "selection), so its positions are not that split's"
            )
    else:
        iterable = getattr(dataset, "_ex_iterable", None)
        while iterable is not None:
            if type(iterable).__name__ not in _ORDER_KEEPING_ITERABLES:
                return None, (
                    f"it is not split {split!r} of {dataset_name} as streamed (it goes through "
                    f"{type(iterable).__name__}), so its positions are not that split's"
                )
            iterable = getattr(iterable, "ex_iterable", None)
        if getattr(dataset, "_distributed", None) is not None:
            return None, "it is one node's part of the split (split_dataset_by_node)"
    config = f"{config}/" if config and config != "default" else ""
    return f"{dataset_name}{SPLIT_SEPARATOR}{config}{split}", ""


def shard_list(patterns: Any) -> list[str | Path | DatasetShard]:
    """``patterns`` as a list of shards: one path, glob or dataset is a list of one; dataset
    objects become :class:`DatasetShard` named by :func:`dataset_shard`."""
    if isinstance(patterns, (str, Path, DatasetShard)) or is_dataset_object(patterns) or _is_dataset_dict(patterns):
        patterns = [patterns]
    return [p if isinstance(p, (str, Path, DatasetShard)) else dataset_shard(p) for p in patterns]


def _is_dataset_dict(value: Any) -> bool:
    import sys

    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(value, (datasets.DatasetDict, datasets.IterableDatasetDict))


def split_shard_spec(path: str | Path) -> tuple[Path, str | None]:
    """Split ``"dir::split"`` into ``(Path("dir"), "split")``; ``(path, None)`` without a split."""
    text = os.fspath(path)
    base, sep, split = text.rpartition(SPLIT_SEPARATOR)
    if not sep:
        return Path(text), None
    if not base or not split:
        raise InputError(
            f"bad shard {text!r}: write a datasets directory with its split as 'path/to/dir::train'",
            location=text,
        )
    return Path(base), split


def dataset_source(text: str | Path) -> str | None:
    """What ``datasets.load_dataset`` is given for a shard's base, when it names a dataset:
    ``owner/name`` for ``hf://datasets/owner/name`` or a repository name that is no local path,
    the directory for a local dataset repository; None for anything else (files,
    ``save_to_disk`` directories, globs)."""
    text = re.sub(r"^hf:/+datasets/", HUB_PREFIX, os.fspath(text))  # a Path keeps one slash of '//'
    if text.startswith(HUB_PREFIX):
        return text[len(HUB_PREFIX) :].strip("/")
    base = Path(text)
    if base.is_dir():
        saved = (base / "dataset_dict.json").is_file() or (base / "state.json").is_file()
        return None if saved else text
    if not base.exists() and not glob.has_magic(text) and _REPO_NAME.fullmatch(text) and not _looks_like_file(text):
        return text
    return None


def _looks_like_file(text: str) -> bool:
    """A missing ``dir/file.jsonl`` is a missing file, not a hub repository."""
    name = text.lower()
    return name.endswith((*_JSONL_SUFFIXES, ".parquet", *_COMPRESSION_SUFFIXES))


def with_split(pattern: str, split: str | None, config: str | None) -> str:
    """A dataset shard spec: ``pattern::split`` or ``pattern::config/split`` (``--split``, ``--config``).

    Raises :class:`InputError` when ``pattern`` names no dataset, or no split is given for one.
    """
    if dataset_source(pattern) is None:
        raise InputError(
            "--split and --config apply to datasets (a hub repository such as owner/name, "
            "hf://datasets/owner/name, or a local dataset directory); this is a file or glob",
            location=pattern,
        )
    if split is None:
        raise InputError("a dataset is read one split at a time: give --split (e.g. --split train)", location=pattern)
    return f"{pattern}{SPLIT_SEPARATOR}{config + '/' if config else ''}{split}"


def detect_format(path: str | Path) -> tuple[ShardFormat, Literal["gzip", "zstd"] | None]:
    """The format and compression of a shard, from its name (and, for directories, contents).

    Returns ``(format, compression)``; compression is only ever set for ``"jsonl"``.
    Raises :class:`InputError` for a missing path or an unsupported name.
    """
    if isinstance(path, DatasetShard):
        return "memory", None
    base, split = split_shard_spec(path)
    shown = os.fspath(path)
    if dataset_source(base) is not None:
        if split is None:
            raise InputError(
                f"is a dataset: name its split as '{shown}::train' (--split; --config for a config)", location=shown
            )
        return "dataset", None
    if base.is_dir():
        if (base / "dataset_dict.json").is_file():
            return "hf", None
        if (base / "state.json").is_file() and (base / "dataset_info.json").is_file():
            if split is not None:
                raise InputError(
                    f"{base} holds a single Dataset, not a DatasetDict; drop the '::{split}' suffix",
                    location=shown,
                )
            return "hf", None
        raise InputError(
            "is a directory but not one written by datasets' save_to_disk (no state.json or "
            "dataset_dict.json); to read the files in it pass a glob such as "
            f"'{base}/*.jsonl'",
            location=shown,
        )
    if split is not None:
        raise InputError(
            "the '::split' suffix is only for directories written by DatasetDict.save_to_disk",
            location=shown,
        )
    if not base.exists():
        raise InputError("no such file or directory", location=shown)
    name = base.name.lower()
    compression = None
    for suffix, kind in _COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            compression = kind
            name = name[: -len(suffix)]
            break
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl", compression  # type: ignore[return-value]
    if name.endswith(".parquet") and compression is None:
        return "parquet", None
    raise InputError(
        "unsupported shard format; expected .jsonl/.json/.ndjson (optionally .gz or .zst), "
        ".parquet, or a directory written by datasets' save_to_disk",
        location=shown,
    )


def expand_shards(patterns: Sequence[str | Path]) -> list[Path]:
    """Resolve shard paths and glob patterns into a sorted, deduplicated list of shards.

    patterns: file or directory paths, or globs (``*``, ``?``, ``[...]``, ``**`` recursive).
        A ``::split`` suffix selects a split of a ``DatasetDict`` directory and is kept on the
        returned path (``Path("data/dd::train")``). Dataset objects and :class:`DatasetShard`
        are shards as they are (see :func:`shard_list`).
    Returns the shards sorted by their path string (a dataset object's: its name), each listed
    once (duplicates found through different patterns or spellings of the same file are
    dropped). Every shard's format is checked here, so a stray file fails before any reading
    starts.
    Raises :class:`InputError` naming a pattern that matches nothing, or an unsupported file.
    """
    patterns = shard_list(patterns)
    if not patterns:
        raise InputError("no shards given: pass at least one shard path or glob pattern")
    found: dict[tuple[str, str | None], Path | DatasetShard] = {}
    for pattern in patterns:
        if isinstance(pattern, DatasetShard):
            found.setdefault((f"memory:{id(pattern.dataset)}", pattern.name), pattern)
            continue
        base, split = split_shard_spec(pattern)
        base_text = os.fspath(base)
        if glob.has_magic(base_text):
            matches = sorted(glob.glob(base_text, recursive=True))
            if not matches:
                raise InputError(f"shard pattern {os.fspath(pattern)!r} matches no file")
        else:
            if not base.exists() and dataset_source(base_text) is None:
                raise InputError(f"shard {os.fspath(pattern)!r} does not exist")
            matches = [base_text]
        for match in matches:
            shard = Path(match if split is None else f"{match}{SPLIT_SEPARATOR}{split}")
            detect_format(shard)
            key = (os.path.realpath(match), split)
            found.setdefault(key, shard)
    return sorted(found.values(), key=lambda shard: shard.name if isinstance(shard, DatasetShard) else os.fspath(shard))


def shard_names(paths: Sequence[str | Path], *, root: str | Path | None = None) -> list[str]:
    """Stable names for shards: what ids, locations and the store record instead of full paths.

    root None: each shard is named by its file or directory name (plus ``::split``), e.g.
        ``"train-00001.jsonl.zst"``, so the same data gives the same names (and ids) on every
        machine. Two shards with the same name in one run raise :class:`InputError`: pass root.
    root given: each shard is named by its POSIX path relative to root
        (``"web/train-00001.jsonl"``); every shard must lie under root.
    """
    names: list[str] = []
    root_path = Path(root).resolve() if root is not None else None
    for path in paths:
        if isinstance(path, DatasetShard):
            names.append(path.name)  # its own name, under a root too: it lies under none
            continue
        base, split = split_shard_spec(path)
        if root_path is None:
            name = base.name
        else:
            try:
                name = str(PurePosixPath(*base.resolve().relative_to(root_path).parts))
            except ValueError:
                raise InputError(f"shard {os.fspath(path)!r} is not under the shard root {os.fspath(root)!r}") from None
        names.append(name if split is None else f"{name}{SPLIT_SEPARATOR}{split}")
    seen: dict[str, Any] = {}
    for path, name in zip(paths, names):
        key = id(path.dataset) if isinstance(path, DatasetShard) else os.fspath(path)
        other = seen.setdefault(name, key)
        if other != key and isinstance(path, DatasetShard):
            raise InputError(
                f"two shards are named {name!r}; shard names must be unique in a run (they go into "
                "example ids): give each dataset its own name with dataset_shard(dataset, name)"
            )
        if other != key:
            raise InputError(
                f"shards {other!r} and {os.fspath(path)!r} have the same name {name!r}; "
                "shard names must be unique in a run (they go into example ids): pass a shard "
                "root so that they are named by their path relative to it"
            )
    return names


def iter_raw_records(path: str | Path, *, shard: str | None = None) -> Iterator[RawRecord]:
    """Stream the records of one shard, in file order.

    path: a shard file, a ``save_to_disk`` directory, ``dir::split`` for a ``DatasetDict``, a
        dataset repository's ``name::split``, or a :class:`DatasetShard`.
    shard: the name to report (default: the file or directory name, see :func:`shard_names`).
    Yields :class:`RawRecord` ``(shard, position, record)``; ``record`` is a ``dict`` or, for a
    malformed JSON line, a :class:`ParseError`.
    Raises :class:`InputError` for problems with the shard as a whole.
    """
    fmt, compression = detect_format(path)
    if shard is None:
        shard = shard_names([path])[0]
    if fmt == "jsonl":
        yield from _iter_jsonl(Path(path), shard, compression)
    elif fmt == "parquet":
        yield from _iter_parquet(Path(path), shard)
    elif fmt == "dataset":
        yield from _iter_dataset(path, shard)
    elif fmt == "memory":
        yield from _iter_memory(path, shard)  # type: ignore[arg-type]
    else:
        yield from _iter_hf(path, shard)


def _open_binary(path: Path, compression: str | None) -> io.BufferedIOBase:
    if compression == "gzip":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zstd":
        import zstandard

        raw = open(path, "rb")
        # read_across_frames: files written by concatenating compressed chunks (a common way
        # to append to .zst shards) hold several frames; without it reading stops at the first.
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)  # type: ignore[arg-type]
    return open(path, "rb")


def _iter_jsonl(path: Path, shard: str, compression: str | None) -> Iterator[RawRecord]:
    try:
        handle = _open_binary(path, compression)
    except OSError as exc:
        raise InputError(f"cannot open: {exc}", location=shard) from exc
    with handle:
        position = -1
        lines = iter(handle)
        while True:
            try:
                # Binary lines split on b"\n" only, unlike str.splitlines, which would also split
                # on U+2028 and friends inside a JSON string.
                line = next(lines)
            except StopIteration:
                return
            except Exception as exc:
                # A truncated or corrupt compressed stream (OSError, EOFError, zlib.error,
                # zstandard.ZstdError): the rest of the shard is unreadable. That is this shard's
                # error, at the first line not read: the lines before it were read, and the
                # other shards of a run are not concerned.
                reason = (
                    f"cannot read line {position + 2} or any after it: {type(exc).__name__}: {exc} "
                    f"(is the {compression or 'file'} stream truncated or corrupt? lines 1 to {position + 1} were read)"
                )
                yield RawRecord(shard, position + 1, ParseError(f"{shard}:{position + 2}", reason))
                return
            position += 1
            if position == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a UTF-8 byte order mark, as some Windows tools write
            if not line.strip():
                continue  # blank lines are skipped but still counted in positions
            location = f"{shard}:{position + 1}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(line[: exc.start].decode("utf-8")) + 1  # the characters before the bad byte, +1
                reason = f"line is not valid UTF-8 at column {column} (byte {exc.start + 1}): {exc.reason}"
                yield RawRecord(shard, position, ParseError(location, reason))
                continue
            try:
                # Without its line break: JSON counts it as a line of its own, and a line cut short
                # (a missing brace) would be reported at "line 2, column 1".
                value = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield RawRecord(shard, position, ParseError(location, _json_error(exc)))
                continue
            if not isinstance(value, dict):
                yield RawRecord(
                    shard,
                    position,
                    ParseError(
                        location,
                        f"line is a JSON {type(value).__name__}, not an object; JSON Lines "
                        "shards need one object per line (a .json file holding one array "
                        "must be converted to JSON Lines)",
                    ),
                )
                continue
            yield RawRecord(shard, position, value)


def _json_error(exc: json.JSONDecodeError) -> str:
    """A malformed JSON line's reason, at the column (1-based, in characters) where it goes wrong."""
    # The line is parsed without its line break, so colno (pos + 1) is the column in the line.
    # An unterminated string is reported where the string starts; the line runs out at its end.
    message, where = exc.msg.removesuffix(" at"), f"at column {exc.colno}"
    if message.startswith("Unterminated string"):
        where += f" (the line ends at column {len(exc.doc) + 1} without closing it)"
    return f"malformed JSON: {message} {where}: {_excerpt(exc.doc, exc.pos)}"


def _excerpt(line: str, pos: int, width: int = 20) -> str:
    """The text of ``line`` around offset ``pos``, quoted, with ``…`` where it is cut."""
    start, end = max(0, pos - width), min(len(line), pos + width)
    return f"{'…' if start else ''}{line[start:end]!r}{'…' if end < len(line) else ''}"


def _iter_parquet(path: Path, shard: str) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read Parquet file: {exc}", location=shard) from exc
    position = 0
    with parquet:
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as exc:
                raise InputError(f"cannot read Parquet rows from row {position}: {exc}", location=shard) from exc
            for row in batch.to_pylist():
                yield RawRecord(shard, position, row)
                position += 1


def _iter_hf(path: str | Path, shard: str) -> Iterator[RawRecord]:
    import datasets

    base, split = split_shard_spec(path)
    try:
        loaded = datasets.load_from_disk(os.fspath(base))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, pyarrow errors
        raise InputError(f"cannot load datasets directory: {exc}", location=shard) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded.keys())
        if split is None:
            raise InputError(
                f"is a DatasetDict with splits [{splits}]; pick one by passing '{os.fspath(base)}::<split>'",
                location=shard,
            )
        if split not in loaded:
            raise InputError(f"has no split {split!r}; its splits are [{splits}]", location=shard)
        dataset = loaded[split]
    else:
        dataset = loaded
    # A saved format (torch, numpy) would hand out tensors; records must be plain Python.
    yield from _iter_rows(dataset.with_format(None), shard)


def _iter_rows(dataset, shard: str) -> Iterator[RawRecord]:
    """A ``datasets.Dataset``'s rows in order, read in batches (a row at a time is slow)."""
    position = 0
    for batch in dataset.iter(batch_size=_HF_BATCH_ROWS):
        columns = list(batch.keys())
        for values in zip(*(batch[c] for c in columns)):
            yield RawRecord(shard, position, dict(zip(columns, values)))
            position += 1


def _iter_dataset(path: str | Path, shard: str) -> Iterator[RawRecord]:
    """A split of a hub or local dataset repository, streamed: records in the split's order, which
    is the order of its data files (so a record's position is the same in every run)."""
    import datasets

    base, split = split_shard_spec(path)
    source = dataset_source(base)
    config, _, split = (split or "").rpartition("/")
    try:
        stream = datasets.load_dataset(source, name=config or None, split=split, streaming=True)
    except Exception as exc:  # datasets raises ValueError, FileNotFoundError, hub errors
        raise InputError(
            f"cannot load split {split!r}{f' of config {config!r}' if config else ''} of dataset {source!r}: {exc}",
            location=shard,
        ) from exc
    for position, row in enumerate(stream):
        yield RawRecord(shard, position, dict(row))


def _iter_memory(source: DatasetShard, shard: str) -> Iterator[RawRecord]:
    """A dataset object's records in its iteration order, as plain Python (no torch / numpy format)."""
    dataset = source.dataset.with_format(None)
    if hasattr(dataset, "num_rows"):  # a Dataset: in batches, as a save_to_disk directory
        yield from _iter_rows(dataset, shard)
        return
    for position, row in enumerate(dataset):
        yield RawRecord(shard, position, dict(row))
