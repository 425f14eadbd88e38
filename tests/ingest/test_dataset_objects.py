"""A ``datasets.Dataset`` or ``IterableDataset`` passed from Python as a shard: named from its info
or by the caller, fitted on, ingested record by record with its iteration index as the position
(a rerun stores nothing twice, the iterable form gives the same rows), recorded in sources.json,
and explained from its stored text (and refused, saying why, without it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eogp_index.data.readers import dataset_shard, expand_shards, iter_raw_records, shard_names, with_split
from eogp_index.errors import ConfigError, InputError

CARD = """---
configs:
- config_name: docs
  data_files:
  - split: train
    path: data/train-*.parquet
---
"""
SENTENCE = "the quick brown fox jumps over the lazy dog"
ROWS = [{"id": f"train-{i}", "text": f"train {i}: {SENTENCE}", "source": "train"} for i in range(12)]


@pytest.fixture(scope="module")
def corpus():
    import datasets

    return datasets.Dataset.from_list(ROWS)


def test_a_dataset_object_is_named_from_its_info_or_by_the_caller(corpus, tmp_path, parquet_writer):
    import datasets

    with pytest.raises(InputError, match=r"no stable name .*from_list.*dataset_shard\(dataset, 'my-corpus'\)"):
        expand_shards([corpus])
    with pytest.raises(InputError, match="no stable name"):
        dataset_shard(corpus.to_iterable_dataset())
    with pytest.raises(InputError, match=r"DatasetDict holds several splits \[train\]; pass one of them"):
        expand_shards(datasets.DatasetDict(train=corpus))
    named = dataset_shard(corpus, "corpus")
    assert [(r.shard, r.position, r.record) for r in iter_raw_records(named)] == [
        ("corpus", i, row) for i, row in enumerate(ROWS)
    ]
    streamed = dataset_shard(corpus.to_iterable_dataset(num_shards=3), "corpus")
    assert [(r.position, r.record) for r in iter_raw_records(streamed)] == list(enumerate(ROWS))
    with pytest.raises(InputError, match="give each dataset its own name"):
        shard_names(expand_shards([named, streamed]))

    # Loaded by name, a split is named as the same split read by `--data DIR --split`.
    repository = tmp_path / "stdlib-docs"
    (repository / "data").mkdir(parents=True)
    (repository / "README.md").write_text(CARD)
    parquet_writer(repository / "data" / "train-00000.parquet", ROWS)
    loaded = datasets.load_dataset(str(repository), "docs", split="train", cache_dir=str(tmp_path / "cache"))
    stream = datasets.load_dataset(str(repository), "docs", split="train", streaming=True)
    expected = shard_names([with_split(str(repository), "train", "docs")])[0]
    assert dataset_shard(loaded).name == dataset_shard(stream).name == expected == "stdlib-docs::docs/train"
    by_path = [(r.position, r.record) for r in iter_raw_records(with_split(str(repository), "train", "docs"))]
    assert [(r.position, r.record) for r in iter_raw_records(dataset_shard(loaded))] == by_path
    assert [(r.position, r.record) for r in iter_raw_records(dataset_shard(stream))] == by_path
    # Another order or selection under the same info has no stable name of its own.
    for derived in (
        loaded.shuffle(seed=0),
        loaded.filter(lambda r: r["id"] != "train-3"),
        loaded.skip(2),
        stream.shuffle(seed=0),
        stream.skip(2),
    ):
        with pytest.raises(InputError, match="no stable name .*not split 'train' of stdlib-docs"):
            dataset_shard(derived)
    assert dataset_shard(loaded.shuffle(seed=0), "shuffled").name == "shuffled"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, corpus, tokenizer):
    """An empty index fitted, from Python, on a sample of the Dataset object."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
    from eogp_index.data.records import RecordSpec
    from eogp_index.fit.sampling import sample_shards

    root = tmp_path_factory.mktemp("fitted")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=64,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    examples, seen = sample_shards(dataset_shard(corpus, "corpus"), RecordSpec(max_tokens=64), tokenizer, 12, seed=0)
    assert seen == 12 and sorted(ex.position for ex in examples) == list(range(12))
    AttributionIndex.create(
        root / "index",
        model,
        tokenizer,
        examples,
        model_name=str(root / "model"),
        curvature=CurvatureConfig(num_examples=6, batch_size=2),
        projection=ProjectionConfig(k=8, num_fit_examples=6),
        gradients=GradientConfig(batch_size=2, device="cpu", max_tokens=64),
        progress=False,
    )
    return root / "index"


