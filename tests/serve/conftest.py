"""One small real index for the server tests, built once per session through the CLI.

A tiny GPT-2 and a word tokenizer saved to disk, 40 documents fitted with `eogp fit` and
ingested by the library's ingest run with their text stored (``store_text``), so that hits and
explanations carry the document's text.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tinymodels import make_tiny_gpt2, make_word_tokenizer

__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

KINDS = ("function", "class", "module")


def _text(i: int) -> str:
    return " ".join(f"t{(i * 7 + j * 3) % 63 + 1}" for j in range(6 + i % 11))


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory):
    from eogp_index.cli import cli

    root = tmp_path_factory.mktemp("serve")
    make_tiny_gpt2().save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    records = [{"id": f"doc-{i}", "text": _text(i), "kind": KINDS[i % 3], "n": i} for i in range(40)]
    (root / "shard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runner = CliRunner()
    fit = runner.invoke(
        cli,
        [
            "fit",
            str(root / "model"),
            "--data",
            str(root / "shard.jsonl"),
            "--out",
            str(root / "idx"),
            "-k",
            "16",
            "--curvature-examples",
            "40",
            "--pca-examples",
            "40",
            "--max-tokens",
            "24",
        ],
    )
    assert fit.exit_code == 0, fit.output
    from eogp_index.data.records import RecordSpec
    from eogp_index.serve.app import open_index
    from ingest.pipeline import run_ingest

    summary = run_ingest(
        open_index(root / "idx", device="cpu"),
        [root / "shard.jsonl"],
        spec=RecordSpec(id_field="id", metadata_fields=("kind", "n")),
        store_text=4096,
        progress=False,
    )
    assert summary.stored == 40, summary
    return root / "idx"


@pytest.fixture(scope="session")
def served_index(index_dir):
    """The index opened with its model, shared by every server test (the server never writes rows)."""
    from eogp_index.serve.app import open_index

    return open_index(index_dir, device="cpu")
