"""Shared plumbing of the scan kernels: argument bundles, FP16 scales, block sizes, twins.

Every kernel takes the stored arrays as one :class:`Store` bundle, a pre-scan query level as
one :class:`Level` and (query, rows) work lists as one :class:`Pairs`, instead of 15-19
positional arguments (numba passes a NamedTuple of arrays and scalars as an LLVM struct; its
fields cost nothing to read, and typing one at the call is cheap).

:func:`twins` compiles one kernel body twice, over ``prange`` in parallel and on the calling
thread (a non-parallel ``njit`` treats ``prange`` as ``range``): small jobs skip waking the
worker threads, and both forms give the same bits because each work item writes its own
outputs.
"""

from __future__ import annotations

import types as pytypes
from typing import Callable, NamedTuple

import numpy as np
from numba import float64, int64, njit

from eogp_index.search.kernels import cache  # noqa: F401  (before any kernel: one stamp for the package)
from eogp_index.search.kernels.checks import _Geometry

# Rows per parallel work item. Small enough that a filtered scan of a few thousand rows still
# splits over the cores, large enough that the per-block overhead does not show.
_ROW_BLOCK = 64
# Batches of at least _BATCH_MIN_QUERIES (see scan.py) go through the query-vectorized exact
# kernel, which handles _QUERY_GROUP queries per pass (one zmm register holds 16 of them).
_QUERY_GROUP = 64
# Batch pre-scan (VNNI): queries per group; each expanded code word feeds this many queries.
_QUERY_SET = 8
# Exact value of every float16 bit pattern (float32 holds them all), for the pre-scan's scales.
_HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_HALF_TABLE.setflags(write=False)
# 2^(e-25) for the FP16 exponent field e (index 0 holds 2^-24, the subnormal step).
_HALF_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=np.float64)


class Store(NamedTuple):
    """The stored arrays, as every kernel takes them (build with :func:`_store_args`).

    numba has no float16 arrays, so FP16 scales travel as their uint16 bits (``s16``) and are
    decoded in the kernel; float32 scales go in ``s32``. Both always hold a 2-D array (the unused
    one a ``(1, 1)`` dummy) so that every kernel is compiled once, not once per scale dtype.
    """

    codes: np.ndarray  # (n, nbytes) uint8 packed signs, C-contiguous (any alignment)
    s16: np.ndarray  # (n, U) uint16 FP16 bits of the scales, or a (1, 1) dummy
    s32: np.ndarray  # (n, U) float32 scales, or a (1, 1) dummy
    half: bool  # the scales are in s16
    stab: np.ndarray  # (65536,) float32 _HALF_TABLE: FP16 bits → value, for the pre-scan


class Level(NamedTuple):
    """One quantization level of the queries as the pre-scan kernels take it (see
    :func:`_level_args`; :mod:`.quantize` for the maths).

    For :func:`~.bounded._bounded_kernel`: ``qarr`` ``(nq, 64·W)`` int8 query integers (VNNI form)
    or ``(nq, 8·W)`` uint64 bit planes (word-major), zero outside each module's coordinates;
    ``c1``, ``c0``, ``err`` ``(nq, U)`` float64. For :func:`~.bounded._bounded_batch_kernel`:
    ``qarr`` ``(G, W·Q·64)`` int8 grouped per :data:`_QUERY_SET` queries, and ``(G, U, Q)``.
    """

    qarr: np.ndarray  # the query integers or bit planes
    wstart: np.ndarray  # (U+1,) uint64 first query word of each module
    boff: np.ndarray  # (U+1,) uint64 module byte offsets of a row
    tail: bool  # the last module's 8-byte loads pass the row end (the store's last row is copied)
    c1: np.ndarray  # float64 2Δ_u, so ⟨ŷ_u, b⟩ = c1·Σ_j q_j c_j - c0
    c0: np.ndarray  # float64 Δ_u Σ_j q_uj
    err: np.ndarray  # float64 per-module error allowance (see quantize._quantize_queries)


class Pairs(NamedTuple):
    """(query, rows) work lists: segment ``s`` is query ``qidx[s]`` against rows
    ``prow[indptr[s]:indptr[s+1]]``, whose results go to the same positions of a ``(P,)`` output."""

    qidx: np.ndarray  # (S,) int64
    indptr: np.ndarray  # (S+1,) int64
    prow: np.ndarray  # (P,) int64


def _scale_args(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(half_bits, floats, half)`` for the scales (see :class:`Store`)."""
    if scales.dtype == np.float16:
        return scales.view(np.uint16), np.zeros((1, 1), dtype=np.float32), True
    return np.zeros((1, 1), dtype=np.uint16), scales, False


def _store_args(codes: np.ndarray, scales: np.ndarray) -> Store:
    """The :class:`Store` bundle of checked ``codes`` ``(n, nbytes)`` uint8 and ``scales`` ``(n, U)``."""
    s16, s32, half = _scale_args(scales)
    return Store(codes, s16, s32, half, _HALF_TABLE)


def _level_args(g: _Geometry, qarr: np.ndarray, c1: np.ndarray, c0: np.ndarray, err: np.ndarray) -> Level:
    """The :class:`Level` bundle of a quantized level on layout geometry ``g``."""
    return Level(qarr, g.word_start_u64, g.boff, g.reads_past_row, c1, c0, err)


def twins(body: Callable, **options) -> tuple:
    """``(parallel, serial)`` dispatchers compiled from one kernel body that loops with ``prange``.

    The serial one is for small jobs: waking the worker threads costs more than they do, the
    more so on a busy machine. numba names a function's cache files after its
    ``__qualname__`` and first line and does not key them by ``parallel``, so two dispatchers of
    one function object would load each other's builds; each twin gets its own function object
    (the same code) with its own name, ``body.__name__`` and ``body.__name__ + "_serial"``.
    """
    out = []
    for suffix, parallel in (("", True), ("_serial", False)):
        fn = pytypes.FunctionType(
            body.__code__, body.__globals__, body.__name__ + suffix, body.__defaults__, body.__closure__
        )
        fn.__qualname__ = body.__qualname__ + suffix
        fn.__module__ = body.__module__
        fn.__doc__ = body.__doc__ if parallel else f"{body.__name__} on the calling thread, for small jobs."
        opts = dict(options, parallel=True) if parallel else options
        out.append(njit(cache=True, boundscheck=False, **opts)(fn))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------


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
def _scale_at(store, r, u):
    """Scale of row ``r``, module ``u`` as float64 (:class:`Store` ``store``)."""
    if store.half:
        return _half_to_f64(store.s16[r, u])
    return float64(store.s32[r, u])


@njit(cache=True, boundscheck=False, inline="always")
def _row_scales(store, r, out):
    """Row ``r``'s scales as float64 into ``out`` ``(U,)`` (FP16 through ``store.stab``)."""
    if store.half:
        for u in range(out.shape[0]):
            out[u] = float64(store.stab[store.s16[r, u]])
    else:
        for u in range(out.shape[0]):
            out[u] = float64(store.s32[r, u])
