"""Opening an index never changes the model passed in: GPT-2's Conv1D layers are swapped on the
index's own module objects (sharing the weights), so one model object serves several indexes."""

import shutil

import numpy as np
import torch
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2
from transformers.pytorch_utils import Conv1D

from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.gradients.model import model_fingerprint

QUERIES = [{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in make_examples(3, seed=5, prefix="q")]


def _open(path, model):
    return AttributionIndex.open(path, model=model, tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8))


def test_open_leaves_the_model_as_it_was_given(fitted_index_template, tmp_path):
    model = make_tiny_gpt2()
    model.train()  # what open must not touch: the modules' mode, requires_grad, the layers
    kinds = {name: type(m) for name, m in model.named_modules()}
    fingerprint = model_fingerprint(model)
    parameters = {name: p for name, p in model.named_parameters()}
    index = _open(fitted_index_template, model)
    assert {name: type(m) for name, m in model.named_modules()} == kinds
    assert isinstance(model.transformer.h[0].attn.c_attn, Conv1D)
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert dict(model.named_parameters()) == parameters  # the same tensors, none replaced
    assert model_fingerprint(model) == fingerprint
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # The index's own copy: Linear layers over the same storage, frozen, in eval mode.
    linear = index.model.transformer.h[0].attn.c_attn
    assert isinstance(linear, torch.nn.Linear) and not index.model.training
    assert linear.weight.data_ptr() == model.transformer.h[0].attn.c_attn.weight.data_ptr()
    assert not any(p.requires_grad for p in index.model.parameters())
    index.scores(QUERIES)
    assert model_fingerprint(model) == fingerprint


def test_two_indexes_over_one_model_both_open_and_answer(fitted_index_template, tmp_path):
    second = tmp_path / "second"
    shutil.copytree(fitted_index_template, second)
    alone = [_open(path, make_tiny_gpt2()).scores(QUERIES) for path in (fitted_index_template, second)]

    model = make_tiny_gpt2()
    first = _open(fitted_index_template, model)
    again = _open(fitted_index_template, model)  # the same index, reopened over the same model
    other = _open(second, first.model)  # another index over the first one's model
    for index, (ids, scores) in zip((first, again, other), (alone[0], alone[0], alone[1])):
        got_ids, got = index.scores(QUERIES)
        assert got_ids == ids
        np.testing.assert_array_equal(got, scores)


def test_create_leaves_the_model_as_it_was_given(tmp_path):
    from eogp_index.config import CurvatureConfig, ProjectionConfig

    model = make_tiny_gpt2()
    fingerprint = model_fingerprint(model)
    created = AttributionIndex.create(
        tmp_path / "idx",
        model,
        TinyTokenizer(),
        make_examples(12, seed=3),
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=8, m=32, num_fit_examples=12),
        curvature=CurvatureConfig(num_examples=12, batch_size=4),
        dtype="bfloat16",
        progress=False,
    )
    assert isinstance(model.transformer.h[0].mlp.c_fc, Conv1D) and model.dtype == torch.float32
    assert model_fingerprint(model) == fingerprint and all(p.requires_grad for p in model.parameters())
    assert created.model.dtype == torch.bfloat16
    created.ingest(make_examples(12, seed=3), progress=False)
    # The created index's model opens it again, as does the caller's model cast as it was built.
    expected = created.scores(QUERIES)[1]
    np.testing.assert_array_equal(_open(tmp_path / "idx", created.model).scores(QUERIES)[1], expected)
    np.testing.assert_array_equal(_open(tmp_path / "idx", model.to(torch.bfloat16)).scores(QUERIES)[1], expected)
