"""Tests of the evaluation metrics against hand-computed values and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation.metrics import (
    LDSResult,
    counterfactual_ranking,
    lds,
    mean_ndcg_at_k,
    mean_spearman,
    median_pearson,
    ndcg_at_k,
    pearson,
    spearman,
    spearman_per_query,
)

# ----------------------------------------------------------------------------- Spearman


def test_spearman_with_ties_matches_hand_computation_and_scipy():
    a = [1, 2, 2, 3]
    e = [1, 3, 2, 4]
    # Average ranks: a -> [1, 2.5, 2.5, 4] (mean 2.5), e -> [1, 3, 2, 4] (mean 2.5).
    # Centred: a -> [-1.5, 0, 0, 1.5], e -> [-1.5, 0.5, -0.5, 1.5].
    # cov = 2.25 + 0 + 0 + 2.25 = 4.5; |a| = sqrt(4.5); |e| = sqrt(5).
    expected = 4.5 / math.sqrt(4.5 * 5.0)
    assert spearman(a, e) == pytest.approx(expected, abs=1e-12)
    assert spearman(a, e) == pytest.approx(spearmanr(a, e).statistic, abs=1e-12)


def test_spearman_random_matches_scipy():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, size=50).astype(float)  # many ties
    e = rng.normal(size=50)
    assert spearman(a, e) == pytest.approx(spearmanr(a, e).statistic, abs=1e-12)


def test_spearman_constant_is_nan():
    assert math.isnan(spearman([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]))
    assert math.isnan(spearman([1.0, 2.0, 3.0], [0.1, 0.1, 0.1]))


def test_mean_spearman_excludes_constant_queries_and_counts_valid():
    A = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0], [4.0, 3.0, 2.0, 1.0]])
    E = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 4.0, 3.0]])
    per_query = spearman_per_query(A, E)
    assert per_query[0] == pytest.approx(1.0)
    assert math.isnan(per_query[1])
    assert per_query[2] == pytest.approx(spearmanr(A[2], E[2]).statistic)
    mean, n_valid = mean_spearman(A, E)
    assert n_valid == 2
    assert mean == pytest.approx((1.0 + spearmanr(A[2], E[2]).statistic) / 2)


def test_mean_spearman_all_undefined():
    mean, n_valid = mean_spearman(np.ones((2, 3)), np.arange(6.0).reshape(2, 3))
    assert n_valid == 0 and math.isnan(mean)


def test_spearman_per_query_matches_scipy_rowwise():
    rng = np.random.default_rng(2)
    A = rng.normal(size=(7, 30))
    E = A + rng.normal(size=(7, 30))
    expected = [spearmanr(A[q], E[q]).statistic for q in range(7)]
    np.testing.assert_allclose(spearman_per_query(A, E), expected, atol=1e-12)


def test_shape_mismatch_raises_input_error():
    with pytest.raises(InputError):
        spearman([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(InputError):
        mean_spearman(np.ones((2, 3)), np.ones((3, 2)))
    with pytest.raises(InputError):
        spearman([1.0, float("nan")], [1.0, 2.0])


# ----------------------------------------------------------------------------- NDCG


def test_ndcg_perfect_ranking_is_one():
    rng = np.random.default_rng(3)
    e = rng.normal(size=100)
    assert ndcg_at_k(e, e, k=20) == pytest.approx(1.0)
    # Any monotone transform gives the same ranking.
    assert ndcg_at_k(np.exp(e), e, k=20) == pytest.approx(1.0)


def test_ndcg_reversed_reference_with_40_candidates_is_zero():
    e = np.arange(40, dtype=float)
    assert ndcg_at_k(-e, e, k=20) == 0.0


def test_ndcg_hand_case_two_hits_at_positions_one_and_three():
    # Reference top-3 = {0, 1, 2}. Compressed order: 0, 5, 1, 2, 3, 4 -> hits at t = 1, 3.
    e = np.array([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    a = np.array([10.0, 8.0, 1.0, 0.5, 0.0, 9.0])
    dcg = 1 / math.log2(2) + 1 / math.log2(4)
    idcg = 1 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert ndcg_at_k(a, e, k=3) == pytest.approx(dcg / idcg, abs=1e-12)
    assert dcg / idcg == pytest.approx(1.5 / (1.5 + 1 / math.log2(3)))


def test_ndcg_uses_signed_scores_not_magnitudes():
    # The most negative reference score is not relevant.
    e = np.array([-100.0, 1.0, 2.0, 0.0])
    a = np.array([100.0, 0.0, 0.0, 0.0])
    assert ndcg_at_k(a, e, k=1) == 0.0


def test_ndcg_ties_break_by_lower_index():
    e = np.array([3.0, 2.0, 1.0, 0.0])
    a = np.zeros(4)  # all tied: order is 0, 1, 2, 3
    assert ndcg_at_k(a, e, k=2) == pytest.approx(1.0)
    assert ndcg_at_k(a, e[::-1].copy(), k=2) == 0.0


def test_ndcg_fewer_candidates_than_k_uses_n():
    e = np.array([1.0, 2.0, 3.0])
    a = np.array([3.0, 2.0, 1.0])
    assert ndcg_at_k(a, e, k=20) == pytest.approx(1.0)


def test_mean_ndcg_averages_queries():
    e = np.arange(40, dtype=float)
    A = np.stack([e, -e])
    E = np.stack([e, e])
    assert mean_ndcg_at_k(A, E, k=20) == pytest.approx(0.5)


def test_ndcg_bad_k():
    with pytest.raises(ConfigError):
        ndcg_at_k([1.0, 2.0], [1.0, 2.0], k=0)


# ----------------------------------------------------------------------------- Pearson


def test_pearson_matches_scipy_and_constant_is_nan():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=20), rng.normal(size=20)
    assert pearson(x, y) == pytest.approx(pearsonr(x, y).statistic, abs=1e-12)
    assert math.isnan(pearson([0.1] * 10, x[:10]))


def test_pearson_near_constant_rounding_is_still_nan():
    # The mean of ten 0.1's is not exactly 0.1 in floating point.
    assert math.isnan(pearson([0.1] * 10, np.arange(10.0)))


def test_median_pearson_skips_undefined():
    B = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    A = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [2.0, 2.0, 2.0], [1.0, 2.0, 4.0]])
    med, n_valid = median_pearson(A, B)
    assert n_valid == 3
    assert med == pytest.approx(pearsonr(A[3], B[3]).statistic)


# ----------------------------------------------------------------------------- LDS


def _subsets(rng, R, n_train):
    return rng.random((R, n_train)) < 0.5


def test_lds_exact_monotone_relation_gives_one_and_degenerate_ci():
    rng = np.random.default_rng(5)
    n_queries, n_train, R = 6, 40, 30
    scores = rng.normal(size=(n_queries, n_train))
    masks = _subsets(rng, R, n_train)
    predicted = -(masks.astype(float) @ scores.T)
    losses = np.exp(predicted / 10.0) + 3.0  # strictly increasing in -sum scores
    res = lds(scores, masks, losses, n_bootstrap=200, seed=0)
    assert isinstance(res, LDSResult)
    assert res.mean == pytest.approx(1.0)
    assert res.ci_low == pytest.approx(1.0) and res.ci_high == pytest.approx(1.0)
    assert res.n_valid == n_queries
    np.testing.assert_allclose(res.per_query, 1.0)


def test_lds_sign_convention():
    # Losses increasing in +sum scores give LDS = -1 under the removal convention.
    rng = np.random.default_rng(6)
    scores = rng.normal(size=(3, 20))
    masks = _subsets(rng, 25, 20)
    losses = masks.astype(float) @ scores.T
    assert lds(scores, masks, losses, n_bootstrap=0).mean == pytest.approx(-1.0)


def test_lds_random_is_near_zero_and_ci_contains_mean():
    rng = np.random.default_rng(7)
    n_queries, n_train, R = 50, 100, 100
    res = lds(
        rng.normal(size=(n_queries, n_train)),
        _subsets(rng, R, n_train),
        rng.normal(size=(R, n_queries)),
        n_bootstrap=300,
        seed=1,
    )
    assert abs(res.mean) < 0.1
    assert res.ci_low <= res.mean <= res.ci_high
    assert res.ci_low < res.ci_high


def test_lds_partial_signal_ci_contains_mean_and_matches_scipy():
    rng = np.random.default_rng(8)
    n_queries, n_train, R = 10, 60, 50
    scores = rng.normal(size=(n_queries, n_train))
    masks = _subsets(rng, R, n_train)
    predicted = -(masks.astype(float) @ scores.T)
    losses = predicted + 3.0 * rng.normal(size=predicted.shape)
    res = lds(scores, masks, losses, n_bootstrap=500, seed=2)
    expected = [spearmanr(predicted[:, q], losses[:, q]).statistic for q in range(n_queries)]
    np.testing.assert_allclose(res.per_query, expected, atol=1e-12)
    assert res.mean == pytest.approx(np.mean(expected))
    assert res.ci_low <= res.mean <= res.ci_high
    # Deterministic under the seed.
    again = lds(scores, masks, losses, n_bootstrap=500, seed=2)
    assert (again.ci_low, again.ci_high) == (res.ci_low, res.ci_high)


def test_lds_excludes_undefined_queries():
    rng = np.random.default_rng(9)
    scores = rng.normal(size=(2, 10))
    masks = _subsets(rng, 12, 10)
    losses = rng.normal(size=(12, 2))
    losses[:, 1] = 1.0  # constant measured loss -> undefined
    res = lds(scores, masks, losses, n_bootstrap=50)
    assert res.n_valid == 1
    assert math.isnan(res.per_query[1])
    assert res.mean == pytest.approx(res.per_query[0])


def test_lds_validates_shapes():
    rng = np.random.default_rng(10)
    scores = rng.normal(size=(2, 10))
    with pytest.raises(InputError):
        lds(scores, np.ones((5, 9), dtype=bool), np.ones((5, 2)))
    with pytest.raises(InputError):
        lds(scores, np.ones((5, 10), dtype=bool), np.ones((5, 3)))
    with pytest.raises(InputError):
        lds(scores, np.full((5, 10), 2), np.ones((5, 2)))
    with pytest.raises(ConfigError):
        lds(scores, np.ones((5, 10), dtype=bool), np.ones((5, 2)), n_bootstrap=-1)


# ----------------------------------------------------------------------------- counterfactual


def test_counterfactual_ranking_sums_first_queries():
    scores = np.array([[1.0, 5.0, 3.0, 3.0], [10.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 100.0]])
    np.testing.assert_array_equal(counterfactual_ranking(scores, n_queries_used=1), [1, 2, 3, 0])
    np.testing.assert_array_equal(counterfactual_ranking(scores, n_queries_used=2), [0, 1, 2, 3])
    np.testing.assert_array_equal(counterfactual_ranking(scores), [3, 0, 1, 2])
    with pytest.raises(ConfigError):
        counterfactual_ranking(scores, n_queries_used=4)
