"""The model: loading it, which layers are attributed, how they are made trackable, its fingerprints.

The paper attributes the attention and MLP linear layers (biases included) and excludes
embeddings, the LM head and normalisation layers. kronfluence tracks ``nn.Linear`` only, so
GPT-2's ``Conv1D`` layers (a linear layer with a transposed weight) are swapped for
``nn.Linear`` layers holding the same numbers: the model's outputs do not change.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from typing import List, Optional, Sequence

import torch
from torch import nn

from eogp_index.errors import ModelError

# Llama / OLMo / Mistral / Qwen projections, GPT-2 / GPT-J / GPT-NeoX names.
_DEFAULT_LEAF_NAMES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
    "fc_in", "fc_out", "out_proj", "qkv_proj", "gate_up_proj", "fc1", "fc2", "wq", "wk", "wv", "wo",
)


def replace_conv1d(model: nn.Module) -> int:
    """Swap every transformers ``Conv1D`` for an equivalent ``nn.Linear`` in place.

    ``Conv1D`` computes ``x @ W + b`` with ``W`` of shape ``(in, out)``; ``nn.Linear`` holds
    ``W.T``. Returns the number of layers swapped.
    """
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                in_features, out_features = child.weight.shape
                linear = nn.Linear(in_features, out_features, bias=child.bias is not None)
                linear.to(device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, child_name, linear)
                swapped += 1
    return swapped


def find_attributed_modules(model: nn.Module, patterns: Optional[Sequence[str]] = None) -> List[str]:
    """Names of the linear layers to attribute, in model order.

    Args:
        model: a model whose ``Conv1D`` layers were already replaced (:func:`replace_conv1d`).
        patterns: optional module names or shell-style patterns (``"*.mlp.*"``); ``None`` picks
            the attention and MLP linear layers inside the model's blocks.

    Raises:
        ModelError: no linear layer matches.
    """
    output_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear_names = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output_head
    ]
    if patterns:
        chosen = [n for n in linear_names if any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns)]
        missing = [p for p in patterns if not any(n == p or fnmatch.fnmatchcase(n, p) for n in linear_names)]
        if missing:
            raise ModelError(
                f"no nn.Linear module matches {missing}; the model's linear modules are "
                f"{linear_names[:8]}{' …' if len(linear_names) > 8 else ''}"
            )
        return chosen
    # Default: linear layers inside a repeated block (…​.h.3.… / ….layers.3.…) whose leaf name is a
    # known attention/MLP projection. The numeric path component is what marks a block.
    block = re.compile(r"\.\d+\.")
    chosen = [n for n in linear_names if block.search(n) and n.rsplit(".", 1)[-1] in _DEFAULT_LEAF_NAMES]
    if not chosen:
        raise ModelError(
            "found no attention/MLP linear layers to attribute; name them explicitly "
            f"(--module / modules=[...]); the model's linear modules are {linear_names[:8]}"
        )
    return chosen


def module_shape(model: nn.Module, name: str) -> tuple[int, int]:
    """``(d_out, d_in')`` of a module's gradient: ``d_in' = in_features + 1`` with a bias."""
    module = model.get_submodule(name)
    if not isinstance(module, nn.Linear):
        raise ModelError(f"module {name!r} is a {type(module).__name__}, not nn.Linear")
    return module.out_features, module.in_features + (1 if module.bias is not None else 0)


def hard_context_length(model: nn.Module) -> Optional[int]:
    """The most tokens ``model`` can read, when a learned position table fixes it (GPT-2, OPT).

    Rotary/ALiBi models only extrapolate past ``max_position_embeddings``, so they get None.
    """
    config = getattr(model, "config", None)
    sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            # OPT's table has two extra rows (an offset of 2); the usable length is still value.
            if value in sizes or value + 2 in sizes:
                return value
    return None


def load_model(name_or_path: str, *, device: str = "cpu", dtype: Optional[torch.dtype] = None):
    """Load a HuggingFace causal LM and its tokenizer (hub name or local directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model.to(device).eval()
    return model, tokenizer


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS, else 0.

    Padding positions never count in the loss, so any id works; a real one keeps embeddings sane.
    """
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def model_sha256(model: nn.Module) -> str:
    """SHA-256 over the state dict as loaded: sorted names, dtypes, shapes and bytes.

    Computed before eogp-index swaps GPT-2's ``Conv1D`` layers, so the same checkpoint always
    hashes the same.
    """
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


#: A tensor up to this many bytes is fingerprinted whole.
FINGERPRINT_WHOLE_TENSOR_BYTES = 1 << 16
#: Otherwise this many evenly spaced chunks of about FINGERPRINT_CHUNK_BYTES each (first and last included).
FINGERPRINT_CHUNKS = 16
FINGERPRINT_CHUNK_BYTES = 1024
FINGERPRINT_PREFIX = "sample1:"


def fingerprint_ranges(numel: int, element_size: int) -> List[tuple[int, int]]:
    """The element ranges ``[start, stop)`` of a flattened tensor that :func:`model_fingerprint` reads."""
    if numel * element_size <= FINGERPRINT_WHOLE_TENSOR_BYTES:
        return [(0, numel)] if numel else []
    per = max(1, FINGERPRINT_CHUNK_BYTES // element_size)
    starts = sorted({round(i * (numel - per) / (FINGERPRINT_CHUNKS - 1)) for i in range(FINGERPRINT_CHUNKS)})
    return [(s, s + per) for s in starts]


def model_fingerprint(model: nn.Module) -> str:
    """A cheap identity of the weights as loaded, checked on every open instead of :func:`model_sha256`.

    ``sample1:`` + SHA-256 over the state dict's sorted names, dtypes and shapes, every tensor of
    up to ``FINGERPRINT_WHOLE_TENSOR_BYTES`` whole (biases, norms, small models entirely), and
    ``FINGERPRINT_CHUNKS`` evenly spaced chunks of ``FINGERPRINT_CHUNK_BYTES`` of each larger one
    (16 KiB per matrix; about 10 MB for a 32B model, read on its device). It catches another
    checkpoint, architecture, dtype or any retraining, fine-tune or re-quantization that moves
    the sampled bytes — all of them, in practice — but not an edit confined to unsampled entries
    of a large matrix; ``eogp verify`` (:func:`model_sha256`) hashes every byte. Taken, like the
    full hash, before GPT-2's ``Conv1D`` layers are swapped.
    """
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.reshape(-1)
        for start, stop in fingerprint_ranges(flat.numel(), flat.element_size()):
            # Slice on the tensor's own device: only the sampled bytes travel to the CPU.
            part = flat[start:stop].to("cpu").contiguous()
            digest.update(part.view(torch.uint8).numpy().tobytes())
    return FINGERPRINT_PREFIX + digest.hexdigest()


def freeze(model: nn.Module) -> nn.Module:
    """Stop gradients from reaching the parameters: ``requires_grad`` False, ``.grad`` dropped.

    Gradient capture roots the backward pass at the embeddings' output and needs output
    gradients only (:mod:`eogp_index.gradients.capture`); trainable parameters would each
    accumulate a ``.grad`` as large as the model in every batch.
    """
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
    return model
