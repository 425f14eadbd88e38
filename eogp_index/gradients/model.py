"""The model: loading it, which layers are attributed, how they are made trackable, its fingerprints.

The paper attributes the attention and MLP linear layers (biases included) and excludes
embeddings, the LM head and normalisation layers. kronfluence tracks ``nn.Linear`` only, so
GPT-2's ``Conv1D`` layers (a linear layer with a transposed weight) are swapped for
``nn.Linear`` layers over the same storage: the model's outputs do not change. An index swaps
them on its own copy of a model it is given (:func:`shared_weights_copy`: new module objects,
the same weights), so the caller's model stays as it was, and the fingerprints read the weights
as loaded (:func:`state_as_loaded`) whether they were swapped or not.

A LoRA adapter (a ``peft`` adapter directory) is loaded onto its base, unmerged: its
``lora_A``/``lora_B`` matrices are ``nn.Linear`` layers of their own, and they are what is
attributed unless modules are named.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import hashlib
import json
import os
import re
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from eogp_index.errors import ConfigError, ModelError

# Llama / OLMo / Mistral / Qwen projections, GPT-2 / GPT-J / GPT-NeoX names.
_DEFAULT_LEAF_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
    "c_fc",
    "query_key_value",
    "dense",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "fc_in",
    "fc_out",
    "out_proj",
    "qkv_proj",
    "gate_up_proj",
    "fc1",
    "fc2",
    "wq",
    "wk",
    "wv",
    "wo",
)


_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: Set on each ``nn.Linear`` that :func:`replace_conv1d` made from a ``Conv1D``: its weight is the
#: ``Conv1D``'s, transposed, and the fingerprints read it back in the ``Conv1D``'s layout.
FROM_CONV1D = "eogp_from_conv1d"


def replace_conv1d(model: nn.Module) -> int:
    """Swap every transformers ``Conv1D`` in ``model`` for an equivalent ``nn.Linear``, in place.

    ``Conv1D`` computes ``x @ W + b`` with ``W`` of shape ``(in, out)``; ``nn.Linear`` holds
    ``W.T``: the new layer's weight is that transposed view of the same storage (no weight is
    copied) and its bias the same tensor. Each new layer is marked :data:`FROM_CONV1D`, so that
    :func:`model_fingerprint` and :func:`model_sha256` hash the model as loaded, swapped or not.
    To leave a caller's model as it is, swap on :func:`shared_weights_copy` of it. Returns the
    number of layers swapped.
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
                linear = nn.Linear(in_features, out_features, bias=child.bias is not None, device="meta")
                linear.weight = nn.Parameter(child.weight.detach().t(), requires_grad=child.weight.requires_grad)
                if child.bias is not None:
                    linear.bias = nn.Parameter(child.bias.detach(), requires_grad=child.bias.requires_grad)
                linear.train(child.training)
                setattr(linear, FROM_CONV1D, True)
                setattr(parent, child_name, linear)
                swapped += 1
    return swapped


def shared_weights_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree over the same weights: what an index prepares for
    attribution (swaps layers in, freezes, moves, hooks) without changing the model it was given.

    Every module object is new, with its own dicts of parameters, buffers, children and hooks,
    so swapping a child, registering a hook, ``eval()`` or ``.to(device)`` on the copy leaves
    ``model`` alone. Each parameter is a new ``nn.Parameter`` over the same storage (its
    ``requires_grad`` may then differ; nothing is copied), buffers are the same tensors, and
    other attributes (the config, a hook's state) are shared. A module or parameter found at
    two places (tied embeddings) is one object in the copy too. Methods and ``functools.partial``
    objects bound to a module as attributes (accelerate's forward hooks) are bound to its copy.
    """
    modules: Dict[int, nn.Module] = {}
    parameters: Dict[int, nn.Parameter] = {}

    def parameter(p: Optional[nn.Parameter]) -> Optional[nn.Parameter]:
        if p is None:
            return None
        if id(p) not in parameters:
            parameters[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
        return parameters[id(p)]

    def module_copy(module: nn.Module) -> nn.Module:
        if id(module) in modules:
            return modules[id(module)]
        new = copy.copy(module)
        modules[id(module)] = new
        state = new.__dict__
        for key, value in list(state.items()):
            if isinstance(value, (dict, set, list)):  # the hook dicts, and any other container
                state[key] = copy.copy(value)
            else:
                state[key] = _rebound(value, module, new)
        state["_parameters"] = type(module._parameters)((name, parameter(p)) for name, p in module._parameters.items())
        state["_modules"] = type(module._modules)(
            (name, None if child is None else module_copy(child)) for name, child in module._modules.items()
        )
        return new

    return module_copy(model)


def _rebound(value: Any, old: nn.Module, new: nn.Module) -> Any:
    """``value`` bound to ``new`` where it is a method or ``functools.partial`` bound to ``old``."""
    if isinstance(value, types.MethodType) and value.__self__ is old:
        return types.MethodType(value.__func__, new)
    if isinstance(value, functools.partial) and value.args and value.args[0] is old:
        rebound = functools.partial(value.func, new, *value.args[1:], **value.keywords)
        rebound.__dict__.update(value.__dict__)
        return rebound
    return value


#: What peft names a LoRA adapter's own parameters and layers (``….q_proj.lora_A.default``).
LORA_MARK = "lora_"
#: The ``nn.Linear`` peft keeps the adapted layer's own weights in (``….q_proj.base_layer``).
BASE_LAYER = ".base_layer"


def _lora_linear(name: str) -> bool:
    """A LoRA matrix: ``….lora_A.<adapter>`` or ``….lora_B.<adapter>``."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B")


def _matches(name: str, pattern: str) -> bool:
    """``name`` is ``pattern`` or matches it as a glob; under a LoRA adapter a base layer is also
    matched by the name of the layer it adapts (``*.q_proj`` picks ``….q_proj.base_layer``)."""
    names = (name, name[: -len(BASE_LAYER)]) if name.endswith(BASE_LAYER) else (name,)
    return any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in names)


