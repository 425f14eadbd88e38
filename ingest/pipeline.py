"""Ingest corpus shards into an index: resumable, idempotent, with a rejects file and progress.

:func:`run_ingest` reads shards (:func:`ingest.records.iter_examples`), skips the examples the
table already holds, projects and encodes the rest in batches, and stores each batch as one
Lance commit. What that buys:

* **Idempotent.** Running the same ingest twice stores each example once: an example whose id
  is already stored *for the same shard and position* is skipped (``skipped_existing``).
* **Resumable.** A killed ingest (``kill -9`` included) leaves whole batches only — a reader
  never sees half a batch, because a batch becomes visible in one commit — and running it
  again stores exactly the examples that are missing.
* **Bad input.** ``on_error="raise"`` stops at the first bad record with an
  :class:`~eogp_index.errors.InputError` naming ``shard:line`` (or ``shard:row N``); nothing of
  the batch being assembled is stored. ``on_error="skip"`` writes each bad record to a JSON
  Lines rejects file with its reason and goes on.
* **Taken down.** A record that a takedown deleted (``eogp delete``: its id or content hash is
  in the index's ``deletions.jsonl``) is skipped (``skipped_deleted``), unless ``allow_deleted``.
* **Duplicate ids.** An id used twice in the run, or already stored for a *different* shard
  or position (say, by an earlier ingest of other shards), is a bad record too (counted in
  ``duplicates``), so the table never holds an id twice.
* **P read per block.** When the ``P`` matrices do not stay in memory, documents go in blocks
  (``IngestConfig.block_documents``): each module's ``P`` is read once per block instead of
  once per gradient batch; a block is one commit, and a killed block's cached batches are
  reused by the next run (:mod:`eogp_index.store.block_cache`).
* **Fragment hygiene.** Every commit adds a fragment; past ``optimize_threshold`` small ones the
  table is compacted between commits, and a run ends with the index ready to query (compacted
  if due, hot copy up to date): :mod:`eogp_index.store.maintenance`.

Ingests must use the same shard names from run to run (the same ``shard_root``): shard names
are part of stable ids and of what "already stored" means. Two ingests must not write the
same index at once; a local index is locked for the duration of a run. To scale out over
several processes or machines run ``eogp ingest`` under ``torchrun`` (:mod:`ingest.distributed`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from eogp_index.client import AttributionIndex
from eogp_index.config import DEFAULT_COMMIT_ROWS, IngestConfig, OnError  # noqa: F401  (re-exported)
from eogp_index.data import location as locations
from eogp_index.data.readers import (
    SPLIT_SEPARATOR,
    DatasetShard,
    dataset_source,
    expand_shards,
    location_of,
    shard_list,
    shard_names,
    split_shard_spec,
)
from eogp_index.encode.commits import Commits, index_lock
from eogp_index.errors import ConfigError, InputError
from eogp_index.gradients.model import hard_context_length
from eogp_index.store.deletions import deleted_set
from eogp_index.store.stored_ids import StoredIds, sql_string, stable_hash  # noqa: F401  (re-exported)
from eogp_index.store.table import RESERVED_COLUMNS
from ingest.records import Example, RecordSpec, Rejected, iter_examples

__all__ = [
    "ExampleReader",
    "IngestConfig",
    "IngestSummary",
    "RejectsFile",
    "StoredIds",
    "Tally",
    "run_ingest",
    "default_rejects_path",
    "sql_string",
    "stable_hash",
]

REJECTS_DIR = "rejects"


@dataclass(frozen=True)
class IngestSummary:
    """What an ingest did.

    stored: rows added to the table by this run. skipped_existing: examples already stored
    (same id, shard and position), e.g. by an earlier, interrupted run. skipped_deleted: records
    a takedown deleted (same id or content hash in ``deletions.jsonl``). rejected: bad records
    (listed in ``rejects_path``). duplicates: records whose id was already used, earlier in
    this run or by a stored row of another shard/position (also listed in ``rejects_path``).
    documents: records read (= stored + skipped_existing + skipped_deleted + rejected + duplicates).
    tokens: tokens of the stored examples. seconds: wall time of the run.
    docs_per_s, tokens_per_s: stored documents and their tokens per second of wall time.
    table_version: the table's version after the run (0 when there is no table yet).
    rejects_path: the rejects file, or None when nothing was rejected.
    workers: processes that took part (1 for :func:`run_ingest`).
    optimized: times the run compacted the table (:mod:`eogp_index.store.maintenance`), the
    one at its end included.
    """

    stored: int
    skipped_existing: int
    rejected: int
    duplicates: int
    documents: int
    tokens: int
    seconds: float
    docs_per_s: float
    tokens_per_s: float
    table_version: int
    rejects_path: Optional[str] = None
    workers: int = 1
    optimized: int = 0
    skipped_deleted: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``--json`` prints)."""
        return asdict(self)

    def describe(self) -> str:
        """One human line: ``stored 120, skipped 40 (already stored), ...``."""
        text = (
            f"stored {self.stored}, skipped {self.skipped_existing} (already stored)"
            f"{f' and {self.skipped_deleted} (deleted)' if self.skipped_deleted else ''}, "
            f"rejected {self.rejected}, duplicates {self.duplicates} of {self.documents} documents "
            f"in {self.seconds:.1f}s ({self.docs_per_s:.1f} doc/s, {self.tokens_per_s:.0f} tok/s); "
            f"table version {self.table_version}"
        )
        if self.optimized:
            text += f"; compacted {self.optimized} time{'s' if self.optimized > 1 else ''}"
        if self.rejects_path:
            text += f"; rejects in {self.rejects_path}"
        return text


