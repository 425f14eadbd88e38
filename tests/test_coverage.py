"""Coverage: the attributed share of a model by kind, checked against a hand count on tiny random
MoE configs, what is left out and why, and the fit's warning when the blocks are mostly left out."""

import json

import pytest
import torch
from click.testing import CliRunner

from tinymodels import make_examples, make_word_tokenizer
from eogp_index.cli import cli
from eogp_index.errors import ModelError
from eogp_index.gradients.capture import GradientCapture, dense_gradient
from eogp_index.gradients.coverage import LowCoverageWarning
from eogp_index.gradients.loss import collate

__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

# OLMoE-shaped: L layers of attention (q, k, v, o; no bias; q_norm and k_norm) and a sparse MoE
# block of E fused experts (gate_up_proj (E, 2I, H), down_proj (E, H, I)) with a router (E, H).
L, H, I, E, V = 2, 16, 8, 4, 64
OLMOE = {"model_type": "olmoe", "vocab_size": V, "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
         "num_attention_heads": 2, "num_key_value_heads": 2, "num_experts": E, "num_experts_per_tok": 2,
         "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
HAND_COUNT = {
    "attention": (L * 4 * H * H, L * 4 * H * H),
    "experts": (0, L * E * (2 * I * H + H * I)),
    "router": (0, L * E * H),
    "embeddings": (0, V * H),
    "head": (0, V * H),
    "norms": (0, L * 4 * H + H),  # input and post-attention norms, q_norm and k_norm; the final norm
}


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_plan_prints_the_hand_counted_coverage_of_an_olmoe_config_and_names_what_is_left_out(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OLMOE))
    result = _run("plan", tmp_path / "config.json", "-k", "8", "--json")
    assert result.exit_code == 0, result.output
    coverage = json.loads(result.stdout)["model"]["coverage"]
    assert {k: (v["attributed"], v["total"]) for k, v in coverage["by_kind"].items()} == HAND_COUNT
    blocks = L * (4 * H * H + E * (3 * I * H) + E * H + 4 * H)
    assert coverage["blocks"] == {"attributed": L * 4 * H * H, "total": blocks}
    assert coverage["total"] == json.loads(result.stdout)["model"]["num_parameters"]
    left_out = {(e["kind"], e["parameters"]): e for e in coverage["left_out"]}
    assert left_out[("experts", L * E * 3 * I * H)]["modules"] == ["model.layers.*.mlp.experts"]
    assert "fused expert tensors" in left_out[("experts", L * E * 3 * I * H)]["reason"]
    assert left_out[("router", L * E * H)]["modules"] == ["model.layers.*.mlp.gate"]

    text = _run("plan", tmp_path / "config.json", "-k", "8").output
    attention = L * 4 * H * H
    total = sum(t for _, t in HAND_COUNT.values())
    assert (f"coverage      {attention:,} of the model's parameters attributed ({100 * attention / total:.1f}% of "
            f"{total:,}); in the blocks {100 * attention / blocks:.1f}% of {blocks:,}") in text
    assert f"  experts      {0:>14,} of {L * E * 3 * I * H:>14,} (0.0%)" in text
    assert (f"  left out: experts, {L * E * 3 * I * H:,} parameters (model.layers.*.mlp.experts): fused expert "
            "tensors") in text


def test_layers_inside_a_sparse_moe_block_are_left_out_by_default_and_refused_by_the_capture():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from eogp_index.gradients.coverage import model_coverage
    from eogp_index.gradients.model import find_attributed_modules

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, moe_intermediate_size=I, shared_expert_intermediate_size=12,
        num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2, num_experts=E, num_experts_per_tok=2,
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    names = find_attributed_modules(model)
    assert names and not any(".mlp." in n for n in names)  # attention only: the shared expert is inside the block
    shared = [e for e in model_coverage(model, names).left_out
              if any("shared_expert.gate_proj" in m for m in e.modules)]
    assert shared and shared[0].parameters == L * 3 * 12 * H and "sparse MoE block" in shared[0].reason
    batch = collate([(e.input_ids, e.labels) for e in make_examples(2, seed=3)], 0)
    with pytest.raises(ModelError, match="no per-example gradient"):
        GradientCapture(model, ["model.layers.0.mlp.shared_expert.gate_proj"], dense_gradient).run(batch)


def test_fit_reports_coverage_and_warns_below_half_of_the_blocks(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(OLMOE)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(tmp_path / "olmoe")
    make_word_tokenizer().save_pretrained(tmp_path / "olmoe")
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(json.dumps({"text": " ".join(f"t{(i * 3 + j) % 63 + 1}" for j in range(6))}) + "\n"
                             for i in range(12)))
    with pytest.warns(LowCoverageWarning, match="less than 50%.*experts .fused expert tensors"):
        fit = _run("fit", tmp_path / "olmoe", "--data", shard, "--out", tmp_path / "idx", "-k", "4",
                   "--curvature-examples", "8", "--pca-examples", "8", "--max-tokens", "12")
    assert fit.exit_code == 0, fit.output
    assert "coverage      2,048 of the model's parameters attributed" in fit.stderr
    assert "left out: experts, 3,072 parameters (model.layers.*.mlp.experts): fused expert tensors" in fit.stderr