def moe_blocks(model: nn.Module) -> List[str]:
    """Names of the sparse mixture-of-experts blocks: the modules with a child named ``experts``.

    Such a block flattens batch and tokens before routing, so the layers inside it (experts,
    router, often shared experts) see no per-example inputs unless
    :func:`~eogp_index.gradients.experts.make_experts_trackable` gives them some.
    """
    return [name for name, module in model.named_modules() if "experts" in dict(module.named_children())]


def find_attributed_modules(model: nn.Module, patterns: Optional[Sequence[str]] = None) -> List[str]:
    """Names of the linear layers to attribute, in model order.

    Args:
        model: a model whose ``Conv1D`` layers were already replaced (:func:`replace_conv1d`).
        patterns: optional module names or shell-style patterns (``"*.mlp.*"``); ``None`` picks
            the LoRA matrices of a model with a LoRA adapter, else the attention and MLP linear
            layers inside the model's blocks.

    Raises:
        ModelError: no linear layer matches.
    """
    output_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear_names = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not output_head
    ]
    if patterns:
        chosen = [n for n in linear_names if any(_matches(n, p) for p in patterns)]
        missing = [p for p in patterns if not any(_matches(n, p) for n in linear_names)]
        if missing:
            raise ModelError(
                f"no nn.Linear module matches {missing}; the model's linear modules are "
                f"{linear_names[:8]}{' …' if len(linear_names) > 8 else ''}"
            )
        return chosen
    lora = [n for n in linear_names if _lora_linear(n)]
    if lora:  # an adapter: its own matrices are what was trained
        return lora
    # Default: linear layers inside a repeated block (…​.h.3.… / ….layers.3.…) whose leaf name is a
    # known attention/MLP projection. The numeric path component is what marks a block. Layers
    # inside a sparse MoE block are left out (experts fed gathered tokens have no per-example
    # inputs), except in the parts given per-example inputs (gradients.experts).
    block = re.compile(r"\.\d+\.")
    blocks = moe_blocks(model)
    moe = tuple(f"{name}." for name in blocks)
    per_example = tuple(
        f"{name}.{child}."
        for name in blocks
        for child, module in model.get_submodule(name).named_children()
        if getattr(module, "per_example_inputs", False)
    )
    chosen = [
        n
        for n in linear_names
        if block.search(n)
        and n.rsplit(".", 1)[-1] in _DEFAULT_LEAF_NAMES
        and (n.startswith(per_example) or not n.startswith(moe))
    ]
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


ADAPTER_CONFIG = "adapter_config.json"
#: Files that mark a directory as holding a tokenizer of its own.
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def is_adapter_dir(path: Any) -> bool:
    """A local directory saved by ``peft`` (it has ``adapter_config.json``)."""
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(adapter: str) -> Dict[str, Any]:
    """``adapter_config.json`` of a LoRA adapter directory, checked.

    Raises:
        ConfigError: not an adapter directory, unreadable, or not a LoRA adapter.
    """
    path = Path(adapter) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{adapter}: not a peft adapter directory (no {ADAPTER_CONFIG}); give the directory "
            "that peft's save_pretrained wrote"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as JSON ({exc}); save the adapter again with peft") from exc
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ConfigError(
            f"{path}: peft_type is {config.get('peft_type')!r}; eogp-index attributes LoRA "
            "adapters only (merge another kind into its base and give the merged model)"
        )
    return config


