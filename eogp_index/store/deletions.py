"""Takedowns: rows deleted from an index, the record of each deletion, and their physical erasure.

A takedown (``eogp delete``; :func:`eogp_index.search.takedown.delete` runs the steps) removes
rows from the table with Lance deletes (deletion files: the rows leave every answer at the next
table version) and, with ``purge``, erases them physically. Two files of the index record it
(schemas/deletions.md):

``deletions.jsonl``
    one line per deleted id, appended: ``{"format_version", "id", "content_sha256",
    "deleted_at", "reason", "request"}``; never the document's text. A later ingest skips a
    record whose id or content hash is listed (:class:`DeletedSet`), unless told otherwise.
``deletions-pending.json``
    the takedown in progress: written first (the intent: which rows, why, purge or not), updated
    after each step, removed last. A takedown killed at any point is completed by the next one
    (every step is idempotent: the log skips lines it has, Lance deletes of absent rows delete
    nothing, compaction and cleanup find nothing left).

All file access of this module goes through :func:`_read_text`, :func:`_write_atomic`,
:func:`_append_lines` and :func:`_remove_tree` (one place to move to another file system).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from eogp_index.data.location import IndexPath, is_remote, remove_tree, write_atomic
from eogp_index.data.location import index_path as as_index_path
from eogp_index.errors import InputError
from eogp_index.store.stored_ids import sql_string
from eogp_index.store.table import Store

DELETIONS_FILE = "deletions.jsonl"
PENDING_FILE = "deletions-pending.json"
DELETIONS_FORMAT_VERSION = 1
PENDING_FORMAT = "eogp-takedown"
#: The steps of a takedown, in order; a purge runs them all, a plain delete the first three.
STEPS = ("recorded", "logged", "deleted", "compacted", "cleaned", "hot", "first-passes", "caches")
PURGE_STEPS = STEPS[3:]
#: Ids per Lance delete predicate (``id IN (...)``): a long predicate is parsed per fragment.
IDS_PER_DELETE = 512
#: Folders of an index that hold copies of document text or codes besides the table, the hot
#: copy and the first passes: block ingest's cache and a finished fit's leftover stage files.
CACHE_DIRS = ("ingest-cache", "fit/coords", "fit/pca")
REJECTS_DIR = "rejects"
#: The fit's record of its fitting documents (eogp_index.fit.cache).
FITTING_SET = "fit/fitting_set.json"


# -- file access ---------------------------------------------------------------------------------------
def _read_text(path: IndexPath) -> Optional[str]:
    try:
        return as_index_path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def _write_atomic(path: IndexPath, text: str) -> None:
    """Write ``text`` whole: renamed into place on a disk, one PUT in an object store."""
    write_atomic(as_index_path(path), text)


def _append_lines(path: IndexPath, lines: Sequence[str]) -> None:
    """Append whole lines, flushed to disk before returning (an object cannot be appended to: it
    is written again whole, with the new lines)."""
    if not lines:
        return
    path = as_index_path(path)
    if is_remote(path):
        _write_atomic(path, (_read_text(path) or "") + "".join(line + "\n" for line in lines))
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
        handle.flush()
        os.fsync(handle.fileno())


def _remove_tree(path: IndexPath) -> bool:
    """Remove a file or folder; whether there was one."""
    path = as_index_path(path)
    if path.is_dir():
        remove_tree(path)
        return True
    if path.exists():
        path.unlink()
        return True
    return False


# -- the log ---------------------------------------------------------------------------------------------
def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second (``2026-01-31T12:00:00Z``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_log(index_path: Path) -> List[Dict[str, Any]]:
    """The lines of ``deletions.jsonl`` (empty without one); a torn last line (a kill mid-append)
    is skipped: the pending takedown that wrote it appends it again."""
    text = _read_text(as_index_path(index_path) / DELETIONS_FILE)
    entries = []
    for line in (text or "").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            entries.append(entry)
    return entries


def read_pending(index_path: Path) -> Optional[Dict[str, Any]]:
    """The takedown in progress (``deletions-pending.json``), or None."""
    text = _read_text(as_index_path(index_path) / PENDING_FILE)
    if text is None:
        return None
    try:
        pending = json.loads(text)
    except ValueError as exc:  # written atomically, so only a foreign file
        raise InputError(
            f"{as_index_path(index_path) / PENDING_FILE} is not a takedown record ({exc}); remove it and run the "
            "`eogp delete` again"
        ) from exc
    return pending


def write_pending(index_path: Path, pending: Dict[str, Any]) -> None:
    _write_atomic(as_index_path(index_path) / PENDING_FILE, json.dumps(pending, indent=1) + "\n")


def finish_pending(index_path: Path) -> None:
    """The takedown is complete: its record goes (the log keeps what was deleted)."""
    _remove_tree(as_index_path(index_path) / PENDING_FILE)


def log_entries(index_path: Path, pending: Dict[str, Any]) -> int:
    """Append the pending takedown's rows to ``deletions.jsonl``, those not there yet; how many."""
    logged = {(e.get("request"), e["id"]) for e in read_log(index_path)}
    lines = [
        json.dumps(
            {
                "format_version": DELETIONS_FORMAT_VERSION,
                "id": row["id"],
                "content_sha256": row.get("content_sha256"),
                "deleted_at": pending["requested_at"],
                "reason": pending.get("reason"),
                "request": pending["request"],
            },
            ensure_ascii=False,
        )
        for row in pending["rows"]
        if (pending["request"], row["id"]) not in logged
    ]
    _append_lines(as_index_path(index_path) / DELETIONS_FILE, lines)
    return len(lines)


