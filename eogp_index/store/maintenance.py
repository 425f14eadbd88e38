"""Keeping a table fast: compaction, scalar indexes, old versions and the hot copy (``eogp optimize``).

Every ingest commit adds one fragment (a data file) and one version (a manifest, which lists
every fragment). Left alone, 10M rows in 256-row commits are 39k fragments: each commit then
rewrites a manifest of 39k entries, each query plans over 39k files, and the table's history
holds 39k manifests (``benchmarks/commits.py`` measures it). :func:`optimize`

1. **compacts** runs of small fragments into fragments of about ``target_rows`` rows (Lance's
   ``compact_files``, which keeps the rows' order and drops deleted rows);
2. **refreshes the scalar indexes** (``eogp index-column``) so that they cover rows added since
   they were built (Lance's ``optimize_indices``);
3. **removes versions** older than ``retention``, and the files only they used (Lance's
   ``cleanup_old_versions``; never files an ingest still writing may own);
4. **rebuilds the hot copy** (:mod:`eogp_index.store.hot`) as one segment of the new version,
   which the next process maps without reading the table.

Ingest calls it by itself once more than ``DEFAULT_FRAGMENT_THRESHOLD`` small fragments have
piled up (:func:`needs_optimize`), without step 4 (the rows are still moving), and once at its
end with step 4. A compaction only rewrites fragments smaller than ``target_rows``: the
threshold bounds how often the tail of the table is rewritten, the target how large it grows.

Example:
    >>> from eogp_index.store.maintenance import optimize, needs_optimize
    >>> report = optimize(stored_index)  # doctest: +SKIP
    >>> print(report.describe())  # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional

from eogp_index.config import DEFAULT_FRAGMENT_THRESHOLD
from eogp_index.errors import ConfigError
from eogp_index.store.table import Store

#: Rows per fragment after compaction: ~70 MB of 1-bit codes at 272 B per row, few enough
#: fragments at 10M rows (~40) and little rewritten when the tail is compacted again.
DEFAULT_TARGET_ROWS = 1 << 18
#: Versions older than this are removed (with the files only they use). Long enough for any
#: reader to have moved to a newer version; short enough that an ingest's thousands of commits
#: do not pile up as manifests.
DEFAULT_RETENTION = timedelta(hours=1)

#: During an ingest, old versions are removed at most once per this fraction of the retention.
CLEANUP_INTERVAL = 0.25


@dataclass(frozen=True)
class OptimizeReport:
    """What :func:`optimize` did.

    fragments_before, fragments_after: fragments of the table before and after.
    fragments_removed, fragments_added: compaction's rewrite (0, 0 when nothing was small).
    indices: scalar indexes refreshed. versions_removed, bytes_removed: the cleanup's.
    version_before, version_after: the table's version before and after; rows: its rows.
    hot_rows: rows of the rebuilt hot copy (None when it was not rebuilt).
    seconds: wall time; steps: seconds per step (compact, indices, cleanup, hot).
    """

    fragments_before: int
    fragments_after: int
    fragments_removed: int
    fragments_added: int
    indices: List[str]
    versions_removed: int
    bytes_removed: int
    version_before: int
    version_after: int
    rows: int
    hot_rows: Optional[int]
    seconds: float
    steps: Dict[str, float]

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One human line."""
        text = (
            f"{self.fragments_before} → {self.fragments_after} fragments ({self.rows} rows), "
            f"{len(self.indices)} scalar indexes refreshed, {self.versions_removed} old versions removed "
            f"({self.bytes_removed / 1e6:.1f} MB), table version {self.version_before} → {self.version_after}"
        )
        if self.hot_rows is not None:
            text += f", hot copy rebuilt ({self.hot_rows} rows)"
        return text + f" in {self.seconds:.1f}s"


def _parts(store_or_index):
    """``(store, stored index or None)`` of a Store, a StoredIndex or an AttributionIndex."""
    stored = getattr(store_or_index, "stored", store_or_index)  # AttributionIndex → its StoredIndex
    if isinstance(stored, Store):
        return stored, None
    store = getattr(stored, "store", None)
    if not isinstance(store, Store):
        raise ConfigError(
            f"optimize needs a Store, a StoredIndex or an AttributionIndex, got {type(store_or_index).__name__}"
        )
    return store, stored


def small_fragments(store: Store, *, target_rows: int = DEFAULT_TARGET_ROWS) -> int:
    """Fragments of the latest version with fewer than ``target_rows`` rows (manifest only)."""
    dataset = store.table
    if dataset is None:
        return 0
    return sum(1 for f in dataset.get_fragments() if f.physical_rows < target_rows)


def needs_optimize(
    store: Store, *, threshold: int = DEFAULT_FRAGMENT_THRESHOLD, target_rows: int = DEFAULT_TARGET_ROWS
) -> bool:
    """Whether more than ``threshold`` small fragments wait for compaction."""
    store = _parts(store)[0]
    return small_fragments(store, target_rows=target_rows) > threshold


