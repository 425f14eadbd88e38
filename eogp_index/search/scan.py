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

Kernels (CPU, numba; the first call compiles for ~30 s, later processes load the cache):

* **Exact scan** (:func:`scan_scores`, and the rescoring inside :func:`scan_top_k`): for each
  query a lookup table gives, for every byte position ``p`` of a row and each of the 256 values
  that byte can take, the signed partial sum ``Σ_t ±y`` of the (at most 8) query coordinates
  that byte covers. Padding coordinates have weight 0 in the table, which is how padding bits
  are masked. A module's inner product is then one table lookup and one add per byte. Entries
  are computed in float64 and rounded once to float32; per-module sums run in float32 with 8
  independent accumulators and are combined with the scales in float64. Results equal the
  float64 reference up to float32 rounding and reassociation (~1e-7 relative to
  ``Σ_u s_iu ‖y_u‖₁``). Large batches (``nq >= 16``) use nibble tables laid out query-minor, so
  that one lookup feeds 64 queries with vector adds (:func:`_exact_batch_kernel`); its float32
  summation order differs, so its scores can differ from a single-query scan in the last bits.
* **Bounded pre-scan** (inside :func:`scan_top_k`): the query is quantized per module to 8-bit
  integers ``ŷ_u = Δ_u · q_u``, and ``⟨q_u, c⟩`` (``c`` the 0/1 bits) is computed from the packed
  bits with integer SIMD written as LLVM IR (:func:`_group_prescan`): per 64-bit code word either
  eight AND+popcount over the bit planes of ``q`` (portable; VPOPCNTQ on AVX-512 hosts), or, for
  query batches on AVX512-VNNI hosts, the word expanded to 64 bytes once and multiplied with
  several queries' int8 values by VPDPBUSD (:func:`_batch_prescan`). Four rows (one query) or
  two rows x eight queries (batch) are scored together so that each load feeds several
  products; rows are read in place at any alignment and prefetched a few rows ahead. Each row
  gets the approximate score and the deterministic bound ``Σ_u s_iu · (‖y_u - ŷ_u‖₁ + ε_u)``
  (``ε_u`` covers the float32 rounding of the exact kernel). Then, per query: the rows with the
  best approximations are rescored exactly first (a *pilot*: their k-th best exact score is a
  threshold about two bounds above the k-th best lower bound); rows whose interval reaches the
  threshold get a second 8-bit pass over the residual ``y - ŷ`` (bound ~127x tighter); the rows
  still in reach are rescored exactly, a few rows at a time straight from the query
  (:func:`_exact_direct_kernel`, the table entries a row uses computed on the fly, same bits).
  So :func:`scan_top_k` returns exactly the rows and float32 scores that sorting the
  single-query :func:`scan_scores` gives (ties ordered by row index).

Both kernels read each row's codes once for the whole query batch and parallelize over blocks
of rows (``numba.prange``); :func:`scan_top_k` walks the store in chunks and keeps a running
top-k, so it never holds ``(nq, n)`` scores. :func:`scan_scores_torch` is a torch path for GPUs
(unpack on the device in chunks, one matmul per chunk).

Speed (benchmarks/scan.py, 1 GB of codes, 64 modules x k=512, 2-core AMD EPYC Zen 4 VM): the
table walk does ~1 GB/s per core; the pre-scan ~10 GB/s per core, so single-query
:func:`scan_top_k` reads the store at ~13-17 GB/s, about half the memory bandwidth (the
pre-scan is compute-bound; the rest is a few ms). A batch of 64 queries costs ~30-40x one
query: its pre-scan is an int8 x 1-bit product of ~8·10⁹ VPDPBUSD for 1 GB, and one VPDPBUSD
per cycle and core puts ~1.1 s under it whatever the loop order. The 64-query exact kernel
(:func:`scan_scores`) takes ~0.3 ns per byte and query, about 4x less than 64 separate scans.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
from llvmlite import ir as llvm_ir
from numba import float32, float64, int64, njit, prange, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic

from eogp_index.errors import ConfigError, InputError
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

