"""A tiny GPT-2-style language model and its training recipe.

This is the offline default that ships with eogp-index (``examples/default/``): a 2-layer
GPT-2 (``GPT2LMHeadModel``, ~0.7M parameters) with a 2048-token byte-level BPE tokenizer,
pretrained on docstrings of the Python standard library and fine-tuned on a disjoint set of
512 of them. The fine-tuned model is the one the default index attributes, and
:func:`finetune` is the recipe the retraining-based evaluation (LDS, paper Appendix D.1)
reruns on random half-subsets of the training set, so everything here is deterministic for a
seed and sized for a CPU: fine-tuning 512 documents for 3 epochs takes seconds on 2 cores.

Conventions shared with the index:

* A *document* is a list of token ids: the text's tokens, truncated to ``max_tokens - 1``,
  followed by ``<|endoftext|>`` (:func:`tokenize_documents`).
* A document's loss is its token-summed next-token cross-entropy,
  ``sum_{t>=1} -log p(x_t | x_<t)`` (:func:`document_losses`).
* The fine-tuning objective of a batch is the sum of its documents' token-summed losses
  divided by the constant ``batch_size * max_tokens``. Each document therefore enters
  training with the same weight whatever else is in its batch (a per-batch token mean would
  re-weight a document according to its batch-mates, which change from subset to subset),
  and the training gradient of document ``i`` is exactly the gradient of its loss above.

Nothing here downloads anything: models and tokenizers are read from local directories only.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from eogp_index.errors import ConfigError, InputError, ModelError

# Defined torch-free (the command line reads them), re-exported here where they are used.
from eogp_index.evaluation.config import FinetuneRecipe, PretrainRecipe, default_root

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "FinetuneRecipe",
    "PretrainRecipe",
    "default_config",
    "train_tokenizer",
    "tokenize_documents",
    "pack_blocks",
    "pretrain",
    "finetune",
    "document_losses",
    "default_root",
    "load_default",
    "load_default_corpus",
    "read_jsonl",
]

EOS_TOKEN = "<|endoftext|>"
#: Special tokens of the default tokenizer; ``<|endoftext|>`` is id 0 and serves as bos, eos,
#: unk and pad. The role markers are the Tülu-style chat roles of :data:`CHAT_TEMPLATE`.
SPECIAL_TOKENS = (EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")

#: Tülu-style chat template: ``<|role|>\ncontent\n`` per message, eos right after each
#: assistant turn's content, ``<|assistant|>\n`` as generation prompt. The newlines are
#: written as Jinja string literals because transformers renders templates with
#: ``trim_blocks=True``, which would eat a literal newline that follows a ``{% ... %}`` tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def default_config(vocab_size: int = 2048, *, n_positions: int = 256, **overrides: Any):
    """The GPT-2 configuration of the default model: 2 layers, 4 heads, width 128."""
    from transformers import GPT2Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=128,
        n_layer=2,
        n_head=4,
        n_inner=512,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, *, model_max_length: int = 256):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for transformers.

    ``<|endoftext|>`` (id 0) is bos, eos, unk and pad; ``<|system|>``, ``<|user|>`` and
    ``<|assistant|>`` are special tokens used by the Tülu-style :data:`CHAT_TEMPLATE`. No
    bos/eos is added on encoding (GPT-2 style); :func:`tokenize_documents` appends eos.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenize_documents(texts: Sequence[str], tokenizer, max_tokens: int = 128) -> list[list[int]]:
    """Token ids of each text, truncated to ``max_tokens - 1``, with eos appended.

    Every returned document has between 1 and ``max_tokens`` tokens and ends with eos.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}; pass a positive --max-tokens")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ModelError(
            f"the tokenizer ({type(tokenizer).__name__}) has no eos token, which ends every document "
            "as in fine-tuning; use a model directory whose tokenizer sets eos_token (e.g. "
            "'<|endoftext|>' in its special_tokens_map.json), or give documents as input_ids records"
        )
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        out.append(list(ids[: max_tokens - 1]) + [int(eos)])
    return out


# --------------------------------------------------------------------------------------
# Batching and losses
# --------------------------------------------------------------------------------------


