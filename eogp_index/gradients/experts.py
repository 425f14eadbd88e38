"""Fused experts made trackable: each expert as ``nn.Linear`` layers run densely on the batch.

transformers keeps a mixture of experts' weights as two 3-D tensors of one module,
``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, and runs each expert on the
tokens routed to it, gathered from the flattened batch. kronfluence tracks ``nn.Linear``
modules, and per-example gradients need inputs shaped ``(batch, tokens, features)``: neither
holds there. :class:`DenseExperts` computes the same function with expert ``e`` as two
``nn.Linear`` layers (``experts.e.gate_up_proj``, ``experts.e.down_proj``) applied to every
token of ``(B, T, H)``, the tokens not routed to ``e`` zeroed first. A zero input row adds
nothing to a layer's input covariance or its weight gradient, and the output gradient of an
unrouted token is zero (its routing weight is), so the factors and per-example gradients are
exactly those of the routed computation. The cost: every expert runs on every token, ``E /
top_k`` times the experts' compute and ``E`` times their activations.

Shared experts (``shared_expert`` / ``shared_experts``: an MLP every token goes through) are
ordinary ``nn.Linear`` layers, but some blocks call them on the flattened ``(B·T, H)`` tokens;
:func:`make_experts_trackable` hands them ``(B, T, H)`` instead (the rows are the batch's
tokens in order, so this is a reshape), at no cost, so they are attributed like any MLP.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from eogp_index.errors import ModelError


class _Expert(nn.Module):
    """One expert as two ``nn.Linear`` layers whose weights are views of the fused tensors' rows
    (no weight is copied: a model an index copies keeps its fused experts at no extra memory)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, device="meta")
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, device="meta")
        self.gate_up_proj.weight = nn.Parameter(gate_up.detach(), requires_grad=gate_up.requires_grad)
        self.down_proj.weight = nn.Parameter(down.detach(), requires_grad=down.requires_grad)
        self.act_fn = act_fn


class _BatchShape:
    """``(B, T)`` of the hidden states the MoE block was last called with, set by its pre-hook."""

    def __init__(self) -> None:
        self.shape: Optional[Tuple[int, int]] = None

    def of(self, rows: int) -> Tuple[int, int]:
        """``(B, T)`` for ``rows`` flattened tokens: the block's, when they are its ``B·T`` tokens."""
        if self.shape is not None and self.shape[0] * self.shape[1] == rows:
            return self.shape
        return (1, rows)


class DenseExperts(nn.ModuleList):
    """A fused experts module's function with one :class:`_Expert` per expert, run densely.

    ``forward(hidden_states (B·T, H), top_k_index (B·T, K), top_k_weights (B·T, K)) -> (B·T, H)``,
    as the fused module's; the layers see ``(B, T, ·)``, ``(B, T)`` taken from the MoE block's
    input (:func:`make_experts_trackable`).
    """

    #: Its layers see (batch, tokens, features) inputs: they have per-example gradients.
    per_example_inputs = True

    def __init__(self, fused: nn.Module, batch: _BatchShape):
        super().__init__(
            _Expert(fused.gate_up_proj[e], fused.down_proj[e], fused.act_fn) for e in range(fused.gate_up_proj.shape[0])
        )
        self.batch = batch

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        n, hidden = hidden_states.shape
        shape = self.batch.of(n)
        x = hidden_states.view(*shape, hidden)
        num = len(self)
        # (B·T, E) routing weights and routed flags; an index of E (no expert) falls in the dropped column
        weights = torch.zeros(n, num + 1, dtype=top_k_weights.dtype, device=hidden_states.device)
        weights.scatter_add_(1, top_k_index, top_k_weights)
        routed = torch.zeros(n, num + 1, dtype=hidden_states.dtype, device=hidden_states.device)
        routed.scatter_(1, top_k_index, 1.0)
        weights, routed = weights[:, :num].view(*shape, num), routed[:, :num].view(*shape, num)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            gate, up = expert.gate_up_proj(x * routed[..., e : e + 1]).chunk(2, dim=-1)
            out = out + expert.down_proj(expert.act_fn(gate) * up) * weights[..., e : e + 1].to(x.dtype)
        return out.view(n, hidden)


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused layout, and only it: ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``
    as its only parameters (no biases, not transposed), gate before up, and an ``act_fn``."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or not hasattr(module, "act_fn"):
        return False
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    return (
        gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
    )


