"""Exact scan of scaled-sign codes (Section 3.3 and Appendix B, "Query scoring").

A store holds ``n`` rows. Row ``i`` keeps, for each of the ``U`` modules, the signs ``b_iu`` of
its ``k_u`` projected coordinates (one bit each) and one FP16 scale ``s_iu = ‖x_iu‖₁ / k_u``.
A query batch ``y`` ``(nq, K)`` (``K = Σ_u k_u``, unquantized) is scored against every row as

    score[q, i] = Σ_u s_iu · Σ_j y[q, cum_k_u + j] · b_iuj,        b ∈ {+1, -1}

(positive = helpful; no sign flips). This module computes that sum exactly, straight from the
packed bits.

Bit layout (fixed, also ``schemas/store.md``): module ``u``'s bits start at a fresh byte
``off_u = Σ_{v<u} ⌈k_v/8⌉``; coordinate ``j`` is bit ``j % 8`` of byte ``off_u + j // 8``,
least significant bit first (``np.packbits(..., bitorder="little")``, FAISS's convention);
bit 1 is ``+1`` (coordinate ``>= 0``), bit 0 is ``-1``. The padding bits at the end of a
module's last byte are written as 0 by :func:`pack_signs`, and every kernel here *masks* them
as well, so garbage in padding bits never changes a score.

Kernels (CPU, numba; the first call compiles them, later processes load the cache):

* **Exact scan** (:func:`scan_scores`, and the rescoring inside :func:`scan_top_k`): for each
  query a lookup table gives, for every byte position ``p`` of a row and each of the 256 values
  that byte can take, the signed partial sum ``Σ_t ±y`` of the (at most 8) query coordinates
  that byte covers. Padding coordinates have weight 0 in the table, which is how padding bits
  are masked. A module's inner product is then one table lookup and one add per byte. Entries
  are computed in float64 and rounded once to float32; per-module sums run in float32 with 8
  independent accumulators and are combined with the scales in float64. Results equal the
  float64 reference up to float32 rounding and reassociation (~1e-7 relative to
  ``Σ_u s_iu ‖y_u‖₁``). Large batches (``nq >= 16``) use nibble tables laid out query-minor, so
  that one lookup feeds 64 queries with vector adds (``kernels.exact._exact_batch_kernel``); its
  float32 summation order differs, so its scores can differ from a single-query scan in the last
  bits.
* **Bounded pre-scan** (inside :func:`scan_top_k`): the query is quantized per module to 8-bit
  integers ``ŷ_u = Δ_u · q_u``, and ``⟨q_u, c⟩`` (``c`` the 0/1 bits) is computed from the packed
  bits with integer SIMD written as LLVM IR (``kernels.prescan_ir._group_prescan``): per 64-bit
  code word either eight AND+popcount over the bit planes of ``q`` (portable; VPOPCNTQ on AVX-512
  hosts), or, for
  query batches on AVX512-VNNI hosts, the word expanded to 64 bytes once and multiplied with
  several queries' int8 values by VPDPBUSD (``_batch_prescan``). Four rows (one query) or
  two rows x eight queries (batch) are scored together so that each load feeds several
  products; rows are read in place at any alignment and prefetched a few rows ahead. Each row
  gets the approximate score and the deterministic bound ``Σ_u s_iu · (‖y_u - ŷ_u‖₁ + ε_u)``
  (``ε_u`` covers the float32 rounding of the exact kernel). Then, per query: the rows with the
  best approximations are rescored exactly first (a *pilot*: their k-th best exact score is a
  threshold about two bounds above the k-th best lower bound); rows whose interval reaches the
  threshold get a second 8-bit pass over the residual ``y - ŷ`` (bound ~127x tighter); the rows
  still in reach are rescored exactly, a few rows at a time straight from the query
  (``kernels.exact._exact_direct_kernel``, the table entries a row uses computed on the fly, same
  bits).
  So :func:`scan_top_k` returns exactly the rows and float32 scores that sorting the
  single-query :func:`scan_scores` gives (ties ordered by row index).

Both kernels read each row's codes once for the whole query batch and parallelize over blocks
of rows (``numba.prange``); :func:`scan_top_k` walks the store in chunks and keeps a running
top-k, so it never holds ``(nq, n)`` scores. :func:`scan_scores_torch` is a torch path for GPUs
(unpack on the device in chunks, one matmul per chunk).

This module is the driver (input checks, which kernel for which job, the top-k loop); the
kernels live in :mod:`eogp_index.search.kernels`, one file per concern: ``checks`` (layout,
geometry, input validation), ``base`` (argument bundles, FP16 scales, parallel/serial twins),
``exact`` (table walks), ``quantize`` (tables and 8-bit query levels), ``prescan_ir`` (the LLVM
IR intrinsics), ``bounded`` (pre-scan kernels), ``select`` (running top-k) and ``torch_scan``.
The private names the tests and benchmarks use (``_geometry``, ``_bounded_kernel``,
``_quantize_queries``, ...) are importable from here.

Speed: the pre-scan is compute-bound and runs several times faster than the table walk, so
single-query :func:`scan_top_k` reads the store at a good share of the memory bandwidth. A
batch of 64 queries costs much more than one: its pre-scan is an int8 x 1-bit product of
``8·10⁹`` VPDPBUSD per GB of codes, a floor whatever the loop order. ``benchmarks/scan.py``
prints the figures; docs/benchmarks.md ("Scan") gives them with the command.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from eogp_index.errors import ConfigError

# Kernel internals that tests reach through this module (scan_mod._HALF_TABLE, ...), with the
# ones imported above; they are not API.
from eogp_index.search.kernels.base import (  # noqa: F401
    _HALF_TABLE,
    _QUERY_GROUP,
    _QUERY_SET,
    _ROW_BLOCK,
    Level,
    Pairs,
    Store,
    _half_to_f64,
    _level_args,
    _scale_args,
    _store_args,
)
from eogp_index.search.kernels.bounded import (
    _bounded_batch_kernel,
    _bounded_kernel,
    _bounded_kernel_serial,
    _bounded_pairs_kernel,
    _bounded_pairs_kernel_serial,
)
from eogp_index.search.kernels.checks import (
    _as_layout,
    _check_codes,
    _check_queries,
    _check_rows,
    _check_scales,
    _geometry,
    _prepare,
)
from eogp_index.search.kernels.exact import (
    _exact_batch_kernel,
    _exact_direct_pairs,
    _exact_direct_pairs_serial,
    _exact_kernel,
    _exact_kernel_serial,
)
from eogp_index.search.kernels.prescan_ir import _host_has_vnni
from eogp_index.search.kernels.quantize import (
    _QUERY_BITS,
    _bit_planes,
    _group_levels,
    _group_tables,
    _lookup_tables,
    _padded_queries,
    _quantize_level,  # noqa: F401
    _quantize_queries,
    _QuantLevel,
)
from eogp_index.search.kernels.select import _kth_lower_bound, _reaching, _Running, _top_positions
from eogp_index.search.kernels.torch_scan import scan_scores_torch
from eogp_index.store.codecs import SignLayout, pack_signs, scales_of, unpack_signs

__all__ = [
    "SignLayout",
    "TopK",
    "pack_signs",
    "unpack_signs",
    "scales_of",
    "score_reference",
    "scan_scores",
    "scan_top_k",
    "scan_scores_torch",
]

# Driver settings: module globals read at call time (tests monkeypatch them). The kernels' own
# block sizes are compile-time constants in eogp_index.search.kernels.

# numba's "workqueue" threading layer aborts the process when two threads launch parallel
# kernels at once; scans from several Python threads take turns instead (they would compete for
# the same cores anyway).
_KERNEL_LOCK = threading.Lock()
# Jobs of at most this many code bytes x queries run on the calling thread: up to a few ms of
# work, less than what waking the worker threads can cost.
_SERIAL_MAX_BYTES = 4 << 20
# Rows per chunk of scan_top_k (before dividing by the number of queries): bounds the
# (nq, chunk) float64 intervals held at once to ~64 MiB.
_TOPK_CHUNK_ELEMS = 1 << 22
# Each chunk scores exactly the rows that enter the running top k, about k·(1 + ln chunks) per
# side in all: a large k (a rescoring's N = F·k rows per side) gets _TOPK_CHUNK_ELEMS times
# ⌊k / _TOPK_CHUNK_K⌋ elements, at most _TOPK_CHUNK_ELEMS_MAX, so that a batch's exact work stays
# near k per side.
_TOPK_CHUNK_K = 100
_TOPK_CHUNK_ELEMS_MAX = 1 << 24
# Byte-position lookup tables (256 entries per byte) are used while the batch's tables are at most
# this large; beyond it nibble tables (2 × 16 entries per byte, 8x smaller) stay in cache better.
_BYTE_LUT_MAX_BYTES = 8 << 20
# Batches of at least this many queries go through the query-vectorized exact kernel, which
# handles _QUERY_GROUP queries per pass.
_BATCH_MIN_QUERIES = 16
# Exact rescoring computes the table entries a row uses on the fly for at most this many rows of
# a query; beyond that building the query's byte table (256 entries per byte) is cheaper.
_DIRECT_MAX_ROWS = 128
# Query batches of at least this size use the batch pre-scan (where VNNI is available).
_BATCH_PRESCAN_MIN = 3
_NO_ROWS = np.empty(0, dtype=np.int64)
# Whether the pre-scan uses the AVX512-VNNI form; None until _prescan_vnni() asks the host.
_PRESCAN_VNNI: Optional[bool] = None


def _prescan_vnni() -> bool:
    """Whether the pre-scan uses the AVX512-VNNI kernel (else bit planes, which run anywhere).

    Only when numba compiles for this very CPU (no ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``
    override) and that CPU has AVX512-VNNI; tests set ``_PRESCAN_VNNI = False`` for the other path.
    """
    global _PRESCAN_VNNI
    if _PRESCAN_VNNI is None:
        _PRESCAN_VNNI = bool(_host_has_vnni())
    return _PRESCAN_VNNI


def _use_nibbles(layout: SignLayout, nq: int) -> bool:
    """Nibble tables once the byte tables of the batch would not stay in cache."""
    return nq * layout.nbytes * 256 * 4 > _BYTE_LUT_MAX_BYTES


def score_reference(codes: np.ndarray, scales: np.ndarray, y: np.ndarray, layout: SignLayout) -> np.ndarray:
    """Plain float64 reference (unpack + matmul), for tests.

    Args:
        codes: ``(n, nbytes)`` uint8. scales: ``(n, U)`` float16. y: ``(nq, K)`` float32.

    Returns:
        ``(nq, n)`` float64 ``Σ_u s_iu ⟨y_u, b_iu⟩``.
    """
    layout = _as_layout(layout)
    codes = _check_codes(codes, layout)
    scales = _check_scales(scales, codes.shape[0], layout).astype(np.float64)
    y = _check_queries(y, layout).astype(np.float64)
    b = unpack_signs(codes, layout).astype(np.float64)
    out = np.zeros((y.shape[0], codes.shape[0]), dtype=np.float64)
    for u, (c0, k) in enumerate(zip(layout.coord_offsets, layout.k)):
        out += (y[:, c0 : c0 + k] @ b[:, c0 : c0 + k].T) * scales[:, u][None, :]
    return out


def _exact_scores(store: Store, lut: np.ndarray, nibble: bool, layout: SignLayout, rows: np.ndarray) -> np.ndarray:
    """Exact scores ``(nq, m)`` float32 of ``rows`` from lookup tables ``lut`` (see
    :func:`_lookup_tables`), on the calling thread for small jobs."""
    out = np.empty((lut.shape[0], rows.shape[0]), dtype=np.float32)
    boff = _geometry(layout).boff
    if rows.shape[0] * layout.nbytes * lut.shape[0] <= _SERIAL_MAX_BYTES:
        _exact_kernel_serial(store, lut, nibble, boff, rows, out)
    else:
        with _KERNEL_LOCK:
            _exact_kernel(store, lut, nibble, boff, rows, out)
    return out


def scan_scores(
    codes: np.ndarray,
    scales: np.ndarray,
    y: np.ndarray,
    layout: SignLayout,
    *,
    rows: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Exact scores of every query against every (or every selected) row.

    Args:
        codes: ``(n, nbytes)`` uint8 packed signs.
        scales: ``(n, U)`` float16 (float32 accepted).
        y: ``(nq, K)`` float32 queries (a 1-D ``(K,)`` query is treated as ``nq = 1``; other
            float dtypes are converted to float32).
        layout: module sizes.
        rows: optional ``(m,)`` int64 row indices to score (a filter), in the order wanted.

    Returns:
        ``(nq, m)`` float32 (``m = n`` without ``rows``); column ``i`` belongs to row ``rows[i]``.
    """
    codes, scales, y, layout = _prepare(codes, scales, y, layout)
    rows = _check_rows(rows, codes.shape[0])
    if rows is None:
        rows = np.arange(codes.shape[0], dtype=np.int64)
    nq = y.shape[0]
    if nq < _BATCH_MIN_QUERIES:
        nibble = _use_nibbles(layout, nq)
        return _exact_scores(_store_args(codes, scales), _lookup_tables(y, layout, nibble), nibble, layout, rows)
    store = _store_args(codes, scales)
    out = np.empty((nq, rows.shape[0]), dtype=np.float32)
    part = np.empty((_QUERY_GROUP, rows.shape[0]), dtype=np.float32)
    for q0 in range(0, nq, _QUERY_GROUP):
        q1 = min(nq, q0 + _QUERY_GROUP)
        if rows.shape[0]:
            lutv = _group_tables(y[q0:q1], layout)
            with _KERNEL_LOCK:
                _exact_batch_kernel(store, lutv, _geometry(layout).boff, rows, part)
        out[q0:q1] = part[: q1 - q0]
    return out