def _pad_batch(docs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)] = torch.as_tensor(list(doc), dtype=torch.long)
        mask[row, : len(doc)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _token_losses(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-document token-summed next-token cross-entropy, shape ``(batch,)``, float32.

    The batch is right-padded, so under causal attention no real position can see a padded
    one: an all-ones attention mask gives the real positions exactly the logits the padding
    mask would, and lets the attention take its fast unmasked causal path. Padded positions
    are excluded from the loss through ``labels == -100``.
    """
    del mask  # right padding: see above
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1, :]
    target = labels[:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100, reduction="none"
    )
    return ce.view(target.shape).sum(dim=1)


def _check_documents(documents: Sequence[Sequence[int]], vocab_size: int | None = None) -> None:
    for i, doc in enumerate(documents):
        if len(doc) == 0:
            raise InputError(
                f"document {i} is empty; every document needs at least one token (drop it, or "
                "tokenize with tokenize_documents, which ends each with eos)"
            )
        if vocab_size is not None and (min(doc) < 0 or max(doc) >= vocab_size):
            raise InputError(
                f"document {i} has token ids outside the model's vocabulary [0, {vocab_size}): it was "
                "tokenized for another model; retrain from a base model (--base) that shares the "
                "attributed model's tokenizer"
            )


def _pad_id(model) -> int:
    cfg = model.config
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return 0


@torch.no_grad()
def document_losses(model, documents: Sequence[Sequence[int]], batch_size: int = 16) -> np.ndarray:
    """Token-summed next-token cross-entropy of each document, as float64.

    ``loss[i] = sum_{t>=1} -log p(doc_i[t] | doc_i[:t])``; a one-token document has loss 0.
    Documents are right-padded within a batch; padding is masked out of attention and of the
    loss, so a document's loss does not depend on its batch-mates (up to float rounding).
    The model is put in eval mode.
    """
    documents = list(documents)
    if not documents:
        return np.zeros(0, dtype=np.float64)
    _check_documents(documents, getattr(model.config, "vocab_size", None))
    model.eval()
    device = next(model.parameters()).device
    pad = _pad_id(model)
    out = np.zeros(len(documents), dtype=np.float64)
    for start in range(0, len(documents), batch_size):
        chunk = documents[start : start + batch_size]
        ids, mask, labels = (t.to(device) for t in _pad_batch(chunk, pad))
        out[start : start + len(chunk)] = _token_losses(model, ids, mask, labels).double().cpu().numpy()
    return out


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def _load_model(base_dir_or_model):
    from transformers import GPT2LMHeadModel

    if isinstance(base_dir_or_model, (str, os.PathLike)):
        path = Path(base_dir_or_model)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{path}: not a model directory (no config.json); pass the directory that "
                "save_pretrained wrote (for LDS: --base)"
            )
        return GPT2LMHeadModel.from_pretrained(str(path), local_files_only=True).float()
    if isinstance(base_dir_or_model, torch.nn.Module):
        return copy.deepcopy(base_dir_or_model)
    raise ConfigError(f"expected a model directory or a GPT2LMHeadModel, got {type(base_dir_or_model).__name__}")


def _adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorms)."""
    decay, no_decay = [], []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)


def finetune(
    base_dir_or_model,
    documents: Sequence[Sequence[int]],
    recipe: FinetuneRecipe = FinetuneRecipe(),
    *,
    callback: Callable[[int, float], None] | None = None,
):
    """Fine-tune a copy of the base model on ``documents`` and return it in eval mode.

    ``base_dir_or_model`` is a local model directory or a ``GPT2LMHeadModel`` (which is
    copied, never modified). ``documents`` are token-id lists as made by
    :func:`tokenize_documents`; longer ones are truncated to ``recipe.max_tokens``. The result
    depends only on the base weights, the documents (and their order) and the recipe: two
    runs with the same seed give bit-identical weights (same machine and thread count).
    ``callback(step, loss)`` is called after every optimizer step, if given.
    """
    documents = [list(d[: recipe.max_tokens]) for d in documents]
    model = _load_model(base_dir_or_model)
    if not documents:
        return model.eval()
    _check_documents(documents, model.config.vocab_size)
    device = next(model.parameters()).device

    # Seed the global RNGs (dropout, if a config enables it) without disturbing the caller's.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(recipe.seed)
        _finetune_loop(model, documents, recipe, device, callback)
    return model.eval()


def _finetune_loop(model, documents, recipe: FinetuneRecipe, device, callback) -> None:
    pad = _pad_id(model)
    gen = torch.Generator().manual_seed(recipe.seed)
    n = len(documents)
    steps_per_epoch = math.ceil(n / recipe.batch_size)
    total = steps_per_epoch * recipe.epochs
    opt = _adamw(model, recipe.lr, recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / total))
    norm = float(recipe.batch_size * recipe.max_tokens)

    model.train()
    step = 0
    for _ in range(recipe.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, recipe.batch_size):
            chunk = [documents[i] for i in order[start : start + recipe.batch_size]]
            ids, mask, labels = (t.to(device) for t in _pad_batch(chunk, pad))
            loss = _token_losses(model, ids, mask, labels).sum() / norm
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if recipe.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            if callback is not None:
                callback(step, loss.item())