# numba's "workqueue" threading layer aborts the process when two threads launch parallel
# kernels at once; scans from several Python threads take turns instead (they would compete for
# the same cores anyway).
_KERNEL_LOCK = threading.Lock()
# Rows per parallel work item. Small enough that a filtered scan of a few thousand rows still
# splits over the cores, large enough that the per-block overhead does not show.
_ROW_BLOCK = 64
# Jobs of at most this many code bytes x queries run on the calling thread: up to a few ms of
# work, less than what waking the worker threads can cost.
_SERIAL_MAX_BYTES = 4 << 20
# Rows per chunk of scan_top_k (before dividing by the number of queries): bounds the
# (nq, chunk) float64 intervals held at once to ~64 MiB.
_TOPK_CHUNK_ELEMS = 1 << 22
# Bits of the quantized query in the bounded pre-scan (two's complement, one plane per bit).
_QUERY_BITS = 8
_QMAX = (1 << (_QUERY_BITS - 1)) - 1
# Byte-position lookup tables (256 entries per byte) are used while the batch's tables are at most
# this large; beyond it nibble tables (2 × 16 entries per byte, 8x smaller) stay in cache better.
_BYTE_LUT_MAX_BYTES = 8 << 20
# Batches of at least this many queries go through the query-vectorized kernel, which handles
# _QUERY_GROUP queries per pass (one zmm register holds 16 of them).
_BATCH_MIN_QUERIES = 16
_QUERY_GROUP = 64
# Rows per work item of the batch kernel: a module's nibble tables for a query group
# (2·⌈k_u/8⌉·16·64·4 bytes, 512 KiB for k_u = 512) are reused by this many rows.
_BATCH_ROW_BLOCK = 1024
# Exact rescoring computes the table entries a row uses on the fly for at most this many rows of
# a query; beyond that building the query's byte table (256 entries per byte) is cheaper.
_DIRECT_MAX_ROWS = 128
_NO_ROWS = np.empty(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def _as_layout(layout: Any) -> SignLayout:
    """Accept this module's :class:`SignLayout` or any object with a ``k`` sequence."""
    if isinstance(layout, SignLayout):
        return layout
    k = getattr(layout, "k", None)
    if k is None:
        raise ConfigError(f"expected a SignLayout (an object with per-module sizes .k), got {type(layout).__name__}")
    return SignLayout(tuple(k))


@dataclass(frozen=True)
class _Geometry:
    """Index arrays derived from a layout (cached per layout)."""

    boff: np.ndarray  # (U+1,) uint64 byte offsets of the modules, plus nbytes
    pad_index: np.ndarray  # (K,) int64: column j of a query → bit position 8*off_u + (j - cum_k_u)
    module_of_coord: np.ndarray  # (K,) int64
    word_start: np.ndarray  # (U+1,) int64 first 64-bit word of each module in a padded row
    word_start_u64: np.ndarray  # the same as uint64, for the kernels
    reads_past_row: bool  # a module's 8-byte loads can pass the end of the row (see _bounded_kernel)


@functools.lru_cache(maxsize=64)
def _geometry(layout: SignLayout) -> _Geometry:
    k = np.asarray(layout.k, dtype=np.int64)
    mb = (k + 7) // 8
    boff = np.concatenate([[0], np.cumsum(mb)]).astype(np.uint64)
    coff = np.concatenate([[0], np.cumsum(k)[:-1]])
    module_of_coord = np.repeat(np.arange(len(k), dtype=np.int64), k)
    pad_index = 8 * boff[:-1].astype(np.int64)[module_of_coord] + (np.arange(int(k.sum())) - coff[module_of_coord])
    mw = (mb + 7) // 8
    word_start = np.concatenate([[0], np.cumsum(mw)]).astype(np.int64)
    past = bool(np.any(boff[:-1].astype(np.int64) + 8 * mw > int(mb.sum())))
    ws64 = word_start.astype(np.uint64)
    for a in (boff, pad_index, module_of_coord, word_start, ws64):
        a.setflags(write=False)
    return _Geometry(boff, pad_index, module_of_coord, word_start, ws64, past)


# --------------------------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------------------------


def _check_codes(codes: Any, layout: SignLayout) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise InputError(f"codes must be uint8 packed sign bits, got dtype {codes.dtype}")
    if codes.ndim != 2 or codes.shape[1] != layout.nbytes:
        raise ConfigError(
            f"codes must have shape (n, {layout.nbytes}) (layout.nbytes = Σ_u ⌈k_u/8⌉ for k={_short(layout.k)}), "
            f"got {codes.shape}; check that the store and the layout belong together"
        )
    return np.ascontiguousarray(codes)


def _check_scales(scales: Any, n: int, layout: SignLayout) -> np.ndarray:
    scales = np.asarray(scales)
    if scales.ndim != 2 or scales.shape != (n, layout.num_modules):
        raise ConfigError(
            f"scales must have shape (n, U) = ({n}, {layout.num_modules}) to match codes and the layout, "
            f"got {scales.shape}"
        )
    if scales.dtype == np.float16:
        return np.ascontiguousarray(scales)
    if not np.issubdtype(scales.dtype, np.floating):
        raise InputError(f"scales must be float16 (or another float dtype), got {scales.dtype}")
    return np.ascontiguousarray(scales, dtype=np.float32)


def _check_queries(y: Any, layout: SignLayout) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 1:
        y = y[None, :]
    if y.ndim != 2 or y.shape[1] != layout.num_coords:
        raise ConfigError(
            f"queries y must have shape (nq, K) with K = Σ_u k_u = {layout.num_coords}, got {np.shape(y)}"
        )
    if not np.issubdtype(y.dtype, np.floating) and not np.issubdtype(y.dtype, np.integer):
        raise InputError(f"queries y must be float32, got dtype {y.dtype}")
    y = np.ascontiguousarray(y, dtype=np.float32)
    if not np.isfinite(y).all():
        bad = np.argwhere(~np.isfinite(y))[0]
        raise InputError(f"queries y contain NaN/inf (first at query {bad[0]}, column {bad[1]}); scores would be NaN")
    return y


def _check_rows(rows: Any, n: int) -> Optional[np.ndarray]:
    if rows is None:
        return None
    rows = np.asarray(rows)
    if rows.ndim != 1 or not (np.issubdtype(rows.dtype, np.integer) or rows.size == 0):
        raise InputError(f"rows must be a 1-D array of integer row indices, got shape {rows.shape} dtype {rows.dtype}")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        bad = rows[(rows < 0) | (rows >= n)][0]
        raise InputError(f"rows contains index {bad}, outside the store's 0..{n - 1}")
    return rows


def _short(k: tuple[int, ...]) -> str:
    return str(k) if len(k) <= 6 else f"({k[0]}, {k[1]}, …, {k[-1]}) [{len(k)} modules]"


def _scale_args(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Kernel arguments ``(half_bits, floats, half)`` for the scales.

    numba has no float16 arrays, so FP16 scales travel as their uint16 bits and are decoded in
    the kernel. Float32 scales go in the second slot. Both slots always hold a 2-D array (the
    unused one a dummy) so that every kernel is compiled once, not once per scale dtype.
    """
    if scales.dtype == np.float16:
        return scales.view(np.uint16), np.zeros((1, 1), dtype=np.float32), True
    return np.zeros((1, 1), dtype=np.uint16), scales, False


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


# --------------------------------------------------------------------------------------------
# numba kernels
# --------------------------------------------------------------------------------------------
# Hot loops index with uint64: numba adds a negative-index wraparound check to signed indices,
# which costs a few instructions per lookup and blocks vectorization. (Mixing int64 and uint64
# in one expression gives float64 in numba, so each loop sticks to one of them.)


# 2^(e-25) for the FP16 exponent field e (index 0 holds 2^-24, the subnormal step).
_HALF_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=np.float64)


@njit(cache=True)
def _half_to_f64(h):
    """IEEE binary16 bits (uint16) → float64, exactly (subnormals, inf, NaN included)."""
    hi = int64(h)
    e = (hi >> 10) & 0x1F
    m = hi & 0x3FF
    if e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = float64(m + (1024 if e > 0 else 0)) * _HALF_POW2[e]
    return -v if (hi >> 15) & 1 else v


@njit(cache=True, inline="always")
def _scale_at(s16, s32, half, r, u):
    if half:
        return _half_to_f64(s16[r, u])
    return float64(s32[r, u])


@njit(cache=True, boundscheck=False, inline="always")
def _lut8_module(cr, lut, p, p1):
    """``Σ_{p ≤ j < p1} lut[256 j + cr[j]]`` over one module's bytes, in float32.

    Eight accumulators: without fastmath LLVM keeps the additions in program order, so a single
    accumulator would make every add wait for the previous one.
    """
    a0 = float32(0.0)
    a1 = float32(0.0)
    a2 = float32(0.0)
    a3 = float32(0.0)
    a4 = float32(0.0)
    a5 = float32(0.0)
    a6 = float32(0.0)
    a7 = float32(0.0)
    one = uint64(1)
    s = uint64(256)
    while p + uint64(8) <= p1:
        b = p * s
        a0 += lut[b + uint64(cr[p])]
        a1 += lut[b + s + uint64(cr[p + one])]
        a2 += lut[b + uint64(512) + uint64(cr[p + uint64(2)])]
        a3 += lut[b + uint64(768) + uint64(cr[p + uint64(3)])]
        a4 += lut[b + uint64(1024) + uint64(cr[p + uint64(4)])]
        a5 += lut[b + uint64(1280) + uint64(cr[p + uint64(5)])]
        a6 += lut[b + uint64(1536) + uint64(cr[p + uint64(6)])]
        a7 += lut[b + uint64(1792) + uint64(cr[p + uint64(7)])]
        p += uint64(8)
    while p < p1:
        a0 += lut[p * s + uint64(cr[p])]
        p += one
    return float64(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)))


@njit(cache=True, boundscheck=False, inline="always")
def _lut4_module(cr, lut, p, p1):
    """Like :func:`_lut8_module` with two 16-entry nibble tables per byte (``lut[16 (2j + h) + v]``)."""
    a0 = float32(0.0)
    a1 = float32(0.0)
    a2 = float32(0.0)
    a3 = float32(0.0)
    a4 = float32(0.0)
    a5 = float32(0.0)
    a6 = float32(0.0)
    a7 = float32(0.0)
    m4 = uint64(15)
    f4 = uint64(4)
    while p + uint64(4) <= p1:
        b = p * uint64(32)
        c0 = uint64(cr[p])
        c1 = uint64(cr[p + uint64(1)])
        c2 = uint64(cr[p + uint64(2)])
        c3 = uint64(cr[p + uint64(3)])
        a0 += lut[b + (c0 & m4)]
        a1 += lut[b + uint64(16) + (c0 >> f4)]
        a2 += lut[b + uint64(32) + (c1 & m4)]
        a3 += lut[b + uint64(48) + (c1 >> f4)]
        a4 += lut[b + uint64(64) + (c2 & m4)]
        a5 += lut[b + uint64(80) + (c2 >> f4)]
        a6 += lut[b + uint64(96) + (c3 & m4)]
        a7 += lut[b + uint64(112) + (c3 >> f4)]
        p += uint64(4)
    while p < p1:
        b = p * uint64(32)
        c0 = uint64(cr[p])
        a0 += lut[b + (c0 & m4)]
        a1 += lut[b + uint64(16) + (c0 >> f4)]
        p += uint64(1)
    return float64(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)))


@njit(cache=True, boundscheck=False, inline="always")
def _exact_block(codes, s16, s32, half, lut, nibble, boff, rows, out, i0, i1):
    """Rows ``rows[i0:i1]`` of :func:`_exact_kernel`."""
    nq = lut.shape[0]
    nmod = boff.shape[0] - 1
    # Query-outer inside a block: the block's codes stay in L2 while each query's table is hot.
    for q in range(nq):
        lq = lut[q]
        for i in range(i0, i1):
            r = rows[i]
            cr = codes[r]
            acc = 0.0
            for u in range(nmod):
                if nibble:
                    t = _lut4_module(cr, lq, boff[u], boff[u + 1])
                else:
                    t = _lut8_module(cr, lq, boff[u], boff[u + 1])
                acc += _scale_at(s16, s32, half, r, u) * t
            out[q, i] = float32(acc)


@njit(parallel=True, cache=True, boundscheck=False)
def _exact_kernel(codes, s16, s32, half, lut, nibble, boff, rows, out):
    """Exact scores from per-query lookup tables, blocks of rows in parallel.

    Args:
        codes: ``(n, nbytes)`` uint8. s16, s32, half: the scales (see :func:`_scale_args`).
        lut: ``(nq, nbytes·256)`` float32 byte tables, or ``(nq, nbytes·32)`` nibble tables
            (``nibble``); entry = signed sum of the query coordinates a byte (nibble) covers.
        boff: ``(U+1,)`` uint64 module byte offsets. rows: ``(m,)`` int64 rows to score.
        out: ``(nq, m)`` float32, written.
    """
    m = rows.shape[0]
    nblocks = (m + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        _exact_block(codes, s16, s32, half, lut, nibble, boff, rows, out,
                     blk * _ROW_BLOCK, min(m, (blk + 1) * _ROW_BLOCK))


@njit(cache=True, boundscheck=False)
def _exact_kernel_serial(codes, s16, s32, half, lut, nibble, boff, rows, out):
    """:func:`_exact_kernel` on the calling thread, for small jobs.

    Waking the worker threads costs ~0.1 ms on an idle machine and several ms on a busy one,
    more than scoring a few hundred rows.
    """
    _exact_block(codes, s16, s32, half, lut, nibble, boff, rows, out, 0, rows.shape[0])


@njit(cache=True, boundscheck=False, inline="always")
def _byte_entry(v, yp2, heads, p):
    """``lut[256 p + v]`` of :func:`_byte_tables`, computed on the fly with the same float64 operations.

    The table builds entry ``v`` from ``v`` without its lowest set bit; unrolled, it adds
    ``2 y_t`` (``yp2``, exact doubles of the padded query) to ``-Σ_t y_t`` for the set bits from
    the highest to the lowest. ``heads[16 p + h]`` holds that chain over the high nibble ``h``;
    the low nibble's bits follow here, without branches (an unset bit adds ``±0``, which changes
    no sum: the float32 accumulators the entry goes to never hold ``-0``).
    """
    x = heads[16 * p + (v >> 4)]
    b = 8 * p
    x = x + yp2[b + 3] * float64((v >> 3) & 1)
    x = x + yp2[b + 2] * float64((v >> 2) & 1)
    x = x + yp2[b + 1] * float64((v >> 1) & 1)
    x = x + yp2[b] * float64(v & 1)
    return float32(x)


@njit(cache=True, boundscheck=False)
def _exact_direct_kernel(codes, s16, s32, half, yp2, heads, boff, rows, out):
    """:func:`_exact_kernel_serial` with byte tables of one query, without building the tables.

    For a few rows, computing the (at most ``nbytes``) entries a row uses is cheaper than the
    ``256 · nbytes`` entries of the table (``16 · nbytes`` partial entries are computed once).
    Same float32 entries, same order of additions: the scores are bit-identical to the table
    walk's.

    Args:
        yp2: ``(nbytes·8,)`` float64, twice the padded query (:func:`_padded_queries`); heads:
            ``(nbytes·16,)`` float64 from :func:`_table_heads`. out: ``(m,)`` float32, written.
    """
    nmod = boff.shape[0] - 1
    for i in range(rows.shape[0]):
        r = rows[i]
        cr = codes[r]
        acc = 0.0
        for u in range(nmod):
            p = int64(boff[u])
            p1 = int64(boff[u + 1])
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            a4 = float32(0.0)
            a5 = float32(0.0)
            a6 = float32(0.0)
            a7 = float32(0.0)
            while p + 8 <= p1:
                a0 += _byte_entry(int64(cr[p]), yp2, heads, p)
                a1 += _byte_entry(int64(cr[p + 1]), yp2, heads, p + 1)
                a2 += _byte_entry(int64(cr[p + 2]), yp2, heads, p + 2)
                a3 += _byte_entry(int64(cr[p + 3]), yp2, heads, p + 3)
                a4 += _byte_entry(int64(cr[p + 4]), yp2, heads, p + 4)
                a5 += _byte_entry(int64(cr[p + 5]), yp2, heads, p + 5)
                a6 += _byte_entry(int64(cr[p + 6]), yp2, heads, p + 6)
                a7 += _byte_entry(int64(cr[p + 7]), yp2, heads, p + 7)
                p += 8
            while p < p1:
                a0 += _byte_entry(int64(cr[p]), yp2, heads, p)
                p += 1
            t = float64(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)))
            acc += _scale_at(s16, s32, half, r, u) * t
        out[i] = float32(acc)


@njit(cache=True, boundscheck=False)
def _table_heads(yp, out):
    """``out[16 p + h]``: :func:`_byte_tables`' chain for byte ``p`` over the high nibble ``h``:
    ``-Σ_t yp[8p + t]`` (in order), then ``+ 2 yp[8p + 4 + t]`` for the set bits ``t`` of ``h``
    from the highest to the lowest."""
    for p in range(out.shape[0] // 16):
        b = 0.0
        for t in range(8):
            b -= yp[8 * p + t]
        for h in range(16):
            x = b
            t = 3
            while t >= 0:
                if (h >> t) & 1:
                    x = x + 2.0 * yp[8 * p + 4 + t]
                t -= 1
            out[16 * p + h] = x


@njit(cache=True, boundscheck=False)
def _exact_direct_segment(codes, s16, s32, half, yp, boff, qidx, indptr, prow, out, seg):
    q = qidx[seg]
    heads = np.empty(codes.shape[1] * 16, dtype=np.float64)
    _table_heads(yp[q], heads)
    yp2 = 2.0 * yp[q]
    i0 = indptr[seg]
    i1 = indptr[seg + 1]
    _exact_direct_kernel(codes, s16, s32, half, yp2, heads, boff, prow[i0:i1], out[i0:i1])


@njit(parallel=True, cache=True, boundscheck=False)
def _exact_direct_pairs(codes, s16, s32, half, yp, boff, qidx, indptr, prow, out):
    """:func:`_exact_direct_kernel` on (query, row) pairs: segment ``s`` scores query ``qidx[s]``
    (padded ``yp[qidx[s]]``) against rows ``prow[indptr[s]:indptr[s+1]]`` into ``out`` at the
    same positions. Segments run in parallel, each building its query's partial entries."""
    for seg in prange(qidx.shape[0]):
        _exact_direct_segment(codes, s16, s32, half, yp, boff, qidx, indptr, prow, out, seg)


@njit(cache=True, boundscheck=False)
def _exact_direct_pairs_serial(codes, s16, s32, half, yp, boff, qidx, indptr, prow, out):
    """:func:`_exact_direct_pairs` on the calling thread, for small jobs."""
    for seg in range(qidx.shape[0]):
        _exact_direct_segment(codes, s16, s32, half, yp, boff, qidx, indptr, prow, out, seg)


@njit(parallel=True, cache=True, boundscheck=False)
def _exact_batch_kernel(codes, s16, s32, half, lutv, boff, rows, out):
    """Exact scores of one group of ``_QUERY_GROUP`` queries, vectorized over the queries.

    Per byte of a row the two nibbles select two table rows of ``_QUERY_GROUP`` floats, added
    to the row's per-query accumulators with full-width vector adds; the table lookup is shared
    by the whole group instead of being repeated per query.

    Args:
        codes: ``(n, nbytes)`` uint8. s16, s32, half: the scales (see :func:`_scale_args`).
        lutv: ``(2·nbytes·16·_QUERY_GROUP,)`` float32 nibble tables, ``[(2p + h)·16 + v, q]``:
            signed sum of query ``q``'s coordinates covered by nibble ``h`` of byte ``p`` when it
            has value ``v``.
        boff: ``(U+1,)`` uint64 module byte offsets. rows: ``(m,)`` int64.
        out: ``(_QUERY_GROUP, m)`` float32, written.
    """
    m = rows.shape[0]
    nmod = boff.shape[0] - 1
    qg = uint64(_QUERY_GROUP)
    nblocks = (m + _BATCH_ROW_BLOCK - 1) // _BATCH_ROW_BLOCK
    for blk in prange(nblocks):
        i0 = blk * _BATCH_ROW_BLOCK
        nr = min(m, i0 + _BATCH_ROW_BLOCK) - i0
        acc = np.empty(nr * _QUERY_GROUP, dtype=np.float32)
        score = np.zeros(nr * _QUERY_GROUP, dtype=np.float64)
        # Module-outer: the module's tables stay in L2 while all rows of the block use them.
        for u in range(nmod):
            acc[:] = 0.0
            p0 = boff[u]
            p1 = boff[u + 1]
            for j in range(nr):
                cr = codes[rows[i0 + j]]
                a = acc[uint64(j) * qg : uint64(j + 1) * qg]
                for p in range(p0, p1):
                    c = uint64(cr[p])
                    b0 = (p * uint64(32) + (c & uint64(15))) * qg
                    b1 = (p * uint64(32) + uint64(16) + (c >> uint64(4))) * qg
                    l0 = lutv[b0 : b0 + qg]
                    l1 = lutv[b1 : b1 + qg]
                    for q in range(_QUERY_GROUP):
                        a[q] += l0[q] + l1[q]
            for j in range(nr):
                s = _scale_at(s16, s32, half, rows[i0 + j], u)
                for q in range(_QUERY_GROUP):
                    score[j * _QUERY_GROUP + q] += s * float64(acc[j * _QUERY_GROUP + q])
        for j in range(nr):
            for q in range(_QUERY_GROUP):
                out[q, i0 + j] = float32(score[j * _QUERY_GROUP + q])


# --------------------------------------------------------------------------------------------
# Bounded pre-scan
# --------------------------------------------------------------------------------------------
# The inner loop over one module's code words is written in LLVM IR (numba has no vector types,
# and its own loops over 8-word modules do not vectorize). Two forms, picked by the dtype of the
# query array at compile time:
#
# * int8 query bytes (AVX512-VNNI hosts): each 64-bit code word becomes a mask that selects
#   0/1 bytes (VMOVDQU8 with zeroing), and VPDPBUSD adds their products with 64 query bytes;
# * uint64 bit planes (any host): the code word is broadcast over the 8 planes of its query
#   word, ANDed, popcounted (VPOPCNTQ where available) and weighted once per module.
#
# Code words are read with unaligned 8-byte loads from a module's first byte, so every layout
# and every buffer alignment reads the row in place; bits past a module's end meet zero query
# entries. Only the store's last row can be read past its end, and that row is copied first.

_IR_I1 = llvm_ir.IntType(1)
_IR_I8 = llvm_ir.IntType(8)
_IR_I32 = llvm_ir.IntType(32)
_IR_I64 = llvm_ir.IntType(64)
_IR_V16I32 = llvm_ir.VectorType(_IR_I32, 16)
_IR_V64I8 = llvm_ir.VectorType(_IR_I8, 64)
_IR_V8I64 = llvm_ir.VectorType(_IR_I64, 8)
# Rows ahead of the current ones whose lines are prefetched (one module's lines per module).
_PREFETCH_ROWS = 4
# Rows scored together by the pre-scan: each query load feeds this many rows.
_ROW_GROUP = 4
# Batch pre-scan (VNNI): _BATCH_ROWS rows x _QUERY_SET queries at once (16 accumulators); each
# expanded code word feeds _QUERY_SET queries and each query load _BATCH_ROWS rows. (8 x 2 beat
# 4 x 4 and 16 x 1 by ~10% and ~35%: expanding a word costs about two VPDPBUSD.)
_QUERY_SET = 8
_BATCH_ROWS = 2
# Rows per work item of the batch pre-scan: their codes (x nbytes, 256 KiB for 4 KiB rows) stay
# in L2 while every group of queries passes over them.
_BATCH_PRESCAN_ROWS = 64
# Query batches of at least this size use the batch pre-scan (where VNNI is available).
_BATCH_PRESCAN_MIN = 3
# Bit-plane weights of an 8-bit two's complement integer (the sign plane counts -128).
_PLANE_WEIGHTS = [1, 2, 4, 8, 16, 32, 64, (-128) & ((1 << 64) - 1)]
# Added to every row's bound: the absolute rounding of float32 results in the subnormal range.
_BOUND_TINY = 2.0**-149
# Exact value of every float16 bit pattern (float32 holds them all), for the pre-scan's scales.
_HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_HALF_TABLE.setflags(write=False)


def _ir_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(ret, args), name)


