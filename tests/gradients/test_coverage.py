"""Coverage and mixtures of experts: the attributed share of a model by kind, checked against a
hand count on tiny random MoE configs, what is left out and why, the fit's warning when the
blocks are mostly left out; shared experts given per-example inputs and fused experts rebuilt
(--experts dense), both checked against autograd's per-example gradients and kronfluence."""

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
# block of E fused experts (gate_up_proj (E, 2FF, H), down_proj (E, H, FF)) with a router (E, H).
L, H, FF, E, V = 2, 16, 8, 4, 64
OLMOE = {
    "model_type": "olmoe",
    "vocab_size": V,
    "hidden_size": H,
    "intermediate_size": FF,
    "num_hidden_layers": L,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_experts": E,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
HAND_COUNT = {
    "attention": (L * 4 * H * H, L * 4 * H * H),
    "experts": (0, L * E * (2 * FF * H + H * FF)),
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
    blocks = L * (4 * H * H + E * (3 * FF * H) + E * H + 4 * H)
    assert coverage["blocks"] == {"attributed": L * 4 * H * H, "total": blocks}
    assert coverage["total"] == json.loads(result.stdout)["model"]["num_parameters"]
    left_out = {(e["kind"], e["parameters"]): e for e in coverage["left_out"]}
    assert left_out[("experts", L * E * 3 * FF * H)]["modules"] == ["model.layers.*.mlp.experts"]
    assert "fused expert tensors" in left_out[("experts", L * E * 3 * FF * H)]["reason"]
    assert left_out[("router", L * E * H)]["modules"] == ["model.layers.*.mlp.gate"]

    text = _run("plan", tmp_path / "config.json", "-k", "8").output
    attention = L * 4 * H * H
    total = sum(t for _, t in HAND_COUNT.values())
    assert (
        f"coverage      {attention:,} of the model's parameters attributed ({100 * attention / total:.1f}% of "
        f"{total:,}); in the blocks {100 * attention / blocks:.1f}% of {blocks:,}"
    ) in text
    assert f"  experts      {0:>14,} of {L * E * 3 * FF * H:>14,} (0.0%)" in text
    assert (
        f"  left out: experts, {L * E * 3 * FF * H:,} parameters (model.layers.*.mlp.experts): fused expert tensors"
    ) in text


def _qwen_moe(seed=0):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=V,
            hidden_size=H,
            intermediate_size=FF,
            moe_intermediate_size=FF,
            shared_expert_intermediate_size=12,
            num_hidden_layers=L,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_experts=E,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    ).eval()


def _per_example_autograd(model, examples, parameter):
    """``parameter``'s gradient of each example's loss alone, ``(n, *shape)``: the reference."""
    from eogp_index.gradients.loss import per_example_loss

    grads = []
    for example in examples:
        one = collate([(example.input_ids, example.labels)], 0)
        model.zero_grad()
        per_example_loss(
            model(input_ids=one["input_ids"], attention_mask=one["attention_mask"]).logits, one["labels"]
        ).sum().backward()
        grads.append(parameter.grad.detach().clone())
    return torch.stack(grads)


def test_shared_experts_get_per_example_inputs_and_the_router_is_left_out():
    """Qwen-MoE calls its shared expert on the flattened (B·T, H) tokens: given (B, T, H) it is
    attributed by default, with autograd's per-example gradients; a layer still fed flattened
    tokens is refused by the capture."""
    import copy

    from eogp_index.gradients.coverage import model_coverage
    from eogp_index.gradients.experts import make_experts_trackable
    from eogp_index.gradients.model import find_attributed_modules

    model = _qwen_moe()
    reference = copy.deepcopy(model)
    assert not any(".mlp." in n for n in find_attributed_modules(model))  # as loaded: flattened inputs
    make_experts_trackable(model)
    names = find_attributed_modules(model)
    shared = [
        f"model.layers.{layer}.mlp.shared_expert.{proj}"
        for layer in range(L)
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    assert [n for n in names if ".mlp." in n] == shared
    coverage = model_coverage(model, names)
    assert coverage.by_kind["experts"] == (L * 3 * 12 * H, L * 3 * 12 * H + L * E * 3 * FF * H)
    (router,) = [e for e in coverage.left_out if e.kind == "router" and "model.layers.*.mlp.gate" in e.modules]
    assert "sparse MoE block" in router.reason and "model.layers.*.mlp.shared_expert_gate" in router.modules

    examples = make_examples(3, seed=5)
    batch = collate([(e.input_ids, e.labels) for e in examples], 0)
    captured, _ = GradientCapture(model, shared, dense_gradient).run(batch)
    for name in shared:
        want = _per_example_autograd(reference, examples, reference.get_submodule(name).weight)
        torch.testing.assert_close(captured[name], want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    with pytest.raises(ModelError, match="no per-example gradient"):
        GradientCapture(model, ["model.layers.0.mlp.shared_expert_gate"], dense_gradient).run(batch)


def _olmoe(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = dict(OLMOE)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).eval()
    with torch.no_grad():  # experts whose outputs matter: transformers initialises them near zero
        for name, parameter in model.named_parameters():
            if ".experts." in name:
                parameter.normal_(0.0, 0.5)
    return model


def test_plan_with_dense_experts_attributes_every_expert():
    from eogp_index.config import GradientConfig
    from eogp_index.errors import ConfigError

    with pytest.raises(ConfigError, match="--experts"):
        GradientConfig(experts="sparse")
    shape = model_shape_of(OLMOE, experts="dense")
    coverage = shape.coverage
    assert coverage["by_kind"]["experts"] == {"attributed": L * E * 3 * FF * H, "total": L * E * 3 * FF * H}
    assert [m.name for m in shape.modules if ".experts." in m.name][:2] == [
        "model.layers.0.mlp.experts.0.gate_up_proj",
        "model.layers.0.mlp.experts.0.down_proj",
    ]
    assert [(m.d_out, m.d_in) for m in shape.modules if ".experts." in m.name][:2] == [(2 * FF, H), (H, FF)]
    assert not any("fused" in e["reason"] for e in coverage["left_out"])


def model_shape_of(config, **kwargs):
    from transformers import AutoConfig

    from eogp_index.fit.plan import shape_of_config

    fields = dict(config)
    return shape_of_config(AutoConfig.for_model(fields.pop("model_type"), **fields), name="olmoe", **kwargs)


def test_dense_experts_compute_the_fused_function_and_its_per_example_gradients():
    """The rebuilt experts' per-example gradients (one batch, padded) equal autograd's on the
    fused tensors, one example at a time."""
    import copy

    from eogp_index.gradients.experts import make_experts_trackable

    fused = _olmoe()
    dense = copy.deepcopy(fused)
    assert make_experts_trackable(dense, dense=True) == L
    examples = make_examples(3, seed=5)
    batch = collate([(e.input_ids, e.labels) for e in examples], 0)
    with torch.no_grad():
        expected = fused(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = dense(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    names = [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        for layer in range(L)
        for e in range(E)
        for proj in ("gate_up_proj", "down_proj")
    ]
    captured, _ = GradientCapture(dense, names, dense_gradient).run(batch)
    routed = 0
    for layer in range(L):
        experts = fused.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            want = _per_example_autograd(fused, examples, getattr(experts, proj))  # (n, E, out, in)
            for e in range(E):
                have = captured[f"model.layers.{layer}.mlp.experts.{e}.{proj}"]
                routed += int((want[:, e].flatten(1).abs().amax(1) > 0).sum())
                torch.testing.assert_close(have, want[:, e], rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert routed > 0


@pytest.mark.parametrize(
    "make_model, experts, modules, count",
    [
        (lambda: _olmoe(), "dense", ["*.experts.*"], L * E * 2),  # every routed expert, rebuilt
        (lambda: _qwen_moe(), "fused", ["*.shared_expert.*"], L * 3),  # the shared experts, unflattened
    ],
    ids=["olmoe-dense-experts", "qwen-moe-shared-experts"],
)
def test_full_width_expert_scores_equal_kronfluence(tmp_path, make_model, experts, modules, count):
    from tinymodels import full_width_index, relative_error_to_kronfluence

    from eogp_index.config import GradientConfig

    train, queries = make_examples(12, seed=1), make_examples(3, seed=2, prefix="q", masked_prompt=True)
    index = full_width_index(
        tmp_path / "idx",
        make_model(),
        train,
        model_name="moe",
        modules=modules,
        gradients=GradientConfig(batch_size=5, experts=experts),
    )
    assert len(index.manifest.modules) == count
    assert index.manifest.model.get("experts", "fused") == experts
    rel = relative_error_to_kronfluence(index, queries, train)
    assert rel <= 1e-4, rel


def test_fit_reports_coverage_and_warns_below_half_of_the_blocks(tmp_path):
    model = _olmoe()
    model.save_pretrained(tmp_path / "olmoe")
    make_word_tokenizer().save_pretrained(tmp_path / "olmoe")
    shard = tmp_path / "shard.jsonl"
    shard.write_text(
        "".join(json.dumps({"text": " ".join(f"t{(i * 3 + j) % 63 + 1}" for j in range(6))}) + "\n" for i in range(12))
    )
    with pytest.warns(LowCoverageWarning, match="less than 50%.*experts .fused expert tensors"):
        fit = _run(
            "fit",
            tmp_path / "olmoe",
            "--data",
            shard,
            "--out",
            tmp_path / "idx",
            "-k",
            "4",
            "--curvature-examples",
            "8",
            "--pca-examples",
            "8",
            "--max-tokens",
            "12",
        )
    assert fit.exit_code == 0, fit.output
    assert "coverage      2,048 of the model's parameters attributed" in fit.stderr
    assert "left out: experts, 3,072 parameters (model.layers.*.mlp.experts): fused expert tensors" in fit.stderr

    dense = _run(
        "fit",
        tmp_path / "olmoe",
        "--data",
        shard,
        "--out",
        tmp_path / "dense",
        "-k",
        "4",
        "--curvature-examples",
        "8",
        "--pca-examples",
        "8",
        "--max-tokens",
        "12",
        "--experts",
        "dense",
    )
    assert dense.exit_code == 0, dense.output
    assert f"  experts      {L * E * 3 * FF * H:>14,} of {L * E * 3 * FF * H:>14,} (100.0%)" in dense.stderr
    ingest = _run("ingest", tmp_path / "dense", shard, "--json")
    assert ingest.exit_code == 0 and json.loads(ingest.stdout)["stored"] == 12, ingest.output
    query = _run("query", tmp_path / "dense", "--text", "t1 t2 t3", "-k", "2", "--by-module", "--json")
    assert query.exit_code == 0, query.output
    (hit, *_) = json.loads(query.stdout)[0]["results"]
    assert any(".mlp.experts.3.down_proj" in module for module in hit["modules"])


def test_a_fused_layout_that_computes_something_else_is_not_rebuilt():
    from eogp_index.gradients.experts import make_experts_trackable

    class UpFirstExperts(torch.nn.Module):  # the same tensors, combined otherwise: act(up) * gate
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * FF, H))
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, FF))
            self.act_fn = torch.nn.SiLU()

        def forward(self, hidden, index, weights):
            out = torch.zeros_like(hidden)
            for row in range(hidden.shape[0]):
                for slot, e in enumerate(index[row].tolist()):
                    gate, up = (self.gate_up_proj[e] @ hidden[row]).chunk(2)
                    out[row] += weights[row, slot] * (self.down_proj[e] @ (self.act_fn(up) * gate))
            return out

    block = torch.nn.Module()
    block.experts = UpFirstExperts()
    with pytest.raises(ModelError, match="--experts dense cannot rebuild it"):
        make_experts_trackable(block, dense=True)


def test_fit_refuses_a_module_without_per_example_inputs_before_the_curvature_pass(tmp_path):
    _qwen_moe().save_pretrained(tmp_path / "qwen")
    make_word_tokenizer().save_pretrained(tmp_path / "qwen")
    shard = tmp_path / "shard.jsonl"
    shard.write_text("".join(json.dumps({"text": f"t{i + 1} t{i + 2} t{i + 3} t{i + 4}"}) + "\n" for i in range(8)))
    fit = _run(
        "fit",
        tmp_path / "qwen",
        "--data",
        shard,
        "--out",
        tmp_path / "idx",
        "-k",
        "4",
        "--curvature-examples",
        "4",
        "--pca-examples",
        "4",
        "--module",
        "model.layers.*.mlp.*",
    )
    assert fit.exit_code != 0 and "Traceback" not in fit.output
    assert "'model.layers.0.mlp.shared_expert_gate' takes inputs of shape (" in fit.output
    assert not list((tmp_path / "idx").rglob("*.safetensors"))  # kronfluence never ran
