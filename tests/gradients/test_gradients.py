"""Per-example gradients: exact against autograd, and independent of batching and padding."""

import torch
from tinymodels import make_examples, make_tiny_gpt2, make_tiny_llama

from eogp_index.gradients.capture import GradientCapture, dense_gradient
from eogp_index.gradients.loss import collate, per_example_loss
from eogp_index.gradients.model import find_attributed_modules, replace_conv1d


def _autograd_gradient(model, name, ids, labels):
    module = model.get_submodule(name)
    model.zero_grad()
    for p in model.parameters():
        p.requires_grad_(True)
    batch = collate([(ids, labels)])
    loss = per_example_loss(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    ).sum()
    loss.backward()
    grad = module.weight.grad
    if module.bias is not None:
        grad = torch.cat([grad, module.bias.grad[:, None]], dim=1)
    return grad.clone()


def test_dense_gradient_equals_autograd_for_gpt2_with_bias():
    model = make_tiny_gpt2().double()
    replace_conv1d(model)
    names = find_attributed_modules(model)
    ex = make_examples(3, seed=4, masked_prompt=True)
    capture = GradientCapture(model, names, dense_gradient)
    got, _ = capture.run({k: v for k, v in collate([(e.input_ids, e.labels) for e in ex]).items()})
    for i, e in enumerate(ex):
        for name in names:
            expected = _autograd_gradient(model, name, e.input_ids, e.labels)
            torch.testing.assert_close(got[name][i].double(), expected, rtol=1e-4, atol=1e-5)


def test_batch_size_and_padding_do_not_change_gradients():
    model = make_tiny_llama()
    names = find_attributed_modules(model)
    ex = make_examples(6, seed=5, min_len=3, max_len=20)
    capture = GradientCapture(model, names, dense_gradient)
    together, losses = capture.run(collate([(e.input_ids, e.labels) for e in ex]))
    for i, e in enumerate(ex):
        alone, loss_alone = capture.run(collate([(e.input_ids, e.labels)]))
        torch.testing.assert_close(losses[i], loss_alone[0], rtol=1e-5, atol=1e-5)
        for name in names:
            torch.testing.assert_close(together[name][i], alone[name][0], rtol=1e-4, atol=1e-5)


def test_model_parameters_stay_frozen_and_ungraded():
    model = make_tiny_gpt2()
    replace_conv1d(model)
    for p in model.parameters():
        p.requires_grad_(False)
    capture = GradientCapture(model, find_attributed_modules(model), dense_gradient)
    capture.run(collate([(e.input_ids, e.labels) for e in make_examples(2)]))
    assert all(p.grad is None for p in model.parameters())
