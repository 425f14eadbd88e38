"""The one commit loop of every writer, and the ingest lock it runs under.

Every writer of an index — :meth:`AttributionIndex.ingest <eogp_index.client.AttributionIndex.ingest>`,
``eogp ingest`` (:func:`ingest.pipeline.run_ingest`) and rank 0 of a torchrun ingest
(:mod:`ingest.distributed`) — holds :func:`index_lock` while it writes, and goes through
:class:`Commits`: a batch (or, when ``P`` does not stay in memory, a block with its first stage
cached on disk, :mod:`eogp_index.store.block_cache`) is encoded and stored as one Lance commit, so
a reader (or a rerun after a kill) sees whole batches only; after each commit the block's cache is
dropped and the table compacted past ``optimize_threshold`` small fragments; after the last one the
index is left ready to query (:func:`~eogp_index.store.maintenance.after_ingest`) and, with a
rescoring tier, the one-bit code's recall of its top rows measured on the table
(:func:`~eogp_index.store.table_recall.record_table_recall`), which sets the default rescoring factor.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import pyarrow as pa

from eogp_index.config import IngestConfig
from eogp_index.data import location as locations
from eogp_index.data.location import RemotePath
from eogp_index.data.records import Example
from eogp_index.errors import ConfigError
from eogp_index.store.maintenance import after_ingest, maybe_optimize
from eogp_index.store.table_recall import record_table_recall

#: The lock file in the index directory; it holds the pid of the ingest writing.
LOCK_FILE = "ingest.lock"


@contextlib.contextmanager
def index_lock(index_path: Path) -> Iterator[None]:
    """Hold ``<index>/ingest.lock`` for a run, so that two ingests never write one index at once.

    An advisory ``flock``: the kernel drops it when the process dies, so a killed ingest never
    leaves a stale lock. Where ``fcntl`` does not exist (Windows) there is no lock. An index in an
    object store holds a lease object instead (:func:`_object_lock`).

    Raises:
        ConfigError: another process holds it (naming its pid).
    """
    location = locations.index_path(index_path)
    if locations.is_remote(location):
        with _object_lock(location / LOCK_FILE, location):
            yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path = Path(location) / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(
                f"another ingest (pid {holder}) is writing to {index_path}; wait for it to finish or stop it "
                "(two ingests of the same shards at once would store examples twice)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing the descriptor releases the lock


#: A remote index's lock not renewed for this long is stale (its ingest died): the next takes it.
LEASE_S = 120.0
#: How often a running ingest renews its remote lock.
RENEW_S = 30.0
#: How long a remote lock's taker waits between its ``PUT`` and the read back: a rival that read
#: "no lock" before our ``PUT`` landed has written its own by then, and only the last ``PUT`` wins.
SETTLE_S = 1.0


def _lock_holder(path: RemotePath) -> Optional[dict]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):  # none (or not ours: taken over)
        return None
    return found if isinstance(found, dict) else None


def _stale(holder: dict) -> bool:
    """Whether a lock's ingest is gone: not renewed for :data:`LEASE_S`, or a process of this
    host that no longer runs."""
    if time.time() - float(holder.get("renewed", 0)) > LEASE_S:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
    return False


@contextlib.contextmanager
def _object_lock(path: RemotePath, where) -> Iterator[None]:
    """``<index>/ingest.lock`` in an object store: a lease object naming its host, pid and a token,
    renewed every :data:`RENEW_S` seconds by a background thread and deleted at the end.

    An object store has no ``flock``, and pyarrow's file systems offer no create-if-absent write,
    so taking the lock is a read, a ``PUT``, a wait of :data:`SETTLE_S` and a read back (the token
    must be ours). Object stores read their writes (S3, GCS and Azure are strongly consistent), so
    of rivals that all read "no lock" only the last ``PUT`` reads its own token back; both pass
    only if a rival's ``PUT`` lands more than :data:`SETTLE_S` after its read. The table stays
    consistent even then (Lance commits conditionally); what the lock prevents is the same shards
    stored twice. A lock whose ingest was killed is taken over once it is stale (:func:`_stale`).
    """
    holder = _lock_holder(path)
    if holder is not None and not _stale(holder):
        raise ConfigError(
            f"another ingest (pid {holder.get('pid')} on {holder.get('host')}) is writing to {where}; wait for "
            f"it to finish or stop it (two ingests of the same shards at once would store examples twice). A "
            f"killed ingest's lock ({path}) is taken over {LEASE_S:.0f} s after its last renewal"
        )
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
    path.write_text(json.dumps({**mine, "renewed": time.time()}))
    time.sleep(SETTLE_S)
    if (_lock_holder(path) or {}).get("token") != mine["token"]:
        raise ConfigError(f"another ingest took {path} at the same moment; wait for it to finish, then rerun")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_S):
            path.write_text(json.dumps({**mine, "renewed": time.time()}))

    renewer = threading.Thread(target=renew, name="eogp-ingest-lock", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        if (_lock_holder(path) or {}).get("token") == mine["token"]:
            path.unlink(missing_ok=True)


class Commits:
    """One writer's commits: encoding batches (or blocks), what follows each commit, the end.

    Args:
        encoder: the opened index's encoder.
        config: ``block_documents``, ``batch_size``, ``store_text`` and ``optimize_threshold`` apply.
        worker, workers: a torchrun worker's rank (its own block cache) and their number.
        default_rows: rows per commit when ``config.batch_size`` is None, outside block ingest
            (default :data:`~eogp_index.config.DEFAULT_COMMIT_ROWS`).

    Attributes:
        rows_per_commit: a block's documents in block ingest, else ``config``'s whole gradient batches.
        stored, tokens: examples committed by :meth:`run` and their tokens. optimized: compactions run.
    """

    def __init__(
        self,
        encoder,
        config: IngestConfig,
        *,
        worker: Optional[int] = None,
        workers: int = 1,
        default_rows: Optional[int] = None,
    ):
        self.encoder = encoder
        self.store_text = config.store_text
        self.threshold = config.optimize_threshold
        self.cache = encoder.block_cache(config, worker=worker, workers=workers)
        batch = encoder.gradients.batch_size
        if self.cache is not None:
            self.rows_per_commit = self.cache.documents
        elif default_rows is not None:
            self.rows_per_commit = config.commit_rows(batch, default=default_rows)
        else:
            self.rows_per_commit = config.commit_rows(batch)
        self.stored = self.tokens = self.optimized = 0

    def encode(
        self, batch: Sequence[Example], on_chunk: Optional[Callable[[Sequence[Example]], None]] = None
    ) -> pa.Table:
        """The Arrow rows of one commit (:meth:`~eogp_index.encode.encoder.Encoder.encode_commit`)."""
        return self.encoder.encode_commit(batch, cache=self.cache, on_chunk=on_chunk, store_text=self.store_text)

    def committed(self, *, optimize: bool = True) -> None:
        """After a commit: its block's cached batches are dropped; past the threshold the table
        is compacted (``optimize``: this process commits)."""
        if self.cache is not None:
            self.cache.clear()
        if optimize:
            self.optimize()

    def optimize(self) -> None:
        """Compact the table once more than the threshold of small fragments wait."""
        self.optimized += maybe_optimize(self.encoder.stored, threshold=self.threshold) is not None

    def run(
        self,
        batches: Iterable[Sequence[Example]],
        *,
        on_chunk: Optional[Callable[[Sequence[Example]], None]] = None,
        on_commit: Optional[Callable[[Sequence[Example]], None]] = None,
    ) -> None:
        """Store each batch in one commit; ``on_chunk(examples)`` after each gradient batch,
        ``on_commit(batch)`` after each commit. Empty batches are passed over."""
        for batch in batches:
            if not batch:
                continue
            self.encoder.store.add(self.encode(batch, on_chunk))  # one commit: all of the batch or none
            self.stored += len(batch)
            self.tokens += sum(example.num_tokens for example in batch)
            self.committed()
            if on_commit is not None:
                on_commit(batch)

    def finish(self, *, stored: Optional[int] = None, settle: bool = True, every_worker: bool = False) -> None:
        """After the last commit: the block a killed run left is dropped (``every_worker``: every
        worker's, once all are past their last commit), and a run that ``stored`` rows (default:
        :meth:`run`'s) leaves the index ready to query
        (:func:`~eogp_index.store.maintenance.after_ingest`, ``settle`` passed on) and records the
        recall measured on its table (:func:`~eogp_index.store.table_recall.record_table_recall`)."""
        if self.cache is not None:
            self.cache.clear_all() if every_worker else self.cache.clear()
        stored = self.stored if stored is None else stored
        if stored and self.threshold is not None:
            done = after_ingest(
                self.encoder.stored, optimized=self.optimized > 0, threshold=self.threshold, settle=settle
            )
            self.optimized += done is not None
        if stored:  # the default rescoring factor, measured again at the table's new size
            record_table_recall(self.encoder.stored)

    def close(self) -> None:
        """Close the block cache (its files stay for a rerun unless :meth:`finish` dropped them)."""
        if self.cache is not None:
            self.cache.close()
