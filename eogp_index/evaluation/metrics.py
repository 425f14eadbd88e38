"""Attribution-quality metrics of the paper's evaluation protocols (Appendix D).

* Fidelity to a reference (EK-FAC) score matrix, D.2: query-wise Spearman correlation
  (:func:`spearman`, :func:`mean_spearman`) and NDCG@k with binary relevance
  (:func:`ndcg_at_k`, :func:`mean_ndcg_at_k`).
* Score preservation under quantization, Table 2: query-wise Pearson correlation and its
  median over queries (:func:`pearson`, :func:`median_pearson`).
* Retraining ground truth, D.1: the linear datamodeling score with a subset bootstrap
  (:func:`lds`), the paired difference of two methods' LDS (:func:`lds_difference`) and the
  removal order of the counterfactual experiment
  (:func:`counterfactual_ranking`).

Score matrices are ``(n_queries, n_candidates)``: row ``q`` holds the signed influence of
every candidate on query ``q`` under the removal convention, never absolute values.
Everything is computed in float64 with numpy. A correlation is *undefined* (nan) when
either vector is constant; means and medians skip undefined queries and say how many
queries were used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from eogp_index.errors import ConfigError, InputError
from eogp_index.fit.ndcg import ndcg_of_hits

__all__ = [
    "LDSResult",
    "counterfactual_ranking",
    "lds",
    "lds_difference",
    "mean_ndcg_at_k",
    "mean_spearman",
    "median_pearson",
    "ndcg_at_k",
    "ndcg_at_k_per_query",
    "pearson",
    "spearman",
    "spearman_per_query",
    "standard_error",
]


# --------------------------------------------------------------------------- validation


def _vector(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise InputError(f"{name} must be a 1-D score vector, got shape {arr.shape}")
    if arr.size < 2:
        raise InputError(f"{name} needs at least 2 entries for a correlation, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{name} contains nan or inf; scores must be finite")
    return arr


def _pair(a, b, names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    a = _vector(a, names[0])
    b = _vector(b, names[1])
    if a.shape != b.shape:
        raise InputError(f"{names[0]} and {names[1]} differ in length: {a.size} vs {b.size}")
    return a, b


def _matrix(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2:
        raise InputError(f"{name} must be a 2-D (n_queries, n_candidates) matrix, got shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InputError(f"{name} needs at least 1 query and 2 candidates, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{name} contains nan or inf; scores must be finite")
    return arr


def _matrix_pair(A, B, names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    A = _matrix(A, names[0])
    B = _matrix(B, names[1])
    if A.shape != B.shape:
        raise InputError(f"{names[0]} and {names[1]} differ in shape: {A.shape} vs {B.shape}")
    return A, B


# --------------------------------------------------------------------------- correlations


def _rowwise_pearson(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row of X with the same row of Y; nan where undefined.

    X, Y: ``(n_rows, n)`` float64. Returns ``(n_rows,)`` float64.
    """
    # Constancy is tested exactly: centring a constant row can leave rounding noise that
    # would otherwise produce an arbitrary "correlation" instead of nan.
    constant = np.all(X == X[:, :1], axis=1) | np.all(Y == Y[:, :1], axis=1)
    Xc = X - X.mean(axis=1, keepdims=True)
    Yc = Y - Y.mean(axis=1, keepdims=True)
    num = np.einsum("ij,ij->i", Xc, Yc)
    den = np.sqrt(np.einsum("ij,ij->i", Xc, Xc) * np.einsum("ij,ij->i", Yc, Yc))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = num / den
    r[constant | ~(den > 0)] = np.nan
    # Rounding can push |r| a hair above 1.
    return np.clip(r, -1.0, 1.0)


def pearson(a, b) -> float:
    """Pearson correlation of two score vectors.

    a, b: ``(n,)`` with n >= 2. Returns nan when either vector is constant.
    """
    a, b = _pair(a, b, ("a", "b"))
    return float(_rowwise_pearson(a[None], b[None])[0])


