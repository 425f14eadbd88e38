"""A served index in shards: long-lived Ray actors, each holding some of the table's fragments.

:class:`ShardActor` runs on a node of the cluster. It opens the index through
:class:`~eogp_index.store.stored_index.StoredIndex` (a local path or a URL, as every command
does) and holds the in-memory copy of only its fragments of one pinned table version
(:func:`~eogp_index.store.hot.fragments_in_memory`), which the one-process searchers scan
unchanged (:class:`~eogp_index.search.searchers.HotSearcher`: the same kernels, filters and
normalization).

:class:`ShardPool` is the ingress's side: it starts the actors, splits the current table
version's fragments among them (:func:`~eogp_index.cluster.runtime.fragment_shards`) and sends
every call to every shard with the shard's assignment ``(version, fragment ids)``. An actor
whose copy is not of that assignment rebuilds it first (reusing its unchanged fragments): so a
new table version is taken up on the ingress's next refresh, and an actor Ray restarted after a
crash rebuilds its copy on its first call, without a restart of the server.

Faults: actors are created with ``max_restarts``, so Ray restarts a dead one; a call whose actor
died is sent again once; a shard that still does not answer, or runs past the shard timeout, is
missing. A missing shard is an error naming it (:class:`~eogp_index.errors.ShardUnavailableError`)
unless the question allows a partial answer, which then says which shards answered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from eogp_index.cluster.merge import RollUpPart
from eogp_index.cluster.runtime import connect, fragment_shards
from eogp_index.errors import ConfigError, EOGPError, ShardUnavailableError
from eogp_index.store.stored_index import StoredIndex

log = logging.getLogger("eogp.cluster")

#: How often Ray restarts a shard's actor that died (each restart rebuilds its copy).
MAX_RESTARTS = 8
#: Seconds a shard may take to build its copy when the split changes (a first load reads its
#: fragments from the table).
LOAD_TIMEOUT_S = 3600.0
#: Seconds ``/healthz`` waits for a shard to say it is alive.
HEALTH_TIMEOUT_S = 2.0

#: A shard's assignment: the table version and its fragment ids.
Assignment = Tuple[int, Tuple[int, ...]]


class ShardIndex(StoredIndex):
    """A :class:`StoredIndex` whose hot copy holds only some fragments of a pinned table version
    (:meth:`assign`); the searchers read it through :meth:`hot_codes` as they read a whole copy."""

    assignment: Optional[Assignment] = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: first pass name -> (the fragments it covers, the first pass over the shard's rows)
        self._first_passes: Dict[str, Tuple[tuple, Any]] = {}
        self._first_pass_lock = threading.Lock()

    def assign(self, version: int, fragment_ids: Sequence[int]) -> None:
        """Hold the copy of ``fragment_ids`` of table ``version``: kept when it already is, else
        rebuilt from the previous copy's unchanged fragments and the table's new ones."""
        from eogp_index.store.hot import HotCodes, fragments_in_memory

        wanted: Assignment = (int(version), tuple(int(f) for f in fragment_ids))
        if wanted == self.assignment:
            return
        if not wanted[0]:  # no table yet: nothing to hold
            self._hot = HotCodes(rowaddr=np.zeros(0, np.uint64), encoded=self.codec.empty(), version=0)
        else:
            dataset = self.store.dataset()
            if dataset.version != wanted[0]:
                dataset = dataset.checkout_version(wanted[0])
            self._hot = fragments_in_memory(dataset, self.codec, wanted[1], previous=self._hot)
            _trim_heap()
        self.assignment = wanted
        rows = tuple(sorted(self._hot.cache.get("fragments", {})))
        with self._first_pass_lock:  # first passes over rows the shard no longer holds: freed now
            self._first_passes = {name: held for name, held in self._first_passes.items() if held[0] == rows}

    def matching_rows(self, where: Optional[str], hot=None):
        """:meth:`StoredIndex.matching_rows` over the shard's rows: a filter DataFusion does not
        plan is answered by Lance over the table, kept to the shard's rows (:class:`_ShardRows`)."""
        if where is None:
            return None
        from eogp_index.store.filters import matching_positions

        hot = self.hot_codes() if hot is None else hot
        return matching_positions(hot, where, _ShardRows(self.store, hot))

    def first_pass(self, name: str):
        """First pass ``name`` over the shard's rows (:meth:`FirstPass.over_rows
        <eogp_index.search.first_pass.base.FirstPass.over_rows>`): of the kind and build parameters
        of the index's saved one, built from the rows the shard holds on the first candidates
        question, and kept until the shard's fragments change (a new fragment, new deletions, a
        compaction: a refresh that gives the shard other rows rebuilds it).

        Raises:
            IndexNotFoundError: the index has no first pass ``name`` (``eogp build-candidates``).
            IncompatibleIndexError: it was made from other codes.
        """
        from eogp_index.search.first_pass import FirstPass

        rows = tuple(sorted(self.hot_codes().cache.get("fragments", {})))  # (fragment id, physical, deleted rows)
        with self._first_pass_lock:  # two calls at once (max_concurrency) build it once
            held = self._first_passes.get(name)
            if held is None or held[0] != rows:
                kind, meta = FirstPass.saved(self.path, name)
                self._first_passes[name] = (rows, kind.over_rows(self, meta))
            return self._first_passes[name][1]

    def first_pass_rows(self) -> Dict[str, int]:
        """``{name: rows}`` of the first passes the shard holds (``/healthz``)."""
        held = dict(self._first_passes)  # a copy (one C call): /healthz never waits for a build's lock
        return {name: first_pass.ntotal for name, (_, first_pass) in held.items()}

    def candidates_top_k(self, y: np.ndarray, k: int, C: int, sides, where: Optional[str], name: str):
        """Each query's best ``k`` per side among the shard's rows that first pass ``name`` picks
        (``C`` per side), scored exactly: what one process's
        :class:`~eogp_index.search.searchers.CandidateSearcher` answers, over the shard's rows."""
        from eogp_index.search.ranking import Hits

        y = self.one_bit(y)
        if self.hot_codes().num_rows == 0:
            return [{side: Hits.empty() for side in sides} for _ in range(y.shape[0])]
        first_pass = self.first_pass(name)
        found = []
        for q in range(y.shape[0]):
            scored = first_pass.top_k(self, y[q : q + 1], k, C, sides, where=where)
            found.append({side: Hits.best(rowaddr, scores, k, side) for side, (rowaddr, scores, _) in scored.items()})
        return found

    def hot_codes(self, *, consolidate: bool = False):
        if self._hot is None:
            raise ConfigError("this shard holds no fragments yet: the ingress assigns them before any query")
        return self._hot

    def loaded_hot(self):
        return self._hot


