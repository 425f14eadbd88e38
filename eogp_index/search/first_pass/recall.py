"""The recall a first pass reaches: the share of the exact one-bit top-``k`` its answer holds.

The exact answer is the exact scan of every stored row (:func:`~eogp_index.search.scan.scan_top_k`
over the hot copy); the first pass's answer is its :meth:`FirstPass.top_k` with budget ``C``
for that side alone, its best ``k`` rows of that side's sign, as the ranking keeps them. Both sides count:
recall is the share of the exact top-``k`` of both sides found, over the queries.

``eogp build-candidates`` measures it after a build on a sample of stored rows' own codes
(signs times their module scales, :func:`stored_row_queries`), each query row left out of both
answers, and warns below :data:`RECALL_TARGET`. Held-out documents measure it too
(:func:`measure_recall` takes any ``(n, K)`` coordinates; ``benchmarks/real_codes.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence

import numpy as np

from eogp_index.search.scan import scan_top_k
from eogp_index.store.codecs import unpack_signs

#: Below this recall ``eogp build-candidates`` warns.
RECALL_TARGET = 0.95
#: The budget ``C`` it measures at, in multiples of ``k``.
BUDGET_FACTOR = 5
#: Stored rows it uses as queries, and the ``k`` of the top it compares.
SAMPLE_QUERIES = 32
RECALL_K = 20
SIDES = ("positive", "negative")


@dataclass(frozen=True)
class Recall:
    """A measured recall.

    Attributes:
        recall: share of the exact top-``k`` of both sides found (``nan``: nothing to find).
        positive, negative: the same per side.
        k, candidates: the top compared and the first pass's budget ``C``.
        queries: how many queries; queries_from: ``"stored rows"`` or ``"held-out documents"``.
    """

    recall: float
    positive: float
    negative: float
    k: int
    candidates: int
    queries: int
    queries_from: str

    @property
    def below_target(self) -> bool:
        return not self.recall >= RECALL_TARGET

    def to_json(self) -> Dict[str, Any]:
        """As JSON values (``None`` for ``nan``), with the target."""
        plain = {key: (None if isinstance(v, float) and v != v else v) for key, v in asdict(self).items()}
        return {**plain, "target": RECALL_TARGET}


def stored_row_queries(stored, n: int = SAMPLE_QUERIES, seed: int = 0) -> tuple:
    """``n`` stored rows drawn at random (seeded) as queries: ``(y (n, K) float32, rowaddr (n,) uint64)``,
    each ``y`` the row's signs times its module scales (what its code says its coordinates are)."""
    hot = stored.hot_codes()
    rows = np.sort(np.random.default_rng(seed).choice(hot.num_rows, size=min(n, hot.num_rows), replace=False))
    layout = stored.layout
    signs = unpack_signs(np.asarray(hot.codes[rows]), layout)
    scales = np.repeat(np.asarray(hot.scales[rows], np.float32), layout.k, axis=1)
    return np.ascontiguousarray(signs * scales, np.float32), hot.rowaddr[rows].astype(np.uint64)


def _best(rowaddr: np.ndarray, scores: np.ndarray, side: str, k: int, leave_out: Optional[int]) -> set:
    """The best ``k`` rows of ``side``'s sign (as the ranking keeps them), ``leave_out`` excluded."""
    keep = (scores > 0 if side == "positive" else scores < 0) & (rowaddr != (-1 if leave_out is None else leave_out))
    rowaddr, scores = rowaddr[keep], scores[keep]
    order = np.lexsort((rowaddr, -scores if side == "positive" else scores))[:k]
    return set(rowaddr[order].tolist())


def measure_recall(
    first_pass,
    stored,
    y: np.ndarray,
    *,
    k: int = RECALL_K,
    C: Optional[int] = None,
    leave_out: Optional[np.ndarray] = None,
    queries_from: str = "held-out documents",
    sides: Sequence[str] = SIDES,
) -> Recall:
    """Recall of ``first_pass`` at budget ``C`` (default ``5 k``) for the queries ``y``.

    Args:
        y: ``(n, K)`` float32 query coordinates.
        leave_out: ``(n,)`` uint64 a row address per query left out of both answers (its own row,
            for stored rows as queries), or ``None``.
    """
    C = BUDGET_FACTOR * k if C is None else C
    hot = stored.hot_codes()
    y = np.ascontiguousarray(stored.one_bit(y), np.float32)  # the encoder's (n, T): the one-bit part
    extra = 0 if leave_out is None else 1  # one more, in case the left-out row is among them
    exact = scan_top_k(hot.codes, hot.scales, y, stored.layout, k + extra)
    found = {side: 0 for side in sides}
    wanted = {side: 0 for side in sides}
    for q in range(y.shape[0]):
        own = None if leave_out is None else int(leave_out[q])
        for side in sides:
            # One side at a time, as a query of one direction asks: the rows scored for the other
            # side do not count for this one.
            answer = first_pass.top_k(stored, y[q : q + 1], k + extra, max(C, k + extra), [side])
            index, score = (
                (exact.largest_indices[q], exact.largest_scores[q])
                if side == "positive"
                else (exact.smallest_indices[q], exact.smallest_scores[q])
            )
            truth = _best(hot.rowaddr[index].astype(np.int64), score, side, k, own)
            rowaddr, scores, _ = answer[side]
            got = _best(np.asarray(rowaddr).astype(np.int64), np.asarray(scores), side, k, own)
            found[side] += len(truth & got)
            wanted[side] += len(truth)
    share = {side: found[side] / wanted[side] if wanted[side] else float("nan") for side in sides}
    total = sum(wanted.values())
    return Recall(
        recall=sum(found.values()) / total if total else float("nan"),
        positive=share.get("positive", float("nan")),
        negative=share.get("negative", float("nan")),
        k=k,
        candidates=C,
        queries=int(y.shape[0]),
        queries_from=queries_from,
    )


def measure_on_stored_rows(first_pass, stored, *, k: int = RECALL_K, C: Optional[int] = None) -> Recall:
    """:func:`measure_recall` on :data:`SAMPLE_QUERIES` stored rows' own codes, each left out of its answers."""
    y, rowaddr = stored_row_queries(stored)
    return measure_recall(first_pass, stored, y, k=k, C=C, leave_out=rowaddr, queries_from="stored rows")