def _ir_data(context, builder, aty, aval, elem):
    """Data pointer of a numba array, cast to ``elem*``."""
    return builder.bitcast(context.make_array(aty)(context, builder, aval).data, elem.as_pointer())


def _ir_loop(builder, start, stop, step, carried, body, name):
    """``for t = start; t + step <= stop; t += step`` carrying values; returns ``(t, values)``."""
    pre = builder.block
    head = builder.append_basic_block(name + ".head")
    loop = builder.append_basic_block(name + ".body")
    done = builder.append_basic_block(name + ".done")
    builder.branch(head)
    builder.position_at_end(head)
    t = builder.phi(_IR_I64)
    vals = [builder.phi(v.type) for v in carried]
    t.add_incoming(start, pre)
    for phi, v in zip(vals, carried):
        phi.add_incoming(v, pre)
    nxt = builder.add(t, llvm_ir.Constant(_IR_I64, step))
    builder.cbranch(builder.icmp_unsigned("<=", nxt, stop), loop, done)
    builder.position_at_end(loop)
    new = body(t, vals)
    t.add_incoming(nxt, builder.block)
    for phi, v in zip(vals, new):
        phi.add_incoming(v, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return t, vals


def _ir_code_word(builder, rp, b0, t):
    """Little-endian 64-bit word of the row at byte ``b0 + 8 t`` (unaligned load)."""
    p = builder.gep(rp, [builder.add(b0, builder.shl(t, llvm_ir.Constant(_IR_I64, 3)))])
    return builder.load(builder.bitcast(p, _IR_I64.as_pointer()), align=1)


def _ir_vnni_dots(builder, rps, b0, nw, qp, qw0, nqg=1):
    """Per row pointer and query, ``Σ_{t<nw} Σ_i bit_i(word t) · int8(q[64 ((qw0 + t) nqg + j) + i])``
    (query ``j`` of a group of ``nqg`` interleaved per word) spread over the 16 int32 lanes of a
    vector; returned row-major (row ``r``, query ``j`` at ``r nqg + j``). Each query load is
    shared by the rows and each expanded code word by the queries; at least four accumulators
    hide VPDPBUSD's latency."""
    nrows = len(rps)
    dpbusd = _ir_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _IR_V16I32, [_IR_V16I32] * 3)
    ones = llvm_ir.Constant(_IR_V64I8, [1] * 64)
    zeros = llvm_ir.Constant(_IR_V64I8, None)

    def word(t, accs):
        wq = builder.mul(builder.add(qw0, t), llvm_ir.Constant(_IR_I64, nqg))
        qs = [builder.load(builder.bitcast(builder.gep(qp, [builder.shl(builder.add(wq, llvm_ir.Constant(_IR_I64, j)),
                                                                          llvm_ir.Constant(_IR_I64, 6))]),
                                           _IR_V16I32.as_pointer()), align=1) for j in range(nqg)]
        out = []
        for r, rp in enumerate(rps):
            mask = builder.bitcast(_ir_code_word(builder, rp, b0, t), llvm_ir.VectorType(_IR_I1, 64))
            bits = builder.bitcast(builder.select(mask, ones, zeros), _IR_V16I32)
            for j, q in enumerate(qs):  # u8 (0/1) x s8 products, 4 per int32 lane
                out.append(builder.call(dpbusd, [accs[r * nqg + j], bits, q]))
        return out

    return _ir_word_loops(builder, nw, max(1, 4 // (nrows * nqg)), nrows * nqg, llvm_ir.Constant(_IR_V16I32, None),
                          word, "vnni")


def _ir_planes_dots(builder, rps, b0, nw, pp, qw0):
    """Per row pointer, ``Σ_{t<nw} Σ_b weight_b · popcount(word t & plane[8 (qw0 + t) + b])``
    spread over the 8 int64 lanes of a vector (lane ``b``: plane ``b``, weighted). The plane
    loads are shared by the rows."""
    nrows = len(rps)
    ctpop = _ir_fn(builder, "llvm.ctpop.v8i64", _IR_V8I64, [_IR_V8I64])
    undef = llvm_ir.Constant(_IR_V8I64, llvm_ir.Undefined)
    splat = llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, 8), [0] * 8)
    weights = llvm_ir.Constant(_IR_V8I64, _PLANE_WEIGHTS)

    def word(t, accs):
        po = builder.shl(builder.add(qw0, t), llvm_ir.Constant(_IR_I64, 3))
        planes = builder.load(builder.bitcast(builder.gep(pp, [po]), _IR_V8I64.as_pointer()), align=8)
        out = []
        for rp, acc in zip(rps, accs):
            c = builder.insert_element(undef, _ir_code_word(builder, rp, b0, t), llvm_ir.Constant(_IR_I32, 0))
            c = builder.shuffle_vector(c, undef, splat)
            out.append(builder.add(acc, builder.call(ctpop, [builder.and_(c, planes)])))
        return out

    accs = _ir_word_loops(builder, nw, max(1, 2 // nrows), nrows, llvm_ir.Constant(_IR_V8I64, None), word, "planes")
    return [builder.mul(a, weights) for a in accs]


def _ir_word_loops(builder, nw, unroll, nrows, zero, word, name):
    """Run ``word(t, accs)`` for ``t < nw`` (``unroll`` words per step, then one at a time) with
    ``nrows`` accumulators per word slot; returns the per-row sums of the slots."""
    def step(t, v):
        return [x for j in range(unroll)
                for x in word(builder.add(t, llvm_ir.Constant(_IR_I64, j)), v[j * nrows : (j + 1) * nrows])]

    t, acc = _ir_loop(builder, llvm_ir.Constant(_IR_I64, 0), nw, unroll, [zero] * (unroll * nrows), step, name + "u")
    if unroll > 1:
        t, head = _ir_loop(builder, t, nw, 1, acc[:nrows], lambda t, v: word(t, v), name + "1")
        acc = head + acc[nrows:]
    out = []
    for r in range(nrows):
        total = acc[r]
        for j in range(1, unroll):
            total = builder.add(total, acc[j * nrows + r])
        out.append(total)
    return out


def _ir_lane_sums(builder, vecs, lanes):
    """The lane sums of ``R`` vectors of ``lanes`` integers (``R`` a power of two up to ``lanes``),
    as one ``<R x int>`` vector: pairs of vectors are folded into one (half of each vector's
    lanes), then the lanes within each row's group."""
    def shuffle(x, y, idx):
        return builder.shuffle_vector(x, y, llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, len(idx)), idx))

    vs, gs = list(vecs), lanes  # each vector holds groups of gs lanes, one group per row
    while len(vs) > 1:
        half = gs // 2
        nxt = []
        for x, y in zip(vs[0::2], vs[1::2]):
            ng = lanes // gs
            lo = [g * gs + o for g in range(ng) for o in range(half)]
            hi = [g * gs + half + o for g in range(ng) for o in range(half)]
            nxt.append(builder.add(shuffle(x, y, lo + [lanes + i for i in lo]),
                                   shuffle(x, y, hi + [lanes + i for i in hi])))
        vs, gs = nxt, half
    v = vs[0]
    g0, size = gs, gs
    while size > 1:  # within each group, add the second half onto the first
        half = size // 2
        perm = [l - l % g0 + ((l % g0) + half if l % g0 < half else l % g0) for l in range(lanes)]
        v = builder.add(v, shuffle(v, v, perm))
        size = half
    return shuffle(v, v, [r * g0 for r in range(len(vecs))])


