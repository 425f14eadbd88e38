"""NDCG@k with binary relevance: the one definition the evaluation and the fit's measurements share.

A ranking's top ``k`` is compared with a reference's top ``k``: a row is relevant when it lies in
the reference's top ``k`` (gain 1, else 0), the gain at place ``i`` (from 0) is discounted by
``1 / log2(i + 2)``, and the sum is divided by that of ``k`` relevant rows in the first ``k``
places, so a perfect top ``k`` gives 1. The evaluation's NDCG@20 against kronfluence
(:func:`eogp_index.evaluation.metrics.ndcg_at_k_per_query`), the fit's held-out fidelity
(:func:`eogp_index.fit.code_choice.ranking_agreement`) and the rescoring gap that chooses the
default rescoring factor (:mod:`eogp_index.fit.recall`, :mod:`eogp_index.store.table_recall`) all
reduce a ranking to its hits and call :func:`ndcg_of_hits`. It sits in the fit because the fit is
the lowest layer that ranks; numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def discounts(k: int) -> np.ndarray:
    """The discounts ``1 / log2(i + 2)`` of places ``0 .. k - 1``, ``(k,)`` float64."""
    return 1.0 / np.log2(np.arange(2, int(k) + 2, dtype=np.float64))


def ndcg_of_hits(hits) -> np.ndarray:
    """NDCG of rankings given their hits.

    Args:
        hits: ``(q, k)``: whether the row at each of a ranking's first ``k`` places lies in the
            reference's top ``k`` (bool or 0/1).

    Returns:
        ``(q,)`` float64 in ``[0, 1]``.
    """
    hits = np.asarray(hits, dtype=np.float64)
    weights = discounts(hits.shape[1])
    return (hits * weights).sum(axis=1) / weights.sum()


def rescored_ndcg(kept_tier, kept_relevant, t: int, factors: Sequence[int]) -> np.ndarray:
    """NDCG@``t`` of the rescored top ``t`` at each factor, against the tier's own top ``t``.

    A query keeps the one-bit top ``F · t`` rows of a side and orders them by the tier's scores;
    its top ``t`` is then compared with the tier's full-scan top ``t`` (relevance: membership in
    it, :func:`ndcg_of_hits`). ``1 -`` this is the NDCG the rescoring loses against the tier alone.

    Args:
        kept_tier: ``(q, depth)`` float64: the tier's (signed) scores of each query's one-bit top
            ``depth`` rows of the side, in one-bit order (NaN: no row at that place).
        kept_relevant: ``(q, depth)`` bool: whether each of those rows is in the tier's top ``t``.
        factors: each with ``F · t <= depth``.

    Returns:
        ``(q, len(factors))`` float64. Rows of equal tier score keep their one-bit order.
    """
    kept_tier = np.asarray(kept_tier, np.float64)
    kept_relevant = np.asarray(kept_relevant, bool)
    out = np.empty((kept_tier.shape[0], len(factors)), np.float64)
    for j, factor in enumerate(factors):
        n = int(factor) * int(t)
        keys = np.where(np.isnan(kept_tier[:, :n]), np.inf, -kept_tier[:, :n])
        order = np.argsort(keys, axis=1, kind="stable")[:, :t]
        hits = np.take_along_axis(kept_relevant[:, :n], order, axis=1)
        if hits.shape[1] < t:  # fewer rows than t: the missing places hold no hit
            hits = np.concatenate([hits, np.zeros((hits.shape[0], t - hits.shape[1]), bool)], axis=1)
        out[:, j] = ndcg_of_hits(hits)
    return out
