"""Query preparation: padded queries, exact lookup tables, 8-bit quantization levels.

Everything here turns the float32 queries ``y`` ``(nq, K)`` into the arrays the kernels read:

* the padded query ``(nq, nbytes·8)`` float64 (padding coordinates 0, so padding bits add nothing);
* the exact kernels' byte / nibble lookup tables (:func:`_lookup_tables`, :func:`_group_tables`);
  entries are computed in float64 and rounded once to float32;
* the bounded pre-scan's quantization levels (:func:`_quantize_queries`): per module
  ``ŷ_u = Δ_u · q_u`` with 8-bit integers, as int8 (VNNI form) or two's complement bit planes,
  plus the error allowance that makes the pre-scan's bound hold for the float32 exact score.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import float32, njit, uint64

from eogp_index.search.kernels.base import _QUERY_GROUP, _QUERY_SET
from eogp_index.search.kernels.checks import _geometry
from eogp_index.store.codecs import SignLayout

# Bits of the quantized query in the bounded pre-scan (two's complement, one plane per bit).
_QUERY_BITS = 8
_QMAX = (1 << (_QUERY_BITS - 1)) - 1


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
    """Nibble tables of up to ``_QUERY_GROUP`` queries for :func:`~.exact._exact_batch_kernel`.

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
    """One 8-bit quantization level of a query batch (see :func:`~.base._level_args` for the kernels' bundle)."""

    qarr: np.ndarray  # (nq, 64·W) int8 query integers, or (nq, 8·W) uint64 bit planes (word-major)
    c1: np.ndarray  # (nq, U) float64: 2Δ
    c0: np.ndarray  # (nq, U) float64: Δ·Σ_j q_j
    err: np.ndarray  # (nq, U) float64: ‖y_u - (ŷ of this level and the ones before)‖₁ + ε_u


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


def _quantize_queries(y: np.ndarray, layout: SignLayout, levels: int = 2, *, vnni: bool) -> list[_QuantLevel]:
    """Successive 8-bit quantizations of the queries: level 1 quantizes ``y``, level 2 the residual.

    ``vnni`` picks the form of ``qarr`` (int8 integers or bit planes, see :func:`_quantize_level`);
    the driver decides it (``scan._prescan_vnni``).

    Level ``l``'s ``err`` is ``‖y_u - Σ_{l' <= l} ŷ_u^(l')‖₁ + ε_u`` with
    ``ε_u = (⌈k_u/8⌉ + 8) · (2⁻²³ · ‖y_u‖₁ + 2⁻¹⁴⁹)``, which bounds the float32 rounding of
    :func:`~.exact._exact_kernel` (table entries rounded once, then ⌈k_u/8⌉ float32 additions of terms
    whose magnitudes sum to at most ``‖y_u‖₁``, float64 after that, one final rounding; the
    ``2⁻¹⁴⁹`` terms cover results in float32's subnormal range) and the float64 rounding of the
    approximate sums (a few roundings of terms at most ``4 ‖y_u‖₁``, far below ``ε_u``). With
    :data:`~.prescan_ir._BOUND_TINY` for the final rounding, ``|exact32 - Σ_l approx_l| <= bound_l`` of the
    last level used: a row outside the candidate set cannot beat a rescored one.
    """
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
    """A VNNI level in groups of :data:`_QUERY_SET` queries, for :func:`~.bounded._bounded_batch_kernel`.

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
