"""The one-bit code's recall of the rescoring tier's top rows and the NDCG gap of the rescored top,
measured at fit time: the curves against a direct float64 recomputation (the tier as the store's codec stores it, the one-bit code
as the store's codec stores it, sorted by hand), the default factor, variant auto's choice by
recall, and a real fit (tiny GPT-2, kronfluence, LanceDB on disk) that records the measurement,
prints it in `eogp info` and answers a query without `rescore` with the recorded factor.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.fit import recall as recall_module
from eogp_index.fit.code_choice import held_out_rows, measure_module, tier_scores
from eogp_index.fit.fitting import fit_projection, format_choices
from eogp_index.fit.projection import module_rotation
from eogp_index.fit.recall import (
    RecallCurve,
    compare_recall,
    default_factor,
    format_recall,
    gap_per_query,
    measured_factors,
    recall_curve,
    recall_factor,
    recall_t,
    tier_documents,
)
from eogp_index.search.query import rescore_factor
from eogp_index.search.question import UNMEASURED_RESCORE, Question
from eogp_index.store.codecs import TIER_LEVELS, SignLayout, TierCodec, decode, encode


# -- the exact reference ------------------------------------------------------------------------
def _reference_recall(tier: np.ndarray, one_bit: np.ndarray, t: int, factors) -> np.ndarray:
    """Per query and factor, by hand: each side's top t of ``tier`` (ties by position) and top F·t
    of ``one_bit``, the share found, averaged over the two sides."""
    q, n = tier.shape
    out = np.zeros((q, len(factors)))
    for row in range(q):
        for j, factor in enumerate(factors):
            shares = []
            for sign in (1, -1):
                by_tier = sorted(range(n), key=lambda i: (-sign * tier[row, i], i))[:t]
                by_bit = set(sorted(range(n), key=lambda i: (-sign * one_bit[row, i], i))[: factor * t])
                shares.append(sum(i in by_bit for i in by_tier) / t)
            out[row, j] = sum(shares) / 2
    return out


def _reference_gap(tier: np.ndarray, one_bit: np.ndarray, t: int, factors) -> np.ndarray:
    """Per query and factor, by hand: each side's one-bit top F·t re-ordered by the tier (equal
    tier scores in one-bit order), its first t against the tier's own top t (binary relevance,
    log2 discount), one minus that NDCG, averaged over the two sides."""
    q, n = tier.shape
    ideal = sum(1 / np.log2(p + 2) for p in range(t))
    out = np.zeros((q, len(factors)))
    for row in range(q):
        for j, factor in enumerate(factors):
            gaps = []
            for sign in (1, -1):
                best = set(sorted(range(n), key=lambda i: (-sign * tier[row, i], i))[:t])
                kept = sorted(range(n), key=lambda i: (-sign * one_bit[row, i], i))[: factor * t]
                rescored = sorted(kept, key=lambda i: (-sign * tier[row, i], kept.index(i)))[:t]
                gaps.append(1 - sum((i in best) / np.log2(p + 2) for p, i in enumerate(rescored)) / ideal)
            out[row, j] = sum(gaps) / 2
    return out


def _reference_scores(y: np.ndarray, k: int, rotation, code: str):
    """One module's held-out scores, every document against every other, from the store's codecs."""
    h, width = y.shape
    stored_tier = TierCodec(code, SignLayout((width,)))
    tier = stored_tier.decode(stored_tier.encode(y.astype(np.float32))).astype(np.float64)
    first = y[:, :k]
    rotated = rotation.apply(torch.from_numpy(first)).numpy()
    one_bit = {
        name: (coords, decode(encode(coords.astype(np.float32), SignLayout((k,)), "1bit"), SignLayout((k,))))
        for name, coords in (("eogp", first), ("eogp-rot", rotated))
    }
    scores = {"tier": np.zeros((h, h - 1))} | {name: np.zeros((h, h - 1)) for name in one_bit}
    for q in range(h):
        others = [i for i in range(h) if i != q]
        for col, i in enumerate(others):
            scores["tier"][q, col] = sum(float(y[q, j]) * float(tier[i, j]) for j in range(width))
            for name, (coords, docs) in one_bit.items():
                scores[name][q, col] = sum(float(coords[q, j]) * float(docs[i, j]) for j in range(k))
    return scores


@pytest.mark.parametrize("code", ["int8", "int4", "fp16"])
def test_tier_documents_are_what_the_tier_codec_stores(code):
    assert recall_module.TIER_LEVELS == TIER_LEVELS
    y = torch.randn(11, 13, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    y[4] = 0.0  # a zero row: scale 0, codes 0
    tier = TierCodec(code, SignLayout((13,)))
    stored = tier.decode(tier.encode(y.float().numpy()))
    np.testing.assert_array_equal(tier_documents(y, code).numpy(), stored.astype(np.float64))


def test_the_recall_curve_equals_a_direct_recomputation():
    """A tiny module (h = 44 held out, a tier wider than the one-bit code), every step by hand."""
    h, k, width = 44, 6, 10
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(h, width, generator=gen, dtype=torch.float64) * torch.linspace(2.0, 0.3, width, dtype=torch.float64)
    rotation = module_rotation(0, "layer", k)
    scores = tier_scores(y, k, rotation, "int4")
    reference = _reference_scores(y.numpy(), k, rotation, "int4")
    for name in ("tier", "eogp", "eogp-rot"):
        np.testing.assert_allclose(scores[name].numpy(), reference[name], rtol=1e-9, atol=1e-9, err_msg=name)
    t = recall_t(h)
    factors = measured_factors(h, t)
    assert t == 2 and factors == (1, 2, 3, 5, 10, 20)  # 20 · 2 = 40 < 43 candidates
    for name in ("eogp", "eogp-rot"):
        curve, per_query = recall_curve(scores["tier"], scores[name])
        expected = _reference_recall(reference["tier"], reference[name], t, factors)
        np.testing.assert_allclose(per_query.numpy(), expected, rtol=0, atol=1e-12)
        assert curve.t == t and curve.held_out == h and curve.factors == factors
        np.testing.assert_allclose(curve.recall, expected.mean(axis=0), rtol=0, atol=1e-12)
        np.testing.assert_allclose(curve.recall_se, expected.std(axis=0, ddof=1) / np.sqrt(h), rtol=0, atol=1e-12)
        assert all(a <= b for a, b in zip(curve.recall, curve.recall[1:]))  # monotone in F
        assert curve.recall[0] < 1.0  # the signs lose some of the tier's top rows at F = 1
        gaps = _reference_gap(reference["tier"], reference[name], t, factors)
        np.testing.assert_allclose(gap_per_query(scores["tier"], scores[name], t, factors).numpy(), gaps, atol=1e-12)
        np.testing.assert_allclose(curve.gap, gaps.mean(axis=0), rtol=0, atol=1e-12)
        np.testing.assert_allclose(curve.gap_se, gaps.std(axis=0, ddof=1) / np.sqrt(h), rtol=0, atol=1e-12)
        assert curve.gap[0] > 0 and all(a >= b for a, b in zip(curve.gap, curve.gap[1:]))  # shrinks with F


def test_ties_are_broken_by_position_as_the_reference_does():
    gen = np.random.default_rng(1)
    tier = np.round(gen.normal(size=(30, 29)), 1)  # many equal scores
    one_bit = np.round(gen.normal(size=(30, 29)), 1)
    curve, per_query = recall_curve(torch.from_numpy(tier), torch.from_numpy(one_bit))
    expected = _reference_recall(tier, one_bit, curve.t, curve.factors)
    np.testing.assert_allclose(per_query.numpy(), expected, rtol=0, atol=1e-12)
    gaps = _reference_gap(tier, one_bit, curve.t, curve.factors)
    np.testing.assert_allclose(curve.gap, gaps.mean(axis=0), rtol=0, atol=1e-12)


def test_t_and_the_factors_scale_with_the_held_out_set():
    assert [recall_t(h) for h in (8, 39, 40, 150, 400, 2000)] == [1, 1, 2, 7, 20, 20]
    assert measured_factors(8, 1) == (1, 2, 3, 5)  # a top 10 of 7 candidates would find all
    assert measured_factors(150, 7) == (1, 2, 3, 5, 10, 20)
    assert measured_factors(2, 1) == ()  # one candidate: a top 1 of it finds it
    # past 20 where the candidates allow it: 50 · 20 < 1,999 < 100 · 20 < 2,100
    assert measured_factors(2000, 20) == (1, 2, 3, 5, 10, 20, 50)
    assert measured_factors(2100, 20) == (1, 2, 3, 5, 10, 20, 50, 100)


def _curve(recall, gap, factors=(1, 2, 5, 10)):
    return RecallCurve(2, 100, factors, tuple(recall), (0.0,) * len(recall), tuple(gap), (0.0,) * len(gap))


def test_the_default_factor_is_the_smallest_within_the_gap_else_the_largest():
    assert default_factor(_curve([0.8, 0.97, 0.99, 1.0], [0.03, 0.006, 0.005, 0.0])) == (5, True)
    assert default_factor(_curve([0.98, 0.99, 0.99, 1.0], [0.004, 0.001, 0.0, 0.0])) == (1, True)
    assert default_factor(_curve([0.5, 0.6, 0.7, 0.8], [0.2, 0.1, 0.05, 0.01])) == (10, False)
    assert default_factor(RecallCurve(1, 3, (), (), ())) == (None, False)
    # recall reaches 0.98 at F = 2, but the rescored top still loses 0.008 of NDCG there
    curve = _curve([0.9, 0.98, 0.995, 1.0], [0.02, 0.008, 0.002, 0.0])
    assert recall_factor(curve) == 2 and default_factor(curve) == (5, True)
    # past RESCORE_MAX_DEFAULT (20) a factor is measured but never the default: its reads cost too much
    deep = _curve([0.9, 0.95, 0.99, 1.0], [0.03, 0.02, 0.004, 0.0], factors=(10, 20, 50, 100))
    assert default_factor(deep) == (20, False) and default_factor(deep, max_factor=100) == (50, True)


def test_the_gap_chooses_a_larger_factor_than_the_recall():
    """Constructed in float64: 40 queries, 400 candidates a side, t = 20. The tier's scores are
    ``400 - i`` (row 0 first) and the one-bit scan ranks like it, except that in one query in four
    it puts the tier's first row at place 59 (a top 40 misses it, a top 60 keeps it). The recall
    is then 1 - 1/80 = 0.9875 at F = 1 and 2, above 0.98; the rescored top 20 of those queries
    holds 19 of the tier's top 20 in its first 19 places, an NDCG@20 loss of ``d_19 / IDCG``
    (0.032): a mean gap of 0.0081. The gap chooses F = 3, the recall F = 1."""
    q, n, t = 40, 400, 20
    tier = np.tile(np.arange(n, 0, -1, dtype=np.float64), (q, 1))  # (q, n), the same each query
    one_bit = tier.copy()
    for row in range(0, q, 4):
        one_bit[row, 0] = tier[row, 3 * t] + 0.5  # after the rows at places 0-58
    both = np.concatenate([tier, -tier[:, ::-1]], axis=1)  # the negative side mirrors the positive
    bits = np.concatenate([one_bit, -one_bit[:, ::-1]], axis=1)
    curve, _ = recall_curve(torch.from_numpy(both), torch.from_numpy(bits))
    assert curve.t == t and curve.factors == (1, 2, 3, 5, 10, 20)
    ideal = sum(1 / np.log2(p + 2) for p in range(t))
    miss = (1 / np.log2(t + 1)) / ideal  # the last place's gain
    expected = [miss / 4 if f * t < 3 * t else 0.0 for f in curve.factors]
    np.testing.assert_allclose(curve.gap, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve.recall[:2], [1 - 1 / (4 * t)] * 2, rtol=0, atol=1e-12)
    assert curve.gap[1] > 0.005 and recall_factor(curve) == 1 and default_factor(curve) == (3, True)


def test_records_written_before_the_gap_still_read_and_print():
    old = {
        "tier": "int8", "t": 3, "held_out": 77, "factors": [1, 2, 5], "recall": [0.9, 0.97, 0.99],
        "recall_se": [0.01, 0.01, 0.005], "target": 0.98, "factor": 5, "reached": True, "codes": {"eogp": 8},
    }  # fmt: skip
    curve = RecallCurve.from_json(old)
    assert curve.gap == () and curve.recall == (0.9, 0.97, 0.99)
    assert "default factor 5, the smallest within recall 0.98" in format_recall(old)
    new = {**old, "gap": [0.1, 0.01, 0.004], "gap_se": [0.01, 0.002, 0.001], "criterion": "ndcg_gap"}
    new.update(gap_target=0.005, recall_factor=5)
    assert RecallCurve.from_json(new).gap == (0.1, 0.01, 0.004)
    assert "default factor 5, the smallest within NDCG@3 gap 0.005" in format_recall(new)


@pytest.mark.parametrize("spectrum, expected", [("steep", "eogp-rot"), ("flat", "eogp")])
def test_auto_picks_the_code_by_recall_and_a_tie_keeps_eogp(spectrum, expected):
    """Unequal variances: the rotation spreads them and its signs find the tier's top rows better;
    equal ones: no difference beyond one standard error, EOGP kept."""
    n, m, k = 400, 64, 32
    scale = torch.arange(1, m + 1).double() ** -1.5 if spectrum == "steep" else torch.ones(m, dtype=torch.float64)
    z = torch.randn(n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scale.sqrt()
    held_out = held_out_rows(n, 0.25, 0)
    choice, scores = measure_module(z.float(), k, module_rotation(0, "layer", k), held_out, tier="int8")
    recall = choice.recall
    assert choice.code == recall.code == expected and set(scores) == {"tier", "eogp", "eogp-rot"}
    assert recall.curves["eogp"].t == recall_t(100) == 5
    if expected == "eogp-rot":
        assert recall.diff > 3 * recall.diff_se
    else:
        assert abs(recall.diff) <= 3 * recall.diff_se
    again = compare_recall(scores["tier"], {c: scores[c] for c in ("eogp", "eogp-rot")})
    assert again == recall
    without = measure_module(z.float(), k, module_rotation(0, "layer", k), held_out)
    assert without[1] is None and without[0].recall is None  # no tier: today's criterion


def test_a_wider_tier_keeps_the_one_bit_code_on_its_first_k_coordinates():
    n, m, k = 200, 48, 8
    z = torch.randn(n, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    z *= torch.arange(1, m + 1).double() ** -0.5
    held_out = held_out_rows(n, 0.25, 0)
    rotation = module_rotation(0, "layer", k)
    _, narrow = measure_module(z.float(), k, rotation, held_out, tier="fp16")
    _, wide = measure_module(z.float(), k, rotation, held_out, tier="fp16", tier_k=24)
    for code in ("eogp", "eogp-rot"):
        torch.testing.assert_close(wide[code], narrow[code], rtol=0, atol=1e-9)
    assert not torch.allclose(wide["tier"], narrow["tier"])  # the tier scores all 24 coordinates


# -- a real fit ---------------------------------------------------------------------------------
EXAMPLES = make_examples(96, seed=5)
K = 8
SETTINGS = dict(
    projection=ProjectionConfig(variant="auto", k=K, m=48, num_fit_examples=64, held_out_fraction=0.25),
    curvature=CurvatureConfig(num_examples=32, batch_size=16),
    gradients=GradientConfig(batch_size=16),
    progress=False,
)
QUERY = list(EXAMPLES[0].input_ids)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A fit, the per-module scores it left in fit/pca/, and the index written from it (the index's
    creation resumes the fit from its folder) with 40 rows."""
    path = tmp_path_factory.mktemp("recall") / "index"
    fit = fit_projection(make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, path, **SETTINGS)
    scores = [fit.folder.read_scores(i) for i in range(len(fit.projection.modules))]
    index = AttributionIndex.create(path, make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, model_name="tiny", **SETTINGS)
    index.add_batch(EXAMPLES[:40])
    return fit, scores, path