def _prescan_args_ok(buf, offs, pbuf, ahead, qarr, int8_only):
    if not (isinstance(offs, types.UniTuple) and offs.dtype == types.uint64 and offs.count in (1, 2, 4)):
        return False
    if not (isinstance(ahead, types.UniTuple) and ahead.dtype == types.uint64 and ahead.count == offs.count):
        return False
    for a in (buf, pbuf):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint8):
            return False
    dtypes = (types.int8,) if int8_only else (types.int8, types.uint64)
    return isinstance(qarr, types.Array) and qarr.ndim == 1 and qarr.dtype in dtypes


def _ir_prescan(context, builder, signature, args, nrows, nqg, vnni):
    """Codegen shared by :func:`_group_prescan` and :func:`_batch_prescan`: the module loop for
    ``nrows`` rows and ``nqg`` queries. Returns ``(approx, bound)``, ``<nrows·nqg x double>``
    vectors (row-major)."""
    bufv, offv, pbufv, aheadv, pf, qv, wsv, bov, c1v, c0v, errv, sv = args[:12]
    tys = signature.args
    f64 = llvm_ir.DoubleType()
    npair = nrows * nqg
    vf = llvm_ir.VectorType(f64, npair)
    base = _ir_data(context, builder, tys[0], bufv, _IR_I8)
    rps = [builder.gep(base, [builder.extract_value(offv, j)]) for j in range(nrows)]
    pbase = _ir_data(context, builder, tys[2], pbufv, _IR_I8)
    aps = [builder.gep(pbase, [builder.extract_value(aheadv, j)]) for j in range(nrows)]
    qp = _ir_data(context, builder, tys[5], qv, _IR_I8 if vnni else _IR_I64)
    wsp = _ir_data(context, builder, tys[6], wsv, _IR_I64)
    bop = _ir_data(context, builder, tys[7], bov, _IR_I64)
    c1p, c0p, errp, sp = (_ir_data(context, builder, tys[j], v, f64)
                          for j, v in ((8, c1v), (9, c0v), (10, errv), (11, sv)))
    nmod = builder.sub(builder.extract_value(context.make_array(tys[6])(context, builder, wsv).shape, 0),
                       llvm_ir.Constant(_IR_I64, 1))
    pfn = _ir_fn(builder, "llvm.prefetch.p0", llvm_ir.VoidType(), [_IR_I8.as_pointer(), _IR_I32, _IR_I32, _IR_I32])
    one = llvm_ir.Constant(_IR_I64, 1)

    def spread(ptr, n, idx):
        """Load ``n`` doubles at ``ptr`` and lay them out as lanes ``idx``."""
        vn = llvm_ir.VectorType(f64, n)
        v = builder.load(builder.bitcast(ptr, vn.as_pointer()), align=8)
        return builder.shuffle_vector(v, llvm_ir.Constant(vn, llvm_ir.Undefined),
                                      llvm_ir.Constant(llvm_ir.VectorType(_IR_I32, npair), idx))

    row_lanes = [r for r in range(nrows) for _ in range(nqg)]
    query_lanes = [j for _ in range(nrows) for j in range(nqg)]

    def module(u, vals):
        acc_a, acc_e = vals
        b0 = builder.load(builder.gep(bop, [u]))
        b1 = builder.load(builder.gep(bop, [builder.add(u, one)]))
        w0 = builder.load(builder.gep(wsp, [u]))
        nw = builder.sub(builder.load(builder.gep(wsp, [builder.add(u, one)])), w0)
        with builder.if_then(pf):
            def lines(o, _):
                for ap in aps:
                    builder.call(pfn, [builder.gep(ap, [builder.add(b0, o)]), llvm_ir.Constant(_IR_I32, 0),
                                       llvm_ir.Constant(_IR_I32, 3), llvm_ir.Constant(_IR_I32, 1)])
                return []
            _ir_loop_lt(builder, builder.sub(b1, b0), 64, lines, "pf")
        if vnni:
            dots = _ir_lane_sums(builder, _ir_vnni_dots(builder, rps, b0, nw, qp, w0, nqg), 16)
        else:
            dots = _ir_lane_sums(builder, _ir_planes_dots(builder, rps, b0, nw, qp, w0), 8)
        d = builder.sitofp(dots, vf)
        uq = builder.mul(u, llvm_ir.Constant(_IR_I64, nqg))
        s = spread(builder.gep(sp, [builder.mul(u, llvm_ir.Constant(_IR_I64, nrows))]), nrows, row_lanes)
        k1 = spread(builder.gep(c1p, [uq]), nqg, query_lanes)
        k0 = spread(builder.gep(c0p, [uq]), nqg, query_lanes)
        ke = spread(builder.gep(errp, [uq]), nqg, query_lanes)
        acc_a = builder.fadd(acc_a, builder.fmul(s, builder.fsub(builder.fmul(k1, d), k0)))
        acc_e = builder.fadd(acc_e, builder.fmul(s, ke))
        return [acc_a, acc_e]

    _, (acc_a, acc_e) = _ir_loop(builder, llvm_ir.Constant(_IR_I64, 0), nmod, 1,
                                 [llvm_ir.Constant(vf, None), llvm_ir.Constant(vf, [_BOUND_TINY] * npair)],
                                 module, "mod")
    return acc_a, acc_e


@intrinsic
def _group_prescan(typingctx, buf, offs, pbuf, ahead, prefetch, qrow, wstart, boff, c1, c0, err, sblk):
    """Approximate scores and bounds of ``R`` rows for one query (``R = len(offs)``, 1 or 4).

    The rows are at byte offsets ``offs`` of the 1-D uint8 ``buf``. ``qrow``: the query's int8
    integers (VNNI) or uint64 bit planes (see :func:`_quantize_level`). ``wstart``, ``boff``:
    ``(U+1,)`` uint64. ``c1``, ``c0``, ``err``: ``(U,)`` float64 rows of the level.
    ``sblk``: ``(U, R)`` float64 scales, module-major. With ``prefetch``, module ``u``'s lines of
    the rows at offsets ``ahead`` of ``pbuf`` are prefetched while module ``u`` is scored.

    Returns ``R`` approximations ``Σ_u s_u (c1_u d_u - c0_u)`` then ``R`` bounds
    ``_BOUND_TINY + Σ_u s_u err_u`` (float64, module order: the same bits for every ``R``).
    """
    if not _prescan_args_ok(buf, offs, pbuf, ahead, qrow, False):
        return None
    nrows = offs.count
    vnni = qrow.dtype == types.int8
    sig = types.UniTuple(types.float64, 2 * nrows)(buf, offs, pbuf, ahead, types.boolean, qrow, wstart, boff,
                                                   c1, c0, err, sblk)

    def codegen(context, builder, signature, args):
        acc_a, acc_e = _ir_prescan(context, builder, signature, args, nrows, 1, vnni)
        out = [builder.extract_element(v, llvm_ir.Constant(_IR_I32, j)) for v in (acc_a, acc_e) for j in range(nrows)]
        return context.make_tuple(builder, signature.return_type, out)

    return sig, codegen


@intrinsic
def _batch_prescan(typingctx, buf, offs, pbuf, ahead, prefetch, qgrp, wstart, boff, c1g, c0g, errg, sblk, res):
    """:func:`_group_prescan` for ``R`` rows and a group of :data:`_QUERY_SET` queries (VNNI only).

    ``qgrp``: the group's int8 integers interleaved per word, ``[(w·Q + j)·64 + i]``.
    ``c1g``, ``c0g``, ``errg``: ``(U, Q)`` float64. Writes ``res[r·Q + j]`` (approximation of row
    ``r`` for query ``j``) and ``res[R·Q + r·Q + j]`` (its bound); ``res`` float64 ``(>= 2RQ,)``.
    Each expanded code word feeds the ``Q`` queries and each query load the ``R`` rows.
    """
    if not _prescan_args_ok(buf, offs, pbuf, ahead, qgrp, True):
        return None
    nrows = offs.count
    sig = types.void(buf, offs, pbuf, ahead, types.boolean, qgrp, wstart, boff, c1g, c0g, errg, sblk, res)

    def codegen(context, builder, signature, args):
        acc_a, acc_e = _ir_prescan(context, builder, signature, args, nrows, _QUERY_SET, True)
        vf = acc_a.type
        rp = _ir_data(context, builder, signature.args[12], args[12], llvm_ir.DoubleType())
        builder.store(acc_a, builder.bitcast(rp, vf.as_pointer()), align=8)
        builder.store(acc_e, builder.bitcast(builder.gep(rp, [llvm_ir.Constant(_IR_I64, nrows * _QUERY_SET)]),
                                             vf.as_pointer()), align=8)
        return context.get_dummy_value()

    return sig, codegen


