"""Tiny real transformers models built from configs, tokenizers and tokenized examples.

A plain module (``import tinymodels``), not conftest: several conftest.py files exist under
tests/, so importing names from "conftest" is ambiguous. Nothing here downloads anything.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import List

import torch

from eogp_index.data.records import Example

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def make_tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_inner=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()


def make_tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).eval()


def make_examples(
    n: int, *, seed: int = 0, prefix: str = "ex", min_len: int = 5, max_len: int = 18, masked_prompt: bool = False
) -> List[Example]:
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
        out.append(
            Example.from_ids(
                id=f"{prefix}-{i}",
                input_ids=ids,
                labels=labels,
                shard="synthetic",
                position=i,
                metadata={"group": i % 3, "name": f"doc{i}"},
            )
        )
    return out


class TinyTokenizer:
    """Enough of a tokenizer for pre-tokenized examples and queries: a pad id and a vocabulary size."""

    pad_token_id = 0
    eos_token_id = 0
    name_or_path = "tiny"

    def __len__(self) -> int:
        return VOCAB


def make_word_tokenizer():
    """A real (saveable) tokenizer over the tiny models' vocabulary: tokens ``t0`` … ``t63``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0", eos_token="t0")


def save_workspace(root: Path, model, documents: int, *, stride: int = 7, numbered: bool = False) -> Path:
    """``root/model`` (``model`` and :func:`make_word_tokenizer`, saved) and ``root/shard.jsonl``
    of ``documents`` word documents ``{"id": "d<i>", "text": "t.. t.."}`` (document ``i``'s words
    start at ``t<i · stride + 1>``; ``numbered``: with ``"n": i``); returns ``root``."""
    import json

    model.save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    lines = [
        json.dumps(
            {"id": f"d{i}", "text": " ".join(f"t{(i * stride + j) % 63 + 1}" for j in range(6 + i % 9))}
            | ({"n": i} if numbered else {})
        )
        for i in range(documents)
    ]
    (root / "shard.jsonl").write_text("\n".join(lines) + "\n")
    return root


def kronfluence_scores(
    index, queries, train, *, per_token: bool = False, preference: bool = False, aggregate_queries: bool = False
):
    """kronfluence's own uncompressed EK-FAC pairwise scores from the index's factors, float64:
    ``(n_queries, n_train)``, or ``(n_queries, n_train, T_max)`` per training token; with
    ``aggregate_queries`` ``(1, n_train)``, the scores of the queries' summed loss (kronfluence's
    aggregated query gradients).

    ``queries`` and ``train`` are examples with ``input_ids`` and ``labels``; with ``preference``
    each query is a ``(chosen, rejected)`` pair of examples, measured in kronfluence's
    ``Task.compute_measurement`` as ``loss(chosen) - loss(rejected)`` (two forward passes, which
    kronfluence accumulates with ``has_shared_parameters``).
    """
    import logging

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    from eogp_index.fit.curvature import ANALYSIS_NAME, FACTORS_NAME, _ExampleDataset, _unwrap_tracked_modules
    from eogp_index.fit.task import LanguageModelingTask
    from eogp_index.gradients.loss import collate, logits_of, per_example_loss

    class PreferenceTask(LanguageModelingTask):
        def compute_measurement(self, batch, model):
            chosen, rejected = batch
            return (
                per_example_loss(logits_of(model, chosen), chosen["labels"]).sum()
                - per_example_loss(logits_of(model, rejected), rejected["labels"]).sum()
            )

    def collate_any(items):
        if preference and isinstance(items[0][0][0], (tuple, list)):  # (chosen, rejected) pairs
            return collate([c for c, _ in items], 0), collate([r for _, r in items], 0)
        return collate(items, 0)

    def pair(e):
        return (e.input_ids, e.labels)

    task = (PreferenceTask if preference else LanguageModelingTask)(modules=index.manifest.module_names)
    prepared = prepare_model(index.model, task)
    try:
        analyzer = Analyzer(
            analysis_name=ANALYSIS_NAME,
            model=prepared,
            task=task,
            cpu=True,
            disable_tqdm=True,
            output_dir=str(index.path / "curvature"),
            log_level=logging.WARNING,
        )
        if preference:
            fitted_args = analyzer.load_factor_args
            analyzer.load_factor_args = lambda factors_name: dataclasses.replace(
                fitted_args(factors_name), has_shared_parameters=True
            )
        analyzer.compute_pairwise_scores(
            scores_name="reference",
            factors_name=FACTORS_NAME,
            query_dataset=_ExampleDataset([(pair(q[0]), pair(q[1])) if preference else pair(q) for q in queries]),
            train_dataset=_ExampleDataset([pair(e) for e in train]),
            # One batch of queries: kronfluence recomputes every training gradient per query batch.
            per_device_query_batch_size=len(queries),
            per_device_train_batch_size=len(train) if per_token else 3,
            dataloader_kwargs=DataLoaderKwargs(collate_fn=collate_any),
            score_args=ScoreArguments(
                damping_factor=None, compute_per_token_scores=per_token, aggregate_query_gradients=aggregate_queries
            ),
            overwrite_output_dir=True,
        )
        return analyzer.load_pairwise_scores("reference")["all_modules"].double().numpy()
    finally:
        _unwrap_tracked_modules(index.model)


def tiny_index(path, examples, commits, *, curvature_examples: int = 16, store_text=None, **projection):
    """The tiny GPT-2's index of ``examples`` (:class:`TinyTokenizer` ids), fitted on all of them
    (``k = 16``, ``m = 64``, EOGP and an int8 tier unless ``projection`` says otherwise: any of
    ``variant``, ``k``, ``rescore``, ``rescore_k``), then ingested in one commit (one fragment)
    per slice ``examples[commits[i]:commits[i + 1]]`` (``store_text``: as ``add_batch`` takes it)."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig

    storage = {key: projection.pop(key) for key in ("rescore", "rescore_k") if key in projection}
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        examples,
        model_name="tiny",
        projection=ProjectionConfig(**{"variant": "eogp", "k": 16, "m": 64, **projection}),
        storage=StorageConfig(**storage),
        curvature=CurvatureConfig(num_examples=curvature_examples, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    ends = [*commits[1:], len(examples)]
    for start, end in zip(commits, ends):
        index.add_batch(examples[start:end], store_text=store_text)
    return index


def full_width_index(path, model, train, **create_kwargs):
    """An index at full width (``m_u = k_u = d_u``, no PCA, float32 coordinates) over ``train``,
    whose scores are EK-FAC influence itself: what kronfluence's are compared with."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, ProjectionConfig, StorageConfig

    index = AttributionIndex.create(
        path,
        model,
        TinyTokenizer(),
        train,
        projection=ProjectionConfig(variant="ekfac-topk", k=10**9),
        storage=StorageConfig(precision="fp32"),
        curvature=CurvatureConfig(num_examples=len(train), batch_size=4),
        progress=False,
        **create_kwargs,
    )
    assert all(m.k == m.d_out * m.d_in for m in index.manifest.modules)
    index.ingest(train, progress=False)
    return index


def relative_error_to_kronfluence(index, queries, train) -> float:
    """``‖ours − kronfluence‖ / ‖kronfluence‖`` over the scores of ``queries`` against ``train``."""
    import numpy as np

    ids, ours = index.scores([{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in queries])
    reference = kronfluence_scores(index, queries, train)
    order = [ids.index(e.id) for e in train]
    return float(np.linalg.norm(ours[:, order] - reference) / np.linalg.norm(reference))