def test_the_fit_sums_the_stored_codes_scores_over_modules(fitted):
    fit, scores, _ = fitted
    recall = fit.recall
    assert recall is not None and recall.tier == "int8" and recall.curve.held_out == 16 and recall.curve.t == 1
    tier = sum(s["tier"] for s in scores)
    one_bit = sum(s["one_bit"] for s in scores)
    expected = _reference_recall(tier.numpy(), one_bit.numpy(), 1, recall.curve.factors)
    np.testing.assert_allclose(recall.curve.recall, expected.mean(axis=0), rtol=0, atol=1e-12)
    gaps = _reference_gap(tier.numpy(), one_bit.numpy(), 1, recall.curve.factors)
    np.testing.assert_allclose(recall.curve.gap, gaps.mean(axis=0), rtol=0, atol=1e-12)
    assert recall.curve.factors == (1, 2, 3, 5, 10)  # 20 x 1 is not below the 15 candidates
    assert all(a <= b for a, b in zip(recall.curve.recall, recall.curve.recall[1:]))
    assert recall.factor == default_factor(recall.curve)[0]
    for name, module in fit.projection.modules.items():
        choice = fit.projection.choices[name]
        assert choice.code == choice.recall.code  # auto follows the recall
        assert (module.rotation is not None) == (choice.code == "eogp-rot")
    assert recall.codes["eogp-rot"] == sum(c.code == "eogp-rot" for c in fit.projection.choices.values())
    printed = format_choices(fit.projection, 1.0, recall)  # the fit's own summary
    assert f"default factor {recall.factor}" in printed and printed.count("recall of the tier's top-1") == 8


