"""The ``flat`` first pass: FAISS scans a RaBitQ code of every row by inner product, the best ``C`` are rescored exactly.

A row's exact score is ``Σ_u s_iu⟨y_u, b_iu⟩ = ⟨y, x_i⟩`` with ``x_i = (s_i1·b_i1, …, s_iU·b_iU)``
``(K,)``, the row's one-bit code decoded: signs times their module's scale. This first pass ranks
rows by an estimate of that very inner product, so it sees the per-row scales (a Hamming distance
on the signs cannot, and on real gradient codes that is what it misses; docs/benchmarks.md):

* **Codes.** FAISS ``IndexRaBitQFastScan`` (inner product) over the decoded vectors ``x_i``:
  RaBitQ stores, per row, the signs of ``x_i − c`` after a random rotation (``c`` the mean of a
  sample of rows, ``train_rows``) and two correction factors, ``K`` bits and a few bytes a row,
  and estimates ``⟨y, x_i⟩`` without bias. The fast-scan layout scores rows 32 at a time from
  4-bit lookup tables of the query (``query_bits`` per coordinate) held in SIMD registers.
* **Search, per query side.** The ``C`` rows with the largest estimates for ``y`` (the most
  negative side: for ``−y``), those matching the filter, rescored exactly from the hot copy
  (:func:`~eogp_index.search.scan.scan_scores`); every returned score is exact, what the first
  pass can miss are rows whose estimate fell below the ``C``-th.
* **Keys.** FAISS ids are stable 63-bit hashes of the example ids (:func:`id_keys`), not Lance row
  addresses (those change on compaction). The key → id mapping is saved next to the FAISS index,
  in FAISS insertion order; positions map to row addresses through the hot copy's ids once per
  table version (:meth:`FlatFirstPass.rowaddr_of`).
* **Files.** ``<index_dir>/faiss/<name>.faissindex`` (``faiss.write_index``),
  ``<name>.ids.parquet`` (``key`` int64, ``id`` string; row ``p`` = FAISS position ``p``) and
  ``<name>.json`` (format ``eogp-faiss`` version 3, kind, parameters, the table version and rows
  covered, and the hashes of the projection and model the codes were made with). Versions 1 and 2
  (Hamming distance on the signs) are refused with a request to rebuild.
* **Freshness.** :meth:`FlatFirstPass.extend` adds the rows of the hot copy whose ids are not
  covered yet, without retraining; a query calls it (through :meth:`~FlatFirstPass.refresh`)
  when the table has a newer version than the one recorded, so a query never silently misses
  ingested rows.

A build streams ``id``, ``signs`` and ``scales`` from Lance in record batches whose decoded
vectors take about ``BATCH_BYTES``; the whole table is never held at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

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
    readable,
    require_signs,
    search_param,
    temporary,
)
from eogp_index.search.scan import scan_scores
from eogp_index.store.codecs import SignLayout, unpack_signs

#: Bytes of decoded float32 vectors per record batch read from Lance.
BATCH_BYTES = 64 << 20
#: The row address of a FAISS position whose row is no longer in the table.
MISSING_ROW = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
KEY_SCHEME = "blake2b-64le-of-utf8-id, top bit cleared"
#: Queries per OpenMP thread of a FAISS search (fewer queries run on one thread).
_QUERIES_PER_THREAD = 16
_KEY_MASK = np.int64(0x7FFF_FFFF_FFFF_FFFF)


@dataclasses.dataclass(frozen=True)
class FlatConfig(FirstPassConfig):
    """``flat``: every row's RaBitQ code scanned by inner product (module docstring)."""

    train_rows: int = build_param(
        65536, "Rows sampled (uniformly) to train RaBitQ's centre, the mean of the decoded codes.", min=1
    )
    query_bits: int = search_param(
        8, "Bits per query coordinate in FAISS's lookup tables (qb; fewer = coarser estimates).", min=1, max=8
    )


def decode(signs: np.ndarray, scales: np.ndarray, layout: SignLayout) -> np.ndarray:
    """The one-bit codes as vectors: ``(n, nbytes)`` signs and ``(n, U)`` scales → ``(n, K)``
    float32 ``s_iu·b_iu``, whose inner product with a query is the row's exact score."""
    x = unpack_signs(np.asarray(signs, np.uint8), layout)
    x *= np.repeat(np.asarray(scales, np.float32), layout.k, axis=1)
    return np.ascontiguousarray(x)


