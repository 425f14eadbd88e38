"""Bounded pre-scan kernels: an approximate score and a guaranteed error bound for every row.

The queries are quantized per module to 8-bit integers ``ŷ_u = Δ_u · q_u`` (:mod:`.quantize`);
``⟨q_u, c⟩`` (``c`` the 0/1 bits of a row) comes from the IR intrinsics of :mod:`.prescan_ir`.
Each row gets ``Σ_u s_iu ⟨ŷ_u, b_iu⟩`` and the bound ``Σ_u s_iu · err_u`` (plus
:data:`~.prescan_ir._BOUND_TINY`) that contains its exact float32 score. Three drivers of the
intrinsics, all reading rows in place at any alignment and prefetching a few rows ahead:

* :func:`_bounded_kernel` (and its serial twin): all rows x all queries, four rows per
  intrinsic call so that each query load feeds four rows;
* :func:`_bounded_pairs_kernel` (and its serial twin): (query, rows) work lists, for the second
  level on the rows that survived the first;
* :func:`_bounded_batch_kernel` (VNNI hosts, parallel only: batches are never small jobs): two
  rows x a group of :data:`~.base._QUERY_SET` queries per call.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from eogp_index.search.kernels.base import _QUERY_SET, _ROW_BLOCK, Level, _row_scales, twins
from eogp_index.search.kernels.prescan_ir import _batch_prescan, _group_prescan

# Rows ahead of the current ones whose lines are prefetched (one module's lines per module).
_PREFETCH_ROWS = 4
# Rows scored together by the pre-scan: each query load feeds this many rows.
_ROW_GROUP = 4
# Batch pre-scan (VNNI): _BATCH_ROWS rows x _QUERY_SET queries at once (16 accumulators); each
# expanded code word feeds _QUERY_SET queries and each query load _BATCH_ROWS rows. (8 x 2 beat
# 4 x 4 and 16 x 1 by ~10% and ~35%: expanding a word costs about two VPDPBUSD.)
_BATCH_ROWS = 2
# Rows per work item of the batch pre-scan: their codes (x nbytes, 256 KiB for 4 KiB rows) stay
# in L2 while every group of queries passes over them.
_BATCH_PRESCAN_ROWS = 64


@njit(cache=True, boundscheck=False)
def _bounded_block(store, flat, level, rows, approx, bound, i0, i1):
    """Columns ``i0:i1`` of :func:`_bounded_kernel`, in groups of four rows where possible (each
    query load then feeds four rows). Several queries take turns over the whole block, so that
    each query's integers stay in L1 while the block's codes stay in L2. ``flat``: the codes as
    one 1-D uint8 array (the intrinsics address rows by byte offset)."""
    codes = store.codes
    qarr, wstart, boff, tail, c1, c0, err = level
    nq = qarr.shape[0]
    nmod = wstart.shape[0] - 1
    nb = codes.shape[1]
    nbu = uint64(nb)
    last = codes.shape[0] - 1
    m = rows.shape[0]
    nr = i1 - i0
    srow = np.empty((nr, nmod), dtype=np.float64)  # the block's scales, decoded once
    for j in range(nr):
        _row_scales(store, rows[i0 + j], srow[j])
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
                offs = (
                    uint64(rows[i]) * nbu,
                    uint64(rows[i + 1]) * nbu,
                    uint64(rows[i + 2]) * nbu,
                    uint64(rows[i + 3]) * nbu,
                )
                j0 = i + _PREFETCH_ROWS
                ahead = (
                    uint64(rows[min(j0, m - 1)]) * nbu,
                    uint64(rows[min(j0 + 1, m - 1)]) * nbu,
                    uint64(rows[min(j0 + 2, m - 1)]) * nbu,
                    uint64(rows[min(j0 + 3, m - 1)]) * nbu,
                )
                a0, a1, a2, a3, e0, e1, e2, e3 = _group_prescan(
                    flat, offs, flat, ahead, q == 0, qarr[q], wstart, boff, c1[q], c0[q], err[q], sgrp
                )
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
                    a, e = _group_prescan(
                        scratch, (uint64(0),), flat, ahead1, q == 0, qarr[q], wstart, boff, c1[q], c0[q], err[q], s1
                    )
                else:
                    a, e = _group_prescan(
                        flat, (uint64(r) * nbu,), flat, ahead1, q == 0, qarr[q], wstart, boff, c1[q], c0[q], err[q], s1
                    )
                approx[q, i] = a
                bound[q, i] = e
                i += 1


def _bounded_kernel(store, level, rows, approx, bound):
    """Scores of quantized queries ``ŷ = Δ q`` with a per-row error bound, blocks of rows in parallel.

    Args:
        store: :class:`~.base.Store`; its codes ``(n, nbytes)`` uint8 C-contiguous (any alignment).
        level: :class:`~.base.Level` of ``nq`` queries: ``qarr`` ``(nq, 64·W)`` int8 query
            integers (VNNI form) or ``(nq, 8·W)`` uint64 bit planes (word-major), zero outside
            each module's coordinates (see :func:`~.quantize._quantize_level`); ``c1``, ``c0``,
            ``err`` ``(nq, U)`` float64; ``tail``: the last module's loads pass the row end (the
            store's last row is copied before it is read).
        rows: ``(m,)`` int64.
        approx, bound: ``(nq, m)`` float64, written: ``Σ_u s_iu ⟨ŷ_u, b_iu⟩`` and
            ``Σ_u s_iu err_u`` (plus :data:`~.prescan_ir._BOUND_TINY`).
    """
    m = rows.shape[0]
    flat = store.codes.reshape(-1)
    nblocks = (m + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        _bounded_block(store, flat, level, rows, approx, bound, blk * _ROW_BLOCK, min(m, (blk + 1) * _ROW_BLOCK))


_bounded_kernel, _bounded_kernel_serial = twins(_bounded_kernel)


@njit(cache=True, boundscheck=False)
def _bounded_segment(store, flat, level, pairs, approx, bound, seg):
    """Segment ``seg`` of :func:`_bounded_pairs_kernel`: one query's rows, as a one-query block."""
    q = pairs.qidx[seg]
    i0 = pairs.indptr[seg]
    i1 = pairs.indptr[seg + 1]
    n = i1 - i0
    one = Level(
        level.qarr[q : q + 1],
        level.wstart,
        level.boff,
        level.tail,
        level.c1[q : q + 1],
        level.c0[q : q + 1],
        level.err[q : q + 1],
    )
    _bounded_block(
        store, flat, one, pairs.prow[i0:i1], approx[i0:i1].reshape((1, n)), bound[i0:i1].reshape((1, n)), 0, n
    )


