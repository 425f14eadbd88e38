"""The language-modelling loss, shared by curvature fitting, training gradients and queries.

Every gradient in eogp-index is of the token-summed next-token cross-entropy over the positions
whose label is not ``-100`` (Appendix C.1). Labels are aligned with ``input_ids`` as in
HuggingFace: ``labels[t]`` is predicted from tokens ``< t``, so ``labels[:, 0]`` is never used.

A batch is a dict of ``(B, T)`` int64 tensors: ``input_ids``, ``attention_mask`` and ``labels``.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.nn.functional as F
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