def _ir_loop_lt(builder, stop, step, body, name):
    """``for o = 0; o < stop; o += step: body(o)`` (``stop`` int64, may be 0)."""
    pre = builder.block
    head = builder.append_basic_block(name + ".head")
    loop = builder.append_basic_block(name + ".body")
    done = builder.append_basic_block(name + ".done")
    builder.branch(head)
    builder.position_at_end(head)
    o = builder.phi(_IR_I64)
    o.add_incoming(llvm_ir.Constant(_IR_I64, 0), pre)
    builder.cbranch(builder.icmp_unsigned("<", o, stop), loop, done)
    builder.position_at_end(loop)
    body(o, [])
    o.add_incoming(builder.add(o, llvm_ir.Constant(_IR_I64, step)), builder.block)
    builder.branch(head)
    builder.position_at_end(done)


@njit(cache=True, boundscheck=False, inline="always")
def _row_scales(stab, s16, s32, half, r, out):
    """Row ``r``'s scales as float64 into ``out`` ``(U,)``."""
    if half:
        for u in range(out.shape[0]):
            out[u] = float64(stab[s16[r, u]])
    else:
        for u in range(out.shape[0]):
            out[u] = float64(s32[r, u])


@njit(cache=True, boundscheck=False)
def _bounded_block(codes, flat, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, rows,
                   approx, bound, i0, i1):
    """Columns ``i0:i1`` of :func:`_bounded_kernel`, in groups of four rows where possible (each
    query load then feeds four rows). Several queries take turns over the whole block, so that
    each query's integers stay in L1 while the block's codes stay in L2."""
    nq = qarr.shape[0]
    nmod = wstart.shape[0] - 1
    nb = codes.shape[1]
    nbu = uint64(nb)
    last = codes.shape[0] - 1
    m = rows.shape[0]
    nr = i1 - i0
    srow = np.empty((nr, nmod), dtype=np.float64)  # the block's scales, decoded once
    for j in range(nr):
        _row_scales(stab, s16, s32, half, rows[i0 + j], srow[j])
    sgrp = np.empty((nmod, _ROW_GROUP), dtype=np.float64)
    s1 = np.empty((nmod, 1), dtype=np.float64)
    scratch = np.zeros(nb + 8, dtype=np.uint8)
    for q in range(nq):
        i = i0
        while i < i1:
            grouped = i + _ROW_GROUP <= i1
            if grouped and tail:
                for j in range(_ROW_GROUP):
                    if rows[i + j] == last:
                        grouped = False
            if grouped:
                for u in range(nmod):
                    for j in range(_ROW_GROUP):
                        sgrp[u, j] = srow[i - i0 + j, u]
                offs = (uint64(rows[i]) * nbu, uint64(rows[i + 1]) * nbu, uint64(rows[i + 2]) * nbu,
                        uint64(rows[i + 3]) * nbu)
                j0 = i + _PREFETCH_ROWS
                ahead = (uint64(rows[min(j0, m - 1)]) * nbu, uint64(rows[min(j0 + 1, m - 1)]) * nbu,
                         uint64(rows[min(j0 + 2, m - 1)]) * nbu, uint64(rows[min(j0 + 3, m - 1)]) * nbu)
                a0, a1, a2, a3, e0, e1, e2, e3 = _group_prescan(flat, offs, flat, ahead, q == 0, qarr[q], wstart,
                                                                boff, c1[q], c0[q], err[q], sgrp)
                approx[q, i] = a0
                approx[q, i + 1] = a1
                approx[q, i + 2] = a2
                approx[q, i + 3] = a3
                bound[q, i] = e0
                bound[q, i + 1] = e1
                bound[q, i + 2] = e2
                bound[q, i + 3] = e3
                i += _ROW_GROUP
            else:
                r = rows[i]
                for u in range(nmod):
                    s1[u, 0] = srow[i - i0, u]
                ahead1 = (uint64(rows[min(i + _PREFETCH_ROWS, m - 1)]) * nbu,)
                if tail and r == last:
                    scratch[:nb] = codes[r]  # the module loads may pass the end of the buffer here
                    a, e = _group_prescan(scratch, (uint64(0),), flat, ahead1, q == 0, qarr[q], wstart, boff,
                                          c1[q], c0[q], err[q], s1)
                else:
                    a, e = _group_prescan(flat, (uint64(r) * nbu,), flat, ahead1, q == 0, qarr[q], wstart, boff,
                                          c1[q], c0[q], err[q], s1)
                approx[q, i] = a
                bound[q, i] = e
                i += 1


@njit(parallel=True, cache=True, boundscheck=False)
def _bounded_kernel(codes, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, rows, approx, bound):
    """Scores of quantized queries ``ŷ = Δ q`` with a per-row error bound, blocks of rows in parallel.

    Args:
        codes: ``(n, nbytes)`` uint8, C-contiguous (any alignment).
        qarr: ``(nq, 64·W)`` int8 query integers (VNNI form) or ``(nq, 8·W)`` uint64 bit planes
            (word-major); zero outside each module's coordinates (see :func:`_quantize_level`).
        wstart: ``(U+1,)`` uint64 first query word of each module. boff: ``(U+1,)`` uint64 byte
            offsets. tail: the last module's loads pass the row end (copy the store's last row).
        stab: :data:`_HALF_TABLE`. s16, s32, half: the scales (see :func:`_scale_args`).
        c1, c0: ``(nq, U)`` float64 ``2Δ_u`` and ``Δ_u Σ_j q_uj``, so ``⟨ŷ_u, b⟩ = c1·Σ_j q_j c_j - c0``.
        err: ``(nq, U)`` float64 per-module error allowance (see :func:`_quantize_queries`).
        rows: ``(m,)`` int64.
        approx, bound: ``(nq, m)`` float64, written: ``Σ_u s_iu ⟨ŷ_u, b_iu⟩`` and
            ``Σ_u s_iu err_u`` (plus :data:`_BOUND_TINY`).
    """
    m = rows.shape[0]
    flat = codes.reshape(-1)
    nblocks = (m + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        _bounded_block(codes, flat, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, rows,
                       approx, bound, blk * _ROW_BLOCK, min(m, (blk + 1) * _ROW_BLOCK))


@njit(cache=True, boundscheck=False)
def _bounded_kernel_serial(codes, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, rows, approx, bound):
    """:func:`_bounded_kernel` on the calling thread, for small jobs."""
    _bounded_block(codes, codes.reshape(-1), qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, rows,
                   approx, bound, 0, rows.shape[0])


@njit(cache=True, boundscheck=False)
def _bounded_segment(codes, flat, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, qidx, indptr,
                     prow, approx, bound, seg):
    q = qidx[seg]
    i0 = indptr[seg]
    i1 = indptr[seg + 1]
    n = i1 - i0
    _bounded_block(codes, flat, qarr[q : q + 1], wstart, boff, tail, stab, s16, s32, half, c1[q : q + 1],
                   c0[q : q + 1], err[q : q + 1], prow[i0:i1], approx[i0:i1].reshape((1, n)),
                   bound[i0:i1].reshape((1, n)), 0, n)


@njit(parallel=True, cache=True, boundscheck=False)
def _bounded_pairs_kernel(codes, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, qidx, indptr, prow,
                          approx, bound):
    """:func:`_bounded_kernel` on (query, row) pairs: segment ``s`` scores query ``qidx[s]``
    against rows ``prow[indptr[s]:indptr[s+1]]`` into ``approx``/``bound`` ``(P,)`` at the
    same positions. Segments run in parallel."""
    flat = codes.reshape(-1)
    for seg in prange(qidx.shape[0]):
        _bounded_segment(codes, flat, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, qidx, indptr,
                         prow, approx, bound, seg)


@njit(cache=True, boundscheck=False)
def _bounded_pairs_serial(codes, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, qidx, indptr, prow,
                          approx, bound):
    """:func:`_bounded_pairs_kernel` on the calling thread, for small jobs."""
    flat = codes.reshape(-1)
    for seg in range(qidx.shape[0]):
        _bounded_segment(codes, flat, qarr, wstart, boff, tail, stab, s16, s32, half, c1, c0, err, qidx, indptr,
                         prow, approx, bound, seg)


@njit(cache=True, boundscheck=False)
def _batch_block(codes, flat, qgrp, wstart, boff, tail, stab, s16, s32, half, c1g, c0g, errg, rows,
                 approx, bound, i0, i1):
    """Columns ``i0:i1`` of :func:`_bounded_batch_kernel`: for each group of queries, every pair
    of rows (the block's codes stay in L2 meanwhile)."""
    nq = approx.shape[0]
    ngrp = qgrp.shape[0]
    nmod = wstart.shape[0] - 1
    nb = codes.shape[1]
    nbu = uint64(nb)
    last = codes.shape[0] - 1
    m = rows.shape[0]
    nr = i1 - i0
    srow = np.empty((nr, nmod), dtype=np.float64)  # the block's scales, decoded once
    for j in range(nr):
        _row_scales(stab, s16, s32, half, rows[i0 + j], srow[j])
    sgrp = np.empty((nmod, _BATCH_ROWS), dtype=np.float64)
    single = np.empty((nmod, 1), dtype=np.float64)
    res = np.empty(2 * _BATCH_ROWS * _QUERY_SET, dtype=np.float64)
    scratch = np.zeros(nb + 8, dtype=np.uint8)
    for g in range(ngrp):
        qg = qgrp[g]
        c1 = c1g[g]
        c0 = c0g[g]
        er = errg[g]
        nqg = min(_QUERY_SET, nq - g * _QUERY_SET)
        i = i0
        while i < i1:
            grouped = i + _BATCH_ROWS <= i1
            if grouped and tail:
                for j in range(_BATCH_ROWS):
                    if rows[i + j] == last:
                        grouped = False
            if grouped:
                for u in range(nmod):
                    for j in range(_BATCH_ROWS):
                        sgrp[u, j] = srow[i - i0 + j, u]
                offs = (uint64(rows[i]) * nbu, uint64(rows[i + 1]) * nbu)
                j0 = i + _PREFETCH_ROWS
                ahead = (uint64(rows[min(j0, m - 1)]) * nbu, uint64(rows[min(j0 + 1, m - 1)]) * nbu)
                _batch_prescan(flat, offs, flat, ahead, g == 0, qg, wstart, boff, c1, c0, er, sgrp, res)
                for r in range(_BATCH_ROWS):
                    for j in range(nqg):
                        approx[g * _QUERY_SET + j, i + r] = res[r * _QUERY_SET + j]
                        bound[g * _QUERY_SET + j, i + r] = res[(_BATCH_ROWS + r) * _QUERY_SET + j]
                i += _BATCH_ROWS
            else:
                r = rows[i]
                for u in range(nmod):
                    single[u, 0] = srow[i - i0, u]
                ahead1 = (uint64(rows[min(i + _PREFETCH_ROWS, m - 1)]) * nbu,)
                if tail and r == last:
                    scratch[:nb] = codes[r]  # the module loads may pass the end of the buffer here
                    _batch_prescan(scratch, (uint64(0),), flat, ahead1, g == 0, qg, wstart, boff, c1, c0, er,
                                   single, res)
                else:
                    _batch_prescan(flat, (uint64(r) * nbu,), flat, ahead1, g == 0, qg, wstart, boff, c1, c0, er,
                                   single, res)
                for j in range(nqg):
                    approx[g * _QUERY_SET + j, i] = res[j]
                    bound[g * _QUERY_SET + j, i] = res[_QUERY_SET + j]
                i += 1


@njit(parallel=True, cache=True, boundscheck=False)
def _bounded_batch_kernel(codes, qgrp, wstart, boff, tail, stab, s16, s32, half, c1g, c0g, errg, rows,
                          approx, bound):
    """:func:`_bounded_kernel` for a batch of queries in groups of :data:`_QUERY_SET` (VNNI only).

    Args:
        qgrp: ``(G, W·Q·64)`` int8, group ``g``'s query integers interleaved per word (see
            :func:`_group_levels`). c1g, c0g, errg: ``(G, U, Q)`` float64.
        approx, bound: ``(nq, m)`` float64, written (``nq <= G·Q``; padding queries are dropped).
        The other arguments as for :func:`_bounded_kernel`.
    """
    m = rows.shape[0]
    flat = codes.reshape(-1)
    nblocks = (m + _BATCH_PRESCAN_ROWS - 1) // _BATCH_PRESCAN_ROWS
    for blk in prange(nblocks):
        _batch_block(codes, flat, qgrp, wstart, boff, tail, stab, s16, s32, half, c1g, c0g, errg, rows,
                     approx, bound, blk * _BATCH_PRESCAN_ROWS, min(m, (blk + 1) * _BATCH_PRESCAN_ROWS))


_LOWEST_BIT = np.array([0] + [(v & -v).bit_length() - 1 for v in range(1, 256)], dtype=np.int64)


@njit(cache=True, boundscheck=False)
def _byte_tables(yp, out):
    """Byte lookup tables, ``out[q, 256 p + v] = Σ_t (bit t of v ? +1 : -1) · yp[q, 8 p + t]``.

    ``yp`` ``(nq, nbytes·8)`` float64 (padding coordinates 0), ``out`` ``(nq, nbytes·256)``
    float32. Each entry is built from the one without its lowest set bit (one float64 add, a
    fixed order), then rounded once.
    """
    nq = yp.shape[0]
    nb = yp.shape[1] // 8
    tab = np.empty(256, dtype=np.float64)
    for q in range(nq):
        for p in range(nb):
            base = 0.0
            for t in range(8):
                base -= yp[q, 8 * p + t]
            tab[0] = base
            out[q, 256 * p] = float32(base)
            for v in range(1, 256):
                t = _LOWEST_BIT[v]
                tab[v] = tab[v ^ (1 << t)] + 2.0 * yp[q, 8 * p + t]
                out[q, 256 * p + v] = float32(tab[v])


# --------------------------------------------------------------------------------------------
# Query preparation
# --------------------------------------------------------------------------------------------


def _padded_queries(y: np.ndarray, layout: SignLayout) -> np.ndarray:
    """``(nq, K)`` → ``(nq, nbytes·8)`` float64 with padding coordinates set to 0."""
    if layout.nbytes * 8 == layout.num_coords:  # no padding bits: the positions are the columns
        return y.astype(np.float64)
    g = _geometry(layout)
    yp = np.zeros((y.shape[0], layout.nbytes * 8), dtype=np.float64)
    yp[:, g.pad_index] = y
    return yp


_BYTE_SIGNS = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.float64) * 2 - 1  # (256, 8)
_NIBBLE_SIGNS = _BYTE_SIGNS[:16, :4].copy()  # (16, 4)


