"""Checkpoint ensembles in ``eogp eval lds``: weights, paired LDS differences, and the exactness of
the ensemble's scores against each checkpoint scored alone."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation import metrics, tinylm
from eogp_index.evaluation.ensemble import ENSEMBLE_FILE, checkpoint_names, read_weights
from eogp_index.evaluation.fidelity import ScoreSet
from eogp_index.evaluation.lds import subset_masks

torch.set_num_threads(1)

RECIPE = tinylm.FinetuneRecipe(epochs=1, batch_size=4, lr=3e-3)
TEXTS = [
    f"Return the {w} of the {v}; raise ValueError when the {v} is empty."
    for w in ("sum", "length", "first item", "maximum", "copy", "mean")
    for v in ("list", "mapping", "string", "queue")
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny base GPT-2 and its fine-tuned model on disk (two checkpoints of one run), the
    documents, and a narrower model with the same tokenizer (another architecture)."""
    from transformers import GPT2LMHeadModel

    root = tmp_path_factory.mktemp("ensemble")
    tok = tinylm.train_tokenizer(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    config = dict(n_positions=64, n_layer=1, n_head=2)
    base = GPT2LMHeadModel(tinylm.default_config(len(tok), n_embd=16, n_inner=32, **config)).eval()
    narrow = GPT2LMHeadModel(tinylm.default_config(len(tok), n_embd=8, n_inner=16, **config)).eval()
    docs = tinylm.tokenize_documents(TEXTS, tok, max_tokens=32)
    model = tinylm.finetune(base, docs[:16], RECIPE)
    for name, m in (("base", base), ("model", model), ("narrow", narrow)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    for name, texts in (("train", TEXTS[:16]), ("queries", TEXTS[16:])):
        with open(root / f"{name}.jsonl", "w") as fh:
            for i, t in enumerate(texts):
                fh.write(json.dumps({"id": f"{name}-{i}", "text": t}) + "\n")
    return root


def _configs(root, model="model"):
    from eogp_index.evaluation.run import DataConfig, FidelityConfig, LDSConfig

    data = DataConfig(
        model=str(root / model),
        train=(str(root / "train.jsonl"),),
        queries=(str(root / "queries.jsonl"),),
        max_tokens=32,
    )
    cfg = FidelityConfig(budgets=(16, 64), methods=("eogp", "eogp-rot", "grass"), tier_codes=())
    lds_cfg = LDSConfig(base=str(root / "base"), num_subsets=4, recipe=RECIPE, n_bootstrap=20, counterfactual=False)
    return data, cfg, lds_cfg


# --------------------------------------------------------------------------- weights


def test_read_weights_uniform_list_mapping_and_trainer_state(tmp_path):
    paths = ("run/checkpoint-100", "run/checkpoint-300")
    assert read_weights("uniform", paths) == (0.5, 0.5)
    listed = tmp_path / "w.json"
    listed.write_text("[1, 3]")
    assert read_weights(str(listed), paths) == (1.0, 3.0)
    listed.write_text('{"weights": [0.25, 0.75]}')
    assert read_weights(str(listed), paths) == (0.25, 0.75)
    state = tmp_path / "trainer_state.json"
    history = [{"step": s, "learning_rate": lr, "loss": 1.0} for s, lr in ((50, 4e-4), (100, 3e-4), (250, 1e-4))]
    state.write_text(json.dumps({"global_step": 300, "log_history": history + [{"step": 300, "train_loss": 0.5}]}))
    assert read_weights(str(state), paths) == pytest.approx((0.75, 0.25))  # the rates, summing to 1
    # A checkpoint's own trainer_state.json says its step, whatever its directory is called.
    own = tmp_path / "last"
    own.mkdir()
    (own / "trainer_state.json").write_text(json.dumps({"global_step": 60}))
    assert read_weights(str(state), (paths[0], str(own))) == pytest.approx((3 / 7, 4 / 7))


@pytest.mark.parametrize(
    "text, match",
    [
        ("[1, 2, 3]", "needs 2 weights"),
        ('{"weigths": [1, 2]}', "needs 2 weights"),
        ("[1, NaN]", "finite"),
        ('[1, "2"]', "finite"),
        ("[0, 0]", "all zero"),
        ("[1, ", "not readable JSON"),
        ('{"log_history": [{"step": 500, "learning_rate": 0.1}]}', "no learning_rate at or before step 100"),
    ],
)
def test_read_weights_refuses_what_it_cannot_use(tmp_path, text, match):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(InputError, match=match):
        read_weights(str(path), ("checkpoint-100", "checkpoint-200"))


def test_read_weights_refuses_a_missing_file_and_an_unknown_step(tmp_path):
    with pytest.raises(ConfigError, match="neither 'uniform' nor a file"):
        read_weights(str(tmp_path / "absent.json"), ("a", "b"))
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [{"step": 1, "learning_rate": 0.1}]}))
    with pytest.raises(InputError, match="cannot tell the step of checkpoint final"):
        read_weights(str(state), ("checkpoint-1", "final"))


def test_checkpoint_names_are_directory_names_made_distinct():
    assert checkpoint_names(("examples/default/model", "examples/default/base/")) == ("model", "base")
    assert checkpoint_names(("a/model", "b/model", "c/base")) == ("model-0", "model-1", "base")


# --------------------------------------------------------------------------- paired LDS