def model_and_adapter(name_or_path: str, adapter: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """``(base, adapter)`` for a model argument: an adapter directory names its base in
    ``adapter_config.json`` (``base_model_name_or_path``); ``adapter`` puts one on a named base.

    Raises:
        ConfigError: both are adapters, or the adapter names no base.
    """
    if adapter is not None:
        if is_adapter_dir(name_or_path):
            raise ConfigError(
                f"{name_or_path} is itself an adapter: give its base model with --adapter "
                f"{adapter}, or the adapter directory alone"
            )
        adapter_config(adapter)
        return name_or_path, adapter
    if not is_adapter_dir(name_or_path):
        return name_or_path, None
    base = adapter_config(name_or_path).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{Path(name_or_path) / ADAPTER_CONFIG}: base_model_name_or_path is empty; give the base "
            f"model and the adapter: eogp fit BASE --adapter {name_or_path}"
        )
    return str(base), name_or_path


def load_model(
    name_or_path: str,
    *,
    adapter: Optional[str] = None,
    device: str = "cpu",
    dtype: Union[str, torch.dtype, None] = "float32",
):
    """Load a HuggingFace causal LM and its tokenizer (hub name or local directory).

    ``name_or_path`` may be a LoRA adapter directory (its base is loaded from
    ``adapter_config.json``), or ``adapter`` an adapter for the named base. The adapter is
    loaded unmerged; the model returned is the base model with peft's LoRA layers in it. The
    tokenizer is the adapter directory's when it has one, else the base's.

    Args:
        dtype: ``"auto"`` keeps the checkpoint's own dtype (``from_pretrained(dtype="auto")``);
            ``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype`` loads in that one.

    Raises:
        ModelError: no model there (a missing directory, a name the hub does not know, no
            weights), or no usable tokenizer beside it (see :func:`check_tokenizer`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wanted = "auto" if dtype == "auto" else torch_dtype(dtype or "float32")
    base, adapter = model_and_adapter(name_or_path, adapter)
    name = str(base)
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ModelError(
            f"model directory {name!r} does not exist; give a local model directory (config.json, "
            "weights and tokenizer files, as save_pretrained writes them) or a hub name"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=wanted)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot load a causal LM from {name!r}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    tokenizer_from = base
    if adapter is not None:
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ConfigError(
                f"{adapter} is a LoRA adapter: loading it needs peft (pip install 'eogp-index[adapters]')"
            ) from exc
        model = PeftModel.from_pretrained(model, adapter, is_trainable=False).get_base_model()
        if any((Path(adapter) / f).is_file() for f in _TOKENIZER_FILES):
            tokenizer_from = adapter
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(
            f"cannot load the tokenizer of {str(tokenizer_from)!r}: {exc}; save it beside the model "
            "(tokenizer.save_pretrained(directory))"
        ) from exc
    check_tokenizer(tokenizer, str(tokenizer_from))
    model.to(device).eval()
    dtype_name(model)  # refuses a checkpoint in a dtype gradients are not taken in (float64, int8, ...)
    return model, tokenizer


#: A probe every usable tokenizer turns into tokens.
_TOKENIZER_PROBE = "The quick brown fox."


def check_tokenizer(tokenizer, name: str) -> None:
    """Refuse a tokenizer that cannot tokenize: transformers returns one without a vocabulary
    for a model directory holding no tokenizer files, and every document would then be empty.

    Raises:
        ModelError: naming the directory and saying how to add the tokenizer.
    """
    try:
        ids = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001  (a vocabulary without an unknown token may refuse the probe's words)
        ids = None
    why = f"it has {len(tokenizer)} token(s)" + (f" and turns {_TOKENIZER_PROBE!r} into none" if ids == [] else "")
    if len(tokenizer) < 2 or ids == []:
        raise ModelError(
            f"{name!r} has no usable tokenizer ({why}); the directory needs the tokenizer files "
            "(tokenizer.json or vocab files and tokenizer_config.json): save them beside the model "
            "with tokenizer.save_pretrained(directory)"
        )


def add_lora_layers(model: nn.Module, adapter: str) -> nn.Module:
    """Put an adapter's LoRA layers into ``model`` in place, without reading its weights: the
    shapes ``eogp plan`` counts (works on a model built on the ``meta`` device)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise ConfigError(
            f"{adapter} is a LoRA adapter: reading it needs peft (pip install 'eogp-index[adapters]')"
        ) from exc
    adapter_config(adapter)
    return inject_adapter_in_model(LoraConfig.from_pretrained(adapter), model)