class _ShardRows:
    """The table as a shard's filters read it: :meth:`read` keeps only the rows of the shard's copy
    (``hot``); everything else is the :class:`~eogp_index.store.table.Store`'s."""

    def __init__(self, store, hot):
        self._store = store
        self._hot = hot

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def read(self, columns, where: Optional[str] = None, *, with_row_address: bool = False):
        import pyarrow as pa

        table = self._store.read(columns, where, with_row_address=True)
        rowaddr = table.column("_rowaddr").to_numpy().astype(np.uint64)
        at = np.minimum(np.searchsorted(self._hot.rowaddr, rowaddr), max(0, self._hot.num_rows - 1))
        keep = self._hot.rowaddr[at] == rowaddr if self._hot.num_rows else np.zeros(rowaddr.shape, bool)
        table = table.filter(pa.array(keep))
        return table if with_row_address else table.drop_columns(["_rowaddr"])


class ShardActor:
    """One shard (a Ray actor: ``ray.remote(ShardActor)``). Every call takes the shard's
    :data:`Assignment` and brings the copy to it first.

    Args:
        index: the index's path or URL, as the ingress opened it.
        shard: the shard's number (0 to N-1).
    """

    def __init__(self, index: str, shard: int):
        self.shard = int(shard)
        self.stored = ShardIndex.open(index)

    def _at(self, assignment: Assignment) -> ShardIndex:
        self.stored.assign(*assignment)
        return self.stored

    def load(self, assignment: Assignment) -> Dict[str, Any]:
        """Build the copy of ``assignment``; :meth:`info`."""
        self._at(assignment)
        return self.info()

    def info(self) -> Dict[str, Any]:
        """``{shard, fragments, rows, version, node, pid, code_bytes, hot_bytes, rss_bytes}``: what
        ``/healthz`` lists (``code_bytes``: the codes it holds, in scanning dtypes; ``hot_bytes``:
        its whole copy, row addresses and metadata too; ``rss_bytes``: its process's resident memory)."""
        import ray

        assignment = self.stored.assignment
        hot = self.stored.loaded_hot()
        return {
            "shard": self.shard,
            "fragments": list(assignment[1]) if assignment else [],
            "rows": hot.num_rows if hot is not None else 0,
            "version": assignment[0] if assignment else None,
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "code_bytes": int(sum(v.nbytes for v in hot.encoded.columns().values())) if hot is not None else 0,
            "hot_bytes": _hot_bytes(hot),
            "rss_bytes": _rss_bytes(),
            "first_passes": self.stored.first_pass_rows(),
        }

    def top_k(self, assignment: Assignment, y: np.ndarray, k: int, sides, where, normalize: str):
        """The shard's exact top ``k`` per query and side (``HotSearcher.top_k``), timed:
        ``(found, seconds)``."""
        from eogp_index.search.searchers import HotSearcher

        stored = self._at(assignment)
        started = time.perf_counter()
        found = HotSearcher(stored, normalize=normalize).top_k(y, k, sides, where)
        return found, time.perf_counter() - started

    def candidates(self, assignment: Assignment, y: np.ndarray, k: int, C: int, sides, where, name: str):
        """The shard's best ``k`` per query and side among first pass ``name``'s ``C`` candidates
        per side over its rows, scored exactly (:meth:`ShardIndex.candidates_top_k`), timed:
        ``(found, seconds)``; the first call after its fragments change builds the first pass."""
        stored = self._at(assignment)
        started = time.perf_counter()
        found = stored.candidates_top_k(y, k, C, sides, where, name)
        return found, time.perf_counter() - started

    def roll_up(self, assignment: Assignment, y: np.ndarray, where, normalize: str, column: str, n: int):
        """Per query, the shard's :class:`~eogp_index.cluster.merge.RollUpPart` (None: no row of
        the shard matches ``where``), its best ``n`` rows per side included; ``(parts, seconds)``."""
        from eogp_index.search.rollup import group_codes, group_sums, top_positions
        from eogp_index.search.searchers import HotSearcher

        stored = self._at(assignment)
        started = time.perf_counter()
        hot = stored.hot_codes()
        rows = stored.matching_rows(where, hot)
        if hot.num_rows == 0 or (rows is not None and rows.size == 0):
            return [None] * y.shape[0], time.perf_counter() - started
        rowaddr, scores = HotSearcher(stored, normalize=normalize).scores(y, where)
        kept = hot.cache.setdefault("shard_group_codes", {})
        if (column, where) not in kept:
            values = hot.filterable.column(column)
            kept.clear()  # one roll-up column and filter at a time: 4 bytes a row
            kept[(column, where)] = group_codes(values if rows is None else values.take(rows))
        keys, index = kept[(column, where)]
        parts = []
        for row in scores:
            largest, smallest = top_positions(row, n)
            top = {
                "positive": (rowaddr[largest], row[largest], index[largest]),
                "negative": (rowaddr[smallest], row[smallest], index[smallest]),
            }
            parts.append(RollUpPart(keys, tuple(group_sums(index, row, len(keys))), top))
        return parts, time.perf_counter() - started


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``): reading the
    fragments leaves Lance's freed record batches in malloc's arenas, resident until trimmed."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _hot_bytes(hot) -> int:
    """Bytes of a shard's in-memory copy: codes, row addresses and the other columns."""
    if hot is None:
        return 0
    codes = sum(v.nbytes for v in hot.encoded.columns().values())
    return int(codes + hot.rowaddr.nbytes + hot.columns.nbytes)