def spearman(a, e) -> float:
    """Spearman rank correlation with average ranks for ties (eq. D.2 of the paper).

    a: ``(n,)`` compressed scores; e: ``(n,)`` reference scores. Returns nan when either
    vector is constant. Equals ``scipy.stats.spearmanr(a, e).statistic``.
    """
    a, e = _pair(a, e, ("a", "e"))
    ra = rankdata(a, method="average")[None]
    re = rankdata(e, method="average")[None]
    return float(_rowwise_pearson(ra, re)[0])


def spearman_per_query(A, E) -> np.ndarray:
    """Query-wise Spearman correlations.

    A: ``(n_queries, n_candidates)`` compressed scores; E: same shape, reference scores.
    Returns ``(n_queries,)`` float64, nan for queries where A[q] or E[q] is constant.
    """
    A, E = _matrix_pair(A, E, ("A", "E"))
    return _rowwise_pearson(rankdata(A, method="average", axis=1), rankdata(E, method="average", axis=1))


def _mean_valid(values: np.ndarray) -> tuple[float, int]:
    valid = ~np.isnan(values)
    n_valid = int(valid.sum())
    return (float(values[valid].mean()) if n_valid else float("nan")), n_valid


def mean_spearman(A, E) -> tuple[float, int]:
    """Mean query-wise Spearman correlation over queries where it is defined.

    A: ``(n_queries, n_candidates)`` compressed scores; E: same shape, reference scores.
    Returns ``(mean, n_valid)``; the mean is nan when no query is valid.
    """
    return _mean_valid(spearman_per_query(A, E))


def median_pearson(A, B) -> tuple[float, int]:
    """Median query-wise Pearson correlation, as in Table 2 (1-bit vs FP16 scores).

    A, B: ``(n_queries, n_candidates)`` score matrices. Queries where either row is constant
    are skipped. Returns ``(median, n_valid)``; the median is nan when no query is valid.
    """
    A, B = _matrix_pair(A, B, ("A", "B"))
    r = _rowwise_pearson(A, B)
    valid = ~np.isnan(r)
    n_valid = int(valid.sum())
    return (float(np.median(r[valid])) if n_valid else float("nan")), n_valid


# --------------------------------------------------------------------------- NDCG


def _descending_order(X: np.ndarray) -> np.ndarray:
    # Stable sort of the negated scores: equal scores keep ascending candidate index, so
    # ties are broken deterministically in favour of the lower index.
    return np.argsort(-X, axis=-1, kind="stable")


def ndcg_at_k_per_query(A, E, k: int = 20) -> np.ndarray:
    """NDCG@k of each query, eq. (D.2) of the paper.

    A: ``(n_queries, n_candidates)`` compressed scores; E: same shape, reference scores.
    Relevance is binary: membership in the reference top k (largest signed E). The
    compressed ranking sorts A in descending order. The denominator is the ideal DCG with
    k relevant items in the first k positions, so a perfect top-k gives 1.0.

    Ties (in A or in E) are broken by ascending candidate index. When
    ``n_candidates < k`` the cut-off becomes ``k' = n_candidates`` in both the numerator and
    the denominator (then every candidate is relevant and the value is 1.0).
    Returns ``(n_queries,)`` float64.
    """
    A, E = _matrix_pair(A, E, ("A", "E"))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k must be a positive integer, got {k!r}")
    kk = min(int(k), A.shape[1])
    relevant = np.zeros(E.shape, dtype=bool)
    np.put_along_axis(relevant, _descending_order(E)[:, :kk], True, axis=1)
    hits = np.take_along_axis(relevant, _descending_order(A)[:, :kk], axis=1)
    return ndcg_of_hits(hits)


def ndcg_at_k(a, e, k: int = 20) -> float:
    """NDCG@k of one query; see :func:`ndcg_at_k_per_query` for the definition.

    a: ``(n,)`` compressed scores; e: ``(n,)`` reference scores.
    """
    a, e = _pair(a, e, ("a", "e"))
    return float(ndcg_at_k_per_query(a[None], e[None], k)[0])


