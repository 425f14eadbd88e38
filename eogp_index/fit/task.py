"""kronfluence's task for causal LMs: the paper's loss, with labels sampled from the model.

The loss itself (:func:`~eogp_index.gradients.loss.per_example_loss`) is shared with ingest and
queries; this adapter is the only place that speaks kronfluence's ``Task`` interface.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from kronfluence.task import Task
from torch import nn

from eogp_index.gradients.loss import IGNORE_INDEX, logits_of, per_example_loss


class LanguageModelingTask(Task):
    """kronfluence's task for causal LMs with the paper's loss and label sampling.

    With ``sample=True`` (the true Fisher), labels are drawn from the model's own next-token
    distribution at the positions that count, with inputs fixed to the data.
    """

    def __init__(self, modules: Optional[List[str]] = None, generator: Optional[torch.Generator] = None):
        self.modules = modules
        self.generator = generator

    def compute_train_loss(self, batch: Dict[str, torch.Tensor], model: nn.Module, sample: bool = False) -> torch.Tensor:
        logits = logits_of(model, batch)
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
        return per_example_loss(logits_of(model, batch), batch["labels"]).sum()

    def get_influence_tracked_modules(self) -> Optional[List[str]]:
        return self.modules

    def get_attention_mask(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["attention_mask"]
