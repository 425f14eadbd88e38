"""Datasets as Hugging Face users name them: a local dataset repository (Parquet files and a
dataset card with a config and two splits), read with ``load_dataset(..., streaming=True)``,
fitted on and ingested with ``--split`` / ``--config``, resumed after a SIGKILL, read back by
explain. Nothing is downloaded (the hub path is the same call with a repository name)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from eogp_index.data.readers import dataset_source, expand_shards, iter_raw_records, with_split
from eogp_index.errors import InputError

CARD = """---
configs:
- config_name: docs
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
---
# A tiny dataset repository
"""
SENTENCE = "the quick brown fox jumps over the lazy dog"


def _rows(split: str, start: int, n: int) -> list[dict]:
    return [
        {"id": f"{split}-{i}", "text": f"{split} {i}: {SENTENCE}", "source": split} for i in range(start, start + n)
    ]


@pytest.fixture(scope="module")
def repository(tmp_path_factory, parquet_writer):
    """A dataset repository: the card and three Parquet files (train in two)."""
    root = tmp_path_factory.mktemp("repo") / "stdlib-docs"
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text(CARD)
    parquet_writer(root / "data" / "train-00000.parquet", _rows("train", 0, 6))
    parquet_writer(root / "data" / "train-00001.parquet", _rows("train", 6, 6))
    parquet_writer(root / "data" / "test-00000.parquet", _rows("test", 0, 4))
    return root


def test_a_dataset_repository_is_read_one_split_at_a_time(repository):
    train = with_split(str(repository), "train", "docs")
    assert train == f"{repository}::docs/train"
    records = list(iter_raw_records(train))
    assert [(r.shard, r.position, r.record["id"]) for r in records] == [
        ("stdlib-docs::docs/train", i, f"train-{i}") for i in range(12)
    ]
    assert [r.record["id"] for r in iter_raw_records(with_split(str(repository), "test", None))] == [
        f"test-{i}" for i in range(4)
    ]
    assert expand_shards([train]) == [Path(train)]
    with pytest.raises(InputError, match=r"stdlib-docs: is a dataset: name its split"):
        expand_shards([repository])
    with pytest.raises(InputError, match=r"cannot load split 'dev' of config 'docs'"):
        list(iter_raw_records(with_split(str(repository), "dev", "docs")))
    # Hub names are datasets; a missing local file is not.
    assert dataset_source("hf://datasets/allenai/c4") == "allenai/c4" == dataset_source("allenai/c4")
    assert dataset_source("data/train.jsonl") is None


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, repository, tokenizer):
    """An index fitted through `eogp fit MODEL --data REPO --split train --config docs` (no rows)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from eogp_index.cli import cli

    root = tmp_path_factory.mktemp("fitted")
    torch.manual_seed(0)
    GPT2LMHeadModel(
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
    ).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    result = CliRunner().invoke(
        cli,
        [
            "fit",
            str(root / "model"),
            "--data",
            str(repository),
            "--split",
            "train",
            "--config",
            "docs",
            "--out",
            str(root / "index"),
            "-k",
            "8",
            "--curvature-examples",
            "8",
            "--pca-examples",
            "8",
            "--max-tokens",
            "64",
            "--batch-size",
            "2",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "sampled from 12 records" in result.output
    return root / "index"


def _stored(index_dir: Path, columns=("id", "shard", "position", "source")) -> list[dict]:
    from eogp_index.store.table import Store

    return Store(index_dir, "examples").read(list(columns)).to_pylist()


def test_ingest_a_split_and_explain_reads_a_document_back(fitted, repository, tmp_path):
    from eogp_index.cli import cli
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    index_dir = Path(shutil.copytree(fitted, tmp_path / "index"))
    command = [
        "ingest",
        str(index_dir),
        str(repository),
        "--split",
        "train",
        "--config",
        "docs",
        "--id-field",
        "id",
        "--metadata",
        "source",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--json",
    ]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    rows = sorted(_stored(index_dir), key=lambda r: r["position"])
    assert [(r["id"], r["shard"], r["position"], r["source"]) for r in rows] == [
        (f"train-{i}", "stdlib-docs::docs/train", i, "train") for i in range(12)
    ]
    sources = json.loads((index_dir / "sources.json").read_text())["shards"]
    assert sources["stdlib-docs::docs/train"]["uri"] == f"{repository.resolve()}::docs/train"

    # explain reads the document back from the dataset, checked against its stored content hash.
    index = AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=2, device="cpu"))
    document = index.stored.document("train-7", index.tokenizer)
    assert not document.truncated
    assert index.tokenizer.decode(document.input_ids, skip_special_tokens=True) == f"train 7: {SENTENCE}"
    explained = index.explain_many("the quick brown fox", ["train-7"])[0]
    assert explained.text == f"train 7: {SENTENCE}" and len(explained.train_tokens) == document.num_tokens

    # Run again: nothing new.
    again = CliRunner().invoke(cli, command)
    assert again.exit_code == 0, again.output
    again = json.loads(again.stdout[again.stdout.index("{") :])
    assert (again["stored"], again["skipped_existing"]) == (0, 12)


@pytest.mark.distributed
def test_rerun_after_sigkill_stores_each_record_once(fitted, repository, tmp_path, killed_ingest):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    index_dir = Path(shutil.copytree(fitted, tmp_path / "index"))
    shard = with_split(str(repository), "train", "docs")
    after_kill = killed_ingest(index_dir, shard, "RecordSpec(id_field='id')", at_least=2)
    assert 2 <= after_kill < 12, f"kill landed outside the split (rows: {after_kill})"
    index = AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=2, device="cpu"))
    summary = run_ingest(index, [shard], spec=RecordSpec(id_field="id"), batch_size=2, progress=False)
    assert summary.skipped_existing == after_kill and summary.stored == 12 - after_kill
    assert sorted(r["id"] for r in _stored(index_dir, ["id"])) == sorted(f"train-{i}" for i in range(12))
