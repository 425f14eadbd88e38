"""A takedown end to end: rows deleted from every answer, recorded, and with ``purge`` erased.

:func:`delete` (``eogp delete``, ``AttributionIndex.delete``, ``DELETE /v1/examples``) runs the
steps of :mod:`eogp_index.store.deletions` under the index's ingest lock, so that no ingest
writes meanwhile:

1. ``recorded``: the rows to delete (ids and content hashes, resolved from ``where`` or
   ``ids``) and the reason are written to ``deletions-pending.json``;
2. ``logged``: one line per id is appended to ``deletions.jsonl``;
3. ``deleted``: Lance deletes the rows (deletion files). From the next table version on, no
   route answers them: the hot copy re-reads fragments with new deletions, the streaming routes
   read the table, and a first pass maps its hits to rows through the hot copy's ids, so a
   deleted row maps to none.

With ``purge``, the rows are also erased from every file of the index:

4. ``compacted``: fragments with deleted rows are rewritten without them (scalar indexes remapped);
5. ``cleaned``: every older table version and every file no version uses are removed;
6. ``hot``: the hot copy's saved segments are removed and written again from the table;
7. ``first-passes``: each first pass is rebuilt from the table (removed when no row is left,
   or when this eogp-index cannot rebuild its kind);
8. ``caches``: block ingest's cache and a fit's leftover stage files are removed, the
   rejects files lose their lines about deleted ids, and the held-out queries of the recall
   measurement (``recall_queries.safetensors``) lose deleted documents' coordinates.

The pending record is removed last. A takedown killed at any step is completed by the next call
(each step is idempotent), before that call's own rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from eogp_index.encode.commits import index_lock
from eogp_index.errors import ConfigError, EOGPError, InputError
from eogp_index.store import deletions
from eogp_index.store.maintenance import DEFAULT_TARGET_ROWS
from eogp_index.store.table_recall import drop_queries

HOT_DIR = "hot"


@dataclass(frozen=True)
class TakedownReport:
    """What :func:`delete` did.

    request: the takedown's id in ``deletions.jsonl`` (None: nothing was asked but a purge or a
    resume). ids: ids recorded. rows_deleted: rows Lance deleted (a resumed takedown's included).
    not_stored: ids recorded that no stored row has (a later ingest of them is skipped too).
    already_deleted: ids asked for that an earlier takedown recorded. purged: whether the rows were
    erased. resumed: the request id of an interrupted takedown this call completed first.
    first_passes: per first pass, ``rebuilt`` or why it was removed. steps: the steps run.
    table_version, rows: the table after.
    """

    request: Optional[str]
    ids: int
    rows_deleted: int
    not_stored: int
    already_deleted: int
    purged: bool
    resumed: Optional[str]
    first_passes: Dict[str, str]
    steps: List[str]
    table_version: int
    rows: int
    details: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One human line."""
        text = (
            f"deleted {self.rows_deleted} rows ({self.ids} ids recorded in {deletions.DELETIONS_FILE}"
            f"{f', {self.not_stored} not stored' if self.not_stored else ''}"
            f"{f', {self.already_deleted} deleted before' if self.already_deleted else ''})"
        )
        if self.resumed:
            text += f"; completed the interrupted takedown {self.resumed}"
        if self.purged:
            passes = ", ".join(f"{name} {what}" for name, what in self.first_passes.items())
            text += "; purged: table compacted, old versions removed, hot copy rewritten"
            text += f", first passes: {passes}" if passes else ""
        return text + f"; table version {self.table_version}, {self.rows} rows"


def read_ids_file(path) -> List[str]:
    """The ids of an ``--ids`` file: one per line, or JSON Lines whose objects have an ``id``
    (a line that starts with ``{`` is JSON); blank lines are skipped.

    Raises:
        InputError: a JSON line that is not an object with a string ``id``, naming its line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the ids file {path}: {exc}") from exc
    ids = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                value = json.loads(line).get("id")
            except (ValueError, AttributeError):
                value = None
            if not isinstance(value, str) or not value:
                raise InputError(
                    "a JSON line must be an object with a string 'id'; write one id per "
                    'line, or {"id": "..."} per line',
                    location=f"{path}:{number}",
                )
            line = value
        ids.append(line)
    return ids


def _targets(stored, where: Optional[str], ids: Optional[Sequence[str]]):
    """The rows asked for (``[{"id", "content_sha256"}]``), ids stored nowhere, and ids an
    earlier takedown recorded."""
    from eogp_index.store.filters import check_filter

    store = stored.store
    if where is not None:
        if not isinstance(where, str) or not where.strip():
            raise InputError("where must be a non-empty SQL filter, e.g. \"source = 'forum'\"", field="where")
        try:
            check_filter(where, store.schema, store)  # the check every question's filter gets
        except InputError as exc:
            exc.field = "where"
            raise
        return deletions.stored_rows(store, where=where), 0, 0
    if isinstance(ids, (str, bytes)):
        raise InputError(f"ids must be a list of example ids, got the single {type(ids).__name__} {ids!r}", field="ids")
    asked = list(dict.fromkeys(ids or []))
    bad = [i for i in asked if not isinstance(i, str) or not i]
    if bad:
        raise InputError(f"ids must be non-empty strings, got {bad[0]!r}", field="ids")
    rows = deletions.stored_rows(store, ids=asked)
    found = {row["id"] for row in rows}
    logged = {entry["id"] for entry in deletions.read_log(stored.path)}
    absent = [i for i in asked if i not in found]
    earlier = [i for i in absent if i in logged]
    unknown = [i for i in absent if i not in logged]
    return rows + [{"id": i, "content_sha256": None} for i in unknown], len(unknown), len(earlier)


def delete(
    stored,
    *,
    where: Optional[str] = None,
    ids: Optional[Sequence[str]] = None,
    reason: Optional[str] = None,
    purge: bool = False,
    on_step: Optional[Callable[[str], None]] = None,
    target_rows: int = DEFAULT_TARGET_ROWS,
) -> TakedownReport:
    """Delete the rows matching ``where`` (SQL over the stored columns, checked as every filter is)
    or with ``ids``, record them in ``deletions.jsonl``, and with ``purge`` erase them (module
    docstring). With neither ``where`` nor ``ids``: complete an interrupted takedown, and with
    ``purge`` erase every row deleted so far.

    Args:
        stored: the index's :class:`~eogp_index.store.stored_index.StoredIndex`.
        ids: example ids; one stored nowhere is recorded too, so that a later ingest skips it.
        reason: why, recorded with each id (never the text).
        on_step: called with each step's name once it is done and recorded.
        target_rows: rows per fragment of the purge's compaction.

    Raises:
        ConfigError: both ``where`` and ``ids``, or another process holds the ingest lock.
        InputError: a bad filter or id; nothing asked and nothing to complete.
    """
    if where is not None and ids is not None:
        raise ConfigError("give where or ids, not both", field="where")
    if reason is not None and not isinstance(reason, str):
        raise InputError(f"reason must be a string, got {type(reason).__name__}", field="reason")
    step = on_step or (lambda _: None)
    with index_lock(stored.path):
        resumed = deletions.read_pending(stored.path)
        done_before = _run(stored, resumed, step, target_rows) if resumed is not None else None
        if where is None and ids is None and not purge:
            if resumed is None:
                raise InputError("nothing to delete: give where (--where) or ids (--ids)", field="where")
            return _report(stored, resumed, done_before, resumed=None)
        rows, not_stored, earlier = _targets(stored, where, ids)
        if not rows and not purge:  # every id asked for was deleted before: nothing to do
            pending, outcome = None, {"rows_deleted": 0, "first_passes": {}, "steps": []}
        else:
            pending = deletions.new_pending(rows, reason=reason, purge=purge)
            outcome = _run(stored, pending, step, target_rows)
        report = _report(stored, pending, outcome, resumed=resumed)
        return _with(
            report,
            not_stored=not_stored,
            already_deleted=earlier,
            rows_deleted=outcome["rows_deleted"] + _resumed_rows(done_before),
        )


def _resumed_rows(outcome: Optional[Dict[str, Any]]) -> int:
    return 0 if outcome is None else int(outcome["rows_deleted"])


def _with(report: TakedownReport, **changes: Any) -> TakedownReport:
    return TakedownReport(**{**asdict(report), **changes})


def _report(stored, pending: Optional[Dict[str, Any]], outcome, *, resumed: Optional[Dict[str, Any]]) -> TakedownReport:
    """The report of ``pending`` (None: nothing was run for the request) given its ``outcome``."""
    rows = [] if pending is None else pending["rows"]
    return TakedownReport(
        request=pending["request"] if rows else None,
        ids=len(rows),
        rows_deleted=int(outcome["rows_deleted"]),
        not_stored=0,
        already_deleted=0,
        purged=bool(pending and pending["purge"]),
        resumed=None if resumed is None else resumed["request"],
        first_passes=dict(outcome["first_passes"]),
        steps=list(outcome["steps"]),
        table_version=stored.store.version,
        rows=stored.store.count(),
        details=dict(outcome.get("details", {})),
    )


def _run(stored, pending: Dict[str, Any], on_step: Callable[[str], None], target_rows: int) -> Dict[str, Any]:
    """Run the steps of ``pending`` not recorded as done, recording each; the outcome."""
    path = stored.path
    done = set(pending.get("steps", []))
    ran: List[str] = []
    outcome: Dict[str, Any] = {"rows_deleted": 0, "first_passes": {}, "steps": ran, "details": {}}
    ids = [row["id"] for row in pending["rows"]]

    def finished(step: str) -> None:
        pending["steps"] = [*pending.get("steps", []), step]
        deletions.write_pending(path, pending)
        ran.append(step)
        on_step(step)

    for step in deletions.STEPS if pending["purge"] else deletions.STEPS[:3]:
        if step not in done:
            _do(step, stored, pending, ids, outcome, target_rows)
            finished(step)
    deletions.finish_pending(path)
    return outcome


def _do(step: str, stored, pending: Dict[str, Any], ids: List[str], outcome: Dict[str, Any], target_rows: int) -> None:
    """Run one step (its name in :data:`~eogp_index.store.deletions.STEPS`), noting what it did in ``outcome``."""
    path, store, details = stored.path, stored.store, outcome["details"]
    if step == "logged":
        deletions.log_entries(path, pending)
    elif step == "deleted":
        outcome["rows_deleted"] = deletions.delete_rows(store, ids)
    elif step == "compacted":
        details["compaction"] = deletions.compact_deleted(store, target_rows)
    elif step == "cleaned":
        details["cleanup"] = deletions.remove_old_versions(store)
    elif step == "hot":
        details["hot_rows"] = deletions.rebuild_hot(stored, stored.cache_dir / HOT_DIR)
    elif step == "first-passes":
        outcome["first_passes"] = rebuild_first_passes(stored)
    elif step == "caches":
        gone = deletions.DeletedSet.load(path)  # every takedown so far: the log, this one included
        details["caches"] = deletions.purge_caches(path, gone.ids, stored.cache_dir)
        details["recall_queries_removed"] = drop_queries(path, gone.hashes)
    # "recorded": the pending record itself, written when the step is marked done


def rebuild_first_passes(stored) -> Dict[str, str]:
    """Rebuild each first pass of ``stored`` from the table as it is now (its saved configuration
    kept); a first pass that cannot be rebuilt (no row left, a kind this eogp-index does not build,
    unreadable files) is removed instead: its files may hold deleted rows' codes. ``{name: what}``."""
    from eogp_index.search.first_pass import class_for, clear_cache, load
    from eogp_index.search.first_pass.base import FIRST_PASS_DIR

    folder = stored.path / FIRST_PASS_DIR
    done: Dict[str, str] = {}
    for meta in sorted(folder.glob("*.json"), key=str) if folder.is_dir() else []:
        name = meta.name[: -len(".json")]
        try:
            found = load(stored.path, name)
            class_for(found.config).build(stored, name, found.config)
            done[name] = "rebuilt"
        except EOGPError as exc:
            for path in folder.glob(f"{name}.*"):
                path.unlink()
            done[name] = f"removed ({str(exc).splitlines()[0][:200]}); rebuild it with `eogp build-candidates`"
    clear_cache()
    return done
