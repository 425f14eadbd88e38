"""The language-modelling loss, shared by curvature fitting, training gradients and queries.

Every gradient in eogp-index is of the token-summed next-token cross-entropy over the positions
whose label is not ``-100`` (Appendix C.1). Labels are aligned with ``input_ids`` as in
HuggingFace: ``labels[t]`` is predicted from tokens ``< t``, so ``labels[:, 0]`` is never used.

A batch is a dict of ``(B, T)`` int64 tensors: ``input_ids``, ``attention_mask`` and ``labels``.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import nn

from eogp_index.data.records import IGNORE_INDEX  # noqa: F401  (one definition, shared)


def collate(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int = 0) -> Dict[str, torch.Tensor]:
    """Right-pad ``(input_ids, labels)`` pairs into a batch; padding has label ``-100``."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        n = len(ids)
        input_ids[row, :n] = torch.as_tensor(ids, dtype=torch.long)
        labels[row, :n] = torch.as_tensor(labs, dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def logits_of(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


#: The most bytes of float32 logits the loss upcasts at once (rows of tokens, at least one).
LOSS_CHUNK_BYTES = 32 << 20


def _chunks(rows: int, vocab: int):
    step = max(1, LOSS_CHUNK_BYTES // (4 * vocab))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class _TokenCrossEntropy(torch.autograd.Function):
    """Cross-entropy of each position's logits against its target, ``(N,)`` float32, computed in
    float32 from logits in the model's dtype, a chunk of tokens at a time.

    ``F.cross_entropy`` on upcast logits would keep a float32 copy of every logit and its float32
    log-softmax for the backward pass, and allocate two more float32 tensors of that size in it;
    here the backward keeps the logits themselves (held by the caller anyway) and one float32
    log-sum-exp per token, and writes the gradient ``softmax - onehot`` straight in the logits'
    dtype. The numbers are those of ``F.cross_entropy(logits.float(), ...)`` up to rounding.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counted = targets != IGNORE_INDEX
        safe = torch.where(counted, targets, torch.zeros_like(targets)).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start, stop in _chunks(*logits.shape):
            lse[start:stop] = torch.logsumexp(logits[start:stop].float(), dim=-1)
        loss = (lse - logits.gather(1, safe).squeeze(1).float()) * counted
        ctx.save_for_backward(logits, safe, counted, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, safe, counted, lse = ctx.saved_tensors
        weight = (grad_loss.float() * counted).unsqueeze(1)
        grad = torch.empty_like(logits)
        for start, stop in _chunks(*logits.shape):
            # softmax in one float32 chunk: the upcast copy is made once and worked on in place
            part = logits[start:stop].to(torch.float32, copy=True).sub_(lse[start:stop, None]).exp_()
            part.scatter_add_(1, safe[start:stop], torch.full_like(part[:, :1], -1.0))
            grad[start:stop] = part.mul_(weight[start:stop])
        return grad, None


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-summed next-token cross-entropy per example, ``(B,)`` float32.

    Args:
        logits: ``(B, T, V)`` in the model's dtype; labels: ``(B, T)``, ``-100`` where not counted.
    """
    # Position t predicts labels[:, t + 1]; the last position predicts nothing. Shifting the
    # labels, not slicing the logits, leaves the logits contiguous: no copy of them is made.
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    vocab = logits.size(-1)
    token_loss = _TokenCrossEntropy.apply(logits.reshape(-1, vocab), targets.reshape(-1))
    return token_loss.view(labels.shape).sum(dim=1)