def load_indexed_model(
    entry: Dict[str, Any],
    override: Optional[str] = None,
    *,
    device: str = "cpu",
    dtype: Union[str, torch.dtype, None] = "float32",
):
    """Load the model a manifest's ``model`` entry names, with its adapter if it has one.

    ``override`` (``--model``) replaces where the base is loaded from, or, when it is an
    adapter directory itself, both base and adapter.
    """
    adapter = (entry.get("adapter") or {}).get("path")
    if override is not None and is_adapter_dir(override):
        adapter = None
    return load_model(override or entry["name"], adapter=adapter, device=device, dtype=dtype)


def torch_dtype(name: Union[str, torch.dtype]) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (one of the model dtypes an index is built in)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _MODEL_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_MODEL_DTYPES)} (--dtype), got {name!r}")
    return _MODEL_DTYPES[name]


def dtype_name(model: nn.Module) -> str:
    """The dtype of the model's floating-point weights, by name (``"bfloat16"``).

    Raises:
        ConfigError: weights in a dtype other than float32, bfloat16 or float16, or in several.
    """
    found = {p.dtype for p in model.parameters() if p.is_floating_point()}
    names = sorted(str(d).removeprefix("torch.") for d in found)
    if len(names) != 1 or names[0] not in _MODEL_DTYPES:
        raise ConfigError(
            f"the model's weights are {', '.join(names) or 'not floating point'}; an index is built "
            f"with one of {sorted(_MODEL_DTYPES)}: load it with --dtype float32 (or model.to(...))"
        )
    return names[0]


def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS, else 0.

    Padding positions never count in the loss, so any id works; a real one keeps embeddings sane.
    """
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def state_as_loaded(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with every weight :func:`replace_conv1d` transposed read back in its
    ``Conv1D`` layout (a view): the state as loaded, whether the layers were swapped or not."""
    state = model.state_dict()
    for name, module in model.named_modules(remove_duplicate=False):
        key = f"{name}.weight" if name else "weight"
        if getattr(module, FROM_CONV1D, False) and key in state:
            state[key] = state[key].t()
    return state


def model_sha256(model: nn.Module) -> str:
    """SHA-256 over the state dict as loaded: sorted names, dtypes, shapes and bytes.

    Read through :func:`state_as_loaded`, so the same checkpoint always hashes the same, GPT-2's
    ``Conv1D`` layers swapped or not.
    """
    digest = hashlib.sha256()
    state = state_as_loaded(model)
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


def model_fingerprint(model: nn.Module, only: Optional[Callable[[str], bool]] = None) -> str:
    """A cheap identity of the weights as loaded, checked on every open instead of :func:`model_sha256`.

    ``sample1:`` + SHA-256 over the state dict's sorted names, dtypes and shapes, every tensor of
    up to ``FINGERPRINT_WHOLE_TENSOR_BYTES`` whole (biases, norms, small models entirely), and
    ``FINGERPRINT_CHUNKS`` evenly spaced chunks of ``FINGERPRINT_CHUNK_BYTES`` of each larger one
    (16 KiB per matrix; about 10 MB for a 32B model, read on its device). It catches another
    checkpoint, architecture, dtype or any retraining, fine-tune or re-quantization that moves
    the sampled bytes — all of them, in practice — but not an edit confined to unsampled entries
    of a large matrix; ``eogp verify`` (:func:`model_sha256`) hashes every byte. Read, like the
    full hash, through :func:`state_as_loaded` (the same whether GPT-2's ``Conv1D`` layers are
    swapped or not). ``only`` keeps the tensors whose names it accepts (:func:`adapter_fingerprint`).
    """
    digest = hashlib.sha256()
    state = state_as_loaded(model)
    for name in sorted(state):
        if only is not None and not only(name):
            continue
        tensor = state[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.reshape(-1)
        for start, stop in fingerprint_ranges(flat.numel(), flat.element_size()):
            # Slice on the tensor's own device: only the sampled bytes travel to the CPU.
            part = flat[start:stop].to("cpu").contiguous()
            digest.update(part.view(torch.uint8).numpy().tobytes())
    return FINGERPRINT_PREFIX + digest.hexdigest()


def is_adapter_tensor(name: str) -> bool:
    """A LoRA adapter's own tensor in the adapted model's state dict (``….lora_B.default.weight``)."""
    return LORA_MARK in name


def adapter_fingerprint(model: nn.Module) -> Optional[str]:
    """:func:`model_fingerprint` of the LoRA adapter's tensors alone; ``None`` without an adapter.

    The whole model's fingerprint already covers them; this one lets a refusal say that it is
    the adapter, not the base, that changed.
    """
    if not any(is_adapter_tensor(name) for name, _ in model.named_parameters()):
        return None
    return model_fingerprint(model, only=is_adapter_tensor)


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
