"""Long documents: gradient checkpointing gives the plain pass's coordinates, capturing once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tinymodels import make_examples, make_tiny_gpt2, make_tiny_llama

from eogp_index.gradients.capture import GradientCapture, dense_gradient
from eogp_index.gradients.loss import collate
from eogp_index.gradients.model import find_attributed_modules, replace_conv1d


@pytest.mark.parametrize("make_model", [make_tiny_gpt2, make_tiny_llama], ids=["gpt2", "llama"])
def test_checkpointed_capture_equals_the_plain_pass_and_captures_once(make_model):
    model = make_model()
    replace_conv1d(model)
    names = find_attributed_modules(model)
    batch = collate([(e.input_ids, e.labels) for e in make_examples(4, seed=3, masked_prompt=True)], 0)
    plain, plain_losses = GradientCapture(model, names, dense_gradient).run(batch)

    transformed, forwards = [], []
    first = model.get_submodule(names[0])
    handle = first.register_forward_hook(lambda *_: forwards.append(1))

    def counting(name, a, g):
        transformed.append(name)
        return dense_gradient(name, a, g)

    try:
        checkpointed, losses = GradientCapture(model, names, counting, checkpoint=True).run(batch)
    finally:
        handle.remove()
    assert len(forwards) == 2  # the block really was recomputed in the backward pass...
    assert sorted(transformed) == sorted(names)  # ...and no module was captured twice
    assert torch.equal(losses, plain_losses)
    for name in names:
        scale = plain[name].abs().max()
        assert float((checkpointed[name] - plain[name]).abs().max() / scale) <= 1e-6, name
    # The blocks' own forward is back: a later plain run recomputes nothing.
    forwards.clear()
    handle = first.register_forward_hook(lambda *_: forwards.append(1))
    try:
        GradientCapture(model, names, dense_gradient).run(batch)
    finally:
        handle.remove()
    assert len(forwards) == 1


def test_index_coordinates_with_checkpointing_equal_the_plain_ones(fitted_index):
    examples = make_examples(6, seed=5)
    plain = fitted_index.project(examples)
    fitted_index.gradients = dataclasses.replace(fitted_index.gradients, gradient_checkpointing=True)
    checkpointed = fitted_index.project(examples)
    rel = np.abs(checkpointed - plain).max() / np.abs(plain).max()
    assert rel <= 1e-6


def test_max_tokens_past_the_models_context_is_refused(tmp_path):
    from tinymodels import TinyTokenizer

    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from eogp_index.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_tokens \(--max-tokens\) is 33, but tiny reads at most 32 tokens"):
        AttributionIndex.create(
            tmp_path / "index",
            make_tiny_gpt2(),
            TinyTokenizer(),
            make_examples(4),
            model_name="tiny",
            gradients=GradientConfig(max_tokens=33),
            progress=False,
        )
    assert not (tmp_path / "index").exists()
