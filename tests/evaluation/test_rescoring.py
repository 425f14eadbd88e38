"""The rescoring tier in ``eogp eval fidelity``: the rescored ranking, the recall curve, the tiers
of a larger k and the index's F, all from the shared pass on a tiny GPT-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinymodels import make_examples, make_tiny_gpt2

from eogp_index.config import RESCORE_GAP_TARGET
from eogp_index.evaluation import metrics
from eogp_index.evaluation.fidelity import Documents, compute_scores, fidelity_records
from eogp_index.evaluation.rescoring import (
    TARGET_GAP,
    index_factor,
    recall_curve,
    rescored_order,
    rescored_scores,
    rescoring_details,
    rescoring_markdown,
)
from eogp_index.fit.code_choice import held_out_rows
from eogp_index.fit.recall import default_factor
from eogp_index.fit.recall import recall_curve as index_curve
from eogp_index.store.codecs import SignLayout, TierCodec

torch.set_num_threads(1)


def _docs(examples) -> Documents:
    return Documents(
        tuple(e.id for e in examples),
        tuple(tuple(e.input_ids) for e in examples),
        tuple(tuple(e.labels) for e in examples),
    )


TRAIN = _docs(make_examples(60, seed=1))  # 9 held out (0.15): the index's F is measured
QUERIES = _docs(make_examples(4, seed=2, prefix="q", masked_prompt=True))
FACTORS = (1, 2, 3)


@pytest.fixture(scope="module")
def scoreset(tmp_path_factory):
    work = tmp_path_factory.mktemp("rescoring")
    return compute_scores(
        make_tiny_gpt2(), TRAIN, QUERIES, work, budgets=(32,), methods=("eogp", "eogp-rot"), batch_size=12
    )


def _direct_order(scores: np.ndarray) -> np.ndarray:
    """Best first, ties by ascending index, one query at a time in plain Python."""
    return np.array([sorted(range(len(row)), key=lambda j: (-row[j], j)) for row in scores])


def test_every_row_rescored_is_the_tiers_own_ranking():
    rng = np.random.default_rng(0)
    one_bit = np.round(rng.normal(size=(5, 37)), 1)  # rounded: ties, broken by the row index
    tier = np.round(rng.normal(size=(5, 37)), 1)
    for n in (37, 40, 100):
        np.testing.assert_array_equal(rescored_order(one_bit, tier, n), _direct_order(tier))
    reference = rng.normal(size=(5, 37))
    np.testing.assert_allclose(
        metrics.ndcg_at_k_per_query(rescored_scores(one_bit, tier, 37), reference, 20),
        metrics.ndcg_at_k_per_query(tier, reference, 20),
    )
    distinct = rng.normal(size=(5, 37))  # Spearman ranks ties by their average: compare without ties
    np.testing.assert_allclose(
        metrics.spearman_per_query(rescored_scores(one_bit, distinct, 37), reference),
        metrics.spearman_per_query(distinct, reference),
    )


def test_the_sides_keep_the_one_bit_sets_and_the_rest_its_order():
    rng = np.random.default_rng(1)
    one_bit, tier = rng.normal(size=(3, 60)), rng.normal(size=(3, 60))
    order = rescored_order(one_bit, tier, 20)
    by_one_bit = _direct_order(one_bit)
    for q in range(3):
        assert set(order[q, :20]) == set(by_one_bit[q, :20])  # the one-bit top 20, in the tier's order
        assert list(order[q, :20]) == sorted(by_one_bit[q, :20], key=lambda j: -tier[q, j])
        np.testing.assert_array_equal(order[q, 20:40], by_one_bit[q, 20:40])  # neither side: one-bit order
        assert set(order[q, 40:]) == set(by_one_bit[q, 40:])  # the negative side
        assert list(order[q, 40:]) == sorted(by_one_bit[q, 40:], key=lambda j: -tier[q, j])
        assert sorted(order[q]) == list(range(60))


def test_recall_curve_is_monotone_and_counts_the_tiers_top_rows():
    rng = np.random.default_rng(2)
    one_bit, tier = rng.normal(size=(6, 90)), rng.normal(size=(6, 90))
    sizes = (20, 40, 60, 100)
    curve = recall_curve(one_bit, tier, sizes, 20)
    assert curve.shape == (4, 6)
    assert np.all(np.diff(curve, axis=0) >= 0)
    for i, n in enumerate(sizes):
        for q in range(6):
            wanted = set(_direct_order(tier[q : q + 1])[0, :20])
            found = set(_direct_order(one_bit[q : q + 1])[0, : min(n, 90)])
            assert curve[i, q] == len(wanted & found) / 20
    np.testing.assert_array_equal(curve[-1], 1.0)  # N above the rows: everything found


def test_tiers_come_from_the_same_coordinates(scoreset):
    """The FP16 tier at the 1-bit k is the unquantized score; the int8 tier stores them with a
    scale per module; a tier of twice the k is scored on more coordinates."""
    for method in ("eogp", "eogp-rot"):
        cfg = scoreset.config(method, 32)
        keys = scoreset.tier_keys(cfg)
        assert {("int8", 1), ("int4", 1), ("fp16", 1), ("int8", 2), ("fp16", 4)} <= set(keys)
        np.testing.assert_allclose(scoreset.tier(cfg, "fp16", 1), scoreset.unquantized[cfg.id][0], rtol=1e-6, atol=1e-9)
        wide = np.abs(scoreset.tier(cfg, "fp16", 1)).max()
        for code, tolerance in (("int8", 0.05), ("int4", 0.6)):
            diff = np.abs(scoreset.tier(cfg, code, 1) - scoreset.tier(cfg, "fp16", 1)).max()
            assert 0 < diff < tolerance * wide, (method, code)
        assert not np.allclose(scoreset.tier(cfg, "fp16", 2), scoreset.tier(cfg, "fp16", 1))
    # EOGP-rot's tier holds its rotated coordinates: FP16 inner products as EOGP's.
    plain, rotated = (scoreset.tier(scoreset.config(m, 32), "fp16", 2) for m in ("eogp", "eogp-rot"))
    np.testing.assert_allclose(rotated, plain, rtol=0, atol=2e-3 * np.abs(plain).max())


def test_rescoring_details_match_a_direct_recomputation(scoreset):
    n = len(TRAIN)
    factors = FACTORS + (-(-n // 20),)  # the last one rescores every row
    details = rescoring_details(scoreset, ndcg_k=20, factors=factors)
    assert [entry["method"] for entry in details] == ["eogp", "eogp-rot"]
    for entry in details:
        cfg = scoreset.config(entry["method"], 32)
        one_bit = scoreset.scores[cfg.id][0]
        assert entry["one_bit"]["ndcg@20"]["mean"] == pytest.approx(metrics.mean_ndcg_at_k(one_bit, scoreset.reference))
        for tier in entry["tiers"]:
            scores = scoreset.tier(cfg, tier["code"], tier["multiple"])
            assert tier["k_tier"] == [tier["multiple"] * k for k in cfg.k]
            codec = TierCodec(tier["code"], SignLayout(tuple(tier["k_tier"])))
            assert tier["bytes_on_disk"] == cfg.bytes_per_example + codec.bytes_per_example
            alone = metrics.mean_ndcg_at_k(scores, scoreset.reference)
            assert tier["alone"]["ndcg@20"]["mean"] == pytest.approx(alone)
            rows = {r["factor"]: r for r in tier["rescored"]}
            # Every row rescored: the tier's own ranking, a gap of zero.
            assert rows[factors[-1]]["ndcg@20"]["mean"] == pytest.approx(alone)
            assert rows[factors[-1]]["gap"]["mean"] == pytest.approx(0.0)
            assert rows[factors[-1]]["recall"]["mean"] == 1.0
            assert tier["first_factor_within"] is not None and tier["first_factor_within"] <= factors[-1]
            recall = [rows[f]["recall"]["mean"] for f in sorted(rows)]
            assert recall == sorted(recall)
            for factor, row in rows.items():
                direct = recall_curve(one_bit, scores, [factor * 20], 20)[0].mean()
                assert row["recall"]["mean"] == pytest.approx(direct)
                expected = metrics.mean_ndcg_at_k(rescored_scores(one_bit, scores, factor * 20), scoreset.reference)
                assert row["ndcg@20"]["mean"] == pytest.approx(expected)
        # F·20 = 20: the one-bit top 20 kept as a set.
        int8 = scoreset.tier(cfg, "int8", 1)
        top = rescored_order(one_bit, int8, 20)[:, :20]
        for q in range(one_bit.shape[0]):
            assert set(top[q]) == set(_direct_order(one_bit[q : q + 1])[0, :20])


def test_fidelity_records_have_the_rescoring_rows(scoreset):
    records, details = fidelity_records(scoreset, rescore_factors=FACTORS, rescore=2)
    by = {(r["method"], r["bytes_per_example"], r["metric"]): r for r in records}
    for label in ("EOGP", "EOGP-rot"):
        for code in ("int8", "int4", "fp16"):
            for metric in ("ndcg@20", "spearman"):
                alone = by[(f"{label} + {code} tier (full scan)", 32, metric)]
                rescored = by[(f"{label}, top 2×20 rescored by {code}", 32, metric)]
                assert alone["ci_low"] <= alone["value"] <= alone["ci_high"]
                assert -1 <= rescored["value"] <= 1
            assert 0 <= by[(f"{label}, top 2×20 rescored by {code}", 32, "recall@40")]["value"] <= 1
    assert details["rescore"] == 2
    assert [r["factor"] for r in details["rescoring"][0]["tiers"][0]["rescored"]] == [1, 2, 3]


def test_the_index_factor_is_the_fits_choice_on_the_held_out_documents(scoreset):
    """The index's F: the fit's held-out documents (9 of 60) as queries scoring the other 59
    training rows, by the tier and by the stored 1-bit code, chosen by the fit's own function; the
    top rescored at that F is measured against the reference like every other F."""
    held = held_out_rows(len(TRAIN), 0.15, 0)
    assert held.numel() == 9
    details = rescoring_details(scoreset, ndcg_k=20, factors=FACTORS)
    for entry in details:
        cfg = scoreset.config(entry["method"], 32)
        one_bit = scoreset.scores[cfg.id][0]
        for tier in entry["tiers"]:
            held_tier, held_bit = scoreset.held_out_scores(cfg, tier["code"], tier["multiple"])
            assert held_tier.shape == held_bit.shape == (9, len(TRAIN) - 1)  # each without its own row
            curve, _ = index_curve(torch.from_numpy(held_tier), torch.from_numpy(held_bit))
            index = tier["index"]
            assert index == index_factor(scoreset, cfg, tier["code"], tier["multiple"])
            assert index["criterion"] == "ndcg_gap" and index["gap_target"] == RESCORE_GAP_TARGET == TARGET_GAP
            assert (index["factor"], index["reached"]) == default_factor(curve)
            assert index["t"] == 3 and index["factors"] == [1, 2, 3, 5, 10]  # 20 x 3 is not below 59
            np.testing.assert_allclose(index["gap"], curve.gap, rtol=0, atol=1e-12)
            at = tier["at_index_factor"]
            scores = scoreset.tier(cfg, tier["code"], tier["multiple"])
            rescored = rescored_scores(one_bit, scores, index["factor"] * 20)
            assert at["factor"] == index["factor"]
            assert at["ndcg@20"]["mean"] == pytest.approx(metrics.mean_ndcg_at_k(rescored, scoreset.reference))
        # the 1-bit code's held-out scores do not depend on the tier; the FP16 tier at k is the 1-bit
        # code's coordinates unquantized, so it ranks differently from the signs
        bits = [scoreset.held_out_scores(cfg, code, 1)[1] for code in ("int8", "fp16")]
        np.testing.assert_array_equal(bits[0], bits[1])
        assert not np.allclose(scoreset.held_out_scores(cfg, "fp16", 1)[0], bits[0])
    text = "\n".join(rescoring_markdown(details, ndcg_k=20, factor=2))
    assert "### At the index's F" in text and text.count("| EOGP-rot | 32 B |") >= 3
