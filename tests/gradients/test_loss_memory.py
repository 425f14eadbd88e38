"""The loss: the numbers of ``F.cross_entropy`` on float32 logits, and the memory ``eogp plan``
counts for it (the logits and their gradient in the model's dtype, float32 chunks of tokens)."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import eogp_index.fit.plan as plan
import eogp_index.gradients.loss as loss
from eogp_index.fit.task import sample_labels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _labels(batch, tokens, vocab, seed):
    labels = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    labels[0, tokens // 2 :] = -100  # padding
    labels[-1, :3] = -100  # a prompt
    return labels


def _reference(logits, labels):
    shifted = logits[:, :-1].float()
    return (
        F.cross_entropy(
            shifted.reshape(-1, shifted.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
        )
        .view(labels[:, 1:].shape)
        .sum(1)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_and_gradient_are_cross_entropy_on_float32_logits(dtype, monkeypatch):
    monkeypatch.setattr(loss, "LOSS_CHUNK_BYTES", 4 * 97 * 5)  # five tokens a chunk: several chunks
    logits = (torch.randn(3, 11, 97, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    labels = _labels(3, 11, 97, seed=1)
    weights = torch.tensor([0.5, -1.0, 2.0])
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (loss.per_example_loss(ours, labels) * weights).sum().backward()
    (_reference(theirs, labels) * weights).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(
        loss.per_example_loss(ours, labels), _reference(theirs, labels), rtol=tolerance, atol=tolerance
    )
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(
        ours.grad.float(), theirs.grad.float(), rtol=tolerance, atol=1e-6 if dtype == torch.float32 else 1e-2
    )
    assert torch.equal(ours.detach(), logits)  # the logits are left as they were
    assert (ours.grad[0, 11 // 2 :] == 0).all()  # positions predicting padding have no gradient


def _peak_bytes(run):
    """The most bytes torch's CPU allocator held for tensors made during ``run()``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocation = torch._C._profiler._EventType.Allocation
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
    first = min(events)
    before = first[2] - first[1]  # the allocator's running total counts tensors made before the profile
    return max(total for _, _, total in events) - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_plan_counts_what_the_loss_holds(dtype, monkeypatch):
    """Forward and backward of the loss hold at most what ``plan.logits_bytes`` counts, and not
    much less: in bf16 no float32 copy of the logits is kept (that would be 3x the bf16 term)."""
    chunk = 64 << 10
    monkeypatch.setattr(loss, "LOSS_CHUNK_BYTES", chunk)
    monkeypatch.setattr(plan, "LOSS_CHUNK_BYTES", chunk)
    batch, tokens, vocab = 4, 64, 8192
    logits = torch.randn(batch, tokens, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    labels = _labels(batch, tokens, vocab, seed=2)
    held = logits.requires_grad_()  # counted by the plan, made before the profile: added below

    def forward_backward():
        loss.per_example_loss(held, labels).sum().backward()

    def sampled():
        with torch.no_grad():
            sample_labels(held, labels, seed=0)

    small = 64 * batch * tokens  # per-token floats and indices
    for run, is_sampled in ((forward_backward, False), (sampled, True)):
        measured = logits.nbytes + _peak_bytes(run)
        planned = plan.logits_bytes(batch * tokens * vocab, logits.element_size(), sampled=is_sampled)
        assert planned / 1.5 <= measured <= planned + small, (is_sampled, measured, planned)
        held.grad = None


def test_the_plan_and_the_loss_upcast_the_same_chunk():
    assert plan.LOSS_CHUNK_BYTES == loss.LOSS_CHUNK_BYTES