def pack_blocks(documents: Sequence[Sequence[int]], block_size: int) -> torch.Tensor:
    """Concatenate documents and cut them into full ``block_size`` blocks (the tail is dropped)."""
    flat = [t for d in documents for t in d]
    n_blocks = len(flat) // block_size
    if n_blocks == 0:
        raise InputError(
            f"{len(flat)} tokens do not fill one block of {block_size}; give more pretraining "
            "documents or a smaller PretrainRecipe.block_size"
        )
    return torch.as_tensor(flat[: n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)


def pretrain(
    documents: Sequence[Sequence[int]],
    config=None,
    recipe: PretrainRecipe = PretrainRecipe(),
    *,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
):
    """Pretrain a fresh ``GPT2LMHeadModel`` on packed blocks of ``documents``; eval mode on return.

    ``documents`` are token-id lists ending in eos (:func:`tokenize_documents`, typically
    with a large ``max_tokens`` so that nothing is cut); ``config`` defaults to
    :func:`default_config`. Deterministic for ``recipe.seed`` (initialisation and batches).
    """
    from transformers import GPT2LMHeadModel

    config = config if config is not None else default_config()
    blocks = pack_blocks(documents, recipe.block_size)
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG
        torch.manual_seed(recipe.seed)
        model = GPT2LMHeadModel(config)
        _pretrain_loop(model, blocks, recipe, log, log_every)
    return model.eval()


def _pretrain_loop(model, blocks: torch.Tensor, recipe: PretrainRecipe, log, log_every: int) -> None:
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    opt = _adamw(model, recipe.lr, recipe.weight_decay)

    def lr_at(s: int) -> float:
        if s < recipe.warmup_steps:
            return (s + 1) / recipe.warmup_steps
        frac = (s - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0, running = time.perf_counter(), []
    order = torch.randperm(len(blocks), generator=gen)
    pos = 0
    for step in range(recipe.steps):
        if pos + recipe.batch_size > len(order):
            order, pos = torch.randperm(len(blocks), generator=gen), 0
        batch = blocks[order[pos : pos + recipe.batch_size]]
        pos += recipe.batch_size
        logits = model(input_ids=batch, attention_mask=torch.ones_like(batch)).logits[:, :-1, :]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if recipe.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        opt.step()
        sched.step()
        running.append(loss.item())
        if log is not None and ((step + 1) % log_every == 0 or step + 1 == recipe.steps):
            recent = running[-log_every:]
            log(
                f"pretrain step {step + 1}/{recipe.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"({time.perf_counter() - t0:.1f}s)"
            )


# --------------------------------------------------------------------------------------
# The shipped default
# --------------------------------------------------------------------------------------


def _resolve_root(root: str | os.PathLike | None) -> Path:
    path = Path(root) if root is not None else default_root()
    if not path.is_dir():
        raise ConfigError(
            f"{path}: the default example is missing; regenerate it with "
            "`python examples/make_default.py`, or pass the directory that holds it"
        )
    return path


def load_default(root: str | os.PathLike | None = None, *, which: str = "model"):
    """Load the shipped default ``(model, tokenizer)`` from local files only (no hub access).

    ``which`` is ``"model"`` (the fine-tuned model the default index attributes) or
    ``"base"`` (its pretrained base, the starting point of :func:`finetune`). The model is
    float32 and in eval mode.
    """
    from transformers import AutoTokenizer, GPT2LMHeadModel

    if which not in ("model", "base"):
        raise ConfigError(f"which must be 'model' or 'base', got {which!r}")
    path = _resolve_root(root) / which
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json; regenerate it with `python examples/make_default.py`")
    model = GPT2LMHeadModel.from_pretrained(str(path), local_files_only=True).float()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval(), tokenizer


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a ``.jsonl`` or ``.jsonl.gz`` file (blank lines skipped)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_default_corpus(split: str, root: str | os.PathLike | None = None) -> list[dict]:
    """Records of the default corpus: ``split`` is ``"train"``, ``"pretrain"``, ``"queries"`` or ``"chat"``."""
    base = _resolve_root(root)
    files = {
        "train": base / "corpus" / "train.jsonl.gz",
        "pretrain": base / "corpus" / "pretrain.jsonl.gz",
        "queries": base / "queries.jsonl",
        "chat": base / "corpus" / "chat.jsonl",
    }
    if split not in files:
        raise ConfigError(f"split must be one of {sorted(files)}, got {split!r}")
    return read_jsonl(files[split])
