"""Shared fixtures: tiny real transformers models built from configs, and tokenized examples.

Nothing here downloads anything: models are built from configs with fixed seeds, and the
default tokenizer/model of the project are read from ``examples/default``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import List

import pytest
import torch

from eogp_index.client import TokenizedExample

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def make_tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, n_inner=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def make_tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


def make_examples(n: int, *, seed: int = 0, prefix: str = "ex", min_len: int = 5, max_len: int = 18,
                  masked_prompt: bool = False) -> List[TokenizedExample]:
    """Random token sequences; with ``masked_prompt`` the first few labels are -100 (chat-like)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1, VOCAB) for _ in range(length)]
        labels = list(ids)
        if masked_prompt:
            cut = rng.randint(1, length - 2)
            labels[:cut] = [-100] * cut
        out.append(TokenizedExample(id=f"{prefix}-{i}", input_ids=ids, labels=labels, shard="synthetic",
                                    position=i, num_tokens=length, metadata={"group": i % 3, "name": f"doc{i}"}))
    return out


class TinyTokenizer:
    """Enough of a tokenizer for pre-tokenized examples and queries: a pad id and a vocabulary size."""

    pad_token_id = 0
    eos_token_id = 0
    name_or_path = "tiny"

    def __len__(self) -> int:
        return VOCAB


@pytest.fixture
def tiny_tokenizer():
    return TinyTokenizer()


@pytest.fixture(scope="session")
def fitted_index_template(tmp_path_factory):
    """A real index (tiny GPT-2, EOGP k=16, 1 bit) with 40 examples, built once per session."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig

    path = tmp_path_factory.mktemp("template") / "index"
    index = AttributionIndex.create(
        path, make_tiny_gpt2(), TinyTokenizer(), make_examples(40, seed=11), model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=40, batch_size=8), gradients=GradientConfig(batch_size=8),
        progress=False)
    # Several commits, so the table has several fragments.
    for start in range(0, 40, 10):
        index.add_batch(make_examples(40, seed=11)[start:start + 10])
    return path


@pytest.fixture
def fitted_index(fitted_index_template, tmp_path):
    """A private copy of the session's fitted index, opened."""
    import shutil

    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    path = tmp_path / "index"
    shutil.copytree(fitted_index_template, path)
    return AttributionIndex.open(path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(),
                                 gradients=GradientConfig(batch_size=8))


def make_word_tokenizer():
    """A real (saveable) tokenizer over the tiny models' vocabulary: tokens ``t0`` … ``t63``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0", eos_token="t0")
