"""Retraining ground truth of ``eogp eval``: subsets, the retraining cache, LDS, counterfactual."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest
import torch

from eogp_index.errors import ConfigError
from eogp_index.evaluation import tinylm
from eogp_index.evaluation.fidelity import MethodConfig, ModuleShape, ScoreSet
from eogp_index.evaluation.lds import counterfactual, lds_records, retrain_subsets, subset_masks

torch.set_num_threads(1)

RECIPE = tinylm.FinetuneRecipe(epochs=1, batch_size=4, lr=3e-3)
TEXTS = [
    f"Return the {w} of the {v}; raise ValueError when the {v} is empty."
    for w in ("sum", "length", "first item", "maximum", "copy", "sorted keys", "mean", "name")
    for v in ("list", "mapping", "string", "queue")
]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A tiny base GPT-2, its fine-tuned model and tokenizer on disk; token lists of the documents."""
    from transformers import GPT2LMHeadModel

    root = tmp_path_factory.mktemp("tinylds")
    tok = tinylm.train_tokenizer(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(
        tinylm.default_config(len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2, n_inner=32)
    ).eval()
    docs = tinylm.tokenize_documents(TEXTS, tok, max_tokens=32)
    train, queries = docs[:24], docs[24:]
    model = tinylm.finetune(base, train, RECIPE)
    for name, m in (("base", base), ("model", model)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    for name, texts in (("train", TEXTS[:24]), ("queries", TEXTS[24:])):
        with open(root / f"{name}.jsonl", "w") as fh:
            for i, t in enumerate(texts):
                fh.write(json.dumps({"id": f"{name}-{i}", "text": t}) + "\n")
    return root, train, queries


class CountingFinetune:
    def __init__(self):
        self.calls = 0

    def __call__(self, base, docs, recipe):
        self.calls += 1
        return tinylm.finetune(base, docs, recipe)


def test_subset_masks_are_seeded_halves_independent_of_their_number():
    masks = subset_masks(10, 5, seed=3)
    assert masks.shape == (5, 10) and masks.dtype == bool and np.all(masks.sum(axis=1) == 5)
    np.testing.assert_array_equal(subset_masks(10, 3, seed=3), masks[:3])
    np.testing.assert_array_equal(subset_masks(10, 2, seed=3, start=3), masks[3:])
    assert not np.array_equal(subset_masks(10, 5, seed=4), masks)
    with pytest.raises(ConfigError):
        subset_masks(10, 2, fraction=1.0)


def test_retraining_is_cached_and_extended(tiny_lm, tmp_path):
    root, train, queries = tiny_lm
    cache = tmp_path / "retraining.npz"
    counter = CountingFinetune()
    first = retrain_subsets(root / "base", train, queries, recipe=RECIPE, num_subsets=4, cache=cache, train_fn=counter)
    assert counter.calls == 4 and first.num_trained == 4
    assert first.masks.shape == (4, len(train)) and first.losses.shape == (4, len(queries))
    assert np.all(np.isfinite(first.losses)) and np.all(first.losses > 0)
    mtime = cache.stat().st_mtime_ns
    again = retrain_subsets(root / "base", train, queries, recipe=RECIPE, num_subsets=4, cache=cache, train_fn=counter)
    assert counter.calls == 4 and again.num_trained == 0 and cache.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.losses, first.losses)
    more = retrain_subsets(root / "base", train, queries, recipe=RECIPE, num_subsets=5, cache=cache, train_fn=counter)
    assert counter.calls == 5 and more.num_trained == 1
    np.testing.assert_array_equal(more.losses[:4], first.losses)
    # Another recipe is another experiment: nothing is reused.
    other = retrain_subsets(
        root / "base",
        train,
        queries,
        recipe=dataclasses.replace(RECIPE, lr=1e-3),
        num_subsets=2,
        cache=cache,
        train_fn=counter,
    )
    assert other.num_trained == 2 and counter.calls == 7


def _scoreset(scores: dict, reference: np.ndarray) -> ScoreSet:
    n_q, n = reference.shape
    configs = [MethodConfig(name, 64, k=(8,)) for name in scores]
    return ScoreSet(
        train_ids=tuple(map(str, range(n))),
        query_ids=tuple(map(str, range(n_q))),
        modules=(ModuleShape("m", 4, 4),),
        configs=configs,
        skipped=[],
        reference=reference,
        references={"tracin": -reference},
        scores={c.id: scores[c.method][None] for c in configs},
        unquantized={},
    )


def test_lds_records_hand_checked():
    """Scores whose subset sums predict the losses exactly have LDS 1; their negation -1."""
    rng = np.random.default_rng(0)
    masks = subset_masks(40, 12, seed=1)
    truth = rng.normal(size=(3, 40))
    losses = -(masks.astype(float) @ truth.T)  # what the removal convention predicts
    from eogp_index.evaluation.lds import Retraining

    retraining = Retraining(masks=masks, losses=losses, num_trained=0, seconds=0.0, seconds_per_subset=0.0, key="")
    scoreset = _scoreset({"eogp": truth, "grass": -truth}, truth)
    records, details = lds_records(scoreset, retraining, n_bootstrap=50)
    by = {r["method"]: r for r in records}
    assert by["EOGP"]["value"] == pytest.approx(1.0) and by["GraSS"]["value"] == pytest.approx(-1.0)
    assert by["EOGP"]["ci_low"] == pytest.approx(1.0)
    assert details["reference_lines"]["EK-FAC (uncompressed)"] == pytest.approx(1.0)
    assert details["reference_lines"]["TracIn (uncompressed)"] == pytest.approx(-1.0)


def test_counterfactual_removes_top_ranked_and_caches(tiny_lm, tmp_path):
    root, train, queries = tiny_lm
    scores = np.zeros((2, len(train)))
    scores[:, 5] = 1.0
    counter = CountingFinetune()
    cache = tmp_path / "cf.json"
    result = counterfactual(
        root / "base",
        train,
        queries,
        {"top": scores},
        removals=(1, 2),
        seeds=(0,),
        num_queries=2,
        recipe=RECIPE,
        cache=cache,
        train_fn=counter,
    )
    # no-removal + "top" at N=1,2 + random at N=1,2
    assert counter.calls == 5 and result.num_trained == 5
    assert set(result.delta_ppl) == {"top", "Random"} and set(result.delta_ppl["top"]) == {1, 2}
    assert all(np.isfinite(v) for d in result.delta_ppl.values() for v in d.values())
    again = counterfactual(
        root / "base",
        train,
        queries,
        {"top": scores},
        removals=(1, 2),
        seeds=(0,),
        num_queries=2,
        recipe=RECIPE,
        cache=cache,
        train_fn=counter,
    )
    assert counter.calls == 5 and again.delta_ppl == result.delta_ppl


def _is_png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and min(struct.unpack(">II", data[16:24])) > 100


def test_run_lds_end_to_end_then_from_caches(tiny_lm, tmp_path):
    from eogp_index.evaluation.run import DataConfig, FidelityConfig, LDSConfig, run_all

    root, train, queries = tiny_lm
    data = DataConfig(
        model=str(root / "model"),
        train=(str(root / "train.jsonl"),),
        queries=(str(root / "queries.jsonl"),),
        max_tokens=32,
    )
    cfg = FidelityConfig(budgets=(16, 64), methods=("eogp", "eogp-fp16", "logra-pca", "gaussian"), gaussian_seeds=2)
    lds_cfg = LDSConfig(
        base=str(root / "base"),
        num_subsets=4,
        recipe=RECIPE,
        n_bootstrap=20,
        cf_budget=16,
        cf_methods=("eogp", "logra-pca"),
        cf_removals=(2,),
        cf_seeds=(0,),
        cf_queries=3,
    )
    out = tmp_path / "eval"
    result = run_all(data, cfg, lds_cfg, out)
    lds = [r for r in result.records if r["metric"] == "lds"]
    assert {r["method"] for r in lds} >= {"EOGP", "EOGP (FP16)", "LoGra (PCA)", "Gaussian"}
    assert all(np.isfinite(r["value"]) for r in lds)
    assert set(result.details["lds"]["reference_lines"]) == {
        "EK-FAC (uncompressed)",
        "K-FAC (uncompressed)",
        "TracIn (uncompressed)",
    }
    cf = result.details["lds"]["counterfactual"]
    assert set(cf["delta_ppl"]) == {"EOGP @ 16 B", "LoGra (PCA) @ 16 B", "EK-FAC (uncompressed)", "Random"}
    assert result.details["lds"]["timings_s"]["subsets_trained_now"] == 4
    for name in ("lds.png", "ndcg_at_20.png", "counterfactual.png"):
        assert _is_png(out / name), name
    md = (out / "results.md").read_text()
    assert "## LDS references" in md and "## Counterfactual removal" in md
    assert json.loads((out / "results.json").read_text())["reference_lines"]["lds"]
    # Everything is cached: no retraining, no rescoring.
    again = run_all(data, cfg, lds_cfg, out)
    assert again.details["scores_reused"] is True
    assert again.details["lds"]["timings_s"]["subsets_trained_now"] == 0
    assert again.details["lds"]["timings_s"]["counterfactual_runs_trained_now"] == 0
    assert [r["value"] for r in again.records] == [r["value"] for r in result.records]