@dataclass
class Tally:
    """Running counts of a run (or of one step of one worker)."""

    documents: int = 0
    skipped_existing: int = 0
    rejected: int = 0
    duplicates: int = 0
    stored: int = 0
    tokens: int = 0
    skipped_deleted: int = 0

    def add(self, other: "Tally") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(
        self, *, seconds: float, table_version: int, rejects_path: Optional[Path], workers: int = 1, optimized: int = 0
    ) -> IngestSummary:
        seconds = max(seconds, 1e-9)
        return IngestSummary(
            stored=self.stored,
            skipped_existing=self.skipped_existing,
            skipped_deleted=self.skipped_deleted,
            rejected=self.rejected,
            duplicates=self.duplicates,
            documents=self.documents,
            tokens=self.tokens,
            seconds=round(seconds, 3),
            docs_per_s=round(self.stored / seconds, 3),
            tokens_per_s=round(self.tokens / seconds, 3),
            table_version=table_version,
            rejects_path=str(rejects_path) if rejects_path is not None else None,
            workers=workers,
            optimized=optimized,
        )


def effective_spec(index: AttributionIndex, spec: Optional[RecordSpec]) -> RecordSpec:
    """``spec`` (None: ``RecordSpec()``), with the index's ``max_tokens`` when the spec sets none
    (for windows without one: the model's context, when its position table fixes it)."""
    if spec is None:
        spec = RecordSpec()
    if not isinstance(spec, RecordSpec):
        raise ConfigError(f"spec must be an ingest.records.RecordSpec, got {type(spec).__name__}")
    if spec.max_tokens is None and index.manifest.max_tokens is not None:
        return replace(spec, max_tokens=int(index.manifest.max_tokens))
    if spec.max_tokens is None and spec.long_documents == "windows":
        return replace(spec, max_tokens=hard_context_length(index.model))  # windows as long as the model reads
    return spec


#: The columns :func:`eogp_index.search.ranking.ranked_tables` puts before a hit's stored columns.
ANSWER_COLUMNS = ("direction", "rank", "score", "modules")


def check_metadata_fields(index, spec: RecordSpec, *, new_allowed: bool = True) -> None:
    """Refuse metadata fields the table cannot take, before any record is read.

    index: an :class:`AttributionIndex` or the :class:`~eogp_index.store.stored_index.StoredIndex`
    under it (only its table is read).
    A field the existing table lacks becomes a new column (the rows stored before hold null),
    unless ``new_allowed`` is False (a run under torchrun, whose workers write to a fixed schema).
    """
    reserved = [name for name in spec.metadata_fields if name in RESERVED_COLUMNS]
    if reserved:
        raise ConfigError(
            f"metadata fields {reserved} clash with the table's own columns {list(RESERVED_COLUMNS)}; "
            "leave them out of RecordSpec.metadata_fields (--metadata)"
        )
    answer = [name for name in spec.metadata_fields if name in ANSWER_COLUMNS]
    if answer:
        raise ConfigError(
            f"metadata fields {answer} clash with the columns every query answer leads with "
            f"{list(ANSWER_COLUMNS)}; rename the field in the records (e.g. {answer[0]}_value) or leave it out "
            "of RecordSpec.metadata_fields (--metadata)"
        )
    schema = index.store.schema
    if schema is None or new_allowed:
        return
    new = [name for name in spec.metadata_fields if name not in schema.names]
    if new:
        known = [n for n in index.store.metadata_columns() if n not in RESERVED_COLUMNS]
        raise ConfigError(
            f"metadata fields {new} are not columns of the existing table {index.store.table_name!r} "
            f"(its metadata columns: {known}); workers under torchrun cannot add columns: ingest one "
            "shard with the new fields without torchrun first (that adds the columns), then the rest"
        )


