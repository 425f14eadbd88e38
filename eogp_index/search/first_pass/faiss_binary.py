"""The FAISS kinds: ``C`` candidates per side by weighted Hamming distance on the stored signs, rescored exactly.

The exact scan reads every stored row. For a store of millions of rows FAISS can pick ``C``
candidates whose codes (:mod:`~eogp_index.search.first_pass.faiss_codes`: stored signs replicated
``R`` times, queries weighted by ``|y|``) are Hamming-nearest to the query's, and only those are
rescored exactly with ``Σ_u s_iu⟨y_u, b_iu⟩``. Hamming cannot see the per-row scales, which
decide the top of a large store; docs/benchmarks.md measures what that costs in recall.

* **Kinds.** ``flat`` (exhaustive Hamming, ``IndexBinaryFlat``; on a machine with a GPU and a
  GPU build of FAISS the search runs on ``GpuIndexBinaryFlat``), ``ivf`` (``IndexBinaryIVF``)
  and ``hnsw`` (``IndexBinaryHNSW``). IVF's binary k-means is trained on a sample of the rows'
  *unreplicated* signs and its centroids are then replicated: FAISS's binary k-means runs on
  ±1 floats, where replicating every coordinate ``R`` times scales every squared distance by
  ``R`` and keeps the means replicated, so this is the same clustering for ``R×`` less work.
* **Keys.** FAISS ids are stable 63-bit hashes of the example ids
  (:func:`~eogp_index.search.first_pass.faiss_codes.id_keys`), not Lance row addresses (those
  change on compaction). The key → id mapping is saved next to the FAISS index, in FAISS
  insertion order; FAISS positions map to row addresses through the hot copy's ids once per
  table version (:meth:`FaissFirstPass.rowaddr_of`).
* **Files.** ``<index_dir>/faiss/<name>.faissindex`` (``faiss.write_index_binary``),
  ``<name>.ids.parquet`` (``key`` int64, ``id`` string; row ``p`` = FAISS position ``p``) and
  ``<name>.json`` (format ``eogp-faiss`` version 2, kind, ``replicas``, parameters, the table
  version and rows covered, and the hashes of the projection and model the codes were made
  with). Version 1 (unreplicated signs) is refused with a request to rebuild.
* **Freshness.** :meth:`FaissFirstPass.extend` adds the rows of the hot copy whose ids are not
  covered yet (replicated the same way), without rebuilding; a query calls it (through
  :meth:`~FaissFirstPass.refresh`) when the table has a newer version than the one recorded,
  so a query never silently misses ingested rows.

A build streams rows from Lance in record batches sized in bytes (``BATCH_BYTES``), reading
only ``id`` and ``signs``; the whole table is never held at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from abc import abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.search.first_pass.base import (
    FirstPass,
    FirstPassConfig,
    SideAnswer,
    build_param,
    commit,
    load_faiss,
    require_signs,
    search_param,
    temporary,
)
from eogp_index.search.first_pass.faiss_codes import (
    KEY_SCHEME,
    MAX_REPLICAS,
    check_unique,
    id_keys,
    query_codes,
    replicate_codes,
)
from eogp_index.store.codecs import SignLayout, unpack_signs
from eogp_index.store.table import list_column_to_numpy

#: Bytes of ``id`` + ``signs`` per record batch read from Lance.
BATCH_BYTES = 64 << 20
#: Rows added to FAISS per ``add`` call (HNSW and IVF parallelize within one call).
_ADD_ROWS = 1 << 16
#: GPU binary flat search keeps at most this many neighbours per query (FAISS's GPU k-select).
_GPU_MAX_K = 2048
#: The row address of a FAISS position whose row is no longer in the table.
MISSING_ROW = np.uint64(0xFFFF_FFFF_FFFF_FFFF)

_REPLICAS_HELP = (
    "R, copies of each stored sign bit in the FAISS code, so that a query can weight coordinate j "
    "by a level of |y_j| (faiss_codes); 1 = plain sign agreement. FAISS memory and distance cost "
    "are R× those of the signs; docs/benchmarks.md measures what R buys."
)


@dataclasses.dataclass(frozen=True)
class FaissBinaryConfig(FirstPassConfig):
    """What every FAISS kind is built with: the replicated codes."""

    replicas: int = build_param(1, _REPLICAS_HELP, min=1, max=MAX_REPLICAS)


@dataclasses.dataclass(frozen=True)
class FlatConfig(FaissBinaryConfig):
    """``flat``: exhaustive Hamming search, the C nearest codes exactly."""

    use_gpu: Literal["auto", "never"] = search_param(
        "auto",
        "auto: search on GpuIndexBinaryFlat when FAISS is a GPU build and sees a GPU; never: on the CPU.",
        choices=("auto", "never"),
    )


@dataclasses.dataclass(frozen=True)
class IVFConfig(FaissBinaryConfig):
    """``ivf``: inverted lists of a binary k-means; a query visits ``nprobe`` of them."""

    nlist: Optional[int] = build_param(None, "IVF lists; None = round(4·sqrt(n)) for the n rows at build time.", min=1)
    nprobe: int = search_param(16, "Lists visited per query (more = better recall, slower).", min=1)
    train_points_per_list: int = build_param(64, "k-means sample size per list (FAISS warns below 39).", min=1)
    train_iters: int = build_param(10, "k-means iterations.", min=1)


@dataclasses.dataclass(frozen=True)
class HNSWConfig(FaissBinaryConfig):
    """``hnsw``: a navigable small-world graph over the codes."""

    hnsw_m: int = build_param(32, "Neighbours per node.", min=1)
    ef_search: int = search_param(128, "Search beam (raised to C when C is larger).", min=1)
    ef_construction: int = build_param(40, "Build beam (lower = faster build, worse graph).", min=1)


class FaissFirstPass(FirstPass):
    """A FAISS binary index over the stored signs (the family of the ``flat``, ``ivf`` and ``hnsw`` kinds).

    Build with :meth:`build`, reopen with :meth:`FirstPass.load`, keep current with
    :meth:`extend`, search with :meth:`search` or answer a query side with :meth:`top_k`. A kind
    supplies :meth:`_new_index` (the empty FAISS index), :meth:`_saved_config` (its build
    parameters read back) and, where it has search parameters, :meth:`_prepare_search`.
    """

    FORMAT = "eogp-faiss"
    FORMAT_VERSION = 2
    OLD_FORMATS = {
        1: "version 1 stored plain signs; version 2 stores each sign bit `replicas` times so that "
        "queries can weight coordinates by |y|"
    }
    FILES = {"index": ".faissindex", "ids": ".ids.parquet", "meta": ".json"}

    def __init__(
        self,
        index_dir: Union[str, Path],
        name: str,
        config: FaissBinaryConfig,
        meta: Dict[str, Any],
        faiss_index,
        keys: np.ndarray,
        ids: pa.Array,
    ):
        super().__init__(index_dir, name, config, meta)
        self._index = faiss_index
        self._keys = np.ascontiguousarray(keys, dtype=np.int64)
        self._ids = ids
        self._addr: Optional[Tuple[int, np.ndarray]] = None  # (table version, rowaddr per position)
        self._lock = threading.Lock()
        self._reindex_keys()

    # -- what each FAISS kind supplies ---------------------------------------------------------
    @classmethod
    @abstractmethod
    def _new_index(
        cls, config: FaissBinaryConfig, nbytes: int, n: int, sample: Callable[[np.ndarray], np.ndarray]
    ) -> Tuple[Any, Dict[str, Any]]:
        """An empty (trained, where the kind trains) FAISS index for ``n`` rows of
        ``replicas·8·nbytes`` bits with ids, and the build parameters to record.

        ``sample(offsets)`` returns the ``(len(offsets), nbytes)`` uint8 *unreplicated* signs of
        the given rows.
        """
        raise NotImplementedError

    @classmethod
    def _saved_config(cls, meta: Dict[str, Any], config: FaissBinaryConfig) -> FaissBinaryConfig:
        """``config`` with the build parameters the JSON records."""
        return replace(config, replicas=int(meta["replicas"]))

    def _prepare_search(self, k: int) -> None:
        """Set the FAISS object's search parameters for ``k`` results (called under the lock)."""

    def _gpu_index(self):
        """A GPU copy to search instead of the CPU index, or None."""
        return None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def build(
        cls, stored, name: str = "default", config: Optional[FaissBinaryConfig] = None, *, progress: bool = False
    ) -> "FaissFirstPass":
        faiss = load_faiss()
        config = config or cls.Config()
        cls.paths(stored.path, name)  # a bad name fails now, not after the build
        require_signs(stored)
        nbytes = stored.layout.nbytes
        dataset = stored.store.dataset() if stored.store.table is not None else None
        n = dataset.count_rows() if dataset is not None else 0
        if n == 0:
            raise InputError(f"{stored.path}: no rows stored yet; ingest examples before building a first pass")

        def sample(offsets: np.ndarray) -> np.ndarray:
            # Training reads a uniform sample (random access by offset), not the first rows: tables
            # are usually ordered by shard, and the first shard is no sample of the corpus.
            return np.concatenate([signs for _, signs in _stream(dataset, nbytes, offsets=offsets)])

        faiss_index, params = cls._new_index(config, nbytes, n, sample)
        meta = {
            **cls.provenance(stored, name),
            "replicas": int(config.replicas),
            "params": params,
            "d_bits": int(config.replicas) * nbytes * 8,
            "key": KEY_SCHEME,
            "table_version": int(dataset.version),
            "rows": 0,
            "faiss_version": getattr(faiss, "__version__", "?"),
        }
        built = cls(
            stored.path,
            name,
            cls._saved_config(meta, config),
            meta,
            faiss_index,
            np.zeros(0, np.int64),
            pa.array([], pa.string()),
        )
        built._add_rows(
            _stream(dataset, nbytes), progress=progress, total=-(-n // _rows_per_batch(nbytes)), where=str(stored.path)
        )
        built.save()
        return built

    @classmethod
    def from_codes(
        cls,
        codes: np.ndarray,
        ids: Sequence[str],
        config: Optional[FaissBinaryConfig] = None,
        *,
        index_dir: Union[str, Path] = ".",
        name: str = "in-memory",
    ) -> "FaissFirstPass":
        """An index over codes held in memory, built exactly as :meth:`build` builds (benchmarks).

        Args:
            codes: ``(n, nbytes)`` uint8 packed signs, unreplicated (replicated here as ``config``
                says); row ``i`` gets FAISS position ``i``.
            ids: ``n`` example ids.

        Not tied to a table: :meth:`check_compatible` refuses every index, and :meth:`save`
        writes under ``index_dir`` only when called.
        """
        config = config or cls.Config()
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        if codes.ndim != 2 or codes.shape[0] != len(ids) or codes.shape[0] == 0:
            raise ConfigError(f"from_codes needs (n, nbytes) codes and n ids, n >= 1; got {codes.shape} and {len(ids)}")
        n, nbytes = codes.shape
        faiss_index, params = cls._new_index(config, nbytes, n, lambda offsets: codes[offsets])
        meta = {
            "format": cls.FORMAT,
            "format_version": cls.FORMAT_VERSION,
            "name": name,
            "kind": cls.kind,
            "replicas": int(config.replicas),
            "params": params,
            "d_bits": int(config.replicas) * nbytes * 8,
            "nbytes": nbytes,
            "k": [],
            "key": KEY_SCHEME,
            "table": None,
            "table_version": -1,
            "rows": 0,
            "projection_sha256": None,
            "weights_sha256": None,
        }
        built = cls(
            Path(index_dir),
            name,
            cls._saved_config(meta, config),
            meta,
            faiss_index,
            np.zeros(0, np.int64),
            pa.array([], pa.string()),
        )
        id_array = pa.array(list(ids), pa.string())
        step = _rows_per_batch(nbytes)
        built._add_rows(
            ((id_array[i : i + step], codes[i : i + step]) for i in range(0, n, step)),
            progress=False,
            total=0,
            where=name,
        )
        return built

    @classmethod
    def _open(cls, index_dir: Path, name: str, meta: Dict[str, Any], config: FaissBinaryConfig) -> "FaissFirstPass":
        import pyarrow.parquet as pq

        faiss = load_faiss()
        paths = cls.paths(index_dir, name)
        # read_index_binary returns the concrete class already; downcasting again would make a
        # non-owning proxy and let the owning one free the index.
        faiss_index = faiss.read_index_binary(str(paths["index"]))
        table = pq.read_table(paths["ids"])
        keys = table.column("key").to_numpy()
        ids = table.column("id").combine_chunks()
        if not (faiss_index.ntotal == len(keys) == meta["rows"]) or faiss_index.d != meta["d_bits"]:
            raise IncompatibleIndexError(
                f"{paths['dir']}: {name}.faissindex holds {faiss_index.ntotal} rows of {faiss_index.d} bits, "
                f"{name}.ids.parquet {len(keys)} rows and {name}.json says {meta['rows']} rows of "
                f"{meta['d_bits']} bits (an interrupted write?); rebuild it with {cls.rebuild_hint(index_dir, name)}"
            )
        return cls(index_dir, name, cls._saved_config(meta, config), meta, faiss_index, keys, ids)

    def save(self) -> None:
        """Write the three files atomically each (the JSON last: it commits the others)."""
        import pyarrow.parquet as pq

        faiss = load_faiss()
        paths = self.paths(self.index_dir, self.name)
        paths["dir"].mkdir(parents=True, exist_ok=True)
        faiss.write_index_binary(self._index, str(temporary(paths["index"])))
        pq.write_table(pa.table({"key": pa.array(self._keys, pa.int64()), "id": self._ids}), temporary(paths["ids"]))
        temporary(paths["meta"]).write_text(json.dumps(self.meta, indent=2) + "\n")
        commit([paths["index"], paths["ids"], paths["meta"]])

    # -- properties ----------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self._keys.shape[0])

    @property
    def replicas(self) -> int:
        """``R``: copies of each stored sign bit in the FAISS codes."""
        return int(self.meta["replicas"])

    @property
    def build_params(self) -> Dict[str, Any]:
        return {"replicas": self.replicas, **self.meta.get("params", {})}

    @property
    def code_bytes(self) -> int:
        """Bytes of a FAISS code (stored or query): ``replicas · nbytes``."""
        return int(self.meta["d_bits"]) // 8

    def query_codes(self, y: np.ndarray, layout: SignLayout) -> np.ndarray:
        """This index's weighted query codes ``(nq, code_bytes)`` of coordinates ``y`` ``(nq, K)``.

        See :func:`~eogp_index.search.first_pass.faiss_codes.query_codes`; pass ``-y`` for the
        most negative side.
        """
        if layout.nbytes != int(self.meta["nbytes"]) or (self.meta.get("k") and list(layout.k) != self.meta["k"]):
            raise ConfigError(
                f"layout k={list(layout.k)} does not match this FAISS index "
                f"(k={self.meta.get('k')}, {self.meta['nbytes']} sign bytes per row)"
            )
        return query_codes(y, layout, self.replicas)

    def row_codes(self, signs: np.ndarray) -> np.ndarray:
        """Stored signs ``(n, nbytes)`` → the FAISS codes ``(n, code_bytes)`` this index stores for them."""
        signs = np.asarray(signs, np.uint8)
        if signs.ndim != 2 or signs.shape[1] != int(self.meta["nbytes"]):
            raise ConfigError(f"signs must have shape (n, {self.meta['nbytes']}) uint8, got {signs.shape}")
        return replicate_codes(signs, self.replicas)

    # -- keeping current -----------------------------------------------------------------------
    def refresh(self, stored, *, progress: bool = False) -> "FaissFirstPass":
        self.extend(stored, progress=progress)
        return self

    def extend(self, stored, *, progress: bool = False) -> int:
        """Add the stored rows whose ids are not covered yet, and save; returns how many were added.

        Flat and HNSW add to the existing structure, IVF assigns new rows to its trained lists
        (no retraining: rebuild after the corpus has changed a lot). The ids and signs come from
        the hot copy (:meth:`StoredIndex.hot_codes`), not from the table. Rows deleted from the
        table stay in FAISS; they map to no row (:meth:`rowaddr_of`) and are dropped.
        """
        stored = getattr(stored, "stored", stored)
        self.check_compatible(stored)
        hot = stored.hot_codes()
        ids = hot.columns.column("id").combine_chunks() if hot.num_rows else pa.array([], pa.string())
        known = pc.is_in(ids, value_set=self._ids).to_numpy(zero_copy_only=False) if len(ids) else np.zeros(0, bool)
        new = np.flatnonzero(~known)
        before = self.ntotal
        if new.size:
            step = _rows_per_batch(int(self.meta["nbytes"]))
            batches = (
                (ids.take(pa.array(new[a : a + step])), np.asarray(hot.codes[new[a : a + step]]))
                for a in range(0, new.size, step)
            )
            self._add_rows(batches, progress=progress, total=-(-new.size // step), where=str(stored.path))
        self.meta["table_version"] = int(hot.version)
        self.save()
        return self.ntotal - before

    def rowaddr_of(self, stored, positions: np.ndarray) -> np.ndarray:
        """FAISS insertion positions → the rows' current Lance addresses ``(…,)`` uint64
        (:data:`MISSING_ROW` for ``-1`` and for rows no longer in the table).

        The mapping is made once per table version, by joining this index's ids with the hot
        copy's (a compaction moves rows: their addresses change, their ids do not); a query
        then looks addresses up by position, without reading the table.
        """
        stored = getattr(stored, "stored", stored)
        hot = stored.hot_codes()
        with self._lock:
            if self._addr is None or self._addr[0] != hot.version or self._addr[1].size != self.ntotal:
                addr = np.full(self.ntotal, MISSING_ROW, np.uint64)
                if hot.num_rows and self.ntotal:
                    at = pc.index_in(self._ids, value_set=hot.columns.column("id").combine_chunks())
                    at = at.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
                    addr[at >= 0] = hot.rowaddr[at[at >= 0]]
                self._addr = (hot.version, addr)
            addr = self._addr[1]
        positions = np.asarray(positions, np.int64)
        out = np.full(positions.shape, MISSING_ROW, np.uint64)
        valid = (positions >= 0) & (positions < addr.size)
        out[valid] = addr[positions[valid]]
        return out

    def _add_rows(self, batches, *, progress: bool, total: int, where: str) -> None:
        with self._lock:  # FAISS add is not safe against a concurrent search of the same object
            keys_parts, id_parts = [self._keys], [self._ids]
            for ids, signs in _progress(batches, progress, "FAISS add", total=total):
                keys = id_keys(ids.to_pylist())
                for start in range(0, len(keys), _ADD_ROWS):
                    chunk = slice(start, start + _ADD_ROWS)
                    self._index.add_with_ids(replicate_codes(signs[chunk], self.replicas), keys[chunk])
                keys_parts.append(keys)
                id_parts.append(ids.cast(pa.string()))
            keys = np.concatenate(keys_parts)
            ids = pa.concat_arrays([a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in id_parts])
            check_unique(keys, ids, where)  # raised before save(): a bad build is never committed
            self._keys, self._ids = keys, ids
            self.meta["rows"] = int(len(keys))
            self._reindex_keys()

    def _reindex_keys(self) -> None:
        self._order = np.argsort(self._keys, kind="stable")
        self._sorted_keys = self._keys[self._order]

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """FAISS keys → insertion positions ``(…,)`` int64, ``-1`` for unknown keys and ``-1`` labels."""
        keys = np.asarray(keys, dtype=np.int64)
        if self._sorted_keys.size == 0:
            return np.full(keys.shape, -1, np.int64)
        idx = np.clip(np.searchsorted(self._sorted_keys, keys), 0, self._sorted_keys.size - 1)
        found = (self._sorted_keys[idx] == keys) & (keys >= 0)
        return np.where(found, self._order[idx], -1).astype(np.int64)

    # -- searching -----------------------------------------------------------------------------
    def search_with_distances(self, query_codes: np.ndarray, C: int) -> Tuple[np.ndarray, np.ndarray]:
        """The ``C`` Hamming-nearest rows per query.

        Args:
            query_codes: ``(nq, code_bytes)`` uint8 FAISS codes: :meth:`query_codes` of query
                coordinates (weighted), or :meth:`row_codes` of stored signs.
            C: candidates per query (``>= 1``; at most ``ntotal`` are found).

        Returns:
            ``distances`` ``(nq, C)`` int32 Hamming distances (``-1`` where fewer than ``C`` were
            found) and ``positions`` ``(nq, C)`` int64 FAISS insertion positions (``-1`` likewise),
            nearest first.
        """
        codes = np.ascontiguousarray(query_codes, dtype=np.uint8)
        width = self.code_bytes
        if codes.ndim != 2 or codes.shape[1] != width:
            raise ConfigError(
                f"query codes must have shape (nq, {width}) uint8 ({self.replicas} replicas of "
                f"{self.meta['nbytes']} sign bytes; see query_codes), got {codes.shape}"
            )
        C = int(C)
        if C < 1:
            raise ConfigError(f"C (candidates) must be >= 1, got {C}")
        nq = codes.shape[0]
        distances = np.full((nq, C), -1, np.int32)
        positions = np.full((nq, C), -1, np.int64)
        k = min(C, self.ntotal)
        if k == 0 or nq == 0:
            return distances, positions
        with self._lock:  # search parameters live on the shared FAISS object
            gpu = self._gpu_index() if k <= _GPU_MAX_K else None
            D = P = None
            if gpu is not None:
                try:
                    D, P = gpu.search(codes, k)
                    P = np.where(P < self.ntotal, P, -1)  # labels are positions on the GPU copy
                except RuntimeError:  # e.g. a k the GPU build cannot select: the CPU index answers
                    D = P = None
            if P is None:
                self._prepare_search(k)
                D, labels = self._index.search(codes, k)
                P = self._positions(labels)
        D = np.where(P >= 0, D, -1)
        distances[:, :k], positions[:, :k] = D, P
        return distances, positions

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Insertion positions → example ids, same shape, ``object`` dtype (``None`` for ``-1``)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.full(positions.shape, None, dtype=object)
        valid = positions >= 0
        out[valid] = np.array(self._ids.take(pa.array(positions[valid])).to_pylist(), dtype=object)
        return out

    def search(self, query_codes: np.ndarray, C: int) -> np.ndarray:
        """Example ids of the ``C`` Hamming-nearest rows: ``(nq, C)`` ``object`` array, nearest first.

        ``None`` fills the tail where fewer than ``C`` rows were found (IVF with few probes, or
        ``C`` above the rows covered).
        """
        return self.ids_at(self.search_with_distances(query_codes, C)[1])

    def top_k(
        self, stored, y: np.ndarray, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None
    ) -> Dict[str, SideAnswer]:
        """The ``C`` Hamming-nearest rows per side (the weighted codes of ``y``, of ``-y`` for the
        negative side), those matching ``where``, rescored exactly: every rescored row, for
        every side (with two sides, the union of both sides' candidates; ``r <= 2C``).

        The result equals the exact scan restricted to (candidates ∩ filter). When the filter
        matches at most ``C`` rows, all of them are rescored instead (exact, and no more work).
        FAISS positions map to row addresses through :meth:`rowaddr_of`, the filter is
        :meth:`StoredIndex.matching_rows`, and the rows are rescored from the hot copy: nothing
        is read from the table per query.
        """
        layout: SignLayout = stored.layout
        hot = stored.hot_codes()
        matching = stored.matching_rows(where, hot) if where else None  # sorted hot positions
        if matching is not None and matching.size <= C:
            rows = matching  # the filter leaves no more rows than candidates: rescore them all
        else:
            y1 = np.asarray(y, np.float32).reshape(1, -1)
            codes = {side: self.query_codes(y1 if side == "positive" else -y1, layout) for side in sides}
            positions = [self.search_with_distances(codes[side], C)[1][0] for side in sides]
            addr = self.rowaddr_of(stored, np.concatenate(positions))
            addr = np.unique(addr[addr != MISSING_ROW])
            rows = hot.positions(addr)  # sorted: the hot copy is in row-address order
            if matching is not None:
                at = np.minimum(np.searchsorted(matching, rows), max(matching.size - 1, 0))
                rows = rows[matching[at] == rows] if matching.size else rows[:0]
        rows = np.asarray(rows, np.int64)
        scores = rescore(hot.codes, hot.scales, y, layout, rows=rows)[0] if rows.size else np.zeros(0, np.float32)
        return {side: (hot.rowaddr[rows].astype(np.uint64), scores, int(rows.size)) for side in sides}


class FlatFirstPass(FaissFirstPass, kind="flat"):
    """Exhaustive Hamming (``IndexBinaryFlat``); searched on ``GpuIndexBinaryFlat`` when one is lent."""

    Config = FlatConfig

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._gpu = None  # lazily built GPU copy; False once known unavailable

    @classmethod
    def _new_index(cls, config, nbytes, n, sample):
        faiss = load_faiss()
        return faiss.IndexBinaryIDMap(faiss.IndexBinaryFlat(int(config.replicas) * nbytes * 8)), {}

    def _add_rows(self, batches, **kwargs: Any) -> None:
        super()._add_rows(batches, **kwargs)
        self._gpu = None  # the GPU copy holds the old rows

    def _gpu_index(self):
        """A ``GpuIndexBinaryFlat`` copy (positions as labels), or None."""
        if self._gpu is False or self.config.use_gpu == "never":
            return None
        if self._gpu is None:
            faiss = load_faiss()
            try:
                if not (hasattr(faiss, "GpuIndexBinaryFlat") and faiss.get_num_gpus() > 0):
                    self._gpu = False
                    return None
                resources = faiss.StandardGpuResources()
                flat = faiss.downcast_IndexBinary(self._index.index)
                gpu = faiss.GpuIndexBinaryFlat(resources, flat)  # copies the codes; labels = positions
                self._gpu = (resources, gpu)  # keep the resources alive as long as the index
            except Exception:  # a GPU build without a usable device: search on the CPU
                self._gpu = False
                return None
        return self._gpu[1]


class IVFFirstPass(FaissFirstPass, kind="ivf"):
    """Inverted lists (``IndexBinaryIVF``) of a binary k-means trained on unreplicated signs."""

    Config = IVFConfig

    @classmethod
    def _new_index(cls, config, nbytes, n, sample):
        faiss = load_faiss()
        R = int(config.replicas)
        d = R * nbytes * 8
        nlist = min(n, int(config.nlist or max(1, round(4 * math.sqrt(n)))))
        n_train = min(n, max(nlist, nlist * int(config.train_points_per_list)))
        offsets = np.sort(np.random.default_rng(0).choice(n, size=n_train, replace=False)).astype(np.int64)
        # FAISS's own binary k-means, on the unreplicated signs (d₀ bits).
        base = faiss.IndexBinaryIVF(faiss.IndexBinaryFlat(nbytes * 8), nbytes * 8, nlist)
        base.cp.niter = int(config.train_iters)
        base.cp.max_points_per_centroid = max(1, -(-n_train // nlist))  # FAISS would subsample otherwise
        base.train(np.ascontiguousarray(sample(offsets), dtype=np.uint8))
        centroids = faiss.vector_to_array(faiss.downcast_IndexBinary(base.quantizer).xb).reshape(nlist, nbytes)
        quantizer = faiss.IndexBinaryFlat(d)
        quantizer.add(replicate_codes(centroids, R))
        # add_with_ids natively: no IDMap. A quantizer holding nlist centroids makes it trained.
        ivf = faiss.IndexBinaryIVF(quantizer, d, nlist)
        if not ivf.is_trained:  # pragma: no cover - FAISS marks an IVF with a full quantizer trained
            raise RuntimeError("FAISS did not accept the replicated IVF centroids")
        return ivf, {"nlist": nlist, "train_rows": int(n_train), "train_iters": int(config.train_iters)}

    @classmethod
    def _saved_config(cls, meta, config):
        params = meta.get("params", {})
        return replace(
            config,
            replicas=int(meta["replicas"]),
            nlist=params.get("nlist"),
            train_iters=params.get("train_iters", config.train_iters),
        )

    def _prepare_search(self, k: int) -> None:
        self._index.nprobe = min(int(self.config.nprobe), int(self._index.nlist))


class HNSWFirstPass(FaissFirstPass, kind="hnsw"):
    """A graph (``IndexBinaryHNSW``) over the codes."""

    Config = HNSWConfig

    @classmethod
    def _new_index(cls, config, nbytes, n, sample):
        faiss = load_faiss()
        inner = faiss.IndexBinaryHNSW(int(config.replicas) * nbytes * 8, int(config.hnsw_m))
        inner.hnsw.efConstruction = int(config.ef_construction)
        return faiss.IndexBinaryIDMap(inner), {
            "hnsw_m": int(config.hnsw_m),
            "ef_construction": int(config.ef_construction),
        }

    @classmethod
    def _saved_config(cls, meta, config):
        params = meta.get("params", {})
        return replace(
            config,
            replicas=int(meta["replicas"]),
            hnsw_m=params.get("hnsw_m", config.hnsw_m),
            ef_construction=params.get("ef_construction", config.ef_construction),
        )

    def _prepare_search(self, k: int) -> None:
        # HNSW returns at most efSearch results: the beam must hold k of them.
        load_faiss().downcast_IndexBinary(self._index.index).hnsw.efSearch = max(int(self.config.ef_search), k)


# ---------------------------------------------------------------------------------------------
# reading the table, rescoring
# ---------------------------------------------------------------------------------------------


def _rows_per_batch(nbytes: int) -> int:
    return max(1, BATCH_BYTES // (nbytes + 64))  # + 64: an id string and its offset, roughly


def _stream(dataset, nbytes: int, *, offsets: Optional[np.ndarray] = None) -> Iterator[Tuple[pa.Array, np.ndarray]]:
    """``(ids, signs (b, nbytes) uint8)`` record batches of the whole table or of ``offsets``."""
    rows = _rows_per_batch(nbytes)
    if offsets is None:
        for batch in dataset.to_batches(columns=["id", "signs"], batch_size=rows, scan_in_order=True):
            if batch.num_rows:
                yield batch.column("id"), list_column_to_numpy(batch.column("signs"), nbytes, np.uint8)
        return
    for start in range(0, len(offsets), rows):
        table = dataset.take(offsets[start : start + rows], columns=["id", "signs"])
        yield table.column("id").combine_chunks(), list_column_to_numpy(table.column("signs"), nbytes, np.uint8)


def _progress(iterable, enabled: bool, desc: str, total: Optional[int] = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="batch")


def rescore(
    signs: np.ndarray, scales: np.ndarray, y: np.ndarray, layout: SignLayout, *, rows: Optional[np.ndarray] = None
) -> np.ndarray:
    """Exact scores ``Σ_u s_iu⟨y_u, b_iu⟩`` ``(nq, m)`` float32 of rows ``rows`` (all if None).

    Args:
        signs: ``(n, nbytes)`` uint8. scales: ``(n, U)`` float16. y: ``(nq, K)`` float32.
        rows: ``(m,)`` int64 row indices into ``signs``.

    Uses the packed-bit kernel of :mod:`eogp_index.search.scan` when present, else unpack + matmul.
    """
    try:
        from eogp_index.search.scan import scan_scores
    except ImportError:
        scan_scores = None
    if scan_scores is not None:
        return scan_scores(signs, scales, np.asarray(y, np.float32), layout, rows=rows)
    if rows is not None:
        signs, scales = signs[rows], scales[rows]
    y = np.asarray(y, np.float32)
    out = np.empty((y.shape[0], signs.shape[0]), np.float32)
    step = 1 << 14  # bounds the decoded ±1 block to step·K floats
    for start in range(0, signs.shape[0], step):
        block = unpack_signs(signs[start : start + step], layout)
        block *= np.repeat(scales[start : start + step].astype(np.float32), layout.k, axis=1)
        out[:, start : start + step] = y @ block.T
    return out


def candidate_ids(
    cand: FaissFirstPass, y: np.ndarray, layout: SignLayout, C: int, direction: str = "positive"
) -> List[str]:
    """Ids of the FAISS candidates of one query ``y`` ``(K,)`` or ``(1, K)``, no duplicates.

    ``positive`` uses the weighted codes of ``y`` (:meth:`FaissFirstPass.query_codes`),
    ``negative`` those of ``-y``, ``both`` the union.
    """
    y = np.asarray(y, np.float32).reshape(1, -1)
    out: Dict[str, None] = {}
    for side in ("positive", "negative") if direction == "both" else (direction,):
        codes = cand.query_codes(y if side == "positive" else -y, layout)
        for i in cand.search(codes, C)[0]:
            if i is not None:
                out[i] = None
    return list(out)
