"""Fixtures for tests that read records and shards (tests/data/, tests/ingest/): a tiny local chat
tokenizer and shard writers. Loaded for every test directory by tests/conftest.py (pytest_plugins).

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences, so
any text round-trips through encode/decode exactly.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

#: Tülu-style template; role markers and eos are special tokens of the tiny tokenizer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_TRAINING_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant",
    "hello world, how are you today?",
    "what is the capital of france? paris is the capital of france.",
    "tell me a joke about cats and dogs",
    "training data attribution finds the documents behind a prediction",
]


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A ~300-token byte-level BPE tokenizer that adds BOS (``<s>``) by default, no EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TRAINING_SENTENCES, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    kwargs: dict[str, Any] = {}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
        **kwargs,
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def jsonl_bytes(lines: Sequence[dict[str, Any] | str]) -> bytes:
    """JSON Lines content; str items are written verbatim (malformed or blank lines)."""
    out = []
    for line in lines:
        out.append(line if isinstance(line, str) else json.dumps(line))
    return ("\n".join(out) + "\n").encode("utf-8")


def write_jsonl(path: Path, lines: Sequence[dict[str, Any] | str]) -> Path:
    """Write lines as JSON Lines, compressed by the file name (``.gz``, ``.zst``)."""
    data = jsonl_bytes(lines)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return path


def write_parquet(path: Path, rows: Sequence[dict[str, Any]], *, row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path, row_group_size=row_group_size)
    return path


def write_hf(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    import datasets

    datasets.Dataset.from_list(list(rows)).save_to_disk(str(path))
    return path


@pytest.fixture
def quiet_datasets(monkeypatch):
    # No progress bars or cache writes outside tmp_path from `datasets`.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()


# Helpers as fixtures: test modules must not `import conftest` (several conftest.py files in
# a tree without __init__.py would clash on that module name).
@pytest.fixture(scope="session")
def jsonl_writer():
    return write_jsonl


@pytest.fixture(scope="session")
def parquet_writer():
    return write_parquet


@pytest.fixture(scope="session")
def hf_writer():
    return write_hf


@pytest.fixture(scope="session")
def tokenizer_factory():
    return make_tokenizer
