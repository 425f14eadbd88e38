"""Long documents split into windows (``--long-documents windows``): rows with a parent_id,
every counted token in exactly one window, read back for explain, resumed after a SIGKILL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.store.table import Store
from ingest.pipeline import run_ingest
from ingest.records import Example, RecordSpec, iter_examples

REPO = Path(__file__).resolve().parents[2]
WINDOW = 16
BATCH = 2
SENTENCE = "the quick brown fox jumps over the lazy dog, "


def _text(i: int, repeats: int) -> str:
    return f"doc {i}: " + SENTENCE * repeats


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tokenizer):
    """A fitted, empty index (max_tokens 16) whose manifest names a model directory on disk."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("windows")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=128,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    fit_shard = root / "fit.jsonl"
    fit_shard.write_text("".join(json.dumps({"text": _text(i, 1)}) + "\n" for i in range(12)))
    examples = list(iter_examples([fit_shard], RecordSpec(max_tokens=WINDOW), tokenizer))
    AttributionIndex.create(
        root / "index",
        model,
        tokenizer,
        examples,
        model_name=str(root / "model"),
        projection=ProjectionConfig(k=8),
        curvature=CurvatureConfig(num_examples=12, batch_size=4),
        gradients=GradientConfig(batch_size=BATCH, max_tokens=WINDOW),
        progress=False,
    )
    return root / "index"


@pytest.fixture
def index_dir(fitted, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(fitted, tmp_path / "index"))


def _rows(index_dir: Path) -> list[dict]:
    columns = ["id", "parent_id", "window", "position", "num_tokens", "num_loss_tokens", "truncated"]
    return sorted(Store(index_dir, "examples").read(columns).to_pylist(), key=lambda r: (r["position"], r["window"]))