def test_lds_difference_is_paired_and_hand_checked():
    rng = np.random.default_rng(0)
    masks = subset_masks(30, 10, seed=2)
    truth = rng.normal(size=(4, 30))
    losses = -(masks.astype(float) @ truth.T)
    same = metrics.lds_difference(truth, truth, masks, losses, n_bootstrap=30)
    assert same.mean == 0.0 and same.ci_low == 0.0 and same.ci_high == 0.0
    flipped = metrics.lds_difference(truth, -truth, masks, losses, n_bootstrap=30)
    assert flipped.mean == pytest.approx(2.0) and flipped.ci_low == pytest.approx(2.0)
    noisy = truth + rng.normal(size=truth.shape)
    diff = metrics.lds_difference(truth, noisy, masks, losses, n_bootstrap=30)
    alone = [metrics.lds(s, masks, losses, n_bootstrap=0).mean for s in (truth, noisy)]
    assert diff.mean == pytest.approx(alone[0] - alone[1]) and diff.mean > 0
    with pytest.raises(InputError):
        metrics.lds_difference(truth, truth[:2], masks, losses)


# --------------------------------------------------------------------------- end to end


def test_ensemble_scores_are_the_weighted_sum_of_each_checkpoint_alone(checkpoints, tmp_path):
    """The CLI's ensemble of model and base, against base scored by a run of its own: the
    ensemble's scores are the weighted sum of the single-checkpoint runs' scores, each
    checkpoint's LDS is the one its own run measures, and only the EOGP methods are ensembled."""
    from eogp_index.cli import cli
    from eogp_index.evaluation.run import run_lds

    root = checkpoints
    data, cfg, lds_cfg = _configs(root)
    weights = tmp_path / "weights.json"
    weights.write_text('{"weights": [0.25, 0.75]}')
    out = tmp_path / "ensemble"
    args = ["eval", "lds", "--model", data.model, "--train", data.train[0], "--queries", data.queries[0]]
    args += ["--max-tokens", "32", "--methods", "eogp,eogp-rot,grass", "--budgets", "16,64", "--base", lds_cfg.base]
    args += ["--subsets", "4", "--bootstrap", "20", "--no-counterfactual", "--epochs", "1", "--lr", "3e-3"]
    args += ["--checkpoints", str(root / "base"), "--checkpoint-weights", str(weights), "--out", str(out), "--json"]
    args += ["--quiet"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)

    alone_out = tmp_path / "base-alone"
    alone_out.mkdir()
    shutil.copy(out / "retraining.npz", alone_out / "retraining.npz")
    recipe = tinylm.FinetuneRecipe(epochs=1, lr=3e-3)  # the command line's: reuses its retraining
    alone = run_lds(replace(data, model=str(root / "base")), cfg, replace(lds_cfg, recipe=recipe), alone_out)
    assert alone.details["lds"]["timings_s"]["subsets_trained_now"] == 0

    model_scores = ScoreSet.load(out / "scores.npz")
    base_scores = ScoreSet.load(alone_out / "scores.npz")
    summed = np.load(out / ENSEMBLE_FILE)
    ensembled = {c.id for c in model_scores.configs if c.method in ("eogp", "eogp-rot")}
    assert set(summed.files) == ensembled | {"reference", "meta"}
    for key in ensembled:
        expected = 0.25 * model_scores.scores[key].astype(np.float64) + 0.75 * base_scores.scores[key]
        np.testing.assert_allclose(summed[key], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
        assert not np.allclose(summed[key], model_scores.scores[key], rtol=1e-2)
    expected = 0.25 * model_scores.reference + 0.75 * base_scores.reference
    np.testing.assert_allclose(summed["reference"][0], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())

    lds = {(r["method"], r["bytes_per_example"]): r["value"] for r in printed["records"] if r["metric"] == "lds"}
    base_alone = {(r["method"], r["bytes_per_example"]): r["value"] for r in alone.records if r["metric"] == "lds"}
    with np.load(out / "retraining.npz") as cached:
        masks, losses = cached["masks"][:4], cached["losses"][:4]
    for budget in (16, 64):
        assert lds[("EOGP @ base", budget)] == pytest.approx(base_alone[("EOGP", budget)], abs=1e-6)
        want = metrics.lds(summed[f"eogp@{budget}"][0], masks, losses, n_bootstrap=0).mean
        assert lds[("EOGP (ensemble of 2)", budget)] == pytest.approx(want, abs=1e-9)
        assert ("GraSS @ base", budget) not in lds and ("GraSS", budget) in lds
    details = printed["details"]["lds"]["ensemble"]
    assert [(c["name"], c["weight"]) for c in details["checkpoints"]] == [("model", 0.25), ("base", 0.75)]
    lines = printed["details"]["lds"]["reference_lines"]
    assert lines["EK-FAC (uncompressed) @ base"] == pytest.approx(
        alone.details["lds"]["reference_lines"]["EK-FAC (uncompressed)"], abs=1e-6
    )
    assert "EK-FAC (uncompressed) (ensemble of 2)" in lines
    md = (out / "results.md").read_text()
    assert "## Checkpoint ensemble" in md and "| EOGP-rot | 64 B |" in md


def test_a_checkpoint_of_another_architecture_is_refused(checkpoints, tmp_path):
    from eogp_index.evaluation.run import EnsembleConfig, run_lds

    data, cfg, lds_cfg = _configs(checkpoints)
    cfg = type(cfg)(budgets=(16,), methods=("eogp",), tier_codes=())
    ensemble = EnsembleConfig(checkpoints=(str(checkpoints / "narrow"),))
    with pytest.raises(ConfigError, match="one architecture"):
        run_lds(data, cfg, lds_cfg, tmp_path / "out", ensemble=ensemble)