def _use_nibbles(layout: SignLayout, nq: int) -> bool:
    """Nibble tables once the byte tables of the batch would not stay in cache."""
    return nq * layout.nbytes * 256 * 4 > _BYTE_LUT_MAX_BYTES


def _lookup_tables(y: np.ndarray, layout: SignLayout, nibble: bool) -> np.ndarray:
    """Signed partial-sum tables ``(nq, nbytes·256)`` (or ``(nq, nbytes·32)`` for nibbles), float32.

    Entry ``[q, 256 p + v]`` = Σ over the valid coordinates t of byte p of ``±y`` (``+`` where bit
    t of v is set). Padding coordinates are 0 in the padded query, so padding bits add nothing.
    Each entry is computed in float64 and rounded once.
    """
    yp = _padded_queries(y, layout)
    nq = y.shape[0]
    if nibble:
        tab = np.empty((nq, layout.nbytes * 2, 16), dtype=np.float32)
        for q in range(nq):
            tab[q] = yp[q].reshape(-1, 4) @ _NIBBLE_SIGNS.T
    else:
        tab = np.empty((nq, layout.nbytes * 256), dtype=np.float32)
        _byte_tables(yp, tab)
    return tab.reshape(nq, -1)


def _group_tables(y: np.ndarray, layout: SignLayout) -> np.ndarray:
    """Nibble tables of up to ``_QUERY_GROUP`` queries for :func:`_exact_batch_kernel`.

    Returns ``(2·nbytes·16·_QUERY_GROUP,)`` float32, entry ``[(2p + h)·16 + v, q]``; missing queries
    of a short group are zero. Entries are computed in float64 and rounded once.
    """
    yp = np.zeros((_QUERY_GROUP, layout.nbytes * 8), dtype=np.float64)
    yp[: y.shape[0]] = _padded_queries(y, layout)
    tab = np.empty((layout.nbytes * 2, 16, _QUERY_GROUP), dtype=np.float32)
    nib = yp.reshape(_QUERY_GROUP, layout.nbytes * 2, 4)
    step = 4096  # nibble positions at a time: bounds the float64 temporary to 32 MiB
    for p0 in range(0, layout.nbytes * 2, step):
        tab[p0 : p0 + step] = np.einsum("qpt,vt->pvq", nib[:, p0 : p0 + step], _NIBBLE_SIGNS)
    return tab.reshape(-1)


@dataclass(frozen=True)
class _QuantLevel:
    """One 8-bit quantization level of a query batch (inputs of :func:`_bounded_kernel`)."""

    qarr: np.ndarray  # (nq, 64·W) int8 query integers, or (nq, 8·W) uint64 bit planes (word-major)
    c1: np.ndarray  # (nq, U) float64: 2Δ
    c0: np.ndarray  # (nq, U) float64: Δ·Σ_j q_j
    err: np.ndarray  # (nq, U) float64: ‖y_u - (ŷ of this level and the ones before)‖₁ + ε_u