@dataclass(frozen=True)
class DeletedSet:
    """The ids and content hashes an index's takedowns name (the log and a pending takedown):
    what an ingest skips as deleted."""

    ids: frozenset = field(default_factory=frozenset)
    hashes: frozenset = field(default_factory=frozenset)

    @classmethod
    def load(cls, index_path: Path) -> "DeletedSet":
        rows: List[Dict[str, Any]] = list(read_log(index_path))
        pending = read_pending(index_path)
        if pending is not None:
            rows += list(pending.get("rows", []))
        return cls(
            ids=frozenset(r["id"] for r in rows),
            hashes=frozenset(r["content_sha256"] for r in rows if r.get("content_sha256")),
        )

    def __bool__(self) -> bool:
        return bool(self.ids)

    def matches(self, example: Any) -> bool:
        """Whether ``example`` (an :class:`~eogp_index.data.records.Example`) was taken down: its
        id, or its content's SHA-256 (the row's ``content_sha256``), is listed."""
        if example.id in self.ids:
            return True
        return bool(self.hashes) and example.content_sha256 in self.hashes


def deleted_set(index_path: Path, *, allow_deleted: bool = False) -> Optional[DeletedSet]:
    """What an ingest into ``index_path`` skips as deleted; None with ``allow_deleted`` or when
    nothing was ever deleted."""
    if allow_deleted:
        return None
    found = DeletedSet.load(index_path)
    return found if found else None


