"""LoRA adapters as peft saves them: loaded onto their base, their LoRA matrices attributed, the
adapter part of the model's identity; full-width scores equal kronfluence's on the same model."""

import gzip
import itertools
import json

import pytest
import torch
from click.testing import CliRunner
from tinymodels import (
    ROOT,
    TinyTokenizer,
    full_width_index,
    make_examples,
    make_tiny_llama,
    make_word_tokenizer,
    relative_error_to_kronfluence,
)

from eogp_index.cli import cli
from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.gradients.coverage import model_coverage
from eogp_index.gradients.model import find_attributed_modules, load_model, replace_conv1d

pytest.importorskip("peft")
__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

SHIPPED = ROOT / "examples" / "default" / "model"


def save_lora(base, out, targets, *, seed, tokenizer=None):
    """A LoRA adapter on the model saved at ``base``, with a non-zero ``B`` as after training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn_like(parameter))
    peft_model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _through_the_cli(index, model_args, shard, text):
    """fit, ingest, query and explain an adapter via the CLI; returns the manifest and the hits."""
    fit = _run(
        "fit",
        *model_args,
        "--data",
        shard,
        "--out",
        index,
        "-k",
        "8",
        "--curvature-examples",
        "16",
        "--pca-examples",
        "16",
        "--max-tokens",
        "24",
        "--rescore",
        "none",  # the hits are compared with the one-bit scan's
        "--json",
    )
    assert fit.exit_code == 0, fit.output
    ingest = _run("ingest", index, shard, "--id-field", "id", "--store-text", "--json")
    assert ingest.exit_code == 0, ingest.output
    assert json.loads(ingest.stdout)["stored"] == 20
    query = _run("query", index, "--text", text, "-k", "3", "--json")
    assert query.exit_code == 0, query.output
    hits = json.loads(query.stdout)[0]["results"]
    assert len(hits) == 6
    explained = _run("explain", index, "--text", text, "--id", hits[0]["id"], "--json")
    assert explained.exit_code == 0, explained.output
    (e,) = json.loads(explained.stdout)
    assert e["id"] == hits[0]["id"] and abs(e["score"] - hits[0]["score"]) <= 1e-4 * abs(hits[0]["score"])
    return json.loads((index / "manifest.json").read_text()), hits, fit.stderr


def test_an_adapter_on_the_shipped_model_goes_through_fit_ingest_query_and_explain(tmp_path):
    adapter = save_lora(SHIPPED, tmp_path / "adapter", ["c_attn", "c_fc"], seed=1)  # no tokenizer of its own
    shard = tmp_path / "shard.jsonl"
    with gzip.open(SHIPPED.parent / "corpus" / "train.jsonl.gz", "rt") as lines:
        shard.write_text("".join(itertools.islice(lines, 20)))
    manifest, _, fit_log = _through_the_cli(tmp_path / "idx", [adapter], shard, "Return the sum of a and b.")
    names = [m["name"] for m in manifest["modules"]]
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert manifest["model"]["name"] == str(SHIPPED.resolve())
    assert manifest["model"]["adapter"]["path"] == str(adapter.resolve())
    assert manifest["model"]["tokenizer"] == str(SHIPPED.resolve())  # the adapter has none: the base's
    # r (d_in + d_out) per adapted layer: c_attn 128 -> 384, c_fc 128 -> 512, in both blocks
    lora = {"attention": 2 * 2 * (128 + 384), "mlp": 2 * 2 * (128 + 512)}
    assert f"coverage      {sum(lora.values()):,} of the LoRA adapter's parameters attributed (100.0%" in fit_log
    plan = _run("plan", adapter, "-k", "8", "--json")
    assert plan.exit_code == 0, plan.output
    coverage = json.loads(plan.stdout)["model"]["coverage"]
    assert coverage["scope"] == "adapter" and coverage["left_out"] == []
    assert {k: (v["attributed"], v["total"]) for k, v in coverage["by_kind"].items()} == {
        kind: (n, n) for kind, n in lora.items()
    }

    verified = _run("verify", tmp_path / "idx", "--json")  # every byte of base and adapter
    assert verified.exit_code == 0 and json.loads(verified.stdout)["ok"], verified.output

    save_lora(SHIPPED, adapter, ["c_attn", "c_fc"], seed=2)  # the adapter is retrained in place
    refused = _run("query", tmp_path / "idx", "--text", "Return the sum.", "-k", "3")
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "the adapter changed since the index was built" in refused.output
    assert not json.loads(_run("verify", tmp_path / "idx", "--json").stdout)["ok"]


def test_an_adapter_on_a_named_tiny_llama_uses_its_own_tokenizer(tmp_path):
    base = tmp_path / "base"
    make_tiny_llama().save_pretrained(base)  # no tokenizer: the adapter carries it
    adapter = save_lora(
        base, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=3, tokenizer=make_word_tokenizer()
    )
    shard = tmp_path / "shard.jsonl"
    shard.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "text": " ".join(f"t{(i * 5 + j) % 63 + 1}" for j in range(5 + i % 7))}) + "\n"
            for i in range(20)
        )
    )
    manifest, hits, _ = _through_the_cli(tmp_path / "idx", [base, "--adapter", adapter], shard, "t1 t2 t3 t4")
    assert [m["name"].rsplit(".", 3)[-3:-1] for m in manifest["modules"][:2]] == [
        ["q_proj", "lora_A"],
        ["q_proj", "lora_B"],
    ]
    assert len(manifest["modules"]) == 2 * 3 * 2
    assert manifest["model"]["adapter"]["path"] == str(adapter.resolve())
    assert all(h["text"].startswith("t") for h in hits)


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    make_tiny_llama().save_pretrained(root / "base")
    make_word_tokenizer().save_pretrained(root / "base")
    return root / "base", save_lora(root / "base", root / "adapter", ["q_proj", "o_proj", "up_proj"], seed=4)


def test_full_width_adapter_scores_equal_kronfluence_on_the_same_peft_model(tmp_path, llama_adapter):
    """m_u = k_u = d_u on the LoRA matrices alone: EK-FAC influence of the adapter's parameters."""
    train = make_examples(16, seed=1)
    queries = make_examples(3, seed=2, prefix="q", masked_prompt=True)
    model, _ = load_model(str(llama_adapter[1]))
    index = full_width_index(
        tmp_path / "idx",
        model,
        train,
        model_name=str(llama_adapter[0]),
        adapter=str(llama_adapter[1]),
        gradients=GradientConfig(batch_size=5),
    )
    assert all(".lora_" in name for name in index.manifest.module_names)
    rel = relative_error_to_kronfluence(index, queries, train)
    assert rel <= 1e-4, rel


