"""The language-modelling loss, shared by curvature fitting, training gradients and queries.

Every gradient in eogp-index is of the token-summed next-token cross-entropy over the positions
whose label is not ``-100`` (Appendix C.1). Labels are aligned with ``input_ids`` as in
HuggingFace: ``labels[t]`` is predicted from tokens ``< t``, so ``labels[:, 0]`` is never used.

A batch is a dict of ``(B, T)`` int64 tensors: ``input_ids``, ``attention_mask`` and ``labels``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from kronfluence.task import Task
from torch import nn

IGNORE_INDEX = -100


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


def _logits(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-summed next-token cross-entropy per example, ``(B,)`` float32."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    token_loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    return token_loss.sum(dim=1)


class LanguageModelingTask(Task):
    """kronfluence's task for causal LMs with the paper's loss and label sampling.

    With ``sample=True`` (the true Fisher), labels are drawn from the model's own next-token
    distribution at the positions that count, with inputs fixed to the data.
    """

    def __init__(self, modules: Optional[List[str]] = None, generator: Optional[torch.Generator] = None):
        self.modules = modules
        self.generator = generator

    def compute_train_loss(self, batch: Dict[str, torch.Tensor], model: nn.Module, sample: bool = False) -> torch.Tensor:
        logits = _logits(model, batch)
        labels = batch["labels"]
        if sample:
            with torch.no_grad():
                probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1)
                drawn = torch.multinomial(probs.reshape(-1, probs.size(-1)), 1, generator=self.generator)
                drawn = drawn.view(probs.shape[:-1])
                counted = labels[:, 1:] != IGNORE_INDEX
                sampled = torch.full_like(labels, IGNORE_INDEX)
                sampled[:, 1:] = torch.where(counted, drawn, torch.full_like(drawn, IGNORE_INDEX))
            labels = sampled
        return per_example_loss(logits, labels).sum()

    def compute_measurement(self, batch: Dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
        return per_example_loss(_logits(model, batch), batch["labels"]).sum()

    def get_influence_tracked_modules(self) -> Optional[List[str]]:
        return self.modules

    def get_attention_mask(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["attention_mask"]