# -- the rows --------------------------------------------------------------------------------------------
def _chunks(values: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def id_predicate(ids: Sequence[str]) -> str:
    """``id IN ('a', 'b')``: the SQL filter of exactly these ids."""
    return "id IN (" + ", ".join(sql_string(i) for i in ids) + ")"


def stored_rows(store: Store, *, where: Optional[str] = None, ids: Optional[Sequence[str]] = None):
    """``[{"id", "content_sha256"}]`` of the stored rows matching ``where`` or among ``ids``
    (``content_sha256`` None on a format-1 table, which has no such column)."""
    if store.table is None:
        return []
    columns = ["id"] + (["content_sha256"] if "content_sha256" in store.schema.names else [])
    if where is not None:
        tables = [store.read(columns, where)]
    else:
        tables = [store.read(columns, id_predicate(list(chunk))) for chunk in _chunks(list(ids or []), IDS_PER_DELETE)]
    rows = [row for table in tables for row in table.to_pylist()]
    return [{"id": row["id"], "content_sha256": row.get("content_sha256")} for row in rows]


def delete_rows(store: Store, ids: Sequence[str]) -> int:
    """Lance-delete the rows of ``ids`` (deletion files, one commit per :data:`IDS_PER_DELETE`
    ids); how many rows were deleted (0 for ids already gone)."""
    if store.table is None or not ids:
        return 0
    deleted = 0
    for chunk in _chunks(list(ids), IDS_PER_DELETE):
        predicate = id_predicate(list(chunk))
        before = store.count(predicate)
        if before:
            store.dataset().delete(predicate)
            store.refresh(force=True)
            deleted += before
    return deleted


def pending_deletions(store: Store) -> int:
    """Rows of the latest version deleted but still in data files (deletion files): what a purge erases."""
    dataset = store.table
    return sum(int(f.num_deletions) for f in dataset.get_fragments()) if dataset is not None else 0


# -- purging ---------------------------------------------------------------------------------------------
def compact_deleted(store: Store, target_rows: int) -> Dict[str, int]:
    """Rewrite every fragment with deleted rows without them (Lance compaction with deletions
    materialized at any fraction); scalar indexes are remapped to the rewritten rows."""
    dataset = store.table
    if dataset is None:
        return {"fragments_removed": 0, "fragments_added": 0}
    metrics = dataset.optimize.compact_files(
        target_rows_per_fragment=target_rows, materialize_deletions=True, materialize_deletions_threshold=0.0
    )
    store.refresh(force=True)
    if store.index_names():
        store.dataset().optimize.optimize_indices()
        store.refresh(force=True)
    return {"fragments_removed": int(metrics.fragments_removed), "fragments_added": int(metrics.fragments_added)}


def remove_old_versions(store: Store) -> Dict[str, int]:
    """Remove every table version but the latest, and every file no version uses (zero retention,
    unverified files too: the caller holds the ingest lock, so no writer has files in flight)."""
    dataset = store.table
    if dataset is None:
        return {"versions_removed": 0, "bytes_removed": 0}
    stats = dataset.cleanup_old_versions(
        older_than=timedelta(0), delete_unverified=True, error_if_tagged_old_versions=False
    )
    store.cleaned_at = time.monotonic()
    store.refresh(force=True)
    return {"versions_removed": int(stats.old_versions), "bytes_removed": int(stats.bytes_removed)}


def rebuild_hot(stored, hot_dir: Path) -> int:
    """Remove the hot copy's saved segments and write it again, as one segment of the current
    version (no segment of an older version survives); its rows."""
    _remove_tree(hot_dir)
    stored.store.settle()
    return stored.hot_codes(consolidate=True).num_rows


def purge_caches(index_path: IndexPath, ids: Iterable[str], cache_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Remove the caches that may hold deleted documents' coordinates (:data:`CACHE_DIRS`, in the
    index and in its local ``cache_dir`` when it has one apart) and the rejects files' lines about
    deleted ids; what was removed."""
    index_path = as_index_path(index_path)
    removed = [name for name in CACHE_DIRS if _remove_tree(index_path / name)]
    if cache_dir is not None and str(cache_dir) != str(index_path):
        removed += [f"{cache_dir}/{name}" for name in CACHE_DIRS if _remove_tree(Path(cache_dir) / name)]
    wanted = set(ids)
    rewritten = 0
    rejects = index_path / REJECTS_DIR
    for path in sorted(rejects.glob("*.jsonl"), key=str) if rejects.is_dir() else []:
        lines = (_read_text(path) or "").splitlines()
        kept = [line for line in lines if _rejected_id(line) not in wanted]
        if len(kept) != len(lines):
            _write_atomic(path, "".join(line + "\n" for line in kept))
            rewritten += 1
    return {"removed": removed, "rejects_rewritten": rewritten}


def _rejected_id(line: str) -> Optional[str]:
    try:
        return json.loads(line).get("record_id")
    except (ValueError, AttributeError):
        return None


# -- what eogp info says -------------------------------------------------------------------------------
def fitting_ids(index_path: Path) -> Dict[str, set]:
    """The ids that fitted the index, per set (``curvature``, ``pca``, ``pca_held_out``), from
    ``fit/fitting_set.json`` (empty when the fit left no record)."""
    text = _read_text(as_index_path(index_path) / FITTING_SET)
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        record = {}
    return {name: {entry[0] for entry in record.get(name, [])} for name in ("curvature", "pca", "pca_held_out")}


def deletions_info(index_path: Path, store: Store) -> Dict[str, Any]:
    """``eogp info``'s ``deletions``: ids taken down, rows awaiting a purge, which deleted ids
    fitted the curvature or the projection, and a takedown left unfinished."""
    log = read_log(index_path)
    ids = {entry["id"] for entry in log}
    fitted = fitting_ids(index_path)
    in_fit = {name: sorted(ids & members) for name, members in fitted.items() if ids & members}
    pending = read_pending(index_path)
    return {
        "ids": len(ids),
        "requests": len({entry.get("request") for entry in log}),
        "awaiting_purge": pending_deletions(store),
        "fitting_set_recorded": (as_index_path(index_path) / FITTING_SET).exists(),
        "in_fitting_set": in_fit,
        "pending": None if pending is None else {"request": pending["request"], "steps": pending.get("steps", [])},
    }


def new_pending(rows: Sequence[Dict[str, Any]], *, reason: Optional[str], purge: bool) -> Dict[str, Any]:
    """The record of a takedown about to start (:data:`PENDING_FILE`)."""
    return {
        "format": PENDING_FORMAT,
        "format_version": DELETIONS_FORMAT_VERSION,
        "request": uuid.uuid4().hex,
        "requested_at": utc_now(),
        "reason": reason,
        "purge": bool(purge),
        "rows": list(rows),
        "steps": [],
    }