def id_keys(ids: Sequence[str]) -> np.ndarray:
    """Stable FAISS keys of example ids: ``(n,)`` int64, non-negative (first 8 bytes of BLAKE2b of
    the UTF-8 id, little endian, top bit cleared)."""
    digest = b"".join(hashlib.blake2b(str(i).encode("utf-8"), digest_size=8).digest() for i in ids)
    return np.frombuffer(digest, dtype="<i8").astype(np.int64) & _KEY_MASK


def check_unique(keys: np.ndarray, ids: pa.Array, where: str) -> None:
    """Refuse duplicate keys: the same id stored twice, or two ids hashing alike."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    dup = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if dup.size == 0:
        return
    a, b = ids[int(order[dup[0]])].as_py(), ids[int(order[dup[0] + 1])].as_py()
    if a == b:
        raise InputError(
            f"example id {a!r} is stored more than once in {where}; FAISS candidates need unique ids. "
            "Delete the duplicate rows (or re-ingest into a fresh index) and build again",
            reason="duplicate example id",
        )
    raise IncompatibleIndexError(
        f"example ids {a!r} and {b!r} have the same 63-bit FAISS key ({int(sorted_keys[dup[0]])}) in {where}; "
        "this is a hash collision (about 1 in 10^19 per pair). Rename one of the two examples and rebuild"
    )


class FlatFirstPass(FirstPass, kind="flat"):
    """FAISS ``IndexRaBitQFastScan`` over the decoded one-bit codes (module docstring).

    Build with :meth:`build` (or :meth:`from_codes`), reopen with :meth:`FirstPass.load`, keep
    current with :meth:`extend`, search with :meth:`search_with_distances` or answer a query side
    with :meth:`top_k`.
    """

    Config = FlatConfig
    FORMAT = "eogp-faiss"
    FORMAT_VERSION = 3
    OLD_FORMATS = {
        v: "versions 1 and 2 ranked rows by Hamming distance on the signs, blind to the per-row scales; "
        "version 3 scans RaBitQ codes of the decoded codes by inner product"
        for v in (1, 2)
    }
    FILES = {"index": ".faissindex", "ids": ".ids.parquet", "meta": ".json"}

    def __init__(
        self,
        index_dir: Union[str, Path],
        name: str,
        config: FlatConfig,
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

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def _new_index(layout: SignLayout, train: np.ndarray):
        """An empty, trained ``IndexIDMap(IndexRaBitQFastScan)`` for ``K``-dimensional vectors."""
        faiss = load_faiss()
        inner = faiss.IndexRaBitQFastScan(layout.num_coords, faiss.METRIC_INNER_PRODUCT)
        inner.train(train)
        return faiss.IndexIDMap(inner)

    @classmethod
    def _meta(cls, base: Dict[str, Any], layout: SignLayout, n_train: int, version: int) -> Dict[str, Any]:
        faiss = load_faiss()
        return {
            **base,
            "params": {"train_rows": int(n_train)},
            "d": int(layout.num_coords),
            "key": KEY_SCHEME,
            "table_version": int(version),
            "rows": 0,
            "faiss_version": getattr(faiss, "__version__", "?"),
        }

    @classmethod
    def build(cls, stored, name: str = "default", config: Optional[FlatConfig] = None, *, progress: bool = False):
        config = config or FlatConfig()
        cls.paths(stored.path, name)  # a bad name fails now, not after the build
        require_signs(stored)
        layout = stored.layout
        dataset = stored.store.dataset() if stored.store.table is not None else None
        n = dataset.count_rows() if dataset is not None else 0
        if n == 0:
            raise InputError(f"{stored.path}: no rows stored yet; ingest examples before building a first pass")
        # A uniform sample (random access by offset), not the first rows: tables are usually
        # ordered by shard, and the first shard is no sample of the corpus.
        n_train = min(n, int(config.train_rows))
        offsets = np.sort(np.random.default_rng(0).choice(n, size=n_train, replace=False)).astype(np.int64)
        codec = stored.codec
        train = np.concatenate([decode(s, sc, layout) for _, s, sc in _stream(dataset, codec, offsets=offsets)])
        meta = cls._meta(cls.provenance(stored, name), layout, n_train, dataset.version)
        built = cls(stored.path, name, config, meta, cls._new_index(layout, train), np.zeros(0, np.int64), _no_ids())
        del train
        total = -(-n // _rows_per_batch(layout))
        built._add_rows(_stream(dataset, codec), layout, progress=progress, total=total, where=str(stored.path))
        built.save()
        return built

    @classmethod
    def from_codes(
        cls,
        codes: np.ndarray,
        scales: np.ndarray,
        layout: SignLayout,
        ids: Sequence[str],
        config: Optional[FlatConfig] = None,
        *,
        index_dir: Union[str, Path] = ".",
        name: str = "in-memory",
    ) -> "FlatFirstPass":
        """A first pass over codes held in memory, built as :meth:`build` builds (benchmarks).

        Args:
            codes: ``(n, nbytes)`` uint8 packed signs. scales: ``(n, U)`` float16 scales.
            ids: ``n`` example ids; row ``i`` gets FAISS position ``i``.

        Not tied to a table: :meth:`check_compatible` refuses every index, and :meth:`save`
        writes under ``index_dir`` only when called.
        """
        config = config or FlatConfig()
        n = codes.shape[0]
        if codes.ndim != 2 or n != len(ids) or n != scales.shape[0] or n == 0:
            raise ConfigError(f"from_codes needs (n, nbytes) codes, (n, U) scales and n ids, n >= 1; got {codes.shape}")
        n_train = min(n, int(config.train_rows))
        offsets = np.sort(np.random.default_rng(0).choice(n, size=n_train, replace=False))
        base = {"format": cls.FORMAT, "format_version": cls.FORMAT_VERSION, "name": name, "kind": cls.kind}
        meta = cls._meta({**base, "nbytes": layout.nbytes, "k": list(layout.k), "table": None}, layout, n_train, -1)
        index = cls._new_index(layout, decode(codes[offsets], scales[offsets], layout))
        built = cls(Path(index_dir), name, config, meta, index, np.zeros(0, np.int64), _no_ids())
        id_array = pa.array(list(ids), pa.string())
        step = _rows_per_batch(layout)
        batches = ((id_array[i : i + step], codes[i : i + step], scales[i : i + step]) for i in range(0, n, step))
        built._add_rows(batches, layout, progress=False, total=0, where=name)
        return built

    @classmethod
    def over_rows(cls, stored, meta: Dict[str, Any]) -> "FlatFirstPass":
        """:meth:`FirstPass.over_rows`: RaBitQ trained and filled as :meth:`build` does, over the
        hot copy's rows (its own sample of ``train_rows`` for the centre), in memory; the JSON
        fields are the saved one's, with the hot copy's table version and rows."""
        require_signs(stored)
        hot = stored.hot_codes()
        if hot.num_rows == 0:
            raise InputError(f"{stored.path}: no rows in this copy; a first pass needs at least one")
        config = FlatConfig(train_rows=int(meta.get("params", {}).get("train_rows", FlatConfig.train_rows)))
        ids = hot.columns.column("id").to_pylist()
        built = cls.from_codes(hot.codes, hot.scales, stored.layout, ids, config, name=meta.get("name", "default"))
        built.index_dir = stored.path  # a local path or an object-store URL: named in messages only
        built.meta = {**meta, "table_version": int(hot.version), "rows": built.ntotal, "held": "in memory"}
        built.check_compatible(stored)  # the saved first pass was made from these codes
        return built

    @classmethod
    def _open(cls, index_dir: Path, name: str, meta: Dict[str, Any], config: FlatConfig) -> "FlatFirstPass":
        import pyarrow.parquet as pq

        faiss = load_faiss()
        paths = cls.paths(index_dir, name)
        faiss_index = faiss.read_index(str(readable(paths["index"])))
        table = pq.read_table(readable(paths["ids"]))
        keys = table.column("key").to_numpy()
        ids = table.column("id").combine_chunks()
        if not (faiss_index.ntotal == len(keys) == meta["rows"]) or faiss_index.d != meta["d"]:
            raise IncompatibleIndexError(
                f"{paths['dir']}: {name}.faissindex holds {faiss_index.ntotal} rows of {faiss_index.d} dimensions, "
                f"{name}.ids.parquet {len(keys)} rows and {name}.json says {meta['rows']} rows of "
                f"{meta['d']} dimensions (an interrupted write?); rebuild it with {cls.rebuild_hint(index_dir, name)}"
            )
        saved = dataclasses.replace(config, train_rows=int(meta["params"]["train_rows"]))
        return cls(index_dir, name, saved, meta, faiss_index, keys, ids)

    def save(self) -> None:
        """Write the three files atomically each (the JSON last: it commits the others)."""
        import pyarrow.parquet as pq

        faiss = load_faiss()
        paths = self.paths(self.index_dir, self.name)
        paths["dir"].mkdir(parents=True, exist_ok=True)
        faiss.write_index(self._index, str(temporary(paths["index"])))
        pq.write_table(pa.table({"key": pa.array(self._keys, pa.int64()), "id": self._ids}), temporary(paths["ids"]))
        temporary(paths["meta"]).write_text(json.dumps(self.meta, indent=2) + "\n")
        commit([paths["index"], paths["ids"], paths["meta"]])

    # -- properties ----------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self._keys.shape[0])

    @property
    def build_params(self) -> Dict[str, Any]:
        return dict(self.meta.get("params", {}))

    # -- keeping current -----------------------------------------------------------------------
    def refresh(self, stored, *, progress: bool = False) -> "FlatFirstPass":
        self.extend(stored, progress=progress)
        return self

    def extend(self, stored, *, progress: bool = False) -> int:
        """Add the stored rows whose ids are not covered yet, and save; returns how many were added.

        The ids, signs and scales come from the hot copy (:meth:`StoredIndex.hot_codes`), not from
        the table; the centre stays the trained one. Rows deleted from the table stay in FAISS;
        they map to no row (:meth:`rowaddr_of`) and are dropped.
        """
        stored = getattr(stored, "stored", stored)
        self.check_compatible(stored)
        hot = stored.hot_codes()
        ids = hot.columns.column("id").combine_chunks() if hot.num_rows else pa.array([], pa.string())
        known = pc.is_in(ids, value_set=self._ids).to_numpy(zero_copy_only=False) if len(ids) else np.zeros(0, bool)
        new = np.flatnonzero(~known)
        before = self.ntotal
        if new.size:
            step = _rows_per_batch(stored.layout)
            batches = (
                (ids.take(pa.array(rows)), np.asarray(hot.codes[rows]), np.asarray(hot.scales[rows]))
                for rows in (new[a : a + step] for a in range(0, new.size, step))
            )
            total = -(-new.size // step)
            self._add_rows(batches, stored.layout, progress=progress, total=total, where=str(stored.path))
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

    def _add_rows(self, batches, layout: SignLayout, *, progress: bool, total: int, where: str) -> None:
        with self._lock:  # FAISS add is not safe against a concurrent search of the same object
            keys_parts, id_parts = [self._keys], [self._ids]
            for ids, signs, scales in _progress(batches, progress, "FAISS add", total=total):
                keys = id_keys(ids.to_pylist())
                self._index.add_with_ids(decode(signs, scales, layout), keys)
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
    def search_with_distances(self, y: np.ndarray, C: int) -> Tuple[np.ndarray, np.ndarray]:
        """The ``C`` rows with the largest estimated scores per query.

        Args:
            y: ``(nq, K)`` float32 query coordinates (``-y`` for the most negative side).
            C: candidates per query (``>= 1``; at most ``ntotal`` are found).

        Returns:
            ``estimates`` ``(nq, C)`` float32 RaBitQ estimates of ``⟨y, x_i⟩`` (``nan`` where fewer
            than ``C`` were found) and ``positions`` ``(nq, C)`` int64 FAISS insertion positions
            (``-1`` likewise), largest first.
        """
        y = np.ascontiguousarray(y, dtype=np.float32)
        if y.ndim != 2 or y.shape[1] != int(self.meta["d"]):
            raise ConfigError(f"query coordinates must have shape (nq, {self.meta['d']}), got {y.shape}")
        C = int(C)
        if C < 1:
            raise ConfigError(f"C (candidates) must be >= 1, got {C}")
        nq = y.shape[0]
        estimates = np.full((nq, C), np.nan, np.float32)
        positions = np.full((nq, C), -1, np.int64)
        k = min(C, self.ntotal)
        if k == 0 or nq == 0:
            return estimates, positions
        faiss = load_faiss()
        with self._lock:  # search parameters live on the shared FAISS object
            faiss.downcast_index(self._index.index).qb = int(self.config.query_bits)
            # FAISS splits the queries across OpenMP threads: for a query's two sides, waking
            # threads costs more than the scan itself, and on a busy machine far more.
            threads = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(max(1, min(threads, nq // _QUERIES_PER_THREAD)))
            try:
                D, labels = self._index.search(y, k)
            finally:
                faiss.omp_set_num_threads(threads)
        P = self._positions(labels)
        estimates[:, :k], positions[:, :k] = np.where(P >= 0, D, np.nan), P
        return estimates, positions

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Insertion positions → example ids, same shape, ``object`` dtype (``None`` for ``-1``)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.full(positions.shape, None, dtype=object)
        valid = positions >= 0
        out[valid] = np.array(self._ids.take(pa.array(positions[valid])).to_pylist(), dtype=object)
        return out

    def top_k(
        self, stored, y: np.ndarray, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None
    ) -> Dict[str, SideAnswer]:
        """The ``C`` rows with the largest estimates per side (for ``y``, for ``-y`` on the negative
        side), those matching ``where``, rescored exactly: every rescored row, for every side (with
        two sides, the union of both sides' candidates; ``r <= 2C``).

        The result equals the exact scan restricted to (candidates ∩ filter). When the filter
        matches at most ``C`` rows, all of them are rescored instead (exact, and no more work).
        Positions map to row addresses through :meth:`rowaddr_of`, the filter is
        :meth:`StoredIndex.matching_rows`, and the rows are rescored from the hot copy: nothing
        is read from the table per query.
        """
        layout: SignLayout = stored.layout
        hot = stored.hot_codes()
        matching = stored.matching_rows(where, hot) if where else None  # sorted hot positions
        y1 = np.asarray(y, np.float32).reshape(1, -1)
        if matching is not None and matching.size <= C:
            rows = matching  # the filter leaves no more rows than candidates: rescore them all
        else:
            queries = np.concatenate([y1 if side == "positive" else -y1 for side in sides])
            addr = self.rowaddr_of(stored, self.search_with_distances(queries, C)[1].ravel())
            addr = np.unique(addr[addr != MISSING_ROW])
            rows = hot.positions(addr)  # sorted: the hot copy is in row-address order
            if matching is not None:
                at = np.minimum(np.searchsorted(matching, rows), max(matching.size - 1, 0))
                rows = rows[matching[at] == rows] if matching.size else rows[:0]
        rows = np.asarray(rows, np.int64)
        if rows.size:
            scores = scan_scores(hot.codes, hot.scales, y1, layout, rows=rows)[0]
        else:
            scores = np.zeros(0, np.float32)
        return {side: (hot.rowaddr[rows].astype(np.uint64), scores, int(rows.size)) for side in sides}


def _no_ids() -> pa.Array:
    return pa.array([], pa.string())


def _rows_per_batch(layout: SignLayout) -> int:
    return max(1, BATCH_BYTES // (4 * layout.num_coords))


def _stream(
    dataset, codec, *, offsets: Optional[np.ndarray] = None
) -> Iterator[Tuple[pa.Array, np.ndarray, np.ndarray]]:
    """``(ids, signs (b, nbytes) uint8, scales (b, U) float32)`` record batches of the table or of
    ``offsets``, in the codec's combined layout (an ensemble's checkpoints' columns joined)."""
    rows, columns = _rows_per_batch(codec.layout), ["id", *codec.columns]

    def split(batch) -> Tuple[pa.Array, np.ndarray, np.ndarray]:
        signs = codec.read_column(batch, "signs", np.uint8)
        scales = codec.read_column(batch, "scales", np.float32)
        ids = batch.column("id")
        return (ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids), signs, scales

    if offsets is None:
        for batch in dataset.to_batches(columns=columns, batch_size=rows, scan_in_order=True):
            if batch.num_rows:
                yield split(batch)
        return
    for start in range(0, len(offsets), rows):
        yield split(dataset.take(offsets[start : start + rows], columns=columns))


def _progress(iterable, enabled: bool, desc: str, total: Optional[int] = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="batch")
