"""Exact-score kernels: table walks and direct rescoring (Appendix B, "Query scoring").

For each query a lookup table gives, for every byte position ``p`` of a row and each of the 256
values that byte can take, the signed partial sum ``Σ_t ±y`` of the (at most 8) query
coordinates that byte covers (built by :mod:`.quantize`). A module's inner product is then one
table lookup and one add per byte, summed in float32 with 8 independent accumulators and
combined with the scales in float64. Three forms, all reading each row's codes once:

* :func:`_exact_kernel` (and its serial twin): per-query byte or nibble tables;
* :func:`_exact_direct_pairs` (and its serial twin): the table entries a row uses computed on
  the fly from the query, for a few rows per query: the same float32 entries in the same order,
  so the same bits as the table walk;
* :func:`_exact_batch_kernel`: nibble tables laid out query-minor, one lookup feeding
  ``_QUERY_GROUP`` queries with vector adds (another summation order: last bits can differ).

Hot loops index with uint64: numba adds a negative-index wraparound check to signed indices,
which costs a few instructions per lookup and blocks vectorization. (Mixing int64 and uint64 in
one expression gives float64 in numba, so each loop sticks to one of them.)
"""

from __future__ import annotations

import numpy as np
from numba import float32, float64, int64, njit, prange, uint64

from eogp_index.search.kernels.base import _QUERY_GROUP, _ROW_BLOCK, _scale_at, twins

# Rows per work item of the batch kernel: a module's nibble tables for a query group
# (2·⌈k_u/8⌉·16·64·4 bytes, 512 KiB for k_u = 512) are reused by this many rows.
_BATCH_ROW_BLOCK = 1024


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
def _exact_block(store, lut, nibble, boff, rows, out, i0, i1):
    """Rows ``rows[i0:i1]`` of :func:`_exact_kernel`."""
    codes = store.codes
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
                acc += _scale_at(store, r, u) * t
            out[q, i] = float32(acc)


def _exact_kernel(store, lut, nibble, boff, rows, out):
    """Exact scores from per-query lookup tables, blocks of rows in parallel.

    Args:
        store: :class:`~.base.Store` (codes ``(n, nbytes)`` uint8 and the scales).
        lut: ``(nq, nbytes·256)`` float32 byte tables, or ``(nq, nbytes·32)`` nibble tables
            (``nibble``); entry = signed sum of the query coordinates a byte (nibble) covers.
        boff: ``(U+1,)`` uint64 module byte offsets. rows: ``(m,)`` int64 rows to score.
        out: ``(nq, m)`` float32, written.
    """
    m = rows.shape[0]
    nblocks = (m + _ROW_BLOCK - 1) // _ROW_BLOCK
    for blk in prange(nblocks):
        _exact_block(store, lut, nibble, boff, rows, out, blk * _ROW_BLOCK, min(m, (blk + 1) * _ROW_BLOCK))


_exact_kernel, _exact_kernel_serial = twins(_exact_kernel)


@njit(cache=True, boundscheck=False, inline="always")
def _byte_entry(v, yp2, heads, p):
    """``lut[256 p + v]`` of :func:`~.quantize._byte_tables`, computed on the fly with the same float64 operations.

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
def _exact_direct_kernel(store, yp2, heads, boff, rows, out):
    """:func:`_exact_kernel_serial` with byte tables of one query, without building the tables.

    For a few rows, computing the (at most ``nbytes``) entries a row uses is cheaper than the
    ``256 · nbytes`` entries of the table (``16 · nbytes`` partial entries are computed once).
    Same float32 entries, same order of additions: the scores are bit-identical to the table
    walk's.

    Args:
        store: :class:`~.base.Store`. boff: ``(U+1,)`` uint64 module byte offsets. rows: ``(m,)`` int64.
        yp2: ``(nbytes·8,)`` float64, twice the padded query (:func:`~.quantize._padded_queries`); heads:
            ``(nbytes·16,)`` float64 from :func:`_table_heads`. out: ``(m,)`` float32, written.
    """
    codes = store.codes
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
            acc += _scale_at(store, r, u) * t
        out[i] = float32(acc)


@njit(cache=True, boundscheck=False)
def _table_heads(yp, out):
    """``out[16 p + h]``: :func:`~.quantize._byte_tables`' chain for byte ``p`` over the high nibble ``h``:
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
def _exact_direct_segment(store, yp, boff, pairs, out, seg):
    """Segment ``seg`` of :func:`_exact_direct_pairs`."""
    q = pairs.qidx[seg]
    heads = np.empty(store.codes.shape[1] * 16, dtype=np.float64)
    _table_heads(yp[q], heads)
    yp2 = 2.0 * yp[q]
    i0 = pairs.indptr[seg]
    i1 = pairs.indptr[seg + 1]
    _exact_direct_kernel(store, yp2, heads, boff, pairs.prow[i0:i1], out[i0:i1])


def _exact_direct_pairs(store, yp, boff, pairs, out):
    """:func:`_exact_direct_kernel` on (query, row) pairs: segment ``s`` of :class:`~.base.Pairs`
    ``pairs`` scores query ``qidx[s]`` (padded ``yp[qidx[s]]``, ``yp`` ``(nq, nbytes·8)``
    float64) against rows ``prow[indptr[s]:indptr[s+1]]`` into ``out`` ``(P,)`` float32 at the
    same positions. Segments run in parallel, each building its query's partial entries."""
    for seg in prange(pairs.qidx.shape[0]):
        _exact_direct_segment(store, yp, boff, pairs, out, seg)


_exact_direct_pairs, _exact_direct_pairs_serial = twins(_exact_direct_pairs)


@njit(parallel=True, cache=True, boundscheck=False)
def _exact_batch_kernel(store, lutv, boff, rows, out):
    """Exact scores of one group of ``_QUERY_GROUP`` queries, vectorized over the queries.

    Per byte of a row the two nibbles select two table rows of ``_QUERY_GROUP`` floats, added
    to the row's per-query accumulators with full-width vector adds; the table lookup is shared
    by the whole group instead of being repeated per query.

    Args:
        store: :class:`~.base.Store` (codes ``(n, nbytes)`` uint8 and the scales).
        lutv: ``(2·nbytes·16·_QUERY_GROUP,)`` float32 nibble tables, ``[(2p + h)·16 + v, q]``:
            signed sum of query ``q``'s coordinates covered by nibble ``h`` of byte ``p`` when it
            has value ``v``.
        boff: ``(U+1,)`` uint64 module byte offsets. rows: ``(m,)`` int64.
        out: ``(_QUERY_GROUP, m)`` float32, written.
    """
    codes = store.codes
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
                s = _scale_at(store, rows[i0 + j], u)
                for q in range(_QUERY_GROUP):
                    score[j * _QUERY_GROUP + q] += s * float64(acc[j * _QUERY_GROUP + q])
        for j in range(nr):
            for q in range(_QUERY_GROUP):
                out[q, i0 + j] = float32(score[j * _QUERY_GROUP + q])