@dataclass(frozen=True)
class TopK:
    """Best rows per query.

    Attributes:
        largest_indices: ``(nq, k)`` int64 row indices (into ``codes``) of the most positive
            scores, best first; ``None`` if not requested.
        largest_scores: ``(nq, k)`` float32 their exact scores (descending).
        smallest_indices: ``(nq, k)`` int64 rows of the most negative scores, most negative first.
        smallest_scores: ``(nq, k)`` float32 (ascending).

    ``k`` is clipped to the number of scanned rows. Equal scores are ordered by row index.
    """

    largest_indices: Optional[np.ndarray]
    largest_scores: Optional[np.ndarray]
    smallest_indices: Optional[np.ndarray]
    smallest_scores: Optional[np.ndarray]


def scan_top_k(
    codes: np.ndarray,
    scales: np.ndarray,
    y: np.ndarray,
    layout: SignLayout,
    k: int,
    *,
    rows: Optional[np.ndarray] = None,
    largest: bool = True,
    smallest: bool = True,
    chunk_rows: Optional[int] = None,
) -> TopK:
    """The ``k`` most positive and most negative rows per query, with their exact scores.

    The store is walked in chunks (``chunk_rows`` rows, default ``~4M / nq``; larger for ``k >= 200``). Per chunk an 8-bit
    pre-scan gives every row an interval that contains its exact score; the rows with the best
    approximations are rescored exactly first, which sets a tight running k-th best; rows whose
    interval still reaches it get a second, ~127x tighter interval from the quantized residual;
    the rows still in reach are rescored exactly. The result is the same as sorting the
    single-query :func:`scan_scores` of each query (rows and float32 scores), with equal scores
    ordered by row index. Only ``(nq, chunk)`` intervals are held at a time.

    Args:
        codes: ``(n, nbytes)`` uint8. scales: ``(n, U)`` float16. y: ``(nq, K)`` float32.
        layout: module sizes. k: rows per query and direction (``>= 1``).
        rows: optional ``(m,)`` int64 row indices to consider (a filter); duplicates are ignored.
        largest, smallest: which directions to return.
        chunk_rows: rows per chunk (tests use small values to exercise the merging).

    Returns:
        :class:`TopK` with ``(nq, min(k, m))`` arrays; indices refer to rows of ``codes``.
    """
    return _TopKScan(
        codes, scales, y, layout, k, rows=rows, largest=largest, smallest=smallest, chunk_rows=chunk_rows
    ).run()