def mean_ndcg_at_k(A, E, k: int = 20) -> float:
    """Arithmetic mean of NDCG@k over queries (always defined).

    A: ``(n_queries, n_candidates)`` compressed scores; E: same shape, reference scores.
    """
    return float(ndcg_at_k_per_query(A, E, k).mean())


# --------------------------------------------------------------------------- LDS


@dataclass(frozen=True, eq=False)
class LDSResult:
    """Linear datamodeling score with a 95% percentile bootstrap interval.

    mean: mean of ``per_query`` over defined queries. ci_low, ci_high: 2.5 and 97.5
    percentiles of the query-averaged LDS over subset resamples (nan when
    ``n_bootstrap == 0``). per_query: ``(n_queries,)`` float64, nan where undefined
    (read-only). n_valid: number of queries with a defined LDS.
    """

    mean: float
    ci_low: float
    ci_high: float
    per_query: np.ndarray
    n_valid: int


def _lds_per_query(A: np.ndarray, Y: np.ndarray) -> np.ndarray:
    # Columns are queries; correlate over subsets (axis 0).
    return _rowwise_pearson(rankdata(A, method="average", axis=0).T, rankdata(Y, method="average", axis=0).T)


def _predicted(scores, masks, losses, n_bootstrap: int) -> tuple[np.ndarray, np.ndarray]:
    """``(A, Y)``, both ``(R, n_queries)``: the predicted subset scores ``A_rq = -sum_{i in S_r}
    I_q(i)`` and the measured losses, checked."""
    S = _matrix(scores, "scores")
    n_queries, n_train = S.shape
    M = np.asarray(masks)
    if M.ndim != 2 or M.shape[1] != n_train:
        raise InputError(f"masks must have shape (R, {n_train}) to match scores, got {M.shape}")
    if M.dtype != np.bool_:
        if not np.all((M == 0) | (M == 1)):
            raise InputError("masks must be boolean (or 0/1): True marks a retained training example")
        M = M.astype(bool)
    R = M.shape[0]
    if R < 2:
        raise InputError(f"LDS needs at least 2 subsets, got {R}")
    Y = np.asarray(losses, dtype=np.float64)
    if Y.shape != (R, n_queries):
        raise InputError(f"losses must have shape (R, n_queries) = ({R}, {n_queries}), got {Y.shape}")
    if not np.all(np.isfinite(Y)):
        raise InputError("losses contain nan or inf")
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, (int, np.integer)) or n_bootstrap < 0:
        raise ConfigError(f"n_bootstrap must be a non-negative integer, got {n_bootstrap!r}")
    return -(M.astype(np.float64) @ S.T), Y


def _percentiles(boot: np.ndarray) -> tuple[float, float]:
    boot = boot[~np.isnan(boot)]
    if not boot.size:
        return float("nan"), float("nan")
    low, high = np.percentile(boot, [2.5, 97.5])
    return float(low), float(high)


def lds(scores, masks, losses, *, n_bootstrap: int = 1000, seed: int = 0) -> LDSResult:
    """Linear datamodeling score, Appendix D.1.

    scores: ``(n_queries, n_train)`` influence I_q(i) (removal convention).
    masks: ``(R, n_train)`` bool, True where training example i is retained in subset r.
    losses: ``(R, n_queries)`` measured query loss after retraining on subset r.

    The predicted subset score is ``A_rq = -sum_{i in S_r} I_q(i)``;
    ``LDS_q = spearman_r(A_rq, Y_rq)`` with average ranks. The reported value is the
    mean over queries with a defined correlation. The CI resamples the R subsets with
    replacement ``n_bootstrap`` times (numpy generator seeded by ``seed``) and recomputes
    the query-averaged LDS; resamples in which no query is defined are dropped.
    """
    A, Y = _predicted(scores, masks, losses, n_bootstrap)
    return _bootstrapped(lambda rows: _lds_per_query(A[rows], Y[rows]), A.shape[0], n_bootstrap, seed)