def _rss_bytes() -> Optional[int]:
    """This process's resident memory in bytes (``VmRSS``; None where /proc is not)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fragments(stored: StoredIndex) -> Tuple[int, List[Tuple[int, int]]]:
    """The table's current version and its fragments' ``(id, live rows)`` (metadata only)."""
    dataset = stored.store.dataset()
    if dataset is None:
        return 0, []
    fragments = [(int(f.fragment_id), int(f.physical_rows) - int(f.num_deletions)) for f in dataset.get_fragments()]
    return int(dataset.version), fragments


class ShardPool:
    """The ingress's handle on the shards: N actors, their assignments, and calls to all of them.

    Args:
        index: the index's path or URL (each actor opens it on its node).
        shards: how many actors (``--shards``).
        address: the Ray cluster to join (``--ray ADDRESS``); None: start a local Ray.
        timeout_s: seconds a shard may take to answer one call (``--shard-timeout``).
    """

    def __init__(self, index: str, shards: int, *, address: Optional[str] = None, timeout_s: float = 30.0):
        if shards < 1:
            raise ConfigError(f"--shards must be at least 1, got {shards}")
        if not timeout_s > 0:
            raise ConfigError(f"--shard-timeout must be positive, got {timeout_s}")
        self.ray = connect(address)
        self.index = str(index)
        self.timeout_s = float(timeout_s)
        self.actors = [self.new_actor(i) for i in range(shards)]
        self.assignments: List[Assignment] = [(0, ()) for _ in range(shards)]
        self.version: Optional[int] = None
        #: which shards answered the calls since :meth:`begin` (``answered``; ``missing``: id and reason)
        self.report: Dict[str, Any] = {"answered": [], "missing": []}
        #: the slowest shard's own seconds in the calls since :meth:`begin` (its scan, without transfers)
        self.shard_seconds = 0.0
        #: the seconds of the calls since :meth:`begin`, from sending them to the last answer received
        self.call_seconds = 0.0

    def __len__(self) -> int:
        return len(self.actors)

    def new_actor(self, shard: int):
        """A new actor for shard ``shard`` (its copy is built on its first call): on the cluster's
        alive nodes in turn (shard ``i`` on node ``i mod nodes``, by node id), restarted by Ray when
        its process dies, with two threads so that ``/healthz`` is answered during a long scan.
        An actor gone for good (its node gone) is replaced by a new one by :meth:`call`."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(n["NodeID"] for n in self.ray.nodes() if n.get("Alive"))
        # Pinned to its node (Ray's SPREAD and soft affinity are best effort: actors that reserve
        # no CPU may share one node); a node's death makes it gone for good, and it is replaced.
        strategy = NodeAffinitySchedulingStrategy(nodes[shard % len(nodes)], soft=False) if nodes else "SPREAD"
        remote = self.ray.remote(ShardActor).options(
            num_cpus=0,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,
            max_concurrency=2,
            scheduling_strategy=strategy,
        )
        return remote.remote(self.index, shard)

    # -- the split ------------------------------------------------------------------------------------
    def refresh(self, stored: StoredIndex) -> bool:
        """Split the table's current version among the shards when it is not the one they hold,
        and have each build its copy (in parallel); True when the split changed."""
        stored.store.refresh()
        if self.version == stored.store.version:
            return False
        version, fragments = _fragments(stored)
        split = fragment_shards(fragments, len(self.actors))
        self.assignments = [(version, tuple(ids)) for ids in split]
        refs = [actor.load.remote(a) for actor, a in zip(self.actors, self.assignments)]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=LOAD_TIMEOUT_S)
        for shard, ref in enumerate(refs):
            try:
                info = self.ray.get(ref, timeout=0) if ref in ready else None
            except Exception as exc:  # noqa: BLE001 - reported; its next call loads it again
                info = None
                log.warning("shard %d could not load table version %d: %s", shard, version, exc)
            if info is not None:
                log.info("shard %d holds %d rows of version %d", shard, info["rows"], version)
        self.version = version
        return True

    # -- calls to every shard ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a new report of which shards answered (one per scan)."""
        self.report = {"answered": [], "missing": []}
        self.shard_seconds = 0.0
        self.call_seconds = 0.0

    def call(self, method: str, *args, allow_partial: bool = False) -> List[Any]:
        """``method(assignment, *args)`` on every shard; the answers of those that answered, in
        shard order. A shard whose actor died is asked once more (Ray restarts it); one that runs
        past the timeout is not.

        Raises:
            ShardUnavailableError: a shard did not answer and ``allow_partial`` is false.
            EOGPError: what a shard raised on purpose (a filter it refuses), as raised.
        """
        ray = self.ray
        started = time.perf_counter()
        args = tuple(ray.put(a) if isinstance(a, np.ndarray) else a for a in args)  # one copy for all shards
        answers: Dict[int, Any] = {}
        missing: Dict[int, str] = {}
        todo = list(range(len(self.actors)))
        gone = set()  # shards whose actor is dead for good (its restarts spent, or its node gone)
        for attempt in range(2):
            refs = {i: getattr(self.actors[i], method).remote(self.assignments[i], *args) for i in todo}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
            ready = set(ready)
            died = []
            for i, ref in refs.items():
                if ref not in ready:
                    ray.cancel(ref)
                    missing[i] = f"no answer within the shard timeout of {self.timeout_s:g} s (--shard-timeout)"
                    continue
                try:
                    answers[i] = ray.get(ref)
                    missing.pop(i, None)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, EOGPError):
                        raise cause from None
                    missing[i] = f"it failed: {str(exc).splitlines()[0][:300]}"
                except ray.exceptions.RayActorError as exc:  # died, or unavailable while Ray restarts it
                    missing[i] = f"its actor died ({type(exc).__name__}) and did not answer again after a retry"
                    died.append(i)
                    if isinstance(exc, ray.exceptions.ActorDiedError):
                        gone.add(i)
            if not died or attempt:
                break
            log.warning("shards %s died during a query; asking them again once Ray has restarted them", died)
            for i in died:
                self._wait_restarted(i)
            todo = died
        self.call_seconds += time.perf_counter() - started
        for i in sorted(gone & set(missing)):  # the next call finds a new actor, on a node alive now
            log.warning("shard %d is gone for good; starting a new actor for it", i)
            self.actors[i] = self.new_actor(i)
        self._record(answers, missing, allow_partial)
        return [answers[i] for i in sorted(answers)]

    def _wait_restarted(self, shard: int) -> None:
        """Wait, at most the shard timeout, until Ray has restarted shard ``shard``'s actor (a call
        to a restarting actor fails at once rather than wait for it)."""
        ray = self.ray
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[shard].info.remote(), timeout=max(0.0, deadline - time.monotonic()))
                return
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.05)  # the call reached the dying process; Ray is restarting it
            except (ray.exceptions.ActorDiedError, ray.exceptions.GetTimeoutError):
                return  # gone for good (restarts spent, or killed for good), or past the timeout

    def _record(self, answers: Dict[int, Any], missing: Dict[int, str], allow_partial: bool) -> None:
        for i, answer in answers.items():
            if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], float):
                self.shard_seconds = max(self.shard_seconds, answer[1])
        known = {m["shard"] for m in self.report["missing"]}
        self.report["missing"] += [{"shard": i, "reason": why} for i, why in sorted(missing.items()) if i not in known]
        gone = {m["shard"] for m in self.report["missing"]}
        self.report["answered"] = [i for i in range(len(self.actors)) if i not in gone]
        if missing and not allow_partial:
            named = "; ".join(
                f"shard {i} of {len(self.actors)} (fragments {list(self.assignments[i][1])}): {why}"
                for i, why in sorted(missing.items())
            )
            raise ShardUnavailableError(
                f"{named}. Retry the query (a restarted shard rebuilds its copy first), or send "
                '"allow_partial": true to be answered by the shards that answer',
                shards=sorted(missing),
            )

    # -- health ---------------------------------------------------------------------------------------
    def health(self) -> List[Dict[str, Any]]:
        """Each shard: ``{shard, fragments, rows, version, node, alive}`` (a shard that does not
        answer within :data:`HEALTH_TIMEOUT_S` is listed from its assignment, not alive)."""
        refs = [actor.info.remote() for actor in self.actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=HEALTH_TIMEOUT_S)
        ready = set(ready)
        out = []
        for i, ref in enumerate(refs):
            info = None
            if ref in ready:
                try:
                    info = self.ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead actor: listed as not alive
                    info = None
            if info is None:
                version, fragments = self.assignments[i]
                info = {"shard": i, "fragments": list(fragments), "rows": None, "version": version, "node": None}
            info["alive"] = ref in ready and info.get("node") is not None
            out.append(info)
        return out

    def close(self) -> None:
        """End the actors (the Ray cluster keeps running)."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