def check_before_loading(
    stored,
    patterns: Sequence[str | Path],
    spec: RecordSpec,
    *,
    shard_root: str | Path | None,
    store_text: Optional[int],
    distributed: bool = False,
) -> None:
    """The checks of an ingest that need no model, so that a mistake is reported before the model
    loads (minutes, for a large one): every shard exists and has a supported format, shard names
    are unique, the metadata fields fit the table, the ``store_text`` setting agrees with the index.

    stored: the index's :class:`~eogp_index.store.stored_index.StoredIndex` (no weights loaded).
    Raises :class:`InputError` or :class:`ConfigError`, as the run itself would.
    """
    shard_names(expand_shards(patterns), root=shard_root)
    check_metadata_fields(stored, spec, new_allowed=not distributed)
    stored.agree_store_text(store_text)


def _metadata_fits(example: Example, schema: Optional[pa.Schema]) -> Optional[str]:
    """Why ``example``'s metadata does not fit the existing columns, or None."""
    if schema is None:
        return None
    for name, value in example.metadata.items():
        if name not in schema.names:
            continue
        target = schema.field(name).type
        try:
            pa.array([value], type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            return (
                f"field {name!r}: metadata value {value!r} ({type(value).__name__}) does not fit the "
                f"table's column type {target}"
            )
    return None


def default_rejects_path(index_path: Path) -> Path:
    """``<index>/rejects/<UTC time>-<pid>.jsonl``: one file per run, never overwritten."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return locations.index_path(index_path) / REJECTS_DIR / f"{stamp}-{os.getpid()}.jsonl"


class RejectsFile:
    """A JSON Lines file of rejected records, created when the first one arrives. In an object
    store (an index at a URL) it is written locally and uploaded whole at each flush and at the end."""

    def __init__(self, path: Path):
        self.path = locations.index_path(path)
        self._local = (
            Path(tempfile.mkdtemp(prefix="eogp-rejects-")) / self.path.name
            if locations.is_remote(self.path)
            else self.path
        )
        self._handle = None
        self.count = 0

    def write(self, rejected: Rejected) -> None:
        if self._handle is None:
            self._local.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self._local, "a", encoding="utf-8")
        record = {
            "shard": rejected.shard,
            "position": rejected.position,
            "location": rejected.location,
            "reason": rejected.reason,
            "record_id": rejected.record_id,
        }
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def flush(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            if locations.is_remote(self.path):
                locations.upload(self._local, self.path)

    def close(self) -> None:
        if self._handle is not None:
            self.flush()
            self._handle.close()
            self._handle = None
            if locations.is_remote(self.path):
                shutil.rmtree(self._local.parent, ignore_errors=True)

    @property
    def written(self) -> Optional[Path]:
        return self.path if self.count else None


def is_duplicate(rejected: Rejected) -> bool:
    """Whether a rejected record was left out for its id (counted in ``duplicates``)."""
    return rejected.reason.startswith("duplicate id")


class ExampleReader:
    """The new examples of some shards, in order, a batch at a time.

    Reads records with :func:`iter_examples`; skips the ones already stored; turns ids stored
    for another shard/position, documents longer than the model can read and metadata that
    does not fit the existing columns into rejected records (or errors, with
    ``on_error="raise"``).
    """

    def __init__(
        self,
        index: AttributionIndex,
        patterns: Sequence[str | Path],
        *,
        spec: RecordSpec,
        on_error: OnError,
        shard_root: str | Path | None,
        stored: StoredIds,
    ):
        self._items: Iterator[Example | Rejected] = iter_examples(
            patterns, spec, index.tokenizer, on_error=on_error, shard_root=shard_root
        )
        self._on_error = on_error
        self._stored = stored
        self._schema = index.store.schema
        self._context = hard_context_length(index.model)
        self.exhausted = False

    def take(self, n: int) -> tuple[list[Example], list[Rejected], Tally]:
        """Up to ``n`` new examples, the records rejected on the way, and the counts.

        Raises :class:`InputError` at the first bad record with ``on_error="raise"``; what was
        read of the batch so far is dropped with it (nothing of the batch is stored).
        """
        batch: list[Example] = []
        rejected: list[Rejected] = []
        tally = Tally()
        while len(batch) < n:
            item = next(self._items, None)
            if item is None:
                self.exhausted = True
                break
            tally.documents += 1
            if isinstance(item, Rejected):
                rejected.append(item)
                if is_duplicate(item):
                    tally.duplicates += 1
                else:
                    tally.rejected += 1
                continue
            status, where = self._stored.lookup(item)
            if status == "same":
                tally.skipped_existing += 1
                continue
            if status == "deleted":
                tally.skipped_deleted += 1
                continue
            problem = None
            if status == "other":
                problem = (
                    f"duplicate id {item.id!r}: already stored for the record at {where}; ids must be "
                    "unique in the index (use another id field, or let ids be derived from content)"
                )
            elif self._context is not None and item.num_tokens > self._context:
                problem = (
                    f"{item.num_tokens} tokens, but the model reads at most {self._context}; "
                    "set max_tokens (RecordSpec.max_tokens; --max-tokens of `eogp fit`) "
                    "to truncate long documents"
                )
            else:
                problem = _metadata_fits(item, self._schema)
            if problem is not None:
                location = location_of(item.shard, item.position)
                if self._on_error == "raise":
                    raise InputError(problem, location=location, reason=problem)
                rejected.append(
                    Rejected(
                        shard=item.shard, position=item.position, location=location, reason=problem, record_id=item.id
                    )
                )
                if status == "other":
                    tally.duplicates += 1
                else:
                    tally.rejected += 1
                continue
            batch.append(item)
        return batch, rejected, tally


def record_sources(
    index: AttributionIndex,
    patterns: Sequence[str | Path],
    spec: RecordSpec,
    *,
    shard_root: str | Path | None,
    store_text: Optional[int],
    write: bool = True,
) -> None:
    """Note in ``sources.json`` where this run's shards live and how they are read, before any of
    their rows is stored, so that every stored row can be explained (format-2 indexes)."""
    index.stored.agree_store_text(store_text)
    if not index.manifest.has_content_hashes:
        return
    sources = index.stored.sources
    shards = expand_shards(patterns)
    names = shard_names(shards, root=shard_root)
    uris, datasets = {}, {}
    for name, path in zip(names, shards):
        if isinstance(path, DatasetShard):
            # A dataset object lives nowhere to read it back from: what is known of it is recorded.
            uris[name], datasets[name] = None, path.describe()
            continue
        base, split = split_shard_spec(path)
        # A hub dataset is recorded by its repository name; files and directories by their absolute path.
        where = str(Path(base).resolve()) if Path(base).exists() else dataset_source(base)
        uris[name] = where + (f"{SPLIT_SEPARATOR}{split}" if split else "")
    sources.record_shards(uris, spec, datasets=datasets)
    if write:
        sources.save()


def _progress_bar(enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=desc, unit="doc", dynamic_ncols=True)


def _postfix(bar, tally: Tally, started: float) -> None:
    if bar is None:
        return
    elapsed = max(time.perf_counter() - started, 1e-9)
    bar.set_postfix(
        {
            "doc/s": f"{tally.stored / elapsed:.1f}",
            "tok/s": f"{tally.tokens / elapsed:.0f}",
            "stored": tally.stored,
            "skipped": tally.skipped_existing,
            "rejected": tally.rejected + tally.duplicates,
        },
        refresh=False,
    )


def run_ingest(
    index: AttributionIndex, patterns: Sequence[str | Path], config: Optional[IngestConfig] = None, **options: Any
) -> IngestSummary:
    """Ingest the records of ``patterns`` (shard paths or globs) into ``index``.

    Args:
        index: an opened :class:`~eogp_index.client.AttributionIndex` (its model and tokenizer
            tokenize and project the records).
        patterns: shard files (JSON Lines, plain/.gz/.zst; Parquet; ``save_to_disk``
            directories, ``dir::split`` for a split; a hub or local dataset repository as
            ``name::split`` or ``name::config/split``), or globs; read in sorted path order. A
            ``datasets.Dataset`` or ``IterableDataset`` is a shard too, streamed in its iteration
            order and named from its info or by :func:`~eogp_index.data.readers.dataset_shard`;
            its documents are explained from their stored text only (``store_text``).
        config: the :class:`~eogp_index.config.IngestConfig` (default: its defaults); what its
            fields mean here:

            * ``spec``: which record fields hold the content, id and metadata
              (``metadata_fields`` become typed, nullable table columns; a list of scalars
              becomes an Arrow list) and ``max_tokens`` (default: the index's).
            * ``on_error``: ``"raise"``: the first bad record raises :class:`InputError` naming
              its shard and line/row, and nothing of the batch it falls in is stored. Batches
              committed before it stay stored; fix the record and run again to continue from
              there. ``"skip"``: bad records are written to ``rejects_path`` and the rest goes in.
            * ``rejects_path``: where ``"skip"`` lists rejected records, one JSON object per line
              with ``shard, position, location, reason, record_id``; default
              ``<index>/rejects/<UTC time>-<pid>.jsonl``, created only if something is rejected.
            * ``batch_size``: rows per commit (default 256, rounded up to whole gradient
              batches). A kill loses at most the batch in flight; each commit adds a Lance
              fragment. In block ingest (``P`` not in memory) a commit is a block
              (``block_documents``).
            * ``progress``: show a progress bar (documents, stored doc/s and tok/s).
            * ``shard_root``: name shards by their path relative to this directory instead of by
              file name (needed when two shards share a file name); keep it the same across runs.
            * ``store_text``: keep each document's text in the table, up to this many UTF-8
              bytes (a longer document is read back from its shard when explained); None keeps
              none. Every ingest into one index uses the same setting.
            * ``optimize_threshold``: once more than this many small fragments pile up, the
              table is compacted between commits
              (:func:`~eogp_index.store.maintenance.maybe_optimize`), and at the end of a run
              that stored rows the index is left ready to query
              (:func:`~eogp_index.store.maintenance.after_ingest`: compacted if due, hot copy
              rebuilt). None: neither (``eogp optimize`` later).
            * ``allow_deleted``: store records a takedown deleted (by default skipped, counted in
              ``skipped_deleted``).
            * ``commit_every`` applies under torchrun only (:mod:`ingest.distributed`).
        options: fields of ``config`` to replace, e.g. ``spec=RecordSpec(...), batch_size=64``.

    Returns:
        An :class:`IngestSummary`.

    Raises:
        InputError: a bad record (``on_error="raise"``) or a shard that cannot be read at all
            (a missing file, an unsupported format, a corrupt compressed stream: in both modes).
        ConfigError: bad options, or another ingest holding the index. A metadata field the
            existing table lacks is added as a column (older rows hold null).
    """
    config = (config or IngestConfig()).with_options(**options)
    config.refuse(("commit_every",), "it applies to torchrun workers (ingest.distributed.run_distributed_ingest)")
    patterns = shard_list(patterns)  # dataset objects named once, for the sources and the reader alike
    started = time.perf_counter()
    spec = effective_spec(index, config.spec)
    check_metadata_fields(index, spec)
    commits = Commits(index.encoder, config)
    rejects = RejectsFile(config.rejects_path or default_rejects_path(index.path))
    tally = Tally()
    bar = _progress_bar(config.progress, "ingest")

    def batches(reader: ExampleReader) -> Iterator[list[Example]]:
        while not reader.exhausted:
            batch, rejected, counts = reader.take(commits.rows_per_commit)
            for item in rejected:
                rejects.write(item)
            rejects.flush()
            tally.add(counts)  # documents read; the batch's count as stored once committed
            if bar is not None:
                bar.update(counts.documents - len(batch))
            yield batch

    def on_commit(batch: Sequence[Example]) -> None:
        tally.stored, tally.tokens = commits.stored, commits.tokens
        _postfix(bar, tally, started)

    try:
        with index_lock(index.path):
            record_sources(index, patterns, spec, shard_root=config.shard_root, store_text=config.store_text)
            reader = ExampleReader(
                index,
                patterns,
                spec=spec,
                on_error=config.on_error,
                shard_root=config.shard_root,
                stored=StoredIds(index.store, deleted=deleted_set(index.path, allow_deleted=config.allow_deleted)),
            )
            on_chunk = None if bar is None else (lambda chunk: bar.update(len(chunk)))
            commits.run(batches(reader), on_chunk=on_chunk, on_commit=on_commit)
            commits.finish()
    finally:
        rejects.close()
        commits.close()
        if bar is not None:
            _postfix(bar, tally, started)
            bar.close()
    return tally.summary(
        seconds=time.perf_counter() - started,
        table_version=index.store.version,
        rejects_path=rejects.written,
        optimized=commits.optimized,
    )