def test_the_manifest_records_the_measurement_and_info_prints_it(fitted):
    from eogp_index.cli import cli

    fit, _, path = fitted
    manifest = json.loads((path / "manifest.json").read_text())
    fidelity = manifest["projection"]["fidelity"]
    record = fidelity["recall"]
    assert record["factor"] == fit.recall.factor and record["t"] == 1 and record["held_out"] == 16
    assert record["recall"] == list(fit.recall.curve.recall) and record["target"] == recall_module.RECALL_TARGET
    assert record["gap"] == list(fit.recall.curve.gap) and record["criterion"] == "ndcg_gap"
    assert record["gap_target"] == recall_module.RESCORE_GAP_TARGET
    rotated = manifest["projection"]["rotation"]["modules"]
    for name, entry in fidelity["modules"].items():
        assert set(entry["recall"]) == {"eogp", "eogp-rot", "diff", "diff_se"}
        assert entry["code"] == ("eogp-rot" if entry["recall"]["diff"] > entry["recall"]["diff_se"] else "eogp")
        assert (name in rotated) == (entry["code"] == "eogp-rot")
    text = CliRunner().invoke(cli, ["info", str(path)])
    assert text.exit_code == 0, text.output
    assert f"default factor {record['factor']}" in text.output and "recall of the int8 tier's top-1" in text.output
    as_json = json.loads(CliRunner().invoke(cli, ["info", str(path), "--json"]).stdout)
    assert as_json["projection"]["fidelity"]["recall"] == record


