"""Selection for the top-k driver: running top-k of exact scores, heaps over pre-scan intervals.

:class:`_Running` holds a query's best exact scores in one direction (ties by row index, as
sorting :func:`scan_scores` would order them). The numba helpers work on a chunk's pre-scan
output, ``approx`` and ``bound`` ``(m,)`` float64: the k-th best lower bound (a threshold every
top-k row must reach), the positions of the best approximations (the pilot rows that are
rescored first), and the positions whose interval reaches a threshold (the rows that survive a
level). Each runs in one pass with a heap of ``k`` entries, without sorting the chunk.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eogp_index.search.kernels import cache  # noqa: F401  (one cache stamp for the package)


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