def _prescan_vnni() -> bool:
    """Whether the pre-scan uses the AVX512-VNNI kernel (else bit planes, which run anywhere).

    Only when numba compiles for this very CPU (no ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``
    override) and that CPU has AVX512-VNNI; tests set ``_PRESCAN_VNNI = False`` for the other path.
    """
    global _PRESCAN_VNNI
    if _PRESCAN_VNNI is None:
        import numba
        from llvmlite import binding

        ok = numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None
        if ok:
            try:
                feats = binding.get_host_cpu_features()
                ok = all(feats.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni"))
            except Exception:  # pragma: no cover - feature query unavailable
                ok = False
        _PRESCAN_VNNI = bool(ok)
    return _PRESCAN_VNNI


_PRESCAN_VNNI: Optional[bool] = None


@njit(cache=True, boundscheck=False)
def _quantize_kernel(target, coff, wstart, q8, resid, delta, qsum, rsum):
    """Per query and module ``u``: ``Δ = max|target_u| / 127`` (0 for an all-zero module),
    ``q = clip(rint(target_u / Δ), ±127)`` written to ``q8[64 wstart[u] + j]``, the residual
    ``target - Δ q`` (float64), ``Σ_j q_j`` and ``Σ_j |residual_j|``. ``q8`` must be zeroed."""
    nq = target.shape[0]
    for q in range(nq):
        for u in range(coff.shape[0] - 1):
            c0 = coff[u]
            c1 = coff[u + 1]
            amax = 0.0
            for c in range(c0, c1):
                amax = max(amax, abs(target[q, c]))
            d = amax / _QMAX if amax > 0 else 0.0
            step = d if d > 0 else 1.0
            p = 64 * wstart[u] - c0
            qs = 0.0
            rs = 0.0
            for c in range(c0, c1):
                v = min(max(np.rint(target[q, c] / step), -_QMAX), _QMAX)  # the clip only guards rounding
                q8[q, p + c] = np.int8(v)
                r = target[q, c] - v * d
                resid[q, c] = r
                qs += v
                rs += abs(r)
            delta[q, u] = d
            qsum[q, u] = qs
            rsum[q, u] = rs


@njit(cache=True, boundscheck=False)
def _bit_planes(q8, planes):
    """``planes[q, 8 w + b]`` bit ``i`` = bit ``b`` of the two's complement byte ``q8[q, 64 w + i]``."""
    acc = np.empty(_QUERY_BITS, dtype=np.uint64)
    for q in range(q8.shape[0]):
        for w in range(q8.shape[1] // 64):
            acc[:] = 0
            for i in range(64):
                byte = uint64(np.uint8(q8[q, 64 * w + i]))
                for b in range(_QUERY_BITS):
                    acc[b] |= ((byte >> uint64(b)) & uint64(1)) << uint64(i)
            for b in range(_QUERY_BITS):
                planes[q, 8 * w + b] = acc[b]


def _quantize_level(target: np.ndarray, layout: SignLayout, vnni: bool):
    """Per-module ``target_u ≈ Δ_u q_u`` with integers ``|q| <= 127``.

    ``target`` ``(nq, K)`` float64. ``Δ_u = max|target_u| / 127`` (0 for an all-zero module, whose
    ``q`` is then 0). Module ``u``'s coordinate ``j`` sits at position ``64 · word_start[u] + j``;
    ``qarr`` is either the int8 integers at those positions, ``(nq, 64·W)`` (``vnni``), or their
    two's complement bit planes, ``(nq, 8·W)`` uint64 with word ``w``'s plane ``b`` at ``8 w + b``.
    Positions that are no coordinate hold 0.

    Returns ``(qarr, Δ, Σ_j q_j, residual target - Δ q, Σ_j |residual_j|)`` (per-module arrays
    ``(nq, U)``).
    """
    g = _geometry(layout)
    nq = target.shape[0]
    U = layout.num_modules
    coff = np.asarray(layout.coord_offsets + (layout.num_coords,), dtype=np.int64)
    nw = int(g.word_start[-1])
    q8 = np.zeros((nq, nw * 64), dtype=np.int8)
    resid = np.empty_like(target)
    delta, qsum, rsum = np.empty((nq, U)), np.empty((nq, U)), np.empty((nq, U))
    _quantize_kernel(np.ascontiguousarray(target), coff, g.word_start, q8, resid, delta, qsum, rsum)
    if vnni:
        return q8, delta, qsum, resid, rsum
    planes = np.zeros((nq, nw * _QUERY_BITS), dtype=np.uint64)
    _bit_planes(q8, planes)
    return planes, delta, qsum, resid, rsum


def _quantize_queries(y: np.ndarray, layout: SignLayout, levels: int = 2,
                      vnni: Optional[bool] = None) -> list[_QuantLevel]:
    """Successive 8-bit quantizations of the queries: level 1 quantizes ``y``, level 2 the residual.

    Level ``l``'s ``err`` is ``‖y_u - Σ_{l' <= l} ŷ_u^(l')‖₁ + ε_u`` with
    ``ε_u = (⌈k_u/8⌉ + 8) · (2⁻²³ · ‖y_u‖₁ + 2⁻¹⁴⁹)``, which bounds the float32 rounding of
    :func:`_exact_kernel` (table entries rounded once, then ⌈k_u/8⌉ float32 additions of terms
    whose magnitudes sum to at most ``‖y_u‖₁``, float64 after that, one final rounding; the
    ``2⁻¹⁴⁹`` terms cover results in float32's subnormal range) and the float64 rounding of the
    approximate sums (a few roundings of terms at most ``4 ‖y_u‖₁``, far below ``ε_u``). With
    :data:`_BOUND_TINY` for the final rounding, ``|exact32 - Σ_l approx_l| <= bound_l`` of the
    last level used: a row outside the candidate set cannot beat a rescored one.
    """
    if vnni is None:
        vnni = _prescan_vnni()
    starts = np.asarray(layout.coord_offsets, dtype=np.int64)
    y64 = y.astype(np.float64)
    l1 = np.add.reduceat(np.abs(y64), starts, axis=1)
    eps = (np.asarray(layout.module_bytes, dtype=np.float64)[None, :] + 8.0) * (2.0**-23 * l1 + 2.0**-149)
    out = []
    resid = y64
    for _ in range(levels):
        qarr, delta, qsum, resid, rsum = _quantize_level(resid, layout, vnni)
        out.append(_QuantLevel(qarr, 2.0 * delta, delta * qsum, rsum + eps))
    return out


def _group_levels(level: _QuantLevel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A VNNI level in groups of :data:`_QUERY_SET` queries, for :func:`_bounded_batch_kernel`.

    Returns ``qgrp`` ``(G, W·Q·64)`` int8 (word-interleaved: ``[(w·Q + j)·64 + i]``) and ``c1``,
    ``c0``, ``err`` as ``(G, U, Q)`` float64; a short last group is padded with zero queries.
    """
    nq, nbq = level.qarr.shape
    G = -(-nq // _QUERY_SET)
    pad = G * _QUERY_SET - nq
    q = np.concatenate([level.qarr, np.zeros((pad, nbq), dtype=np.int8)]) if pad else level.qarr
    qgrp = np.ascontiguousarray(q.reshape(G, _QUERY_SET, nbq // 64, 64).transpose(0, 2, 1, 3)).reshape(G, -1)

    def grouped(a: np.ndarray) -> np.ndarray:
        a = np.concatenate([a, np.zeros((pad, a.shape[1]))]) if pad else a
        return np.ascontiguousarray(a.reshape(G, _QUERY_SET, -1).transpose(0, 2, 1))

    return qgrp, grouped(level.c1), grouped(level.c0), grouped(level.err)


# --------------------------------------------------------------------------------------------
# Public scans
# --------------------------------------------------------------------------------------------


def _prepare(codes, scales, y, layout):
    layout = _as_layout(layout)
    codes = _check_codes(codes, layout)
    scales = _check_scales(scales, codes.shape[0], layout)
    y = _check_queries(y, layout)
    return codes, scales, y, layout


def _exact_scores(codes, scales, lut, nibble, layout, rows) -> np.ndarray:
    s16, s32, half = _scale_args(scales)
    out = np.empty((lut.shape[0], rows.shape[0]), dtype=np.float32)
    if rows.shape[0] * layout.nbytes * lut.shape[0] <= _SERIAL_MAX_BYTES:
        _exact_kernel_serial(codes, s16, s32, half, lut, nibble, _geometry(layout).boff, rows, out)
    else:
        with _KERNEL_LOCK:
            _exact_kernel(codes, s16, s32, half, lut, nibble, _geometry(layout).boff, rows, out)
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
        return _exact_scores(codes, scales, _lookup_tables(y, layout, nibble), nibble, layout, rows)
    s16, s32, half = _scale_args(scales)
    out = np.empty((nq, rows.shape[0]), dtype=np.float32)
    part = np.empty((_QUERY_GROUP, rows.shape[0]), dtype=np.float32)
    for q0 in range(0, nq, _QUERY_GROUP):
        q1 = min(nq, q0 + _QUERY_GROUP)
        if rows.shape[0]:
            lutv = _group_tables(y[q0:q1], layout)
            with _KERNEL_LOCK:
                _exact_batch_kernel(codes, s16, s32, half, lutv, _geometry(layout).boff, rows, part)
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


class _Running:
    """Running top-k of one query in one direction (exact scores only)."""

    def __init__(self, k: int, largest: bool):
        self.k = k
        self.sign = 1.0 if largest else -1.0  # work on sign·score, bigger is better
        self.idx = np.empty(0, dtype=np.int64)
        self.val = np.empty(0, dtype=np.float32)

    def threshold(self) -> float:
        """Best-direction value a new row must reach (``-inf`` until k rows are held)."""
        if self.val.size < self.k:
            return -np.inf
        return float((self.sign * self.val.astype(np.float64)).min())

    def merge(self, idx: np.ndarray, val: np.ndarray) -> None:
        idx = np.concatenate([self.idx, idx])
        val = np.concatenate([self.val, val])
        key = self.sign * val.astype(np.float64)
        if idx.size > self.k:
            keep = np.argpartition(-key, self.k - 1)[: self.k]
            # argpartition cuts ties arbitrarily; take every row tied with the cut, then sort.
            cut = key[keep].min()
            keep = np.nonzero(key >= cut)[0]
            idx, val, key = idx[keep], val[keep], key[keep]
        order = np.lexsort((idx, -key))[: self.k]
        self.idx, self.val = idx[order], val[order]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.idx, self.val


@njit(cache=True, boundscheck=False)
def _kth_lower_bound(approx, bound, sign, kk):
    """The ``kk``-th largest ``sign·approx - bound`` (``-inf`` with fewer values; NaN never counts)."""
    m = approx.shape[0]
    heap = np.empty(kk, dtype=np.float64)  # min-heap of the kk largest so far
    size = 0
    for i in range(m):
        v = sign * approx[i] - bound[i]
        if not (v == v):
            continue
        if size < kk:
            j = size  # sift up
            size += 1
            while j > 0 and heap[(j - 1) // 2] > v:
                heap[j] = heap[(j - 1) // 2]
                j = (j - 1) // 2
            heap[j] = v
        elif v > heap[0]:
            j = 0  # replace the root, sift down
            while True:
                c = 2 * j + 1
                if c >= kk:
                    break
                if c + 1 < kk and heap[c + 1] < heap[c]:
                    c += 1
                if heap[c] >= v:
                    break
                heap[j] = heap[c]
                j = c
            heap[j] = v
    return heap[0] if size == kk and kk > 0 else -np.inf


@njit(cache=True, boundscheck=False)
def _top_positions(approx, sign, p):
    """Positions of the ``p`` largest ``sign·approx`` (all positions if there are fewer; ties and
    order arbitrary; NaN never counts)."""
    m = approx.shape[0]
    heap = np.empty(p, dtype=np.float64)  # min-heap of values, positions alongside
    where = np.empty(p, dtype=np.int64)
    size = 0
    for i in range(m):
        v = sign * approx[i]
        if not (v == v):
            continue
        if size < p:
            j = size
            size += 1
            while j > 0 and heap[(j - 1) // 2] > v:
                heap[j] = heap[(j - 1) // 2]
                where[j] = where[(j - 1) // 2]
                j = (j - 1) // 2
            heap[j] = v
            where[j] = i
        elif v > heap[0]:
            j = 0
            while True:
                c = 2 * j + 1
                if c >= p:
                    break
                if c + 1 < p and heap[c + 1] < heap[c]:
                    c += 1
                if heap[c] >= v:
                    break
                heap[j] = heap[c]
                where[j] = where[c]
                j = c
            heap[j] = v
            where[j] = i
    return where[:size].copy()


@njit(cache=True, boundscheck=False)
def _reaching(approx, bound, thr_up, thr_down):
    """Positions whose interval ``approx ± bound`` reaches ``thr_up`` from below (``approx + bound
    >= thr_up``) or ``-thr_down`` from above (``bound - approx >= thr_down``).

    Returns ``(positions, flags)``: ascending int64 positions and uint8 flags, bit 0 for the
    largest direction, bit 1 for the smallest (``+inf`` switches a direction off).
    """
    m = approx.shape[0]
    n = 0
    for i in range(m):
        if approx[i] + bound[i] >= thr_up or bound[i] - approx[i] >= thr_down:
            n += 1
    pos = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.uint8)
    n = 0
    for i in range(m):
        f = 0
        if approx[i] + bound[i] >= thr_up:
            f |= 1
        if bound[i] - approx[i] >= thr_down:
            f |= 2
        if f:
            pos[n] = i
            flags[n] = f
            n += 1
    return pos, flags


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

    The store is walked in chunks (``chunk_rows`` rows, default ``~4M / nq``). Per chunk an 8-bit
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
    m = n if rows is None else rows.shape[0]
    nq = y.shape[0]
    if chunk_rows is None:
        chunk_rows = max(_ROW_BLOCK * 16, _TOPK_CHUNK_ELEMS // nq)
    chunk_rows = int(chunk_rows)
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")

    g = _geometry(layout)
    s16, s32, half = _scale_args(scales)
    nbytes = layout.nbytes
    nibble = _use_nibbles(layout, 1)  # rescoring runs one query at a time
    # One query: bit planes (as fast as VNNI there, and the same code on every host). A batch
    # where VNNI is available: groups of queries share each expanded code word.
    batch = nq >= _BATCH_PRESCAN_MIN and _prescan_vnni()
    level1, level2 = _quantize_queries(y, layout, levels=2, vnni=batch)
    grouped1 = _group_levels(level1) if batch else None
    if batch:  # level 2 scores a few rows per query: bit planes there too (one kernel form fewer)
        planes = np.zeros((nq, level2.qarr.shape[1] // 64 * _QUERY_BITS), dtype=np.uint64)
        _bit_planes(level2.qarr, planes)
        level2 = _QuantLevel(planes, level2.c1, level2.c0, level2.err)
    kargs = (g.word_start_u64, g.boff, g.reads_past_row, _HALF_TABLE, s16, s32, half)
    tables: dict[int, np.ndarray] = {}
    padded: list = []

    def pairs(todo: dict[int, np.ndarray], split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(query, rows) lists as segments of at most ``split`` rows: ``(qidx, indptr, rows)``."""
        qidx, lens = [], []
        for q, r in todo.items():
            for i0 in range(0, r.shape[0], split):
                qidx.append(q)
                lens.append(min(split, r.shape[0] - i0))
        indptr = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        prow = np.concatenate(list(todo.values())) if todo else _NO_ROWS
        return np.asarray(qidx, dtype=np.int64), indptr, np.ascontiguousarray(prow, dtype=np.int64)

    def exact(todo: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Exact single-query scores (the bits of :func:`scan_scores`) of rows ``todo[q]`` per query.

        A few rows of a query are scored straight from the query (:func:`_exact_direct_pairs`,
        all such queries in one parallel call); more go through the query's lookup table, built
        when first needed and kept while the tables fit in 64 MiB.
        """
        out: dict[int, np.ndarray] = {}
        few = {q: r for q, r in todo.items()
               if r.size and not nibble and q not in tables and r.size <= _DIRECT_MAX_ROWS}
        if few:
            if not padded:
                padded.append(_padded_queries(y, layout))
            serial = sum(r.size for r in few.values()) * nbytes <= _SERIAL_MAX_BYTES // 4
            qidx, indptr, prow = pairs(few, _DIRECT_MAX_ROWS if len(few) > 1 or serial else 16)
            res = np.empty(prow.shape[0], dtype=np.float32)
            if serial:
                _exact_direct_pairs_serial(codes, s16, s32, half, padded[0], g.boff, qidx, indptr, prow, res)
            else:
                with _KERNEL_LOCK:
                    _exact_direct_pairs(codes, s16, s32, half, padded[0], g.boff, qidx, indptr, prow, res)
            start = 0
            for q, r in few.items():  # pairs() lays the queries out in this order
                out[q] = res[start : start + r.size]
                start += r.size
        for q, r in todo.items():
            if q in out or not r.size:
                out.setdefault(q, np.empty(0, dtype=np.float32))
                continue
            t = tables.get(q)
            if t is None:
                t = _lookup_tables(y[q : q + 1], layout, nibble)
                if (len(tables) + 1) * t.nbytes <= 64 << 20:
                    tables[q] = t
            out[q] = _exact_scores(codes, scales, t, nibble, layout, r)[0]
        return out

    def bounded1(crow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Level 1 of every query on the chunk's rows: ``(approx, bound)`` ``(nq, len(crow))``."""
        approx = np.empty((nq, crow.shape[0]), dtype=np.float64)
        bound = np.empty_like(approx)
        if grouped1 is not None:
            with _KERNEL_LOCK:
                _bounded_batch_kernel(codes, grouped1[0], *kargs, *grouped1[1:], crow, approx, bound)
            return approx, bound
        args = (codes, level1.qarr, *kargs, level1.c1, level1.c0, level1.err, crow, approx, bound)
        # Measured on 2 idle cores, a 1% filter of 1 GB (10 MB) gains ~0.7 ms in parallel; on
        # cores busy with other work, waking a second thread can cost more than that.
        if crow.shape[0] * nbytes * nq <= _SERIAL_MAX_BYTES:
            _bounded_kernel_serial(*args)
        else:
            with _KERNEL_LOCK:
                _bounded_kernel(*args)
        return approx, bound

    def bounded2(todo: dict[int, np.ndarray]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Level 2 of query ``q`` on rows ``todo[q]``, all queries in one call."""
        qidx, indptr, prow = pairs(todo, 256)
        approx = np.empty(prow.shape[0], dtype=np.float64)
        bound = np.empty_like(approx)
        args = (codes, level2.qarr, *kargs, level2.c1, level2.c0, level2.err, qidx, indptr, prow, approx, bound)
        if prow.shape[0] * nbytes <= 4 * _SERIAL_MAX_BYTES:
            _bounded_pairs_serial(*args)
        else:
            with _KERNEL_LOCK:
                _bounded_pairs_kernel(*args)
        out, start = {}, 0
        for q, r in todo.items():  # pairs() lays the queries out in this order
            out[q] = (approx[start : start + r.size], bound[start : start + r.size])
            start += r.size
        return out

    def threshold(q: int, d: float, approx: np.ndarray, bound: np.ndarray, floor: float,
                  lower: bool = True) -> float:
        """A value of ``d · score`` (bigger is better) that ``kk`` rows are guaranteed to reach:
        the running k-th best exact score, the previous level's threshold ``floor``, or (with
        ``lower``) the kk-th best lower bound ``d · approx - bound`` of these rows, whichever is
        highest."""
        thr = max(floor, running[(q, d)].threshold())
        return max(thr, _kth_lower_bound(approx, bound, d, kk)) if lower else thr

    dirs = [d for d, want in ((1.0, largest), (-1.0, smallest)) if want]
    bits = {1.0: 1, -1.0: 2}
    running = {(q, d): _Running(k, d > 0) for q in range(nq) for d in dirs}
    kk = min(k, m)
    pilot = kk + 4
    for c0 in range(0, m, chunk_rows):
        c1 = min(m, c0 + chunk_rows)
        crow = np.arange(c0, c1, dtype=np.int64) if rows is None else rows[c0:c1]
        # Level 1 (every row of the chunk): 8-bit queries.
        approx1, bound1 = bounded1(crow)
        # Pilot: each query's rows with the best approximate scores are rescored first (once
        # its running top-k is full, only those whose approximation beats it: they are likely
        # to enter). Their exact k-th best is a threshold close to the final one (the k-th best
        # lower bound is about two bounds below it), so far fewer rows survive level 1.
        scored = {}
        for q in range(nq):
            pos = np.unique(np.concatenate([_top_positions(approx1[q], d, pilot) for d in dirs]))
            t_up = running[(q, 1.0)].threshold() if largest else np.inf
            t_down = running[(q, -1.0)].threshold() if smallest else np.inf
            sel, _ = _reaching(approx1[q, pos], np.zeros(pos.shape[0]), t_up, t_down)
            if sel.size:
                scored[q] = pos[sel]
        for q, ex in exact({q: crow[pos] for q, pos in scored.items()}).items():
            for d in dirs:
                running[(q, d)].merge(crow[scored[q]], ex)
        # Rows whose level-1 interval reaches a direction's threshold survive for it.
        thr1, stage1 = {}, {}
        for q in range(nq):
            # (A full running top-k, from the pilot or earlier chunks, is nearly always above the
            # chunk's k-th best lower bound, which is then not worth its pass.)
            thr1[q] = {d: threshold(q, d, approx1[q], bound1[q], -np.inf, running[(q, d)].val.size < kk)
                       for d in dirs}
            union, flags = _reaching(approx1[q], bound1[q], thr1[q].get(1.0, np.inf), thr1[q].get(-1.0, np.inf))
            if union.size:
                stage1[q] = (union, flags)
        # Level 2 (survivors only): add the 8-bit quantized residual, ~127x tighter bound.
        level2_out = bounded2({q: crow[union] for q, (union, _) in stage1.items()})
        final: dict[int, list] = {}
        for q, (union, flags) in stage1.items():
            approx2, bound2 = level2_out[q]
            approx12 = approx1[q, union] + approx2
            done = scored.get(q, _NO_ROWS)
            final[q] = []
            for d in dirs:
                inside = np.flatnonzero(flags & bits[d])
                a12, b2 = approx12[inside], bound2[inside]
                thr2 = threshold(q, d, a12, b2, thr1[q][d])
                keep, _ = _reaching(a12, b2, thr2, np.inf) if d > 0 else _reaching(a12, b2, np.inf, thr2)
                pos = union[inside[keep]]
                final[q].append(pos[~np.isin(pos, done)] if done.size else pos)  # pilot rows are merged
        # Exact rescoring of what is left, both directions at once.
        todo = {q: np.unique(np.concatenate(f)) for q, f in final.items()}
        for q, ex in exact({q: crow[t] for q, t in todo.items() if t.size}).items():
            for d, pos in zip(dirs, final[q]):
                running[(q, d)].merge(crow[pos], ex[np.searchsorted(todo[q], pos)])

    def collect(d: float):
        idx = np.empty((nq, kk), dtype=np.int64)
        val = np.empty((nq, kk), dtype=np.float32)
        for q in range(nq):
            i, v = running[(q, d)].result()
            idx[q], val[q] = i[:kk], v[:kk]
        return idx, val

    li, ls = collect(1.0) if largest else (None, None)
    si, ss = collect(-1.0) if smallest else (None, None)
    return TopK(li, ls, si, ss)


# --------------------------------------------------------------------------------------------
# torch path (GPU)
# --------------------------------------------------------------------------------------------


def scan_scores_torch(
    codes: Union[np.ndarray, "Any"],
    scales: Union[np.ndarray, "Any"],
    y: Union[np.ndarray, "Any"],
    layout: SignLayout,
    device: Union[str, "Any"] = "cpu",
    *,
    chunk_rows: Optional[int] = None,
):
    """Scores with torch, e.g. on CUDA: chunks of rows are unpacked on the device and multiplied.

    Per chunk the bits are unpacked with shifts into ``±s_iu`` (scale folded in), giving a
    ``(rows, K)`` float32 matrix that is multiplied by ``yᵀ``; only one chunk is expanded at a time.

    Args:
        codes: ``(n, nbytes)`` uint8 (numpy or torch). scales: ``(n, U)`` float16.
        y: ``(nq, K)`` float32. layout: module sizes. device: e.g. ``"cuda"`` or ``"cpu"``.
        chunk_rows: rows per chunk (default: ~256 MiB of float32 per chunk).

    Returns:
        ``(nq, n)`` float32 ``torch.Tensor`` on ``device``.
    """
    import torch

    layout = _as_layout(layout)
    dev = torch.device(device)
    np_codes = codes.detach().cpu().numpy() if isinstance(codes, torch.Tensor) else codes
    np_scales = scales.detach().cpu().numpy() if isinstance(scales, torch.Tensor) else scales
    np_y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else y
    np_codes = _check_codes(np_codes, layout)
    np_scales = _check_scales(np_scales, np_codes.shape[0], layout)
    np_y = _check_queries(np_y, layout)
    g = _geometry(layout)
    n, K = np_codes.shape[0], layout.num_coords
    if chunk_rows is None:
        chunk_rows = max(1, (256 << 20) // (4 * K))
    chunk_rows = int(chunk_rows)
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")

    pad_index = torch.from_numpy(g.pad_index.copy()).to(dev)  # copies: the cached arrays are read-only
    module_of_coord = torch.from_numpy(g.module_of_coord.copy()).to(dev)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    yt = torch.as_tensor(np_y, device=dev).T.contiguous()  # (K, nq)
    out = torch.empty((np_y.shape[0], n), dtype=torch.float32, device=dev)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        c = torch.as_tensor(np_codes[r0:r1], device=dev)
        bits = ((c.unsqueeze(-1) >> shifts) & 1).reshape(r1 - r0, -1)[:, pad_index]  # (R, K) uint8
        s = torch.as_tensor(np_scales[r0:r1], device=dev).to(torch.float32)[:, module_of_coord]  # (R, K)
        signed = torch.where(bits.bool(), s, -s)
        out[:, r0:r1] = (signed @ yt).T
    return out