def _pairs(todo: dict[int, np.ndarray], split: int) -> Pairs:
    """(query, rows) lists as segments of at most ``split`` rows (queries in ``todo``'s order)."""
    qidx, lens = [], []
    for q, r in todo.items():
        for i0 in range(0, r.shape[0], split):
            qidx.append(q)
            lens.append(min(split, r.shape[0] - i0))
    indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    prow = np.concatenate(list(todo.values())) if todo else _NO_ROWS
    return Pairs(np.asarray(qidx, dtype=np.int64), indptr, np.ascontiguousarray(prow, dtype=np.int64))


def _split_by_query(todo: dict[int, np.ndarray], *flat: np.ndarray) -> dict[int, tuple[np.ndarray, ...]]:
    """Cut arrays laid out as :func:`_pairs` lays out ``todo`` (queries in order) back per query."""
    out, start = {}, 0
    for q, r in todo.items():
        out[q] = tuple(a[start : start + r.size] for a in flat)
        start += r.size
    return out


class _TopKScan:
    """One :func:`scan_top_k` call: the checked inputs, the quantized queries and the running top-k.

    :meth:`run` walks the store in chunks; per chunk, :meth:`_level1` (8-bit pre-scan of every
    row), :meth:`_pilot` (exact scores of the best approximations), :meth:`_survivors` (rows whose
    level-1 interval reaches a threshold), :meth:`_level2` (the residual pass on those) and
    :meth:`_rescore` (exact scores of what is still in reach). ``running[(q, d)]`` holds query
    ``q``'s best exact scores in direction ``d`` (``+1.0`` largest, ``-1.0`` smallest).
    """

    _BITS = {1.0: 1, -1.0: 2}  # the flag bit of each direction in _reaching's output

    def __init__(self, codes, scales, y, layout, k, *, rows, largest, smallest, chunk_rows):
        codes, scales, y, layout = _prepare(codes, scales, y, layout)
        k = int(k)
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        if not (largest or smallest):
            raise ConfigError("scan_top_k needs largest=True or smallest=True (both False asks for nothing)")
        n = codes.shape[0]
        rows = _check_rows(rows, n)
        if rows is not None and not (rows.size < 2 or bool(np.all(rows[1:] > rows[:-1]))):
            rows = np.unique(rows)  # (Lance hands row lists over sorted and unique: no sort then)
        nq = y.shape[0]
        if chunk_rows is None:
            elems = min(_TOPK_CHUNK_ELEMS_MAX, _TOPK_CHUNK_ELEMS * max(1, k // _TOPK_CHUNK_K))
            chunk_rows = max(_ROW_BLOCK * 16, elems // nq)
        chunk_rows = int(chunk_rows)
        if chunk_rows < 1:
            raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")

        self.y, self.layout, self.rows, self.nq, self.chunk_rows = y, layout, rows, nq, chunk_rows
        self.m = n if rows is None else rows.shape[0]
        self.largest, self.smallest = largest, smallest
        self.dirs = [d for d, want in ((1.0, largest), (-1.0, smallest)) if want]
        self.kk = min(k, self.m)  # rows per query and direction in the result
        self.pilot = self.kk + 4  # best approximations per direction rescored first
        self.running = {(q, d): _Running(k, d > 0) for q in range(nq) for d in self.dirs}

        self.g = _geometry(layout)
        self.store = _store_args(codes, scales)
        self.nbytes = layout.nbytes
        self.nibble = _use_nibbles(layout, 1)  # rescoring runs one query at a time
        # One query: bit planes (as fast as VNNI there, and the same code on every host). A batch
        # where VNNI is available: groups of queries share each expanded code word.
        self.batch = nq >= _BATCH_PRESCAN_MIN and _prescan_vnni()
        level1, level2 = _quantize_queries(y, layout, levels=2, vnni=self.batch)
        # The kernels' bundles of the two levels (level 1 in groups of queries for the batch kernel).
        self.lv1 = _level_args(
            self.g, *(_group_levels(level1) if self.batch else (level1.qarr, level1.c1, level1.c0, level1.err))
        )
        if self.batch:  # level 2 scores a few rows per query: bit planes there too (one kernel form fewer)
            planes = np.zeros((nq, level2.qarr.shape[1] // 64 * _QUERY_BITS), dtype=np.uint64)
            _bit_planes(level2.qarr, planes)
            level2 = _QuantLevel(planes, level2.c1, level2.c0, level2.err)
        self.lv2 = _level_args(self.g, level2.qarr, level2.c1, level2.c0, level2.err)
        self.tables: dict[int, np.ndarray] = {}  # query -> its lookup table, kept while they fit
        self.padded: Optional[np.ndarray] = None  # the queries padded for the direct kernel

    def run(self) -> TopK:
        for c0 in range(0, self.m, self.chunk_rows):
            c1 = min(self.m, c0 + self.chunk_rows)
            crow = np.arange(c0, c1, dtype=np.int64) if self.rows is None else self.rows[c0:c1]
            approx1, bound1 = self._level1(crow)
            scored = self._pilot(crow, approx1)
            thr1, stage1 = self._survivors(approx1, bound1)
            final = self._level2(crow, approx1, thr1, stage1, scored)
            self._rescore(crow, final)
        li, ls = self._collect(1.0) if self.largest else (None, None)
        si, ss = self._collect(-1.0) if self.smallest else (None, None)
        return TopK(li, ls, si, ss)

    def _level1(self, crow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Level 1 of every query on the chunk's rows: ``(approx, bound)`` ``(nq, len(crow))``."""
        approx = np.empty((self.nq, crow.shape[0]), dtype=np.float64)
        bound = np.empty_like(approx)
        if self.batch:
            with _KERNEL_LOCK:
                _bounded_batch_kernel(self.store, self.lv1, crow, approx, bound)
            return approx, bound
        # On cores busy with other work, waking a second thread for a small filtered scan can
        # cost more than the parallel kernel gains.
        if crow.shape[0] * self.nbytes * self.nq <= _SERIAL_MAX_BYTES:
            _bounded_kernel_serial(self.store, self.lv1, crow, approx, bound)
        else:
            with _KERNEL_LOCK:
                _bounded_kernel(self.store, self.lv1, crow, approx, bound)
        return approx, bound

    def _pilot(self, crow: np.ndarray, approx1: np.ndarray) -> dict[int, np.ndarray]:
        """Rescore each query's rows with the best approximate scores first; returns their
        positions in the chunk per query.

        Once a query's running top-k is full, only those whose approximation beats it (they are
        likely to enter). Their exact k-th best is a threshold close to the final one (the k-th
        best lower bound is about two bounds below it), so far fewer rows survive level 1.
        """
        scored = {}
        for q in range(self.nq):
            pos = np.unique(np.concatenate([_top_positions(approx1[q], d, self.pilot) for d in self.dirs]))
            t_up = self.running[(q, 1.0)].threshold() if self.largest else np.inf
            t_down = self.running[(q, -1.0)].threshold() if self.smallest else np.inf
            sel, _ = _reaching(approx1[q, pos], np.zeros(pos.shape[0]), t_up, t_down)
            if sel.size:
                scored[q] = pos[sel]
        for q, ex in self._exact({q: crow[pos] for q, pos in scored.items()}).items():
            for d in self.dirs:
                self.running[(q, d)].merge(crow[scored[q]], ex)
        return scored

    def _survivors(self, approx1: np.ndarray, bound1: np.ndarray) -> tuple[dict, dict]:
        """Rows whose level-1 interval reaches a direction's threshold survive for it.

        Returns ``thr1[q][d]`` (the thresholds) and ``stage1[q] = (union, flags)``: the surviving
        positions in the chunk and which directions each survives for (``_BITS``).
        """
        thr1, stage1 = {}, {}
        for q in range(self.nq):
            # (A full running top-k, from the pilot or earlier chunks, is nearly always above the
            # chunk's k-th best lower bound, which is then not worth its pass.)
            thr1[q] = {
                d: self._threshold(q, d, approx1[q], bound1[q], -np.inf, self.running[(q, d)].val.size < self.kk)
                for d in self.dirs
            }
            union, flags = _reaching(approx1[q], bound1[q], thr1[q].get(1.0, np.inf), thr1[q].get(-1.0, np.inf))
            if union.size:
                stage1[q] = (union, flags)
        return thr1, stage1

    def _level2(self, crow, approx1, thr1, stage1, scored) -> dict[int, list]:
        """Level 2 (survivors only): add the 8-bit quantized residual, ~127x tighter bound.

        Returns, per query, one array per direction (``dirs``' order) of the chunk positions
        still in reach, less the pilot's rows (already merged).
        """
        todo = {q: crow[union] for q, (union, _) in stage1.items()}
        work = _pairs(todo, 256)
        approx = np.empty(work.prow.shape[0], dtype=np.float64)
        bound = np.empty_like(approx)
        if work.prow.shape[0] * self.nbytes <= 4 * _SERIAL_MAX_BYTES:
            _bounded_pairs_kernel_serial(self.store, self.lv2, work, approx, bound)
        else:
            with _KERNEL_LOCK:
                _bounded_pairs_kernel(self.store, self.lv2, work, approx, bound)
        level2_out = _split_by_query(todo, approx, bound)
        final: dict[int, list] = {}
        for q, (union, flags) in stage1.items():
            approx2, bound2 = level2_out[q]
            approx12 = approx1[q, union] + approx2
            done = scored.get(q, _NO_ROWS)
            final[q] = []
            for d in self.dirs:
                inside = np.flatnonzero(flags & self._BITS[d])
                a12, b2 = approx12[inside], bound2[inside]
                thr2 = self._threshold(q, d, a12, b2, thr1[q][d])
                keep, _ = _reaching(a12, b2, thr2, np.inf) if d > 0 else _reaching(a12, b2, np.inf, thr2)
                pos = union[inside[keep]]
                final[q].append(pos[~np.isin(pos, done)] if done.size else pos)
        return final

    def _rescore(self, crow: np.ndarray, final: dict[int, list]) -> None:
        """Exact rescoring of what is left, both directions at once, merged into the running top-k."""
        todo = {q: np.unique(np.concatenate(f)) for q, f in final.items()}
        for q, ex in self._exact({q: crow[t] for q, t in todo.items() if t.size}).items():
            for d, pos in zip(self.dirs, final[q]):
                self.running[(q, d)].merge(crow[pos], ex[np.searchsorted(todo[q], pos)])

    def _threshold(
        self, q: int, d: float, approx: np.ndarray, bound: np.ndarray, floor: float, lower: bool = True
    ) -> float:
        """A value of ``d · score`` (bigger is better) that ``kk`` rows are guaranteed to reach:
        the running k-th best exact score, the previous level's threshold ``floor``, or (with
        ``lower``) the kk-th best lower bound ``d · approx - bound`` of these rows, whichever is
        highest."""
        thr = max(floor, self.running[(q, d)].threshold())
        return max(thr, _kth_lower_bound(approx, bound, d, self.kk)) if lower else thr

    def _exact(self, todo: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Exact single-query scores (the bits of :func:`scan_scores`) of rows ``todo[q]`` per query.

        A few rows of a query are scored straight from the query (:func:`_exact_direct_pairs`,
        all such queries in one parallel call); more go through the query's lookup table, built
        when first needed and kept while the tables fit in 64 MiB.
        """
        out: dict[int, np.ndarray] = {}
        few = {
            q: r
            for q, r in todo.items()
            if r.size and not self.nibble and q not in self.tables and r.size <= _DIRECT_MAX_ROWS
        }
        if few:
            if self.padded is None:
                self.padded = _padded_queries(self.y, self.layout)
            serial = sum(r.size for r in few.values()) * self.nbytes <= _SERIAL_MAX_BYTES // 4
            work = _pairs(few, _DIRECT_MAX_ROWS if len(few) > 1 or serial else 16)
            res = np.empty(work.prow.shape[0], dtype=np.float32)
            if serial:
                _exact_direct_pairs_serial(self.store, self.padded, self.g.boff, work, res)
            else:
                with _KERNEL_LOCK:
                    _exact_direct_pairs(self.store, self.padded, self.g.boff, work, res)
            out.update({q: scores for q, (scores,) in _split_by_query(few, res).items()})
        for q, r in todo.items():
            if q in out or not r.size:
                out.setdefault(q, np.empty(0, dtype=np.float32))
                continue
            t = self.tables.get(q)
            if t is None:
                t = _lookup_tables(self.y[q : q + 1], self.layout, self.nibble)
                if (len(self.tables) + 1) * t.nbytes <= 64 << 20:
                    self.tables[q] = t
            out[q] = _exact_scores(self.store, t, self.nibble, self.layout, r)[0]
        return out

    def _collect(self, d: float) -> tuple[np.ndarray, np.ndarray]:
        """``(nq, kk)`` rows and scores of direction ``d``, best first."""
        idx = np.empty((self.nq, self.kk), dtype=np.int64)
        val = np.empty((self.nq, self.kk), dtype=np.float32)
        for q in range(self.nq):
            i, v = self.running[(q, d)].result()
            idx[q], val[q] = i[: self.kk], v[: self.kk]
        return idx, val