def _check_same_function(name: str, fused: nn.Module, dense: DenseExperts) -> None:
    """Refuse a rebuild that would compute something else: the structure matched transformers'
    layout, but a family may combine the same tensors otherwise (no check on the ``meta`` device)."""
    weight = fused.gate_up_proj
    if weight.device.type == "meta":
        return
    num, hidden = weight.shape[0], weight.shape[2]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(8, hidden, generator=generator).to(weight.device, weight.dtype)
    top_k = min(2, num)
    index = torch.stack([torch.randperm(num, generator=generator)[:top_k] for _ in range(8)]).to(weight.device)
    weights = torch.rand(8, top_k, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        expected, got = fused(tokens, index, weights), dense(tokens, index, weights)
    tolerance = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 2e-2
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max())):
        raise ModelError(
            f"{name} ({type(fused).__name__}) does not compute act(gate) * up then down per expert as "
            "transformers' fused layout does; --experts dense cannot rebuild it (use --experts fused: "
            "its experts are then left out)"
        )


def _record_batch_shape(batch: _BatchShape):
    def hook(block: nn.Module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        batch.shape = tuple(hidden.shape[:2]) if hidden is not None and hidden.dim() == 3 else None

    return hook


def _unflatten_inputs(batch: _BatchShape):
    """A pre-hook giving a shared expert ``(B, T, H)`` for the block's flattened ``(B·T, H)`` tokens."""

    def hook(module: nn.Module, args):
        if args and args[0].dim() == 2 and batch.of(args[0].shape[0]) == batch.shape:
            module._flattened_rows = args[0].shape[0]
            return (args[0].view(*batch.shape, args[0].shape[-1]), *args[1:])
        module._flattened_rows = None
        return None

    return hook


def _flatten_output(module: nn.Module, args, output: torch.Tensor):
    """The shared expert's output flattened back, as the block expects it."""
    rows = getattr(module, "_flattened_rows", None)
    return output.reshape(rows, output.shape[-1]) if rows is not None else None


def _shared_experts(block: nn.Module):
    """A block's shared-expert MLPs (``shared_expert``, ``shared_experts``; not a gate layer)."""
    return [
        child
        for name, child in block.named_children()
        if name.startswith("shared_expert") and not name.endswith("_gate") and not isinstance(child, nn.Linear)
    ]


def make_experts_trackable(model: nn.Module, *, dense: bool = False) -> int:
    """Give every sparse MoE block's shared experts per-example inputs, and with ``dense`` replace
    its fused experts (transformers' layout) by :class:`DenseExperts` (same outputs; see the
    module docstring for the cost). In place; idempotent. Returns how many fused experts modules
    were replaced."""
    replaced = 0
    for block_name, block in list(model.named_modules()):
        children = dict(block.named_children())
        if "experts" not in children:
            continue
        batch = getattr(block, "_eogp_batch", None)
        if batch is None:  # first call: the hooks, once
            batch = block._eogp_batch = _BatchShape()
            block.register_forward_pre_hook(_record_batch_shape(batch), with_kwargs=True)
            for shared in _shared_experts(block):
                shared.register_forward_pre_hook(_unflatten_inputs(batch))
                shared.register_forward_hook(_flatten_output)
                shared.per_example_inputs = True
        if dense and _is_fused_experts(children["experts"]):
            rebuilt = DenseExperts(children["experts"], batch)
            _check_same_function(f"{block_name}.experts", children["experts"], rebuilt)
            block.experts = rebuilt
            replaced += 1
    return replaced
