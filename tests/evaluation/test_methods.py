"""The registry of evaluation methods: what the command line offers is what is registered, an
unknown name is refused cleanly, and evaluation errors reach the user as one line."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from transformers import GPT2LMHeadModel

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation import methods as registry
from eogp_index.evaluation import tinylm
from eogp_index.evaluation.cli import eval_group
from eogp_index.evaluation.fidelity import ModuleShape, plan_methods


def _cli_choices() -> list[str]:
    """The names ``eogp eval fidelity --methods`` lists in its help."""
    option = next(p for p in eval_group.commands["fidelity"].params if p.name == "methods")
    listed = re.search(r"from: ([a-z0-9,-]+)\.", option.help)
    assert listed, option.help
    return listed.group(1).split(",")


def test_every_method_the_cli_offers_is_registered_once():
    choices = _cli_choices()
    assert choices == list(registry.METHODS) and len(set(choices)) == len(choices)
    labels = [registry.label(name) for name in choices]
    assert len(set(labels)) == len(labels) and all(label != name for label, name in zip(labels, choices))
    colours = registry.colours()
    assert set(colours) == set(labels) and len(set(colours.values())) == len(labels)  # one line each in a plot
    families = registry.families()
    assert len({f.seed_index for f in families}) == len(families)
    assert {registry.family_of(name).family for name in choices} == {f.family for f in families}
    assert set(registry.DEFAULT_METHODS) < set(choices)
    # Every registered method plans dimensions at some budget (a family without them would be dead).
    modules = (ModuleShape("h.0.mlp.c_fc", 64, 17), ModuleShape("h.0.mlp.c_proj", 16, 65))
    configs, _ = plan_methods(modules, (64, 256, 1024), choices)
    assert {c.method for c in configs} == set(choices)
    assert all(c.spec is registry.family_of(c.method) and c.label == registry.label(c.method) for c in configs)


def test_a_family_cannot_take_a_registered_name():
    before = registry.families()
    with pytest.raises(ConfigError, match="'eogp'.*already registered"):

        class Copy(registry.MethodFamily, family="copy-of-eogp", seed_index=99):
            variants = (registry.Variant("eogp", "Copy", "1bit", order=99, colour="black"),)

    assert registry.families() == before and registry.label("eogp") == "EOGP"


def test_unknown_method_is_refused_with_the_choices_and_no_traceback(tmp_path):
    result = CliRunner().invoke(eval_group, ["fidelity", "--out", str(tmp_path), "--methods", "eogp,bogus"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "unknown method(s) 'bogus'" in message
    assert all(name in message for name in registry.METHODS)
    with pytest.raises(ConfigError, match="bogus"):
        registry.variant("bogus")


def test_tinylm_refuses_foreign_token_ids_with_an_eogp_error():
    model = GPT2LMHeadModel(tinylm.default_config(32, n_positions=16, n_embd=8, n_layer=1, n_head=1, n_inner=16))
    with pytest.raises(InputError, match=r"outside the model's vocabulary \[0, 32\).*--base"):
        tinylm.finetune(model, [[1, 2, 40]], tinylm.FinetuneRecipe(epochs=1))
    with pytest.raises(ConfigError, match="not a model directory"):
        tinylm.finetune("/nonexistent-model-dir", [[1, 2]])


def test_cli_reports_a_tokenizer_without_eos_in_one_line(tmp_path):
    texts = [f"Return the {w} of the list." for w in ("sum", "length", "first item", "maximum", "copy", "mean")]
    tok = tinylm.train_tokenizer(texts, vocab_size=300)
    tok.eos_token = None
    model = GPT2LMHeadModel(tinylm.default_config(len(tok), n_positions=16, n_embd=8, n_layer=1, n_head=1, n_inner=16))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = CliRunner().invoke(
        eval_group,
        [
            "fidelity",
            "--model",
            str(tmp_path / "model"),
            "--train",
            str(docs),
            "--queries",
            str(docs),
            "--out",
            str(tmp_path / "eval"),
            "--quiet",
        ],
    )
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    assert "no eos token" in result.output and "eos_token" in result.output
