"""The rescoring tier's kernels (:mod:`eogp_index.search.rescore`): (row, query) pairs scored
straight from the stored tier codes, and the rows' norms for unit scores."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from eogp_index.search.kernels import cache  # noqa: F401  (before any kernel: one stamp for the package)


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def pair_scores(codes, scales, offsets, y, row, query, out):  # pragma: no cover - compiled
    """``out[p] = Σ_u scales[row[p], u] · Σ_j codes[row[p], j] · y[query[p], j]`` in float64 (``j``
    over module ``u``'s columns ``offsets[u]:offsets[u + 1]``; an int8 code times a float32 is
    exact in float64). codes ``(c, T)`` int8 or float32; scales ``(c, U)`` float32; y ``(nq, T)``
    float32; row, query ``(P,)`` int64."""
    for p in prange(row.shape[0]):
        r, q = row[p], query[p]
        acc = 0.0
        for u in range(offsets.shape[0] - 1):
            a = codes[r, offsets[u] : offsets[u + 1]]  # slices: the loop below vectorizes
            b = y[q, offsets[u] : offsets[u + 1]]
            part = 0.0
            for j in range(a.shape[0]):
                part += np.float64(a[j]) * np.float64(b[j])
            acc += part * np.float64(scales[r, u])
        out[p] = acc


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def row_norms(codes, scales, offsets, out):  # pragma: no cover - compiled
    """``out[r]``: the float64 norm of row ``r`` of the tier, ``√(Σ_u scales[r, u]² Σ_j codes[r, j]²)``."""
    for r in prange(codes.shape[0]):
        acc = 0.0
        for u in range(offsets.shape[0] - 1):
            a = codes[r, offsets[u] : offsets[u + 1]]
            part = 0.0
            for j in range(a.shape[0]):
                part += np.float64(a[j]) * np.float64(a[j])
            s = np.float64(scales[r, u])
            acc += part * s * s
        out[r] = math.sqrt(acc)