def _open(index_dir: Path):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    return AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=2, device="cpu"))


def _stored(index_dir: Path) -> list[dict]:
    from eogp_index.store.table import Store

    store = Store(index_dir, "examples")
    return sorted(store.read(store.schema.names).to_pylist(), key=lambda r: r["position"])


def _ingest(index, shard, **options):
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    return run_ingest(
        index,
        [shard],
        spec=RecordSpec(id_field="id", metadata_fields=("source",)),
        batch_size=4,
        progress=False,
        **options,
    )


def test_ingest_a_dataset_and_explain_from_its_stored_text(fitted, corpus, tmp_path):
    index_dir = Path(shutil.copytree(fitted, tmp_path / "index"))
    index = _open(index_dir)
    summary = _ingest(index, dataset_shard(corpus, "corpus"), store_text=4096)
    assert (summary.stored, summary.skipped_existing) == (12, 0)
    rows = _stored(index_dir)
    assert [(r["id"], r["shard"], r["position"], r["source"], r["text"]) for r in rows] == [
        (row["id"], "corpus", i, "train", row["text"]) for i, row in enumerate(ROWS)
    ]
    entry = json.loads((index_dir / "sources.json").read_text())["shards"]["corpus"]
    assert entry["uri"] is None
    assert entry["dataset"] == {
        "type": "Dataset",
        "dataset_name": None,
        "config_name": None,
        "split": None,
        "num_rows": 12,
        "fingerprint": corpus._fingerprint,
    }

    # A rerun stores nothing twice, from the Dataset or from the same records streamed.
    again = _ingest(index, dataset_shard(corpus, "corpus"), store_text=4096)
    assert (again.stored, again.skipped_existing) == (0, 12)
    streamed = _ingest(index, dataset_shard(corpus.to_iterable_dataset(num_shards=2), "corpus"), store_text=4096)
    assert (streamed.stored, streamed.skipped_existing) == (0, 12)
    assert (
        json.loads((index_dir / "sources.json").read_text())["shards"]["corpus"]["dataset"]["type"] == "IterableDataset"
    )

    # explain reads the stored text back (checked against the stored content hash).
    document = index.stored.document("train-7", index.tokenizer)
    assert index.tokenizer.decode(document.input_ids, skip_special_tokens=True) == ROWS[7]["text"]
    explained = index.explain_many("the quick brown fox", ["train-7"])[0]
    assert explained.text == ROWS[7]["text"] and len(explained.train_tokens) == document.num_tokens

    # AttributionIndex.ingest takes examples: it points at run_ingest for a dataset.
    with pytest.raises(ConfigError, match=r"run_ingest\(index, \[dataset\]"):
        index.ingest(corpus)


def test_an_iterable_dataset_stores_the_same_rows(fitted, corpus, tmp_path):
    by_dataset = Path(shutil.copytree(fitted, tmp_path / "dataset"))
    by_iterable = Path(shutil.copytree(fitted, tmp_path / "iterable"))
    _ingest(_open(by_dataset), dataset_shard(corpus, "corpus"), store_text=4096)
    # An ingest cut short (the first 5 records), then the whole stream: the rest goes in, once.
    iterable = _open(by_iterable)
    cut_short = dataset_shard(corpus.to_iterable_dataset(num_shards=3).take(5), "corpus")
    first = _ingest(iterable, cut_short, store_text=4096)
    assert first.stored == 5
    summary = _ingest(iterable, dataset_shard(corpus.to_iterable_dataset(num_shards=3), "corpus"), store_text=4096)
    assert (summary.stored, summary.skipped_existing) == (7, 5)
    assert _stored(by_iterable) == _stored(by_dataset)  # ids, positions, content hashes and codes alike


def test_without_stored_text_explain_says_the_document_cannot_be_read_back(fitted, corpus, tmp_path):
    index_dir = Path(shutil.copytree(fitted, tmp_path / "index"))
    index = _open(index_dir)
    assert _ingest(index, dataset_shard(corpus, "corpus")).stored == 12
    with pytest.raises(
        InputError,
        match=r"shard 'corpus' was ingested from a Dataset object in memory, which cannot "
        r"be read back.*--store-text",
    ):
        index.stored.document("train-3", index.tokenizer)
    with pytest.raises(InputError, match="cannot be read back"):
        index.explain_many("the quick brown fox", ["train-3"])