def _bootstrapped(per_query_of, R: int, n_bootstrap: int, seed: int) -> LDSResult:
    """:class:`LDSResult` of ``per_query_of(rows)`` (per-query LDS ``(n_queries,)`` of the subsets
    ``rows``) over all ``R`` subsets, with the 95% interval of its query mean over ``n_bootstrap``
    resamples of the subsets (numpy generator seeded by ``seed``)."""
    per_query = per_query_of(np.arange(R))
    mean, n_valid = _mean_valid(per_query)
    ci_low = ci_high = float("nan")
    if n_bootstrap > 0:
        rng = np.random.default_rng(seed)
        boot = np.empty(n_bootstrap)
        for b in range(n_bootstrap):
            boot[b] = _mean_valid(per_query_of(rng.integers(0, R, size=R)))[0]
        ci_low, ci_high = _percentiles(boot)
    per_query.setflags(write=False)
    return LDSResult(mean=mean, ci_low=ci_low, ci_high=ci_high, per_query=per_query, n_valid=n_valid)


def lds_difference(scores, other, masks, losses, *, n_bootstrap: int = 1000, seed: int = 0) -> LDSResult:
    """LDS of ``scores`` minus LDS of ``other`` on the same subsets, paired.

    ``per_query`` is ``LDS_q(scores) - LDS_q(other)`` (nan where either is undefined) and
    ``mean`` its mean over the defined queries. The 95% interval resamples the ``R`` subsets as
    :func:`lds` does (the same resamples for a given ``seed``), computing both LDS on each
    resample, so the variation the two share cancels.
    """
    A, Y = _predicted(scores, masks, losses, n_bootstrap)
    B, _ = _predicted(other, masks, losses, n_bootstrap)
    if A.shape != B.shape:
        raise InputError(f"scores {A.shape[1:]} and other {B.shape[1:]} must score the same queries")
    return _bootstrapped(
        lambda rows: _lds_per_query(A[rows], Y[rows]) - _lds_per_query(B[rows], Y[rows]), A.shape[0], n_bootstrap, seed
    )


def counterfactual_ranking(scores, n_queries_used: int | None = None) -> np.ndarray:
    """Order in which to remove training examples for counterfactual retraining (D.1).

    scores: ``(n_queries, n_train)`` signed influence. The first ``n_queries_used`` rows
    (all when None; the paper uses the first 50 validation blocks) are summed per training
    example, and examples are sorted by that sum in descending order, ties by ascending
    index. Returns ``(n_train,)`` int64 training indices; remove a prefix of it.
    """
    S = np.asarray(scores, dtype=np.float64)
    if S.ndim != 2 or S.shape[0] < 1 or S.shape[1] < 1:
        raise InputError(f"scores must be a non-empty (n_queries, n_train) matrix, got shape {S.shape}")
    if not np.all(np.isfinite(S)):
        raise InputError("scores contain nan or inf")
    if n_queries_used is not None:
        if (
            isinstance(n_queries_used, bool)
            or not isinstance(n_queries_used, (int, np.integer))
            or not 1 <= n_queries_used <= S.shape[0]
        ):
            raise ConfigError(f"n_queries_used must be an integer in [1, {S.shape[0]}], got {n_queries_used!r}")
        S = S[:n_queries_used]
    return _descending_order(S.sum(axis=0)).astype(np.int64)


def nanmean(values) -> float:
    """Mean of the defined (non-NaN) values; NaN when none is defined."""
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    return float(arr.mean()) if arr.size else float("nan")


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of the finite entries (``std / sqrt(n)``); NaN below two."""
    finite = values[np.isfinite(values)]
    return float(finite.std(ddof=1) / np.sqrt(finite.size)) if finite.size > 1 else float("nan")
