"""Scale-out ingest: several workers (processes, GPUs, nodes) fill one table, via ``torchrun``.

Launch one worker per GPU (or several CPU processes) with ``torchrun``; the command and its
options are ``eogp ingest``'s, declared once in :mod:`eogp_index.cli`::

    torchrun --nproc_per_node 8 -m eogp_index.cli ingest my-index 'data/*.jsonl.zst'
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m eogp_index.cli ingest my-index 'data/*.parquet' --commit-every 4

How the work and the table are shared:

* The shard list (sorted, as :func:`eogp_index.data.readers.expand_shards` returns it) is dealt out
  round-robin by rank: worker ``r`` of ``W`` reads shards ``r, r + W, r + 2W, ...``.
* The workers advance in lockstep *steps*. In each step every worker reads its next batch
  (skipping examples already stored, as :func:`ingest.pipeline.run_ingest` does), the workers
  exchange the batch's ids (an id read by two workers is a duplicate: the lower rank keeps
  it), each worker projects and encodes its batch and writes it as Lance data files
  (``lance.fragment.write_fragments``) next to the table, and every ``commit_every`` steps
  rank 0 commits all workers' new fragments in one ``LanceOperation.Append``. Lance's commit
  protocol makes that atomic: readers see a step's rows from every worker, or none of them.
* Only rank 0 keeps the table compact: after its commits it runs
  :func:`~eogp_index.store.maintenance.maybe_optimize` (past ``optimize_threshold`` small
  fragments), and after the last one :func:`~eogp_index.store.maintenance.after_ingest`. The
  other workers go on writing their next step's files meanwhile; those are not referenced by
  any version yet, and the cleanup of old versions leaves such files alone.
* A crash (any worker, any moment) loses at most the steps since the last commit: their
  data files are never referenced by the table. Running the same command again skips what
  is stored and completes the rest, without duplicates.
* When the ``P`` matrices do not stay in memory, a worker's step is a block of documents
  (``--block-documents``), as in :func:`ingest.pipeline.run_ingest`: the worker caches the
  block's first-stage coordinates in FP16 in ``INDEX/ingest-cache/rank-R/``, then reads each
  module's ``P`` once for the whole block (:mod:`eogp_index.store.block_cache`). The workers'
  blocks of a step are committed together, whole; a killed step is redone by the next run,
  reusing the batches its workers cached (with ``--commit-every 1``, the default). Rank 0
  removes ``INDEX/ingest-cache/`` at the end of the run.
* With ``--on-error raise`` (the default) the first bad record stops every worker: the
  fragments of earlier steps are committed, nothing of the failing step is, and every worker
  exits with the error (naming the shard and line/row). With ``--on-error skip`` rank 0
  writes the rejects file.

The table lives wherever the index's LanceDB store points (a local directory, or an
object-store URI LanceDB supports); the workers need to reach the same index directory and
shards (a shared file system or object store). The process group uses NCCL on GPUs (Gloo
for the small bookkeeping messages) and Gloo on CPUs. Without ``torchrun`` the module runs as
a single worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from eogp_index.config import GradientConfig, IngestConfig
from eogp_index.data import location as locations
from eogp_index.data.readers import expand_shards, location_of, shard_names
from eogp_index.encode.commits import Commits, index_lock
from eogp_index.errors import ConfigError, EOGPError, InputError
from eogp_index.store.deletions import deleted_set
from eogp_index.store.manifest import Manifest, open_dtype
from ingest.pipeline import (
    ExampleReader,
    IngestSummary,
    RejectsFile,
    StoredIds,
    Tally,
    check_metadata_fields,
    default_rejects_path,
    effective_spec,
    record_sources,
    stable_hash,
)
from ingest.records import Rejected

__all__ = ["run_distributed_ingest"]


# -- the process group ----------------------------------------------------------------------------
class _Comm:
    """The few collectives the ingest needs; a world of one when not launched by torchrun."""

    def __init__(self, *, use_cuda: bool):
        import torch.distributed as dist

        self._dist = dist
        self._owned = False
        self._group = None
        launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if launched and not dist.is_initialized():
            if use_cuda:
                import torch

                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
            self._owned = True
        self.active = dist.is_available() and dist.is_initialized()
        if self.active and dist.get_backend() != "gloo":
            # Object collectives over NCCL would round-trip every message through GPU memory;
            # the bookkeeping here is small Python objects, so a Gloo group carries it.
            self._group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1

    def all_gather(self, obj: Any) -> List[Any]:
        if not self.active:
            return [obj]
        out: List[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()


# -- messages between workers ---------------------------------------------------------------------
@dataclass
class _Report:
    """What a worker tells the others at the start of a step."""

    keys: List[tuple] = field(default_factory=list)  # (id, shard, position, num_tokens) of the batch
    rejected: List[Rejected] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    done: bool = False
    error: Optional[tuple] = None  # (kind "input" | "other", message)


def _error_of(exc: BaseException) -> tuple:
    """``(kind, message)`` of an exception, for the other workers."""
    kind = "input" if isinstance(exc, InputError) else "other"
    # Our own errors already say what and where; others get their type for context.
    message = str(exc) if isinstance(exc, EOGPError) else f"{type(exc).__name__}: {exc}"
    return kind, message


class _Aborted(Exception):
    """Raised on every worker when one of them failed; carries the first failure."""

    def __init__(self, rank: int, error: tuple):
        self.rank = rank
        self.kind, self.message = error
        super().__init__(self.message)


def _first_error(items: Sequence[Optional[tuple]]) -> Optional[_Aborted]:
    for rank, error in enumerate(items):
        if error is not None:
            return _Aborted(rank, error)
    return None


# -- the run --------------------------------------------------------------------------------------
def run_distributed_ingest(
    index_path: str | Path,
    patterns: Sequence[str | Path],
    config: Optional[IngestConfig] = None,
    *,
    gradients: GradientConfig = GradientConfig(),
    model_path: Optional[str] = None,
    **options: Any,
) -> IngestSummary:
    """Ingest ``patterns`` into the index at ``index_path`` as one worker of a ``torchrun`` job.

    Every worker calls this with the same arguments; each opens the index (and its model) on
    its own device, reads its share of the shards and writes its rows; rank 0 commits. See the
    module docstring for the protocol, and :func:`ingest.pipeline.run_ingest` for the meaning
    of ``config``'s fields.

    Args:
        config: the :class:`~eogp_index.config.IngestConfig` (default: its defaults). Here
            ``batch_size`` is rows per worker per step (default 256, whole gradient batches;
            in block ingest a step is a block of ``block_documents``), ``commit_every`` the
            steps between commits (a crash loses at most this many steps of work), and
            ``optimize_threshold`` makes rank 0 compact the table past this many small
            fragments, after its commits, and leave the index ready to query at the end.
        gradients: the per-example gradient settings; ``device="auto"`` puts worker ``r`` on
            ``cuda:LOCAL_RANK`` when CUDA is present, else on the CPU.
        model_path: load the model and tokenizer from here instead of the manifest's name
            (the weights must still be the ones the index was built with).
        options: fields of ``config`` to replace, e.g. ``batch_size=64, commit_every=4``.

    Returns:
        The run's :class:`IngestSummary` (the same on every worker).

    Raises:
        InputError: a bad record (``on_error="raise"``) on any worker.
        ConfigError, IncompatibleIndexError: bad options or an index built for another model.
        RuntimeError: another worker failed (its message is included).
    """
    from eogp_index.client import AttributionIndex
    from eogp_index.gradients.model import load_indexed_model

    config = (config or IngestConfig()).with_options(**options)
    import torch

    use_cuda = gradients.device.startswith("cuda") or (gradients.device == "auto" and torch.cuda.is_available())
    comm = _Comm(use_cuda=use_cuda)
    worker = None
    try:
        if gradients.device == "auto":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu"
            gradients = dataclasses.replace(gradients, device=device)
        model = tokenizer = None
        if model_path is not None:
            manifest = Manifest.load(locations.index_path(index_path))
            dtype = open_dtype(manifest, gradients.dtype, where=str(index_path))
            model, tokenizer = load_indexed_model(
                manifest.model, model_path, device=gradients.resolved_device(), dtype=dtype
            )
        index = AttributionIndex.open(index_path, model=model, tokenizer=tokenizer, gradients=gradients)
        worker = _Worker(index, comm, patterns, config)
        with contextlib.ExitStack() as stack:
            # Rank 0 holds the index's ingest lock for the whole job (its node's view of it);
            # every worker learns whether it got it, so none waits on a job that never starts.
            refused = None
            if comm.rank == 0:
                try:
                    stack.enter_context(index_lock(index.path))
                except ConfigError as exc:
                    refused = str(exc)
            refused = comm.broadcast(refused)
            if refused is not None:
                raise ConfigError(refused)
            return worker.run()
    finally:
        if worker is not None:
            worker.commits.close()
        comm.close()


class _Worker:
    def __init__(self, index, comm: _Comm, patterns, config: IngestConfig):
        self.index = index
        self.config = config
        self.comm = comm
        self.on_error = config.on_error
        self.commit_every = config.commit_every
        self.spec = effective_spec(index, config.spec)
        check_metadata_fields(index, self.spec, new_allowed=False)
        # The one commit loop's encoding and its work after commits (rank 0's compactions). P not in
        # memory: each step is a block per worker, cached in the worker's own directory.
        self.commits = Commits(index.encoder, config, worker=comm.rank if comm.world > 1 else None, workers=comm.world)
        self.rows_per_step = self.commits.rows_per_commit
        shards = expand_shards(patterns)
        shard_root = config.shard_root
        shard_names(shards, root=shard_root)  # names must be unique across all workers' shards
        # Every worker checks the text setting against sources.json alike; rank 0 alone writes it.
        record_sources(
            index, patterns, self.spec, shard_root=shard_root, store_text=config.store_text, write=comm.rank == 0
        )
        self.mine = shards[comm.rank :: comm.world]
        self.shard_root = shard_root
        self.rejects = RejectsFile(config.rejects_path or default_rejects_path(index.path)) if comm.rank == 0 else None
        self.bar = None
        if config.progress and comm.rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=f"ingest ({comm.world} workers)", unit="doc", dynamic_ncols=True)
        self.pending: List[str] = []  # this worker's written, uncommitted fragments (JSON)
        self.schema = index.store.schema
        self._target: Optional[tuple] = None
        self.version = index.store.version
        self.tally = Tally()
        # Ids admitted in this run by any worker: hash -> shard number << 40 | position.
        self.seen: dict[int, int] = {}
        self.shard_numbers: dict[str, int] = {}
        self.shard_list: List[str] = []

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> IngestSummary:
        started = time.perf_counter()
        reader = None
        if self.mine:
            reader = ExampleReader(
                self.index,
                self.mine,
                spec=self.spec,
                on_error=self.on_error,
                shard_root=self.shard_root,
                stored=StoredIds(
                    self.index.store, deleted=deleted_set(self.index.path, allow_deleted=self.config.allow_deleted)
                ),
            )
        local_error: Optional[BaseException] = None
        step = 0
        try:
            while True:
                report = _Report(done=reader is None or reader.exhausted)
                batch = []
                if local_error is None and not report.done:
                    try:
                        batch, report.rejected, report.tally = reader.take(self.rows_per_step)
                        report.done = reader.exhausted
                    except Exception as exc:  # reported to every worker below, then re-raised
                        local_error, batch = exc, []
                if local_error is not None:
                    report.error = _error_of(local_error)
                report.keys = [(ex.id, ex.shard, ex.position, ex.num_tokens) for ex in batch]
                reports: List[_Report] = self.comm.all_gather(report)
                failure = _first_error([r.error for r in reports])
                if failure is not None:
                    self._abort(failure)
                try:
                    keep = self._resolve_duplicates(reports)
                except _Aborted as duplicate:  # on_error="raise": every worker sees it alike
                    self._abort(duplicate)
                batch = [ex for ex, kept in zip(batch, keep[self.comm.rank]) if kept]
                self._account(reports, keep, started)
                all_done = all(r.done for r in reports)

                rows = None
                try:
                    if batch:
                        rows = self.commits.encode(batch)
                except Exception as exc:
                    local_error = exc
                if self.schema is None:
                    self._create_table(rows, local_error)
                try:
                    if rows is not None and local_error is None:
                        self._write(rows)
                except Exception as exc:
                    local_error = exc
                step += 1
                if all_done or step % self.commit_every == 0:
                    self._commit(local_error)
                if all_done:
                    break
            if self.comm.rank == 0:  # every worker is past its last commit: no block is in flight
                self.commits.finish(stored=self.tally.stored, every_worker=True)
        except _Aborted as failure:
            if local_error is not None and failure.rank == self.comm.rank:
                raise local_error
            if failure.kind == "input":
                raise InputError(failure.message, reason=failure.message) from None
            raise RuntimeError(f"ingest worker {failure.rank} failed: {failure.message}") from None
        finally:
            if self.rejects is not None:
                self.rejects.close()
            if self.bar is not None:
                self.bar.close()
        if self.comm.rank == 0:
            self.version = self.index.store.version  # after the compactions
        return self.tally.summary(
            seconds=time.perf_counter() - started,
            table_version=self.version,
            rejects_path=self.rejects.written if self.rejects is not None else None,
            workers=self.comm.world,
            optimized=self.commits.optimized,
        )

    def _abort(self, failure: _Aborted) -> None:
        """Commit the whole steps written before the failure, then stop every worker."""
        self._commit(None, raise_errors=False)
        raise failure

    # -- duplicates across workers ----------------------------------------------------------------
    def _resolve_duplicates(self, reports: List[_Report]) -> List[List[bool]]:
        """Which keys each worker keeps; the same answer on every worker (same inputs, same order).

        Each worker's own reader already rejects ids repeated in its shards; this catches an
        id read by two workers. The first one in (step, rank) order keeps it.
        """
        if self.comm.world == 1:
            return [[True] * len(report.keys) for report in reports]  # the reader's RunState saw them all
        keep: List[List[bool]] = []
        for rank, report in enumerate(reports):
            flags = []
            for key in report.keys:
                ident, shard, position = key[0], key[1], key[2]
                hashed = stable_hash(ident)
                first = self.seen.get(hashed)
                if first is None:
                    number = self.shard_numbers.setdefault(shard, len(self.shard_numbers))
                    if number == len(self.shard_list):
                        self.shard_list.append(shard)
                    self.seen[hashed] = (number << 40) | position
                    flags.append(True)
                    continue
                where = location_of(self.shard_list[first >> 40], first & ((1 << 40) - 1))
                reason = f"duplicate id {ident!r}: already used by the record at {where}; ids must be unique in a run"
                location = location_of(shard, position)
                if self.on_error == "raise":
                    raise _Aborted(rank, ("input", f"{location}: {reason}"))
                report.rejected.append(
                    Rejected(shard=shard, position=position, location=location, reason=reason, record_id=ident)
                )
                report.tally.duplicates += 1
                flags.append(False)
            keep.append(flags)
        return keep

    def _account(self, reports: List[_Report], keep: List[List[bool]], started: float) -> None:
        step = Tally()
        for report, flags in zip(reports, keep):
            step.add(report.tally)
            for key, kept in zip(report.keys, flags):
                if kept:
                    step.stored += 1
                    step.tokens += key[3]
            if self.rejects is not None:
                for item in report.rejected:
                    self.rejects.write(item)
        self.tally.add(step)
        if self.rejects is not None:
            self.rejects.flush()
        if self.bar is not None:
            self.bar.update(step.documents)
            elapsed = max(time.perf_counter() - started, 1e-9)
            self.bar.set_postfix(
                {
                    "doc/s": f"{self.tally.stored / elapsed:.1f}",
                    "tok/s": f"{self.tally.tokens / elapsed:.0f}",
                    "stored": self.tally.stored,
                    "skipped": self.tally.skipped_existing,
                    "rejected": self.tally.rejected + self.tally.duplicates,
                },
                refresh=False,
            )

    # -- the table --------------------------------------------------------------------------------
    def _create_table(self, rows, local_error: Optional[BaseException]) -> None:
        """Create the (empty) table from the first rows any worker has, on rank 0."""
        offers = self.comm.all_gather(
            (rows.schema if rows is not None else None, _error_of(local_error) if local_error is not None else None)
        )
        failure = _first_error([error for _, error in offers])
        if failure is not None:
            self._abort(failure)
        schemas = [s for s, _ in offers if s is not None]
        if not schemas:
            return  # nobody has rows yet
        import pyarrow as pa

        try:  # every worker's columns: a field may have values in one worker's first rows only
            schema = pa.unify_schemas(schemas)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:  # the same on every worker: all stop alike
            self._abort(
                _Aborted(
                    0,
                    _error_of(
                        InputError(
                            f"the workers' first rows give a metadata field different types ({exc}); make each field's "
                            "type the same everywhere",
                            reason="metadata type mismatch",
                        )
                    ),
                )
            )
        result = None
        if self.comm.rank == 0:
            try:
                import lance

                if self.index.store.table is None:  # (a rerun finds it made)
                    store = self.index.store
                    lance.write_dataset(
                        schema.empty_table(), store.path, mode="create", storage_options=store.storage_options
                    )
                self.index.store.refresh(force=True)
            except Exception as exc:
                result = _error_of(exc)
        result = self.comm.broadcast(result)
        if result is not None:
            raise _Aborted(0, result)
        self.index.store.refresh(force=True)  # made by rank 0: every worker looks now
        self.schema = self.index.store.schema
        self.version = self.index.store.version

    def _write(self, rows) -> None:
        """Write this worker's rows as Lance data files of the table (not visible until committed)."""
        import pyarrow as pa
        from lance.fragment import write_fragments

        new = [name for name in rows.column_names if name not in self.schema.names]
        if new:  # a field that had only nulls when the table was made: never drop its values
            raise InputError(
                f"metadata fields {new} have values here but are not columns of the table (their first "
                "rows held only nulls when the table was made); workers under torchrun cannot add columns: "
                "ingest a shard holding values of these fields without torchrun first, then rerun",
                reason="new metadata fields",
            )
        for column in self.schema:  # a field without a value in these rows: null, typed as the table's
            if column.name not in rows.column_names:
                rows = rows.append_column(column, pa.nulls(rows.num_rows, column.type))
        try:
            rows = rows.select(self.schema.names).cast(self.schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise InputError(
                f"this worker's rows do not fit the table's columns ({exc}); a metadata field holds values "
                "of different types in different shards (the table was created with "
                f"{self.schema}); make each field's type the same everywhere",
                reason="metadata type mismatch",
            ) from exc
        if self._target is None:  # the table's URI and file format, fixed once it exists
            dataset = self.index.store.dataset()
            self._target = (dataset.uri, dataset.data_storage_version)
        uri, storage_version = self._target
        fragments = write_fragments(
            rows,
            uri,
            schema=self.schema,
            data_storage_version=storage_version,
            storage_options=self.index.store.storage_options,
        )
        self.pending.extend(json.dumps(f.to_json()) for f in fragments)

    def _maybe_optimize(self) -> None:
        """Rank 0, after a commit: compact once enough small fragments wait. A failure is only
        reported: the rows are committed, and the next run (or ``eogp optimize``) compacts."""
        try:
            self.commits.optimize()
        except Exception as exc:  # noqa: BLE001
            import warnings

            warnings.warn(
                f"compacting the table failed ({type(exc).__name__}: {exc}); the ingest goes on. "
                "Run `eogp optimize` afterwards",
                RuntimeWarning,
                stacklevel=2,
            )

    def _commit(self, local_error: Optional[BaseException], *, raise_errors: bool = True) -> None:
        """Rank 0 commits every worker's pending fragments in one Append; then all go on (or stop)."""
        offers = self.comm.all_gather((self.pending, _error_of(local_error) if local_error is not None else None))
        self.pending = []
        result = None
        if self.comm.rank == 0:
            try:
                import lance
                from lance.fragment import FragmentMetadata

                fragments = [FragmentMetadata.from_json(text) for pending, _ in offers for text in pending]
                if fragments:
                    uri, options = self.index.store.path, self.index.store.storage_options
                    latest = lance.dataset(uri, storage_options=options).version
                    committed = lance.LanceDataset.commit(
                        uri, lance.LanceOperation.Append(fragments), read_version=latest, storage_options=options
                    )
                    self.index.store.refresh(force=True)
                    result = ("ok", committed.version)
                else:
                    result = ("ok", self.index.store.version if self.schema is not None else 0)
            except Exception as exc:
                result = ("error", _error_of(exc))
        result = self.comm.broadcast(result)
        if result[0] == "error":
            raise _Aborted(0, result[1])
        self.version = result[1]
        if local_error is None:
            self.commits.committed(optimize=False)  # this worker's block is committed (or it had none in flight)
        if self.comm.rank == 0 and result[1] and raise_errors:
            self._maybe_optimize()
        failure = _first_error([error for _, error in offers])
        if failure is not None and raise_errors:
            raise failure
