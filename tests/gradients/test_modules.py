"""Attributed-module discovery and the Conv1D → Linear swap."""

import pytest
import torch
from tinymodels import make_tiny_gpt2, make_tiny_llama

from eogp_index.errors import ModelError
from eogp_index.gradients.model import find_attributed_modules, module_shape, replace_conv1d


def test_conv1d_swap_keeps_outputs_identical():
    model = make_tiny_gpt2()
    ids = torch.randint(1, 64, (3, 11))
    before = model(input_ids=ids).logits
    assert replace_conv1d(model) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in 2 blocks
    after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_gpt2_default_modules_are_attention_and_mlp_only():
    model = make_tiny_gpt2()
    replace_conv1d(model)
    names = find_attributed_modules(model)
    assert names == [
        f"transformer.h.{i}.{leaf}"
        for i in range(2)
        for leaf in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert module_shape(model, "transformer.h.0.attn.c_attn") == (48, 17)  # bias adds an input column


def test_llama_default_modules():
    names = find_attributed_modules(make_tiny_llama())
    leaves = [n.rsplit(".", 1)[-1] for n in names]
    assert leaves == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2
    assert not any("lm_head" in n or "embed" in n or "norm" in n for n in names)


def test_explicit_patterns_and_clear_error():
    model = make_tiny_llama()
    assert find_attributed_modules(model, ["*.mlp.down_proj"]) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    ]
    with pytest.raises(ModelError, match="no nn.Linear module matches"):
        find_attributed_modules(model, ["model.layers.9.nothing"])


def test_conv1d_swap_shares_the_weights_and_keeps_the_fingerprints():
    from eogp_index.gradients.model import model_fingerprint, model_sha256

    model = make_tiny_gpt2()
    before = (model_fingerprint(model), model_sha256(model))
    storage = model.transformer.h[1].mlp.c_proj.weight.data_ptr()
    replace_conv1d(model)
    assert model.transformer.h[1].mlp.c_proj.weight.data_ptr() == storage  # a transposed view, not a copy
    assert (model_fingerprint(model), model_sha256(model)) == before


def test_shared_weights_copy_is_new_modules_over_the_same_storage():
    from transformers.pytorch_utils import Conv1D

    from eogp_index.gradients.model import freeze, shared_weights_copy

    model = make_tiny_gpt2().train()
    ids = torch.randint(1, 64, (2, 9))
    expected = model.eval()(input_ids=ids).logits
    model.train()
    copy = shared_weights_copy(model)
    assert replace_conv1d(copy) == 8
    freeze(copy).eval()
    handle = copy.transformer.h[0].register_forward_hook(lambda *args: None)
    # The original: its Conv1D layers, mode, requires_grad and hooks as they were.
    assert isinstance(model.transformer.h[0].attn.c_attn, Conv1D) and model.training
    assert all(p.requires_grad for p in model.parameters())
    assert not model.transformer.h[0]._forward_hooks
    # The copy: the same storage, tied weights still tied, the same function.
    pairs = zip(model.state_dict().values(), copy.state_dict().values())
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)
    assert copy.lm_head.weight is copy.transformer.wte.weight
    assert copy.lm_head.weight is not model.lm_head.weight
    torch.testing.assert_close(copy(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
    handle.remove()