def _bounded_pairs_kernel(store, level, pairs, approx, bound):
    """:func:`_bounded_kernel` on (query, row) pairs: segment ``s`` of :class:`~.base.Pairs`
    ``pairs`` scores query ``qidx[s]`` against rows ``prow[indptr[s]:indptr[s+1]]`` into
    ``approx``/``bound`` ``(P,)`` float64 at the same positions. Segments run in parallel."""
    flat = store.codes.reshape(-1)
    for seg in prange(pairs.qidx.shape[0]):
        _bounded_segment(store, flat, level, pairs, approx, bound, seg)


_bounded_pairs_kernel, _bounded_pairs_kernel_serial = twins(_bounded_pairs_kernel)


@njit(cache=True, boundscheck=False)
def _batch_block(store, flat, level, rows, approx, bound, i0, i1):
    """Columns ``i0:i1`` of :func:`_bounded_batch_kernel`: for each group of queries, every pair
    of rows (the block's codes stay in L2 meanwhile)."""
    codes = store.codes
    qgrp, wstart, boff, tail, c1g, c0g, errg = level
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
        _row_scales(store, rows[i0 + j], srow[j])
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
                    _batch_prescan(
                        scratch, (uint64(0),), flat, ahead1, g == 0, qg, wstart, boff, c1, c0, er, single, res
                    )
                else:
                    _batch_prescan(
                        flat, (uint64(r) * nbu,), flat, ahead1, g == 0, qg, wstart, boff, c1, c0, er, single, res
                    )
                for j in range(nqg):
                    approx[g * _QUERY_SET + j, i] = res[j]
                    bound[g * _QUERY_SET + j, i] = res[_QUERY_SET + j]
                i += 1


@njit(parallel=True, cache=True, boundscheck=False)
def _bounded_batch_kernel(store, level, rows, approx, bound):
    """:func:`_bounded_kernel` for a batch of queries in groups of :data:`_QUERY_SET` (VNNI only).

    Args:
        level: :class:`~.base.Level` with ``qarr`` ``(G, W·Q·64)`` int8, group ``g``'s query
            integers interleaved per word, and ``c1``, ``c0``, ``err`` ``(G, U, Q)`` float64
            (see :func:`~.quantize._group_levels`).
        approx, bound: ``(nq, m)`` float64, written (``nq <= G·Q``; padding queries are dropped).
        The other arguments as for :func:`_bounded_kernel`.
    """
    m = rows.shape[0]
    flat = store.codes.reshape(-1)
    nblocks = (m + _BATCH_PRESCAN_ROWS - 1) // _BATCH_PRESCAN_ROWS
    for blk in prange(nblocks):
        _batch_block(
            store, flat, level, rows, approx, bound, blk * _BATCH_PRESCAN_ROWS, min(m, (blk + 1) * _BATCH_PRESCAN_ROWS)
        )
