"""kronfluence's task for causal LMs: the paper's loss, with labels sampled from the model.

The loss itself (:func:`~eogp_index.gradients.loss.per_example_loss`) is shared with ingest and
queries; this adapter is the only place that speaks kronfluence's ``Task`` interface.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional

import torch
from kronfluence.task import Task
from torch import nn

from eogp_index.gradients.loss import IGNORE_INDEX, logits_of, per_example_loss


def batch_seed(seed: int, batch: Dict[str, torch.Tensor]) -> int:
    """A 63-bit seed from ``seed`` and the batch's token ids and labels (BLAKE2b, stable across runs).

    Deriving the draw from the batch itself, not from a generator carried from batch to batch,
    makes a batch's sampled labels independent of how many batches came before it: a resumed
    or re-split fit samples exactly what an uninterrupted one samples.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(int(seed).to_bytes(8, "little", signed=True))
    for key in ("input_ids", "labels"):
        tensor = batch[key].detach().to("cpu", torch.int64).contiguous()
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def sample_labels(logits: torch.Tensor, labels: torch.Tensor, seed: int) -> torch.Tensor:
    """Labels drawn from the model's next-token distribution where ``labels`` count, ``(B, T)`` int64.

    Args:
        logits: ``(B, T, V)``; labels: ``(B, T)``, ``-100`` where a position does not count.
        seed: the draw's seed (:func:`batch_seed`).

    The generator is made here, on the probabilities' device: ``torch.multinomial`` refuses a
    generator on another device (a CPU generator with CUDA probabilities fails).
    """
    with torch.no_grad():
        probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1)
        generator = torch.Generator(device=probs.device).manual_seed(seed)
        drawn = torch.multinomial(probs.reshape(-1, probs.size(-1)), 1, generator=generator)
        drawn = drawn.view(probs.shape[:-1])
        counted = labels[:, 1:] != IGNORE_INDEX
        sampled = torch.full_like(labels, IGNORE_INDEX)
        sampled[:, 1:] = torch.where(counted, drawn, torch.full_like(drawn, IGNORE_INDEX))
    return sampled


class LanguageModelingTask(Task):
    """kronfluence's task for causal LMs with the paper's loss and label sampling.

    With ``sample=True`` (the true Fisher), labels are drawn from the model's own next-token
    distribution at the positions that count, with inputs fixed to the data. Each batch's draw
    is seeded by ``seed`` and the batch's tokens (:func:`batch_seed`), so kronfluence's
    covariance and Λ passes see the same draw for a batch, as if each example's labels were
    sampled once, and the draw does not depend on the batches before it.
    """

    def __init__(self, modules: Optional[List[str]] = None, seed: int = 0):
        self.modules = modules
        self.seed = seed

    def compute_train_loss(
        self, batch: Dict[str, torch.Tensor], model: nn.Module, sample: bool = False
    ) -> torch.Tensor:
        logits = logits_of(model, batch)
        labels = batch["labels"]
        if sample:
            labels = sample_labels(logits, labels, batch_seed(self.seed, batch))
        return per_example_loss(logits, labels).sum()

    def compute_measurement(self, batch: Dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
        return per_example_loss(logits_of(model, batch), batch["labels"]).sum()

    def get_influence_tracked_modules(self) -> Optional[List[str]]:
        return self.modules

    def get_attention_mask(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["attention_mask"]