def _with_factor(src, dst, factor):
    """A copy of the index whose manifest records ``factor`` (None: no record at all)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    if factor is None:
        del manifest["projection"]["fidelity"]["recall"]
    else:
        manifest["projection"]["fidelity"]["recall"]["factor"] = factor
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return AttributionIndex.open(dst, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())


def test_a_query_without_rescore_uses_the_recorded_factor(fitted, tmp_path):
    _, _, path = fitted
    narrow = _with_factor(path, tmp_path / "one", 1)
    wide = _with_factor(path, tmp_path / "eight", 8)
    unmeasured = _with_factor(path, tmp_path / "none", None)
    assert [rescore_factor(Question(), i.stored) for i in (narrow, wide, unmeasured)] == [1, 8, UNMEASURED_RESCORE]
    assert (
        rescore_factor(Question(rescore=3), narrow.stored) == 3
        and rescore_factor(Question(rescore=0), wide.stored) == 0
    )
    # what eogp info says a query reads follows the same factor
    assert [i.stored.info()["bytes"]["rescore"] for i in (narrow, wide, unmeasured)] == [1, 8, UNMEASURED_RESCORE]
    y = narrow.query_coordinates([QUERY])  # (1, K): every index here projects it alike

    def ids(index, factor=None):
        question = index.search(QUERY).limit(5)
        question = question if factor is None else question.rescore(factor)
        return question.to_list(coordinates=y)[0].column("id").to_pylist()

    by = {f: ids(narrow, f) for f in (1, 5, 8)}
    assert by[1] != by[8]  # 5 rows rescored against all 40: the answers differ, so the test can tell
    assert ids(narrow) == by[1] and ids(wide) == by[8] and ids(unmeasured) == by[UNMEASURED_RESCORE]
    assert ids(narrow, 8) == by[8]  # an explicit factor wins over the recorded one


def test_a_manifest_written_before_the_gap_still_opens_and_prints(fitted, tmp_path):
    """A manifest whose recall records carry no gap (the factor chosen by recall 0.98): it
    validates, queries use its factor, and `eogp info` says how that factor was chosen."""
    from eogp_index.cli import cli

    _, _, path = fitted
    copy = tmp_path / "old"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    fidelity = manifest["projection"]["fidelity"]
    new_only = ("gap", "gap_se", "criterion", "gap_target", "recall_factor")
    fidelity["recall"] = {k: v for k, v in fidelity["recall"].items() if k not in new_only}
    fidelity["recall"].update(factor=3, reached=True)
    for entry in fidelity["modules"].values():
        for code in ("eogp", "eogp-rot"):
            entry["recall"][code] = {k: v for k, v in entry["recall"][code].items() if k not in new_only}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    index = AttributionIndex.open(copy, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    assert index.stored.manifest.rescore_factor == 3
    out = CliRunner().invoke(cli, ["info", str(copy)])
    assert out.exit_code == 0, out.output
    assert "default factor 3, the smallest within recall 0.98" in out.output
