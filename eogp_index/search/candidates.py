"""Candidate first passes: C candidates by (weighted) Hamming distance on the stored signs (FAISS), or
the promising cells of a clustered copy of the codes, then exact rescoring.

Two families sit behind one interface (:func:`build`, :func:`load`, :func:`open_candidates`,
:func:`candidate_top_k`, ``query.candidates(C)``, ``eogp build-faiss --kind``):

* ``flat``, ``ivf``, ``hnsw``: FAISS binary indexes over the signs (below). They cannot see the
  per-row scales, which decide the top of a large store: on 1M rows their best line at ≥ 5×
  the exact scan's speed stays far below the target recall (``benchmarks/candidates.py``;
  docs/benchmarks.md, "First passes").
* ``clustered`` (:mod:`eogp_index.search.clustered`): a copy of the codes grouped into cells by
  scale profile, the cells visited by an optimistic estimate of their best score and scanned
  with the exact kernel, with an early stop (``benchmarks/client.py``: recall@20 >= 0.95 at
  >= 5x in both directions). There ``C`` is the budget of rows scanned per side.

Nothing is read from the table per query: FAISS positions map to row addresses through the hot
copy's ids once per table version (:meth:`CandidateIndex.rowaddr_of`), filters are
:meth:`StoredIndex.matching_rows`, and rescoring reads the hot copy.

The FAISS indexes:

The exact scan reads every stored row. For a store of millions of rows a cheaper first pass can
pick ``C`` candidates and only those are rescored exactly with ``Σ_u s_iu⟨y_u, b_iu⟩``:

* **Stored binary vectors: replicated signs.** A row's signs are its ``signs`` column as stored,
  the per-module sign bytes concatenated (``nbytes`` bytes, ``d₀ = 8·nbytes`` bits, bit 0 of a
  byte least significant, which is FAISS's convention too; padding bits are 0). The FAISS code
  of the row is that byte string repeated ``R = FaissConfig.replicas`` times
  (``np.tile(signs, R)``: ``R·nbytes`` bytes, ``d = R·d₀`` bits), so each real coordinate ``j``
  has ``R`` identical *replica* bits ``b_j``, and every padding bit is 0 in every replica.
* **Query binary vectors: |y|-weighted.** Plain Hamming on ``pack_signs(y)`` ranks rows by the
  sign agreement ``Σ_j sign(y_j)·β_j`` (``β_j = ±1`` the stored sign), which ignores ``|y_j|``.
  With replicas the query can weight coordinates. Per query, each real coordinate gets an
  integer level ``w_j ∈ {R mod 2, R mod 2 + 2, …, R}`` (so ``R − w_j`` is even) and a sign
  ``σ_j = +1`` if ``y_j >= 0`` else ``−1``; its ``R`` replica bits are ``σ_j``'s bit in the first
  ``w_j`` replicas, then ``R − w_j`` *neutral* bits alternating 1, 0, 1, 0, … (pairs); padding
  bits are 0. Write ``q̃ = ±1`` for a query bit, then ``[q ≠ b] = (1 − q̃·β)/2`` for one bit and,
  summed over the ``R`` replicas of coordinate ``j`` (a neutral pair contributes
  ``(1 − β)/2 + (1 + β)/2 = 1``, whatever ``β``)::

      Σ_r [q_rj ≠ b_j] = w_j·(1 − σ_j β_j)/2 + (R − w_j)/2 = (R − w_j σ_j β_j)/2,

  so with ``K = Σ_u k_u`` real coordinates (padding bits match: 0 vs 0) the FAISS distance is
  exactly::

      H(query, row) = (R·K − Σ_j v_j β_j) / 2,      v_j = σ_j·w_j,

  an integer (``v_j ≡ R mod 2``). The Hamming-nearest rows are the rows with the largest
  weighted agreement ``⟨v, β⟩``. The levels are ``w = clip(round-to-parity(c·|y|), R mod 2,
  R)`` with the factor ``c`` that maximizes the cosine between ``w`` and ``|y|`` (a grid of
  factors from the query's own quantiles; :func:`query_levels`), i.e. ``v ≈ c·y`` on
  ``R + 1`` evenly spaced levels. ``R = 1`` is plain Hamming on ``pack_signs(y)``. The
  most negative influences are the nearest rows to the codes of ``-y`` (same levels, ``σ``
  flipped). What Hamming cannot see: the per-row scales ``s_iu`` (the exact rescoring applies
  them), and ``|y|`` beyond ``R + 1`` levels. The cost: FAISS holds ``R×`` the sign bytes and
  every distance reads ``R×`` the bytes.
* **Indexes.** ``flat`` (exhaustive Hamming, ``IndexBinaryFlat``; on a machine with a GPU and a
  GPU build of FAISS the search runs on ``GpuIndexBinaryFlat``), ``ivf`` (``IndexBinaryIVF``)
  and ``hnsw`` (``IndexBinaryHNSW``). IVF's binary k-means is trained on a sample of the rows'
  *unreplicated* signs and its centroids are then replicated: FAISS's binary k-means runs on
  ±1 floats, where replicating every coordinate ``R`` times scales every squared distance by
  ``R`` and keeps the means replicated, so this is the same clustering for ``R×`` less work.
* **Keys.** FAISS ids are not Lance row addresses (those change on compaction): they are a
  stable 63-bit hash of the example id (first 8 bytes of BLAKE2b of its UTF-8, little endian,
  top bit cleared); collisions are detected and refused. The key → id mapping is saved next to
  the FAISS index, in FAISS insertion order.
* **Files.** ``<index_dir>/faiss/<name>.faissindex`` (``faiss.write_index_binary``),
  ``<name>.ids.parquet`` (``key`` int64, ``id`` string; row ``p`` = FAISS position ``p``) and
  ``<name>.json`` (format version 2, kind, ``replicas``, parameters, the table version and rows
  covered, and the hashes of the projection and model the codes were made with). The JSON is
  written last: it is the commit of a build or an extension. Version 1 (unreplicated signs) is
  refused with a request to rebuild.
* **Freshness.** :meth:`CandidateIndex.extend` adds the rows of the hot copy whose ids are not
  covered yet (replicated the same way), without rebuilding; :func:`candidate_top_k` calls
  it when the table has a newer version than the one recorded, so a query never silently misses
  ingested rows. A compaction moves rows: :meth:`CandidateIndex.rowaddr_of` maps positions to
  the new addresses by id, once per version.

A build streams rows from Lance in record batches sized in bytes (``BATCH_BYTES``), reading
only ``id`` and ``signs``; the whole table is never held at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eogp_index.version import __version__
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError, InputError
from eogp_index.store.codecs import SignLayout, pack_signs, unpack_signs
from eogp_index.store.table import list_column_to_numpy

FORMAT = "eogp-faiss"
FORMAT_VERSION = 2  # 2: replicated stored signs and |y|-weighted queries (1: plain signs)
FAISS_DIR = "faiss"
KEY_SCHEME = "blake2b-64le-of-utf8-id, top bit cleared"
#: Bytes of ``id`` + ``signs`` per record batch read from Lance.
BATCH_BYTES = 64 << 20
#: Rows added to FAISS per ``add`` call (HNSW and IVF parallelize within one call).
_ADD_ROWS = 1 << 16
#: GPU binary flat search keeps at most this many neighbours per query (FAISS's GPU k-select).
_GPU_MAX_K = 2048
#: Most replicas per stored sign bit (FAISS memory and distance cost grow linearly with it).
MAX_REPLICAS = 16
#: Factors tried by :func:`query_levels` per query (quantiles of ``|y|`` mapped to level ``R``).
_LEVEL_GRID = np.linspace(0.25, 1.0, 64)
_KEY_MASK = np.int64(0x7FFF_FFFF_FFFF_FFFF)
#: The row address of a FAISS position whose row is no longer in the table.
MISSING_ROW = np.uint64(0xFFFF_FFFF_FFFF_FFFF)

Kind = Literal["flat", "ivf", "hnsw", "clustered"]
KINDS = ("flat", "ivf", "hnsw", "clustered")
Direction = Literal["positive", "negative", "both"]


@dataclass(frozen=True)
class FaissConfig:
    """Which FAISS binary index to build and how to search it.

    Attributes:
        kind: ``flat`` (exhaustive, exact Hamming), ``ivf`` (inverted lists) or ``hnsw`` (graph).
        replicas: ``R``, copies of each stored sign bit in the FAISS code, so that a query can
            weight coordinate ``j`` by a level ``w_j ∈ {R mod 2, …, R-2, R}`` of ``|y_j|`` (the
            module docstring); ``1`` = plain sign agreement. Build time; FAISS memory and
            distance cost are ``R×`` those of the signs. Default 1: the FAISS path exists to
            be faster than the exact scan, and at equal search time ``R > 1`` gained nothing
            (each probed row costs ``R×``). ``R > 1`` raises the proxy's correlation with the
            exact score and a flat index's recall at a given ``C``, with little more past
            ``R = 4`` (``benchmarks/candidates.py``; docs/benchmarks.md, "First passes"). Take
            ``R = 4`` when recall at a given ``C`` matters more than search time.
        nlist: IVF lists; ``None`` = ``round(4·sqrt(n))`` for the ``n`` rows at build time.
        nprobe: IVF lists visited per query (search time; more = better recall, slower).
        hnsw_m: HNSW neighbours per node (build time).
        ef_search: HNSW search beam (search time; raised to ``C`` when ``C`` is larger).
        ef_construction: HNSW build beam (build time; lower = faster build, worse graph).
        train_points_per_list: IVF k-means sample size per list (FAISS warns below 39).
        train_iters: IVF k-means iterations.
        use_gpu: ``auto`` searches a flat index on ``GpuIndexBinaryFlat`` (and trains the
            ``clustered`` kind's k-means on the GPU) when ``faiss.get_num_gpus() > 0`` and FAISS
            is a GPU build; ``never`` stays on the CPU.
        lists: ``clustered`` only: sign lists ``L`` (binary k-means over the signs; 1 = none).
        scale_cells: ``clustered`` only: scale cells ``P`` (k-means over the log-scales).
        z: ``clustered`` only, search time: standard deviations in a cell's optimistic estimate
            (:mod:`eogp_index.search.clustered`); larger = more cells scanned, higher recall.
        first_fraction: ``clustered`` only, search time: share of the rows scanned before the
            early stop is applied (round 1).

    The ``clustered`` kind (:mod:`eogp_index.search.clustered`) is no FAISS index: it regroups
    a copy of the codes by scale profile and scans the promising cells with the exact kernel.
    Measured with ``benchmarks/client.py`` (10M rows of codes modelled on the demo's) it is the
    one that pays; the defaults ``scale_cells=64, z=4, first_fraction=0.01`` are its.
    """

    kind: Kind = "flat"
    replicas: int = 1
    nlist: Optional[int] = None
    nprobe: int = 16
    hnsw_m: int = 32
    ef_search: int = 128
    ef_construction: int = 40
    train_points_per_list: int = 64
    train_iters: int = 10
    use_gpu: Literal["auto", "never"] = "auto"
    lists: int = 1
    scale_cells: int = 64
    z: float = 4.0
    first_fraction: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"FaissConfig.kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("lists", "scale_cells"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"FaissConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not float(self.z) >= 0:
            raise ConfigError(f"FaissConfig.z must be >= 0, got {self.z!r}")
        if not 0 < float(self.first_fraction) <= 1:
            raise ConfigError(f"FaissConfig.first_fraction must be in (0, 1], got {self.first_fraction!r}")
        if self.use_gpu not in ("auto", "never"):
            raise ConfigError(f"FaissConfig.use_gpu must be 'auto' or 'never', got {self.use_gpu!r}")
        for name in ("nprobe", "hnsw_m", "ef_search", "ef_construction", "train_points_per_list", "train_iters"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"FaissConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not 1 <= int(self.replicas) <= MAX_REPLICAS:
            raise ConfigError(f"FaissConfig.replicas must be in 1..{MAX_REPLICAS}, got {self.replicas!r}")
        if self.nlist is not None and int(self.nlist) < 1:
            raise ConfigError(f"FaissConfig.nlist must be >= 1 (or None for 4·sqrt(n)), got {self.nlist!r}")


# ---------------------------------------------------------------------------------------------
# replicated stored codes and weighted query codes (the algebra is in the module docstring)
# ---------------------------------------------------------------------------------------------


def replicate_codes(signs: np.ndarray, replicas: int) -> np.ndarray:
    """Stored signs ``(n, nbytes)`` uint8 → FAISS codes ``(n, replicas·nbytes)`` uint8 (``np.tile``).

    Replica ``r`` of every bit sits in bytes ``[r·nbytes, (r+1)·nbytes)`` at the bit's own place,
    so padding bits stay 0 in every replica.
    """
    signs = np.ascontiguousarray(signs, dtype=np.uint8)
    return signs if replicas == 1 else np.ascontiguousarray(np.tile(signs, (1, int(replicas))))


def query_levels(y: np.ndarray, replicas: int) -> np.ndarray:
    """Integer weights ``w`` ``(nq, K)`` int32 of ``|y|``, each in ``{R mod 2, R mod 2 + 2, …, R}``.

    ``w = clip(p + 2·round((c·|y| − p)/2), p, R)`` with ``p = R mod 2`` (so ``R − w`` is even,
    as neutral pairs need) and, per query, the factor ``c`` among ``R / quantile(|y|, g)``
    (``g`` in ``_LEVEL_GRID``) that maximizes ``cos(w, |y|)``: the quantized weights closest in
    angle to ``|y|``, which is what ``⟨v, β⟩ ≈ c·⟨y, β⟩`` needs. ``R = 1`` gives all ones.

    Args:
        y: ``(nq, K)`` float query coordinates. replicas: ``R``.
    """
    a = np.abs(np.asarray(y, np.float64))
    R, p = int(replicas), int(replicas) % 2
    out = np.full(a.shape, p, np.int32)
    if R == 1:
        return out  # every level is 1: plain sign agreement
    for i, row in enumerate(a):  # one query at a time: the trial levels are (G, K)
        q = np.quantile(row, _LEVEL_GRID)
        c = R / q[q > 0]  # a zero quantile gives no factor; an all-zero query keeps level p
        if c.size == 0:
            continue
        w = np.clip(p + 2 * np.round((c[:, None] * row[None, :] - p) / 2), p, R)  # (G, K)
        norms = np.linalg.norm(w, axis=1) * np.linalg.norm(row)
        cos = np.where(norms > 0, (w @ row) / np.where(norms > 0, norms, 1.0), -1.0)
        out[i] = w[int(np.argmax(cos))]  # first of equals: deterministic
    return out


def query_codes(y: np.ndarray, layout: SignLayout, replicas: int) -> np.ndarray:
    """Weighted FAISS query codes ``(nq, replicas·nbytes)`` uint8 of coordinates ``y`` ``(nq, K)``.

    Replica ``r`` of coordinate ``j`` is ``σ_j``'s bit (1 for ``y_j >= 0``) when ``r < w_j``, else
    1 if ``r − w_j`` is even and 0 if odd (neutral pairs); ``w = query_levels(y, replicas)``.
    The Hamming distance to a row with stored signs ``β`` is then ``(R·K − Σ_j σ_j w_j β_j)/2``
    (module docstring). Pass ``-y`` for the most negative side.
    """
    y = np.asarray(y, np.float32)
    if y.ndim != 2 or y.shape[1] != layout.num_coords:
        raise ConfigError(f"query coordinates must have shape (nq, {layout.num_coords}), got {y.shape}")
    R = int(replicas)
    sigma = np.where(y >= 0, 1.0, -1.0).astype(np.float32)
    w = query_levels(y, R)
    parts = []
    for r in range(R):
        neutral = np.where((r - w) % 2 == 0, 1.0, -1.0).astype(np.float32)
        parts.append(pack_signs(np.where(r < w, sigma, neutral), layout))  # ±1 → bits 1/0
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------


def id_keys(ids: Sequence[str]) -> np.ndarray:
    """Stable FAISS keys of example ids: ``(n,)`` int64, non-negative (see the module docstring)."""
    digest = b"".join(hashlib.blake2b(str(i).encode("utf-8"), digest_size=8).digest() for i in ids)
    return np.frombuffer(digest, dtype="<i8").astype(np.int64) & _KEY_MASK


def _check_unique(keys: np.ndarray, ids: pa.Array, where: str) -> None:
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


# ---------------------------------------------------------------------------------------------
# reading the table
# ---------------------------------------------------------------------------------------------


def _require_signs(index) -> None:
    if index.manifest.precision != "1bit":
        raise IncompatibleIndexError(
            f"{index.path}: FAISS candidates need stored signs, but this index stores precision "
            f"{index.manifest.precision!r} coordinates. Use the exact scan (top_influential without "
            "candidates) or build a 1-bit index (--precision 1bit)"
        )


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
        table = dataset.take(offsets[start:start + rows], columns=["id", "signs"])
        yield table.column("id").combine_chunks(), list_column_to_numpy(table.column("signs"), nbytes, np.uint8)


def _progress(iterable, enabled: bool, desc: str, total: Optional[int] = None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="batch")


# ---------------------------------------------------------------------------------------------
# the index
# ---------------------------------------------------------------------------------------------


def _new_faiss_index(config: FaissConfig, nbytes: int, n: int, sample: Callable[[np.ndarray], np.ndarray]):
    """An empty (IVF: trained) FAISS binary index for ``n`` rows of ``replicas·8·nbytes`` bits, and its parameters.

    ``sample(offsets)`` returns the ``(len(offsets), nbytes)`` uint8 *unreplicated* signs of the
    given rows (IVF training; the centroids are replicated afterwards, see the module docstring).
    """
    faiss = _faiss()
    R = int(config.replicas)
    d = R * nbytes * 8
    params: Dict[str, Any] = {}
    if config.kind == "flat":
        return faiss.IndexBinaryIDMap(faiss.IndexBinaryFlat(d)), params
    if config.kind == "hnsw":
        inner = faiss.IndexBinaryHNSW(d, int(config.hnsw_m))
        inner.hnsw.efConstruction = int(config.ef_construction)
        params.update(hnsw_m=int(config.hnsw_m), ef_construction=int(config.ef_construction))
        return faiss.IndexBinaryIDMap(inner), params
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
    params.update(nlist=nlist, train_rows=int(n_train), train_iters=int(config.train_iters))
    return ivf, params


def _faiss():
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - faiss is a dependency of the cpu/gpu extras
        raise ConfigError("FAISS is not installed: pip install 'eogp-index[cpu]' (or [gpu])") from exc
    return faiss


def _paths(index_dir: Union[str, Path], name: str) -> Dict[str, Path]:
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"FAISS index name must be a plain file name, got {name!r}")
    base = Path(index_dir) / FAISS_DIR
    return {"dir": base, "index": base / f"{name}.faissindex", "ids": base / f"{name}.ids.parquet",
            "meta": base / f"{name}.json"}


class CandidateIndex:
    """A FAISS binary index over the stored signs of an :class:`~eogp_index.client.AttributionIndex`.

    Build with :func:`build` (or :meth:`build`), reopen with :meth:`load`, keep current with
    :meth:`extend`, query with :meth:`search`.

    Attributes:
        config: the :class:`FaissConfig` (search parameters can be changed with :meth:`set_search`).
        meta: the ``<name>.json`` contents (kind, parameters, table version, rows covered, hashes).
        ntotal: rows covered.
    """

    def __init__(self, index_dir: Path, name: str, config: FaissConfig, faiss_index, keys: np.ndarray,
                 ids: pa.Array, meta: Dict[str, Any]):
        self.index_dir = Path(index_dir)
        self.name = name
        self.config = config
        self.meta = meta
        self._index = faiss_index
        self._keys = np.ascontiguousarray(keys, dtype=np.int64)
        self._ids = ids
        self._gpu = None  # lazily built GPU copy of a flat index; False once known unavailable
        self._addr: Optional[Tuple[int, np.ndarray]] = None  # (table version, rowaddr per position)
        self._lock = threading.Lock()
        self._reindex_keys()

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, index, name: str = "default", config: FaissConfig = FaissConfig(), *,
              progress: bool = True) -> "CandidateIndex":
        """See :func:`build`."""
        faiss = _faiss()
        _paths(index.path, name)  # a bad name fails now, not after the build
        _require_signs(index)
        layout: SignLayout = index.layout
        nbytes = layout.nbytes
        if index.store.table is None:
            raise InputError(f"{index.path}: no rows stored yet; ingest examples before building a FAISS index")
        dataset = index.store.dataset()
        n = dataset.count_rows()
        if n == 0:
            raise InputError(f"{index.path}: no rows stored yet; ingest examples before building a FAISS index")
        # Train on a uniform sample (random access by offset), not the first rows: tables are
        # usually ordered by shard, and the first shard is no sample of the corpus.
        faiss_index, params = _new_faiss_index(
            config, nbytes, n, lambda offsets: np.concatenate([s for _, s in _stream(dataset, nbytes, offsets=offsets)]))
        config = replace(config, nlist=params.get("nlist", config.nlist))
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "kind": config.kind,
            "replicas": int(config.replicas), "params": params, "d_bits": int(config.replicas) * nbytes * 8,
            "nbytes": nbytes, "k": list(layout.k), "key": KEY_SCHEME,
            "table": index.manifest.table, "table_version": int(dataset.version), "rows": 0,
            "projection_sha256": index.manifest.projection["sha256"],
            "weights_sha256": index.manifest.model.get("weights_sha256"),
            "faiss_version": getattr(faiss, "__version__", "?"), "created_by": f"eogp-index {__version__}",
        }
        built = cls(index.path, name, config, faiss_index, np.zeros(0, np.int64), pa.array([], pa.string()), meta)
        built._add_rows(_stream(dataset, nbytes), progress=progress, total=-(-n // _rows_per_batch(nbytes)),
                        where=str(index.path))
        built.meta["table_version"] = int(dataset.version)
        built.save()
        return built

    @classmethod
    def from_codes(cls, codes: np.ndarray, ids: Sequence[str], config: FaissConfig = FaissConfig(), *,
                   index_dir: Union[str, Path] = ".", name: str = "in-memory") -> "CandidateIndex":
        """An index over codes held in memory, built exactly as :meth:`build` builds (benchmarks).

        Args:
            codes: ``(n, nbytes)`` uint8 packed signs, unreplicated (replicated here as ``config``
                says); row ``i`` gets FAISS position ``i``.
            ids: ``n`` example ids.

        Not tied to a table: :meth:`check_compatible` refuses every index, and :meth:`save`
        writes under ``index_dir`` only when called.
        """
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        if codes.ndim != 2 or codes.shape[0] != len(ids) or codes.shape[0] == 0:
            raise ConfigError(f"from_codes needs (n, nbytes) codes and n ids, n >= 1; got {codes.shape} and {len(ids)}")
        n, nbytes = codes.shape
        faiss_index, params = _new_faiss_index(config, nbytes, n, lambda offsets: codes[offsets])
        config = replace(config, nlist=params.get("nlist", config.nlist))
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "kind": config.kind,
                "replicas": int(config.replicas), "params": params, "d_bits": int(config.replicas) * nbytes * 8,
                "nbytes": nbytes, "k": [], "key": KEY_SCHEME,
                "table": None, "table_version": -1, "rows": 0, "projection_sha256": None, "weights_sha256": None}
        built = cls(Path(index_dir), name, config, faiss_index, np.zeros(0, np.int64), pa.array([], pa.string()), meta)
        id_array = pa.array(list(ids), pa.string())
        step = _rows_per_batch(nbytes)
        built._add_rows(((id_array[i:i + step], codes[i:i + step]) for i in range(0, n, step)), progress=False,
                        total=0, where=name)
        return built

    @classmethod
    def load(cls, index_dir: Union[str, Path], name: str = "default", *,
             config: Optional[FaissConfig] = None) -> "CandidateIndex":
        """Open ``<index_dir>/faiss/<name>.*``.

        Args:
            config: search parameters to use (``nprobe``, ``ef_search``, ``use_gpu``); build
                parameters (``kind``, ``replicas``, ``nlist``, HNSW's) always come from the saved index.

        Raises:
            IndexNotFoundError: no such FAISS index (build it with :func:`build` / ``eogp build-faiss``).
            IncompatibleIndexError: another format or format version (version 1 held unreplicated
                signs: rebuild it), or the three files disagree.
        """
        faiss = _faiss()
        paths = _paths(index_dir, name)
        if not paths["meta"].exists():
            raise IndexNotFoundError(
                f"{paths['meta']} not found: no FAISS index named {name!r} in {index_dir}; "
                f"build one with `eogp build-faiss {index_dir} --name {name}`"
            )
        meta = json.loads(paths["meta"].read_text())
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            old = (" (version 1 stored plain signs; version 2 stores each sign bit `replicas` times so that "
                   "queries can weight coordinates by |y|)") if meta.get("format_version") == 1 else ""
            raise IncompatibleIndexError(
                f"{paths['meta']}: format {meta.get('format')!r} version {meta.get('format_version')!r}, but this "
                f"eogp-index reads {FORMAT!r} version {FORMAT_VERSION}{old}; rebuild it with "
                f"`eogp build-faiss {index_dir} --name {name}`"
            )
        import pyarrow.parquet as pq

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
                f"{meta['d_bits']} bits (an interrupted write?); rebuild it with "
                f"`eogp build-faiss {index_dir} --name {name}`"
            )
        params = meta.get("params", {})
        base = config or FaissConfig()
        config = replace(base, kind=meta["kind"], replicas=int(meta["replicas"]), nlist=params.get("nlist"),
                         hnsw_m=params.get("hnsw_m", base.hnsw_m),
                         ef_construction=params.get("ef_construction", base.ef_construction))
        return cls(index_dir, name, config, faiss_index, keys, ids, meta)

    def save(self) -> None:
        """Write the three files atomically each (the JSON last: it commits the others)."""
        faiss = _faiss()
        import pyarrow.parquet as pq

        paths = _paths(self.index_dir, self.name)
        paths["dir"].mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        tmp_index = paths["index"].with_name(paths["index"].name + suffix)
        faiss.write_index_binary(self._index, str(tmp_index))
        tmp_ids = paths["ids"].with_name(paths["ids"].name + suffix)
        pq.write_table(pa.table({"key": pa.array(self._keys, pa.int64()), "id": self._ids}), tmp_ids)
        tmp_meta = paths["meta"].with_name(paths["meta"].name + suffix)
        tmp_meta.write_text(json.dumps(self.meta, indent=2) + "\n")
        tmp_index.replace(paths["index"])
        tmp_ids.replace(paths["ids"])
        tmp_meta.replace(paths["meta"])

    # -- keeping current ---------------------------------------------------------------------
    def check_compatible(self, index) -> None:
        """Refuse an index whose codes are not the ones this FAISS index was built from.

        Raises:
            IncompatibleIndexError: other projection, model, layout or table; or not 1-bit.
        """
        _require_signs(index)
        where = _paths(self.index_dir, self.name)["meta"]
        checks = [
            ("projection sha256", self.meta.get("projection_sha256"), index.manifest.projection.get("sha256")),
            ("model weights sha256", self.meta.get("weights_sha256"), index.manifest.model.get("weights_sha256")),
            ("sign layout k", list(self.meta.get("k", [])), list(index.layout.k)),
            ("table", self.meta.get("table"), index.manifest.table),
        ]
        for what, ours, theirs in checks:
            if ours != theirs:
                raise IncompatibleIndexError(
                    f"{where} was built from another index ({what}: {ours!r} here, {theirs!r} in {index.path}); "
                    f"its candidates would not match these rows. Rebuild it with `eogp build-faiss {index.path} "
                    f"--name {self.name}`"
                )

    @property
    def ntotal(self) -> int:
        return int(self._keys.shape[0])

    @property
    def replicas(self) -> int:
        """``R``: copies of each stored sign bit in the FAISS codes."""
        return int(self.meta["replicas"])

    @property
    def code_bytes(self) -> int:
        """Bytes of a FAISS code (stored or query): ``replicas · nbytes``."""
        return int(self.meta["d_bits"]) // 8

    def query_codes(self, y: np.ndarray, layout: SignLayout) -> np.ndarray:
        """This index's weighted query codes ``(nq, code_bytes)`` of coordinates ``y`` ``(nq, K)``.

        See :func:`query_codes`; pass ``-y`` for the most negative side.
        """
        if layout.nbytes != int(self.meta["nbytes"]) or (self.meta.get("k") and list(layout.k) != self.meta["k"]):
            raise ConfigError(f"layout k={list(layout.k)} does not match this FAISS index "
                              f"(k={self.meta.get('k')}, {self.meta['nbytes']} sign bytes per row)")
        return query_codes(y, layout, self.replicas)

    def row_codes(self, signs: np.ndarray) -> np.ndarray:
        """Stored signs ``(n, nbytes)`` → the FAISS codes ``(n, code_bytes)`` this index stores for them."""
        signs = np.asarray(signs, np.uint8)
        if signs.ndim != 2 or signs.shape[1] != int(self.meta["nbytes"]):
            raise ConfigError(f"signs must have shape (n, {self.meta['nbytes']}) uint8, got {signs.shape}")
        return replicate_codes(signs, self.replicas)

    @property
    def table_version(self) -> int:
        return int(self.meta["table_version"])

    def extend(self, index, *, progress: bool = False, save: bool = True) -> int:
        """Add the stored rows whose ids are not covered yet; returns how many were added.

        Flat and HNSW add to the existing structure, IVF assigns new rows to its trained lists
        (no retraining: rebuild after the corpus has changed a lot). The ids and signs come from
        the hot copy (:meth:`StoredIndex.hot_codes`), not from the table. Rows deleted from the
        table stay in FAISS; they map to no row (:meth:`rowaddr_of`) and are dropped.
        """
        stored = getattr(index, "stored", index)
        self.check_compatible(stored)
        hot = stored.hot_codes()
        ids = hot.columns.column("id").combine_chunks() if hot.num_rows else pa.array([], pa.string())
        known = pc.is_in(ids, value_set=self._ids).to_numpy(zero_copy_only=False) if len(ids) else np.zeros(0, bool)
        new = np.flatnonzero(~known)
        before = self.ntotal
        if new.size:
            step = _rows_per_batch(int(self.meta["nbytes"]))
            batches = ((ids.take(pa.array(new[a:a + step])), np.asarray(hot.codes[new[a:a + step]]))
                       for a in range(0, new.size, step))
            self._add_rows(batches, progress=progress, total=-(-new.size // step), where=str(stored.path))
        self.meta["table_version"] = int(hot.version)
        if save:
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
            _check_unique(keys, ids, where)  # raised before save(): a bad build is never committed
            self._keys, self._ids = keys, ids
            self.meta["rows"] = int(len(keys))
            self._gpu = None
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

    # -- searching ---------------------------------------------------------------------------
    def set_search(self, *, nprobe: Optional[int] = None, ef_search: Optional[int] = None) -> None:
        """Change search-time parameters (IVF ``nprobe``, HNSW ``ef_search``)."""
        self.config = replace(self.config, nprobe=nprobe or self.config.nprobe,
                              ef_search=ef_search or self.config.ef_search)

    def _gpu_index(self):
        """A ``GpuIndexBinaryFlat`` copy of a flat index (positions as labels), or None."""
        if self._gpu is False or self.config.kind != "flat" or self.config.use_gpu == "never":
            return None
        if self._gpu is None:
            faiss = _faiss()
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
            raise ConfigError(f"query codes must have shape (nq, {width}) uint8 ({self.replicas} replicas of "
                              f"{self.meta['nbytes']} sign bytes; see query_codes), got {codes.shape}")
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
                if self.config.kind == "ivf":
                    self._index.nprobe = min(int(self.config.nprobe), int(self._index.nlist))
                elif self.config.kind == "hnsw":
                    # HNSW returns at most efSearch results: the beam must hold C of them.
                    faiss = _faiss()
                    faiss.downcast_IndexBinary(self._index.index).hnsw.efSearch = max(int(self.config.ef_search), k)
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


def build(index, name: str = "default", config: FaissConfig = FaissConfig(), *,
          progress: bool = True) -> CandidateIndex:
    """Build (or replace) the FAISS binary index ``name`` over every stored row of ``index``.

    Args:
        index: a :class:`~eogp_index.store.stored_index.StoredIndex` (or an opened index) with ``precision="1bit"``.
        name: saved as ``<index>/faiss/<name>.*``.
        config: which index (:class:`FaissConfig`).

    Raises:
        IncompatibleIndexError: the index stores coordinates, not signs.
        InputError: no rows stored yet, or an example id stored twice.

    ``config.kind == "clustered"`` builds a :class:`~eogp_index.search.clustered.ClusteredIndex`.
    """
    if config.kind == "clustered":
        from eogp_index.search.clustered import ClusteredIndex

        stored = getattr(index, "stored", index)
        _paths(stored.path, name)
        _require_signs(stored)
        return ClusteredIndex.build(stored, name, config, progress=progress)
    return CandidateIndex.build(index, name, config, progress=progress)


def load(index_dir: Union[str, Path], name: str = "default", *, config: Optional[FaissConfig] = None):
    """Open candidate index ``name`` of ``index_dir``, whichever its kind (the JSON says)."""
    meta_path = _paths(index_dir, name)["meta"]
    if meta_path.exists():
        try:
            fmt = json.loads(meta_path.read_text()).get("format")
        except (ValueError, OSError):
            fmt = None
        if fmt == "eogp-clustered":
            from eogp_index.search.clustered import ClusteredIndex

            return ClusteredIndex.load(index_dir, name, config=config or FaissConfig(kind="clustered"))
    return CandidateIndex.load(index_dir, name, config=config)


# ---------------------------------------------------------------------------------------------
# exact rescoring and the query path
# ---------------------------------------------------------------------------------------------


def rescore(signs: np.ndarray, scales: np.ndarray, y: np.ndarray, layout: SignLayout, *,
            rows: Optional[np.ndarray] = None) -> np.ndarray:
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
        block = unpack_signs(signs[start:start + step], layout)
        block *= np.repeat(scales[start:start + step].astype(np.float32), layout.k, axis=1)
        out[:, start:start + step] = y @ block.T
    return out


_CACHE: Dict[Tuple[str, str], Tuple[Tuple[int, int], CandidateIndex]] = {}
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget the FAISS indexes :func:`open_candidates` keeps loaded (they hold the codes in memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def open_candidates(index, name: str = "default", *, refresh: bool = True):
    """The candidate index ``name`` of ``index``, checked compatible and covering every stored row.

    Loaded once per process and reused while its JSON is unchanged. With ``refresh`` and a table
    newer than the recorded version, :meth:`CandidateIndex.extend` adds the new rows (and saves);
    a :class:`~eogp_index.search.clustered.ClusteredIndex` is refreshed (new rows to its delta,
    or rebuilt after a compaction).
    """
    index = getattr(index, "stored", index)
    meta_path = _paths(index.path, name)["meta"]
    try:
        stat = meta_path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except FileNotFoundError:
        stamp = None
    key = (str(Path(index.path).resolve()), name)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is None or stamp is None or cached[0] != stamp:
            cand = load(index.path, name)
            stat = meta_path.stat()
            _CACHE[key] = ((stat.st_mtime_ns, stat.st_size), cand)
        cand = _CACHE[key][1]
    cand.check_compatible(index)
    # The table's latest version: another process may have ingested (Store.version looks cheaply).
    if refresh and index.store.version not in (0, cand.table_version):
        if getattr(cand, "kind", None) == "clustered":
            cand = cand.refresh(index)
        else:
            cand.extend(index)
        stat = meta_path.stat()
        with _CACHE_LOCK:
            _CACHE[key] = ((stat.st_mtime_ns, stat.st_size), cand)
    return cand


def candidate_ids(cand: CandidateIndex, y: np.ndarray, layout: SignLayout, C: int,
                  direction: Direction = "positive") -> List[str]:
    """Ids of the FAISS candidates of one query ``y`` ``(K,)`` or ``(1, K)``, no duplicates.

    ``positive`` uses the weighted codes of ``y`` (:meth:`CandidateIndex.query_codes`),
    ``negative`` those of ``-y``, ``both`` the union.
    """
    y = np.asarray(y, np.float32).reshape(1, -1)
    out: Dict[str, None] = {}
    for side in (("positive", "negative") if direction == "both" else (direction,)):
        codes = cand.query_codes(y if side == "positive" else -y, layout)
        for i in cand.search(codes, C)[0]:
            if i is not None:
                out[i] = None
    return list(out)


def candidate_top_k(stored, y: np.ndarray, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None,
                    faiss_name: str = "default") -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """One query's top ``k`` per side among ``C`` FAISS candidates per side, rescored exactly.

    The query's weighted codes (``-y``'s for the negative side) pick ``C`` Hamming-nearest rows
    from FAISS, the ``where`` filter is applied to them, and the survivors are scored exactly;
    the result equals the exact scan restricted to (candidates ∩ filter). With two sides the
    candidate set is the union of both sides' candidates. When the filter matches at most ``C``
    rows, all of them are rescored instead (exact, and no more work). FAISS positions map to row
    addresses through :meth:`CandidateIndex.rowaddr_of` (made once per table version), the filter
    is :meth:`StoredIndex.matching_rows`, and the rows are rescored from the hot copy: nothing is
    read from the table per query.

    A ``clustered`` index (:mod:`eogp_index.search.clustered`) scans its promising cells, at
    most ``C`` rows per side, with the exact kernel, and returns its best ``k + 8`` per side.

    Args:
        stored: a :class:`~eogp_index.store.stored_index.StoredIndex` (or an
            ``AttributionIndex``). y: ``(1, K)`` float32.

    Returns:
        ``{side: (rowaddr (r,) uint64, scores (r,) float32)}`` of every rescored row (ranking
        picks the best): ``r <= 2C``, fewer when few survive the filter.

    Raises:
        IncompatibleIndexError: not a 1-bit index, or the FAISS index was built from other codes.
        IndexNotFoundError: no FAISS index ``faiss_name`` (build it first).
        ConfigError: ``C < k``.
    """
    if C < k:
        raise ConfigError(f"candidates C={C} must be at least k={k}")
    stored = getattr(stored, "stored", stored)
    _require_signs(stored)
    cand = open_candidates(stored, faiss_name)
    if getattr(cand, "kind", None) == "clustered":
        found = cand.top_k(stored, y, k, C, sides, where=where)
        return {side: (rowaddr, scores) for side, (rowaddr, scores, _) in found.items()}
    layout: SignLayout = stored.layout
    hot = stored.hot_codes()
    matching = stored.matching_rows(where, hot) if where else None  # sorted hot positions
    if matching is not None and matching.size <= C:
        rows = matching  # the filter leaves no more rows than candidates: rescore them all
    else:
        y1 = np.asarray(y, np.float32).reshape(1, -1)
        positions = [cand.search_with_distances(cand.query_codes(y1 if side == "positive" else -y1, layout), C)[1][0]
                     for side in sides]
        addr = cand.rowaddr_of(stored, np.concatenate(positions))
        addr = np.unique(addr[addr != MISSING_ROW])
        rows = hot.positions(addr)  # sorted: the hot copy is in row-address order
        if matching is not None:
            at = np.minimum(np.searchsorted(matching, rows), max(matching.size - 1, 0))
            rows = rows[matching[at] == rows] if matching.size else rows[:0]
    rows = np.asarray(rows, np.int64)
    scores = rescore(hot.codes, hot.scales, y, layout, rows=rows)[0] if rows.size else np.zeros(0, np.float32)
    return {side: (hot.rowaddr[rows].astype(np.uint64), scores) for side in sides}