def optimize(
    store_or_index,
    *,
    retention: Optional[timedelta] = DEFAULT_RETENTION,
    rebuild_hot: bool = True,
    target_rows: int = DEFAULT_TARGET_ROWS,
    settle: bool = True,
) -> OptimizeReport:
    """Compact the table, refresh its scalar indexes, remove old versions, rebuild the hot copy.

    Safe while other processes read the table or append to it (Lance's commits resolve a
    compaction against concurrent appends); a reader holding a version older than
    ``retention`` may lose its files.

    Args:
        store_or_index: a :class:`~eogp_index.store.table.Store`, or an index
            (:class:`~eogp_index.store.stored_index.StoredIndex` or ``AttributionIndex``), whose
            hot copy can then be rebuilt.
        retention: remove versions older than this (``timedelta(0)``: every version but the
            latest); None keeps every version.
        rebuild_hot: rebuild the hot copy as one segment of the new version (an index only).
        target_rows: rows per fragment after compaction.
        settle: before rebuilding the hot copy, wait (up to a second) until the last commit is
            old enough for the copy to record its table's stamp (see :func:`after_ingest`).

    Returns:
        An :class:`OptimizeReport`.
    """
    if isinstance(target_rows, bool) or not isinstance(target_rows, int) or target_rows < 1:
        raise ConfigError(f"target_rows must be a positive int, got {target_rows!r}")
    if retention is not None and (not isinstance(retention, timedelta) or retention < timedelta(0)):
        raise ConfigError(f"retention must be a non-negative datetime.timedelta or None, got {retention!r}")
    store, stored = _parts(store_or_index)
    started = time.perf_counter()
    steps: Dict[str, float] = {}
    dataset = store.table
    if dataset is None:
        return OptimizeReport(0, 0, 0, 0, [], 0, 0, 0, 0, 0, None, 0.0, {})
    version_before = dataset.version
    fragments_before = len(dataset.get_fragments())

    t = time.perf_counter()
    metrics = dataset.optimize.compact_files(target_rows_per_fragment=target_rows, compaction_mode="try_binary_copy")
    store.refresh(force=True)
    steps["compact"] = time.perf_counter() - t

    t = time.perf_counter()
    indices = store.index_names()
    if indices:
        store.dataset().optimize.optimize_indices()
        store.refresh(force=True)
    steps["indices"] = time.perf_counter() - t

    t = time.perf_counter()
    versions_removed = bytes_removed = 0
    if retention is not None:
        # delete_unverified=False: data files a running ingest wrote but has not committed yet
        # look unreferenced, and must stay.
        stats = store.dataset().cleanup_old_versions(
            older_than=retention, delete_unverified=False, error_if_tagged_old_versions=False
        )
        versions_removed, bytes_removed = int(stats.old_versions), int(stats.bytes_removed)
        store.cleaned_at = time.monotonic()
        store.refresh(force=True)
    steps["cleanup"] = time.perf_counter() - t

    hot_rows = None
    if rebuild_hot and stored is not None:
        t = time.perf_counter()
        if settle:
            # Wait out the file system's timestamp granularity, so that the copy can record the
            # version directory's stamp and the next process map it without opening the table.
            store.settle()
        hot_rows = stored.hot_codes(consolidate=True).num_rows
        steps["hot"] = time.perf_counter() - t
    dataset = store.dataset()
    return OptimizeReport(
        fragments_before=fragments_before,
        fragments_after=len(dataset.get_fragments()),
        fragments_removed=int(metrics.fragments_removed),
        fragments_added=int(metrics.fragments_added),
        indices=indices,
        versions_removed=versions_removed,
        bytes_removed=bytes_removed,
        version_before=version_before,
        version_after=dataset.version,
        rows=dataset.count_rows(),
        hot_rows=hot_rows,
        seconds=round(time.perf_counter() - started, 3),
        steps={k: round(v, 3) for k, v in steps.items()},
    )


def maybe_optimize(
    stored, *, threshold: Optional[int] = DEFAULT_FRAGMENT_THRESHOLD, retention: timedelta = DEFAULT_RETENTION
) -> Optional[OptimizeReport]:
    """During an ingest, after a commit: :func:`optimize` (without the hot copy, the rows are still
    moving) once more than ``threshold`` small fragments wait; None when not due or
    ``threshold`` is None.

    Old versions are removed at most once per :data:`CLEANUP_INTERVAL` × ``retention`` through
    the same store: Lance's cleanup reads every version's manifest, and until versions age past
    ``retention`` there is nothing to remove, so cleaning at every compaction made each one
    slower than the last, for nothing.
    """
    store = _parts(stored)[0]
    if threshold is None or not needs_optimize(store, threshold=threshold):
        return None
    now = time.monotonic()
    due = store.cleaned_at is None or now - store.cleaned_at >= CLEANUP_INTERVAL * retention.total_seconds()
    return optimize(stored, rebuild_hot=False, retention=retention if due else None)


def after_ingest(
    stored, *, optimized: bool, threshold: Optional[int] = DEFAULT_FRAGMENT_THRESHOLD, settle: bool = True
) -> Optional[OptimizeReport]:
    """After an ingest's last commit, leave the index ready to query: :func:`optimize` (hot copy
    included) when the run compacted along the way or small fragments are due; else bring the
    hot copy up to date (only the new fragments are read from the table) as one segment, which
    the next process maps without copying. Returns the optimize report, if any.

    Args:
        stored: the index's :class:`~eogp_index.store.stored_index.StoredIndex`.
        optimized: whether the run already compacted (its hot copy is then one of older fragments).
        threshold: as in :func:`maybe_optimize`; None never optimizes.
        settle: wait (up to a second) until the last commit is old enough for the hot copy to
            record the stamp that lets another process open it without opening the table
            (:meth:`Store.settle <eogp_index.store.table.Store.settle>`); ``eogp ingest`` does,
            ``AttributionIndex.ingest`` (whose process usually queries next) does not.
    """
    if stored.store.version == 0:
        return None
    if threshold is not None and (optimized or needs_optimize(stored.store, threshold=threshold)):
        return optimize(stored, rebuild_hot=True, settle=settle)
    if settle:
        stored.store.settle()
    stored.hot_codes(consolidate=True)
    return None