def test_module_names_base_layers_of_an_adapted_model_and_the_default_is_the_adapter(llama_adapter):
    model, _ = load_model(str(llama_adapter[0]), adapter=str(llama_adapter[1]))
    replace_conv1d(model)
    assert find_attributed_modules(model, ["*.q_proj"]) == [
        f"model.layers.{i}.self_attn.q_proj.base_layer" for i in range(2)
    ]
    assert find_attributed_modules(model)[:2] == [
        "model.layers.0.self_attn.q_proj.lora_A.default",
        "model.layers.0.self_attn.q_proj.lora_B.default",
    ]
    adapter = model_coverage(model, find_attributed_modules(model))
    assert adapter.scope == "adapter" and adapter.share == 1.0
    assert adapter.frozen_base == sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    base = model_coverage(model, find_attributed_modules(model, ["*.q_proj"]))  # the whole model's share
    assert base.scope == "model" and base.by_kind["attention"][0] == 2 * 16 * 16


def test_an_adapter_the_index_cannot_reload_is_refused(tmp_path, llama_adapter):
    base, adapter = llama_adapter
    model, _ = load_model(str(adapter))
    with pytest.raises(ConfigError, match="no adapter directory was given"):
        AttributionIndex.create(tmp_path / "idx", model, TinyTokenizer(), make_examples(4), model_name=str(base))
    with pytest.raises(ConfigError, match="itself an adapter"):
        load_model(str(adapter), adapter=str(adapter))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ConfigError, match="LoRA adapters only"):
        load_model(str(tmp_path / "other"))


def test_the_base_alone_is_refused_by_an_adapter_index(fitted_index_template):
    from eogp_index.store.manifest import Manifest, check_compatible

    manifest = Manifest.load(fitted_index_template)
    entry = dict(manifest.model, adapter={"path": "/x/adapter", "fingerprint": "sample1:" + "0" * 64})
    adapted = Manifest(**{**manifest.__dict__, "model": entry})
    with pytest.raises(IncompatibleIndexError, match="has no LoRA adapter"):
        check_compatible(adapted, model_fingerprint=manifest.model["weights_fingerprint"], adapter_fingerprint=None)
