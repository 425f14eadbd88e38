"""Coverage: how much of a model the attributed modules are, by kind, and what is left out and why.

Influence covers only the parameters whose gradients are taken: an index over a few modules of a
model says nothing about the rest. Every parameter is given one kind (attention, MLP, experts,
router, embeddings, head, norms, other) from its place in the model; those outside the
attributed modules are grouped by the reason they are out:

* fused expert tensors: several transformers families keep a mixture of experts' weights as 3-D
  parameters of one module, not as ``nn.Linear`` layers; kronfluence tracks ``nn.Linear`` (and
  ``nn.Conv2d``) modules only, and the experts see tokens gathered from the whole batch, so there
  is no per-example gradient to capture (``experts="dense"`` rebuilds them:
  :mod:`eogp_index.gradients.experts`);
* routers and other layers inside a sparse MoE block: the block flattens batch and tokens
  before routing, so they too see no per-example inputs (shared experts are given some:
  :func:`~eogp_index.gradients.experts.make_experts_trackable`);
* non-linear layers: embeddings, normalisation layers and other modules kronfluence cannot track;
* linear layers outside the default set (the output head, which the paper leaves out, and
  anything else ``--module`` did not name).

When a LoRA adapter's matrices are attributed, coverage is counted over the adapter's own
parameters (what was trained), and the frozen base is reported alongside.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from eogp_index.gradients.model import is_adapter_tensor, moe_blocks

KINDS = ("attention", "mlp", "experts", "router", "embeddings", "head", "norms", "other")
#: ``eogp fit`` warns when the attributed modules hold less than this share of the blocks' parameters.
WARN_BELOW = 0.5
_BLOCK = re.compile(r"\.\d+\.")
_REASONS = {
    "fused": "fused expert tensors (3-D parameters, not nn.Linear layers): kronfluence tracks nn.Linear and "
    "nn.Conv2d modules only, and the experts see tokens gathered from the whole batch, so no "
    "per-example gradient exists to capture; --experts dense attributes them (each expert as "
    "nn.Linear layers run on every token: E/top_k times the experts' compute)",
    "moe": "routers and other layers inside a sparse MoE block: the block flattens batch and tokens before "
    "routing, so they see no per-example inputs and kronfluence cannot take per-example gradients of them",
    "embedding": "embedding lookups, not linear layers (the paper leaves embeddings out)",
    "norm": "normalisation layers, not linear layers (the paper leaves them out)",
    "head": "the output head: a linear layer the paper leaves out (name it with --module to attribute it)",
    "not_chosen": "linear layers not in the attributed set (name them with --module)",
    "not_linear": "not linear layers: kronfluence tracks nn.Linear modules only",
}


class LowCoverageWarning(UserWarning):
    """The attributed modules hold less than half of the parameters of the model's blocks."""


@dataclass(frozen=True)
class LeftOut:
    """Parameters left out for one reason: ``modules`` are name patterns (block numbers as ``*``)."""

    kind: str
    reason: str
    parameters: int
    modules: Tuple[str, ...]


@dataclass(frozen=True)
class Coverage:
    """The attributed share of a model (``scope`` ``"model"``) or of its LoRA adapter (``"adapter"``).

    ``by_kind`` maps each kind present to ``(attributed, total)`` parameters; ``blocks`` is the same
    pair over the repeated blocks (``….layers.3.…``); ``frozen_base`` the base model's parameters
    when the scope is an adapter; ``tied_head``: the output head is the input embeddings' tensor,
    counted once, as embeddings.
    """

    scope: str
    attributed: int
    total: int
    by_kind: Dict[str, Tuple[int, int]]
    blocks: Tuple[int, int]
    left_out: Tuple[LeftOut, ...]
    frozen_base: int = 0
    tied_head: bool = False

    @property
    def share(self) -> float:
        return self.attributed / self.total if self.total else 0.0

    @property
    def blocks_share(self) -> float:
        return self.blocks[0] / self.blocks[1] if self.blocks[1] else 0.0

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["by_kind"] = {k: {"attributed": a, "total": t} for k, (a, t) in self.by_kind.items()}
        data["blocks"] = {"attributed": self.blocks[0], "total": self.blocks[1]}
        data["share"], data["blocks_share"] = self.share, self.blocks_share
        return data


