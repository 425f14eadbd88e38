"""Where an index's documents came from: ``<index>/sources.json`` (index format 2).

Rows keep a shard *name* and a position; explaining a row needs the document itself, read back
from its shard when its text is not stored. Every ingest therefore records, before it stores a
row, where each shard lives (an absolute path or URI) and the record options it was read with,
and whether (and up to how many bytes) document text is stored in the table::

    {"format": "eogp-sources", "format_version": 1,
     "store_text": {"max_bytes": 65536} | null,
     "shards": {"train.jsonl.gz": {"uri": "/data/train.jsonl.gz",
                                   "record_spec": {"text_field": "text", ...}}}}

The file is rewritten atomically; a shard ingested again from elsewhere updates its entry.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Mapping, Optional

from eogp_index.data.location import index_path, write_atomic
from eogp_index.data.records import RecordSpec
from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError

SOURCES_FILE = "sources.json"
FORMAT = "eogp-sources"
FORMAT_VERSION = 1
#: Default cap on the stored text of one document (UTF-8 bytes); longer ones are read back from
#: their shard when explained.
DEFAULT_TEXT_BYTES = 64 << 10


class Sources:
    """The parsed ``sources.json`` of an index directory (empty before the first ingest)."""

    def __init__(self, index_dir, data: Optional[Dict[str, Any]] = None):
        self.path = index_path(index_dir) / SOURCES_FILE
        self.data = data or {"format": FORMAT, "format_version": FORMAT_VERSION, "store_text": None, "shards": {}}

    @classmethod
    def load(cls, index_dir) -> "Sources":
        path = index_path(index_dir) / SOURCES_FILE
        if not path.exists():
            return cls(index_dir)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise IncompatibleIndexError(f"{path}: not valid JSON ({exc}); restore it or re-ingest") from exc
        if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise IncompatibleIndexError(f"{path}: not an eogp sources file of version {FORMAT_VERSION}")
        return cls(index_dir, data)

    @property
    def store_text(self) -> Optional[int]:
        """The per-document cap on stored text in bytes, or None when text is not stored."""
        setting = self.data.get("store_text")
        return None if setting is None else int(setting["max_bytes"])

    def agree_store_text(self, max_bytes: Optional[int], *, table_exists: bool) -> None:
        """Record the text setting of the first ingest; refuse a later one that differs (the
        table's columns are fixed by its first rows)."""
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError(f"the stored-text cap must be at least 1 byte, got {max_bytes}")
        if not table_exists:
            self.data["store_text"] = None if max_bytes is None else {"max_bytes": int(max_bytes)}
            return
        if max_bytes != self.store_text:
            have = "without stored text" if self.store_text is None else f"with --store-text ({self.store_text} bytes)"
            want = "without --store-text" if max_bytes is None else f"with --store-text ({max_bytes} bytes)"
            raise ConfigError(
                f"this index's rows were ingested {have}; an ingest {want} would mix them. "
                "Use the same --store-text setting as the first ingest"
            )

    def record_shards(
        self,
        uris: Mapping[str, Optional[str]],
        spec: RecordSpec,
        *,
        datasets: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        """Remember each shard's location and the record options it is read with.

        uris: shard name -> where it lives; None for a dataset object passed from Python, which
            cannot be read back. datasets: for those, what is known of the dataset (its type,
            info name, config, split...), kept under ``"dataset"``. A shard recorded before with a
            location keeps it (the rows stored from there are still read back from there).
        """
        options = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "metadata_fields"}
        for name, uri in uris.items():
            entry: Dict[str, Any] = {"uri": None if uri is None else str(uri), "record_spec": options}
            if uri is None:
                entry["uri"] = self.data["shards"].get(name, {}).get("uri")
                entry["dataset"] = dict((datasets or {}).get(name, {}))
            self.data["shards"][name] = entry

    def shard(self, name: str) -> tuple[str, RecordSpec]:
        """Where shard ``name`` lives and how its records were read.

        Raises :class:`InputError` for a shard not recorded, or one ingested from a dataset object
        (nothing to read it back from)."""
        entry = self.data["shards"].get(name)
        if entry is None:
            raise InputError(
                f"{self.path} does not say where shard {name!r} lives (it was ingested by an older "
                "eogp-index); ingest it again to record it, or ingest with --store-text"
            )
        if entry["uri"] is None:
            kind = entry.get("dataset", {}).get("type", "dataset")
            raise InputError(
                f"shard {name!r} was ingested from a {kind} object in memory, which cannot be read back "
                "from anywhere, so its documents are only known from their stored text; ingest it with "
                "--store-text (store_text=N in run_ingest) to explain them, or ingest the dataset by its "
                "name or directory instead"
            )
        return entry["uri"], RecordSpec(**entry["record_spec"])

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=2) + "\n")  # a reader never sees half a file
