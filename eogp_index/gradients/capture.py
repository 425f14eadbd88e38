"""Per-example gradients of the attributed modules, as Kronecker factors.

For a linear module with input activations ``a_b`` ``(T, d_in')`` and output gradients
``g_b`` ``(T, d_out)`` of example ``b``, the per-example weight gradient is
``G_b = g_b^T a_b`` ``(d_out, d_in')``; ``d_in' = d_in + 1`` when the layer has a bias, whose
gradient is the column of ones appended to ``a`` (kronfluence's convention). The dense ``G_b``
is never needed: the projection consumes ``(a, g)`` directly.

One backward pass of the batch's summed loss gives every example's own gradient, because in
evaluation mode examples do not interact. Padding positions are masked out of ``a``; their
output gradients are zero because no counted label depends on them.

Module outputs are processed in backward hooks, as soon as their gradient exists, so only the
projected coordinates of all modules are alive at once — not every module's activations. Each
module's input is held from its forward to its backward hook in the model's dtype (bfloat16 or
float16 halve it) and handed to the transform in float32, with the output gradient.

With ``checkpoint=True`` each transformer block keeps only its input in the forward pass and is
run again in the backward pass (``torch.utils.checkpoint``, non-reentrant), so the memory of
the model's own activations no longer grows with the number of blocks times the tokens. The
recomputed forward calls the modules' forward hooks again: each module's ``a`` is taken, and
its gradient hook registered, once per run, so the recomputation captures nothing twice and
the coordinates are those of the plain pass.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from eogp_index.errors import InputError, ModelError
from eogp_index.gradients.loss import IGNORE_INDEX, collate, per_example_loss

#: ``transform(module_name, a (B, T, d_in') float32, g (B, T, d_out) float32) -> (B, ...)``
Transform = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_gradient(name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The per-example gradient itself, ``(B, d_out, d_in')``: a :data:`Transform` for tests."""
    del name
    return torch.einsum("bto,bti->boi", g, a)


class GradientCapture:
    """Hooks that hand each attributed module's ``(a, g)`` of a batch to a transform.

    Example:
        >>> capture = GradientCapture(model, ["transformer.h.0.mlp.c_fc"], dense_gradient)  # doctest: +SKIP
        >>> outputs, losses = capture.run(batch)  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, modules: Sequence[str], transform: Transform, *, checkpoint: bool = False):
        self.model = model
        self.modules = list(modules)
        self.transform = transform
        self.checkpoint = checkpoint
        self._linears: Dict[str, nn.Linear] = {}
        for name in self.modules:
            module = model.get_submodule(name)
            if not isinstance(module, nn.Linear):
                raise ModelError(f"attributed module {name!r} is a {type(module).__name__}, not nn.Linear")
            self._linears[name] = module

    def run(self, batch: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Forward and backward one batch.

        Returns:
            ``{module: transform(...)}`` and the per-example losses ``(B,)`` float32.
        """
        model = self.model
        model.eval()
        mask = batch["attention_mask"].unsqueeze(-1)
        activations: Dict[str, torch.Tensor] = {}
        results: Dict[str, torch.Tensor] = {}
        handles: List[torch.utils.hooks.RemovableHandle] = []
        # Modules whose ``a`` was taken, and whose gradient hook is registered: a checkpointed
        # block's recomputed forward must add neither again.
        captured: set = set()
        hooked: set = set()

        def on_backward(name: str):
            def hook(grad_output: torch.Tensor) -> None:
                a = activations.pop(name).float()
                g = grad_output.detach().float() * mask.to(grad_output.device, torch.float32)
                results[name] = self.transform(name, a, g)

            return hook

        def on_forward(name: str):
            def hook(module: nn.Linear, inputs, output: torch.Tensor) -> None:
                if inputs[0].shape[:2] != mask.shape[:2]:
                    raise ModelError(
                        f"module {name!r} takes inputs of shape {tuple(inputs[0].shape)}, not (batch, tokens, "
                        f"features) = {tuple(mask.shape[:2])} + (features,): it runs on tokens flattened or "
                        "gathered across the batch (as layers inside a sparse MoE block do), so it has no "
                        "per-example gradient; leave it out of --module"
                    )
                if name not in captured:
                    captured.add(name)
                    # Held until the module's backward hook in the model's own dtype (half of float32
                    # in bf16/fp16: every attributed module's input is alive at once); the mask and
                    # the bias column of ones are exact in it. Upcast there, one module at a time.
                    x = inputs[0].detach()
                    a = x * mask.to(x.device, x.dtype)
                    if module.bias is not None:
                        a = torch.cat([a, mask.to(a.device, a.dtype).expand(*a.shape[:-1], 1)], dim=-1)
                    activations[name] = a
                if output.requires_grad and name not in hooked:
                    hooked.add(name)
                    output.register_hook(on_backward(name))

            return hook

        def require_grad(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
            # Parameters stay frozen: the graph is rooted at the embeddings' output instead, so
            # backward computes module-output gradients but no weight gradients.
            return output.detach().requires_grad_(True)

        embeddings = model.get_input_embeddings()
        handles.append(embeddings.register_forward_hook(require_grad))
        for name, module in self._linears.items():
            handles.append(module.register_forward_hook(on_forward(name)))
        blocks = checkpointed_blocks(model) if self.checkpoint else []
        patched: List[nn.Module] = []
        try:
            for block in blocks:
                block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
                patched.append(block)
            # A key/value cache would grow again in the recomputation: none is kept when checkpointing.
            no_cache = {"use_cache": False} if blocks else {}
            with torch.enable_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **no_cache).logits
                losses = per_example_loss(logits, batch["labels"])
                losses.sum().backward()
        finally:
            for block in patched:
                del block.forward  # the class's forward again
            for handle in handles:
                handle.remove()
            activations.clear()
        missing = [n for n in self.modules if n not in results]
        if missing:
            raise ModelError(
                f"modules {missing[:4]} received no gradient: they do not influence the loss "
                "(check the module names and that the batch has counted labels)"
            )
        return {n: results[n] for n in self.modules}, losses.detach()