def test_long_document_becomes_window_rows_with_one_parent_id(index_dir, tmp_path, tokenizer):
    from eogp_index.cli import cli

    records = [{"id": "short", "text": "hello world"}, {"id": "long", "text": _text(0, 6)}]
    shard = tmp_path / "docs.jsonl"
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(
        cli,
        [
            "ingest",
            str(index_dir),
            str(shard),
            "--id-field",
            "id",
            "--long-documents",
            "windows",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output

    short, long_doc = iter_examples([shard], RecordSpec(id_field="id"), tokenizer)  # untruncated
    n = long_doc.num_tokens
    assert n > 3 * WINDOW
    expected_windows = -(-(n - 1) // (WINDOW - 1))
    rows = _rows(index_dir)
    assert rows[0] == {
        "id": "short",
        "parent_id": "short",
        "window": 0,
        "position": 0,
        "num_tokens": short.num_tokens,
        "num_loss_tokens": short.num_loss_tokens,
        "truncated": False,
    }
    windows = rows[1:]
    assert [r["id"] for r in windows] == [f"long#{j}" for j in range(expected_windows)]
    assert {r["parent_id"] for r in windows} == {"long"} and [r["window"] for r in windows] == list(range(len(windows)))
    assert all(r["num_tokens"] <= WINDOW and not r["truncated"] for r in windows)
    # Every counted token of the document is counted in exactly one window.
    assert sum(r["num_loss_tokens"] for r in windows) == long_doc.num_loss_tokens

    # explain reads each window back from the shard: its own tokens, checked against the stored hash.
    index = AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=BATCH, device="cpu"))
    start = (WINDOW - 1) * 2
    third = index.stored.document("long#2", index.tokenizer)
    assert third.input_ids == long_doc.input_ids[start : start + WINDOW]
    # The stored row holds the window's own gradient.
    stored = Store(index_dir, "examples").read(["signs", "scales"], where="id = 'long#2'").to_pylist()[0]
    encoded = index.encode_rows([third]).select(["signs", "scales"]).to_pylist()[0]
    assert stored == encoded
    explained = index.explain_many({"text": "the quick brown fox"}, ["long#2"])[0]
    assert len(explained.train_tokens) == third.num_tokens


@pytest.mark.distributed
def test_killed_windowed_ingest_stores_every_window_exactly_once(index_dir, tmp_path, tokenizer, killed_ingest):
    shard = tmp_path / "long.jsonl"
    shard.write_text("".join(json.dumps({"text": _text(i, 4)}) + "\n" for i in range(3)))
    spec = RecordSpec(long_documents="windows", max_tokens=WINDOW)
    expected = [e.id for e in iter_examples([shard], spec, tokenizer)]
    assert len(expected) >= 3 * 3  # several windows per document
    after_kill = killed_ingest(index_dir, str(shard), "RecordSpec(long_documents='windows')", at_least=3)
    assert 3 <= after_kill < len(expected), f"kill landed outside the shard (rows: {after_kill})"

    index = AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=BATCH, device="cpu"))
    summary = run_ingest(index, [shard], spec=RecordSpec(long_documents="windows"), batch_size=2, progress=False)
    assert summary.skipped_existing == after_kill and summary.stored == len(expected) - after_kill
    ids = Store(index_dir, "examples").read(["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(expected)  # every window, each once


def test_split_windows_counts_each_label_once_and_drops_windows_with_none():
    from eogp_index.data.records import split_windows

    labels = [-100] * 9 + list(range(9, 20))  # a masked prompt longer than the first window
    doc = Example.from_ids("d", list(range(20)), labels)
    windows = split_windows(doc, 5)
    counted = [t for w in windows for t in w.labels[1:] if t != -100]
    assert sorted(counted) == list(range(9, 20))
    assert [w.metadata["window"] for w in windows] == [2, 3, 4]  # windows 0 and 1 count nothing
    assert all(w.metadata["parent_id"] == "d" and w.num_tokens <= 5 for w in windows)
    assert split_windows(doc, 20)[0].id == "d" and np.isscalar(split_windows(doc, 20)[0].metadata["window"])


def test_each_window_stores_and_explains_its_own_span_of_the_document(index_dir, tmp_path, tokenizer):
    from eogp_index.cli import cli

    text = "".join(f"part {j}: the quick brown fox jumps over the lazy dog. " for j in range(8))
    shard = tmp_path / "docs.jsonl"
    shard.write_text(json.dumps({"id": "long", "text": text}) + "\n")
    args = ["ingest", str(index_dir), str(shard), "--id-field", "id", "--long-documents", "windows"]
    result = CliRunner().invoke(cli, [*args, "--store-text", "--batch-size", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output

    (whole,) = iter_examples([shard], RecordSpec(id_field="id"), tokenizer)  # untruncated
    rows = sorted(Store(index_dir, "examples").read(["id", "window", "text"]).to_pylist(), key=lambda r: r["window"])
    assert len(rows) > 3
    spans = [row["text"] for row in rows]
    assert len(set(spans)) == len(spans) and spans[0].startswith("part 0:") and not spans[1].startswith("part 0:")
    offset = 0
    for row in rows:
        start = row["window"] * (WINDOW - 1)
        ids = whole.input_ids[start : start + WINDOW]
        # The span is exactly the characters the window's tokens cover, in order through the document.
        assert row["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        found = text.index(row["text"].lstrip(), offset)
        assert found >= offset and text[found:].startswith(row["text"].lstrip())
        offset = found
    index = AttributionIndex.open(index_dir, gradients=GradientConfig(batch_size=BATCH, device="cpu"))
    explained = index.explain_many({"text": "the quick brown fox"}, ["long#2"])[0]
    assert explained.text == rows[2]["text"] and len(explained.train_tokens) == WINDOW


def test_window_spans_by_offsets_equal_the_decoded_windows_of_a_slow_tokenizer(tokenizer):
    from eogp_index.data.records import tokenize_windows

    class Slow:  # the same tokenizer, seen as one without offsets
        is_fast = False

        def __call__(self, text, **kwargs):
            return tokenizer(text, **kwargs)

        def __len__(self):
            return len(tokenizer)

        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    record = {"text": "".join(f"line {j}: the lazy dog sleeps. " for j in range(6))}
    spec = RecordSpec(long_documents="windows", max_tokens=WINDOW)
    fast = tokenize_windows(record, shard="s.jsonl", position=0, spec=spec, tokenizer=tokenizer)
    slow = tokenize_windows(record, shard="s.jsonl", position=0, spec=spec, tokenizer=Slow())
    assert len(fast) > 2 and [w.input_ids for w in fast] == [w.input_ids for w in slow]
    assert [w.display_text for w in fast] == [w.display_text for w in slow]
    assert len({w.display_text for w in fast}) == len(fast) and fast[0].display_text.startswith("line 0:")
    assert all(w.content == {"text": record["text"]} for w in fast)  # the hash is the document's