def model_coverage(model: nn.Module, attributed: Sequence[str]) -> Coverage:
    """The coverage of ``attributed`` (module names, as :func:`find_attributed_modules` gives them).

    Works on a model built on the ``meta`` device: only names, types and shapes are read.
    """
    chosen = set(attributed)
    owners = {
        f"{m}.{p}" if m else p: (m, module)
        for m, module in model.named_modules()
        for p, _ in module.named_parameters(recurse=False)
    }
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    blocks = moe_blocks(model)
    params = list(model.named_parameters())  # a tied head shares the embeddings' tensor: counted once
    # LoRA matrices attributed: the share is of the adapter's parameters; base layers named
    # instead (--module): of the whole model's, as without an adapter.
    adapter = any(is_adapter_tensor(name) for name in chosen)
    by_kind: Dict[str, List[int]] = {}
    in_blocks = [0, 0]
    groups: Dict[Tuple[str, str], List[Any]] = {}
    frozen = 0
    for name, parameter in params:
        if adapter and not is_adapter_tensor(name):
            frozen += parameter.numel()
            continue
        module_name, module = owners[name]
        kind = _kind(module_name, module, embeddings, head, blocks)
        taken = module_name in chosen
        counts = by_kind.setdefault(kind, [0, 0])
        counts[0] += parameter.numel() if taken else 0
        counts[1] += parameter.numel()
        if _BLOCK.search(name):
            in_blocks[0] += parameter.numel() if taken else 0
            in_blocks[1] += parameter.numel()
        if not taken:
            reason = _reason(module_name, module, parameter, head, blocks)
            group = groups.setdefault((kind, reason), [0, []])
            group[0] += parameter.numel()
            pattern = _BLOCK.sub(".*.", f".{module_name}.").strip(".") or name
            if pattern not in group[1]:
                group[1].append(pattern)
    left_out = tuple(
        LeftOut(kind, _REASONS[reason], n, tuple(patterns))
        for (kind, reason), (n, patterns) in sorted(groups.items(), key=lambda g: -g[1][0])
    )
    return Coverage(
        scope="adapter" if adapter else "model",
        attributed=sum(a for a, _ in by_kind.values()),
        total=sum(t for _, t in by_kind.values()),
        by_kind={k: (by_kind[k][0], by_kind[k][1]) for k in KINDS if k in by_kind},
        blocks=(in_blocks[0], in_blocks[1]),
        left_out=left_out,
        frozen_base=frozen,
        tied_head=not adapter
        and head is not None
        and embeddings is not None
        and getattr(head, "weight", None) is getattr(embeddings, "weight", False),
    )


def _in_moe(module_name: str, blocks: Sequence[str]) -> Optional[str]:
    """The path below the sparse MoE block that holds ``module_name`` (``"experts"``, ``"gate"``), if any."""
    for block in blocks:
        if module_name.startswith(block + "."):
            return module_name[len(block) + 1 :]
    return None


def _adapted(module_name: str) -> str:
    """The layer a LoRA matrix adapts (``….q_proj.lora_A.default`` -> ``….q_proj``)."""
    return module_name.split(".lora_", 1)[0]


def _kind(module_name: str, module: nn.Module, embeddings, head, blocks: Sequence[str]) -> str:
    if module is embeddings or isinstance(module, nn.Embedding):
        return "embeddings"
    if module is head:
        return "head"
    path = _adapted(module_name)
    inner = _in_moe(path, blocks)
    if inner is not None:
        first = inner.split(".", 1)[0]
        if first == "experts" or (first.startswith("shared_expert") and not first.endswith("_gate")):
            return "experts"
        return "router"
    if "norm" in type(module).__name__.lower():
        return "norms"
    parts = path.lower().split(".")
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if any(p in ("mlp", "ffn", "feed_forward", "block_sparse_moe") for p in parts):
        return "mlp"
    return "other"


def _reason(module_name: str, module: nn.Module, parameter, head, blocks: Sequence[str]) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "norm" in type(module).__name__.lower():
        return "norm"
    if parameter.dim() == 3:
        return "fused"
    if module is head:
        return "head"
    if _in_moe(module_name, blocks) is not None:
        return "moe"
    return "not_chosen" if isinstance(module, nn.Linear) else "not_linear"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_coverage(data: Dict[str, Any]) -> List[str]:
    """:meth:`Coverage.to_json` as lines of text: the share, a line per kind, what is left out and why."""
    of = "of the LoRA adapter's parameters" if data["scope"] == "adapter" else "of the model's parameters"
    blocks = data["blocks"]
    lines = [
        f"coverage      {data['attributed']:,} {of} attributed ({_percent(data['attributed'], data['total'])} "
        f"of {data['total']:,}); in the blocks {_percent(blocks['attributed'], blocks['total'])} "
        f"of {blocks['total']:,}"
    ]
    if data["scope"] == "adapter":
        lines.append(
            f"              the base model's {data['frozen_base']:,} parameters are frozen: not attributed "
            "(name base layers with --module to attribute them instead)"
        )
    for kind, counts in data["by_kind"].items():
        lines.append(
            f"  {kind:<12} {counts['attributed']:>14,} of {counts['total']:>14,} "
            f"({_percent(counts['attributed'], counts['total'])})"
        )
    if data.get("tied_head"):
        lines.append("  head: tied to the input embeddings (the same tensor, counted with them)")
    for entry in data["left_out"]:
        shown = ", ".join(entry["modules"][:3]) + (" …" if len(entry["modules"]) > 3 else "")
        lines.append(f"  left out: {entry['kind']}, {entry['parameters']:,} parameters ({shown}): {entry['reason']}")
    return lines


def coverage_warning(coverage: Coverage) -> Optional[str]:
    """The warning ``eogp fit`` gives below :data:`WARN_BELOW` of the blocks' parameters, else ``None``."""
    if coverage.blocks[1] == 0 or coverage.blocks_share >= WARN_BELOW:
        return None
    largest = max(coverage.left_out, key=lambda entry: entry.parameters, default=None)
    why = f"; the largest part left out is {largest.kind} ({largest.reason})" if largest else ""
    return (
        f"the attributed modules hold {_percent(*coverage.blocks)} of the parameters of the model's blocks "
        f"(less than {WARN_BELOW:.0%}): influence will say nothing about the rest{why}"
    )


def report_coverage(model: nn.Module, attributed: Sequence[str], log) -> Coverage:
    """Log the coverage (``log.info``) and warn (:class:`LowCoverageWarning`) when it is low."""
    coverage = model_coverage(model, attributed)
    for line in format_coverage(coverage.to_json()):
        log.info(line)
    message = coverage_warning(coverage)
    if message is not None:
        warnings.warn(message, LowCoverageWarning, stacklevel=2)
    return coverage