def checkpointed_blocks(model: nn.Module) -> List[nn.Module]:
    """The transformer blocks to recompute: the children of the model's longest ``nn.ModuleList``
    of modules of one class (``transformer.h``, ``model.layers``).

    Raises:
        ModelError: the model has no such list, so there is nothing to checkpoint.
    """
    best: List[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(m) for m in module}) == 1:
            best = list(module)
    if not best:
        raise ModelError(
            f"{type(model).__name__} has no list of transformer blocks to checkpoint; "
            "run without gradient checkpointing"
        )
    return best


def batches(items: Iterable[Any], size: int) -> Iterator[List[Any]]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    batch: List[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_counted(examples: Sequence[Any]) -> None:
    """Refuse, by name, an example with no counted label: it has no gradient."""
    for ex in examples:
        if not any(label != IGNORE_INDEX for label in list(ex.labels)[1:]):
            raise InputError(
                f"example {ex.id!r} has no tokens that count in the loss", location=getattr(ex, "shard", "") or None
            )


def run_batches(
    capture: GradientCapture,
    examples: Sequence[Any],
    *,
    batch_size: int,
    pad_token_id: int,
    device: str,
    progress: bool = False,
    desc: str = "projecting",
) -> Iterator[Tuple[List[Any], Dict[str, torch.Tensor]]]:
    """Run ``capture`` over tokenized examples, a batch at a time: yields each batch and its
    ``{module: (B, ...)}`` outputs, as the transform gives them (on the model's device).

    ``examples`` have ``input_ids``, ``labels`` and ``id`` (an
    :class:`~eogp_index.data.records.Example`); an example with no counted label has no
    gradient and is refused by name.
    """
    from tqdm.auto import tqdm

    total = -(-len(examples) // batch_size)
    for batch in tqdm(batches(examples, batch_size), desc=desc, total=total, unit="batch", disable=not progress):
        check_counted(batch)
        collated = collate([(ex.input_ids, ex.labels) for ex in batch], pad_token_id)
        outputs, _ = capture.run({key: value.to(device) for key, value in collated.items()})
        yield batch, outputs


def project_examples(
    capture: GradientCapture,
    examples: Sequence[Any],
    *,
    batch_size: int,
    pad_token_id: int,
    device: str,
    progress: bool = False,
    desc: str = "projecting",
) -> Dict[str, torch.Tensor]:
    """:func:`run_batches`, gathered: ``{module: (n, ...) float32 on the CPU}``."""
    parts: Dict[str, List[torch.Tensor]] = {name: [] for name in capture.modules}
    for _, outputs in run_batches(
        capture, examples, batch_size=batch_size, pad_token_id=pad_token_id, device=device, progress=progress, desc=desc
    ):
        for name in capture.modules:
            parts[name].append(outputs[name].cpu())
    return {name: torch.cat(chunks) if chunks else torch.zeros(0) for name, chunks in parts.items()}
