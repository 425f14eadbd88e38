"""The `eogp` command line on a real (tiny) model saved to disk, end to end."""

import json

import pytest
from click.testing import CliRunner

from tinymodels import make_tiny_gpt2, make_word_tokenizer
from eogp_index.cli import cli

# CliRunner swaps sys.stdout/sys.stderr per call, and transformers' logging handler keeps the
# stream of the first call, which can land its config warnings in a later call's stdout.
# Its weight-loading progress bar likewise.
__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_tiny_gpt2().save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    lines = [json.dumps({"id": f"d{i}", "text": " ".join(f"t{(i * 7 + j) % 63 + 1}" for j in range(6 + i % 9)),
                         "kind": "ab"[i % 2], "n": i}) for i in range(30)]
    (root / "shard.jsonl").write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    fit = runner.invoke(cli, ["fit", str(root / "model"), "--data", str(root / "shard.jsonl"), "--out",
                              str(root / "idx"), "-k", "16", "--curvature-examples", "30", "--pca-examples", "30",
                              "--max-tokens", "24", "--json"])
    assert fit.exit_code == 0, fit.output
    ingest = runner.invoke(cli, ["ingest", str(root / "idx"), str(root / "shard.jsonl"), "--id-field", "id",
                                 "--metadata", "kind", "--metadata", "n", "--json"])
    assert ingest.exit_code == 0, ingest.output
    return root, json.loads(fit.stdout), json.loads(ingest.stdout)


def _run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result


def test_fit_and_ingest_report_json(workspace):
    root, fitted, summary = workspace
    assert fitted["projection"]["variant"] == "eogp" and all(m["k"] == 16 for m in fitted["modules"])
    assert summary["stored"] == 30 and summary["rejected"] == 0
    info = json.loads(_run("info", root / "idx", "--json").stdout)
    assert info["rows"] == 30 and info["bytes_per_example"] == 8 * (2 + 2)


def test_query_with_filter_and_json(workspace):
    root, _, _ = workspace
    result = _run("query", root / "idx", "--text", "t1 t2 t3 t4", "-k", "3", "--where", "kind = 'a'", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)[0]["results"]
    assert len(rows) == 6 and all(r["kind"] == "a" for r in rows)
    assert [r["direction"] for r in rows] == ["positive"] * 3 + ["negative"] * 3
    human = _run("query", root / "idx", "--text", "t1 t2 t3 t4", "-k", "2")
    assert human.exit_code == 0 and "query: t1 t2 t3 t4" in human.output


def test_faiss_candidates_and_scalar_index(workspace):
    root, _, _ = workspace
    assert _run("index-column", root / "idx", "kind", "--kind", "BITMAP").exit_code == 0
    built = _run("build-faiss", root / "idx", "--json")
    assert built.exit_code == 0, built.output
    default_replicas = __import__("eogp_index.search.candidates").search.candidates.FaissConfig().replicas
    assert json.loads(built.stdout)["rows"] == 30 and json.loads(built.stdout)["replicas"] == default_replicas
    assert f"default {default_replicas};" in " ".join(_run("build-faiss", "--help").output.split())
    exact = json.loads(_run("query", root / "idx", "--text", "t5 t6 t7", "-k", "4", "--json").stdout)
    approx = json.loads(_run("query", root / "idx", "--text", "t5 t6 t7", "-k", "4", "--candidates", "30",
                             "--json").output)
    assert [r["id"] for r in exact[0]["results"]] == [r["id"] for r in approx[0]["results"]]
    # Rebuilt with another number of replicas: recorded in the sidecar JSON, used by queries.
    rebuilt = _run("build-faiss", root / "idx", "--replicas", "2", "--json")
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads(rebuilt.stdout)["replicas"] == 2
    meta = json.loads((root / "idx" / "faiss" / "default.json").read_text())
    assert meta["replicas"] == 2 and meta["format_version"] == 2
    again = json.loads(_run("query", root / "idx", "--text", "t5 t6 t7", "-k", "4", "--candidates", "30",
                            "--json").output)
    assert [r["id"] for r in exact[0]["results"]] == [r["id"] for r in again[0]["results"]]
    assert _run("build-faiss", root / "idx", "--replicas", "0").exit_code != 0


def test_user_errors_exit_nonzero_with_a_message(workspace, tmp_path):
    root, _, _ = workspace
    bad = _run("query", root / "idx", "--text", "t1 t2", "--where", "nosuchcolumn = 1")
    assert bad.exit_code != 0 and "invalid where filter" in bad.output
    short = _run("query", root / "idx", "--text", "t1")
    assert short.exit_code != 0 and "no loss tokens" in short.output
    missing = _run("info", tmp_path)
    assert missing.exit_code != 0 and "not an eogp index" in missing.output
    again = _run("fit", root / "model", "--data", root / "shard.jsonl", "--out", root / "idx")
    assert again.exit_code != 0 and "already holds an index" in again.output


def _refused(result, *expected):
    """A user error: non-zero exit, a one-line message naming what to fix, no traceback."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for text in expected:
        assert text in result.output, result.output


@pytest.mark.parametrize("args, expected", [
    (["eval", "lds", "--out", "{tmp}", "--epochs", "0"], ["--epochs", "0 is not in the range x>=1"]),
    (["eval", "lds", "--out", "{tmp}", "--lr", "0"], ["--lr"]),
    (["eval", "lds", "--out", "{tmp}", "--cf-removals", "32,0"], ["--cf-removals"]),
    (["eval", "fidelity", "--out", "{tmp}", "--budgets", "64,many"], ["--budgets", "'many' is not a valid integer"]),
    (["eval", "fidelity", "--out", "{tmp}", "--budgets", ","], ["--budgets", "at least one value"]),
    (["eval", "all", "--out", "{tmp}", "--subsets", "1"], ["--subsets"]),
    (["fit", "model", "--data", "x", "--out", "{tmp}/i", "--batch-size", "0"], ["--batch-size"]),
    (["fit", "model", "--data", "x", "--out", "{tmp}/i", "--budget-kb", "0"], ["--budget-kb"]),
    (["fit", "model", "--data", "x", "--out", "{tmp}/i", "--variant", "pca"], ["--variant"]),
    (["fit", "model", "--data", "x", "--out", "{tmp}/i", "-k", "8", "--budget-kb", "1"], ["exactly one of k"]),
    (["query", "{tmp}", "--text", "a b", "-k", "0"], ["-k"]),
    (["fit", "model", "--data", "x", "--out", "{tmp}/i", "--device", "gpu"], ["--device", "'gpu'", "cuda:N"]),
    (["ingest", "{tmp}", "x.jsonl", "--commit-every", "2"], ["--commit-every applies to torchrun workers"]),
    (["ingest", "{tmp}", "x.jsonl", "--text-field", "t", "--messages-field", "t"], ["distinct record keys"]),
])
def test_bad_option_values_are_refused_without_a_traceback(tmp_path, args, expected):
    _refused(_run(*[a.replace("{tmp}", str(tmp_path)) for a in args]), *expected)


def test_eval_without_its_extra_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr("eogp_index.evaluation.cli._EXTRA_MODULES", ("matplotlib", "no_such_module_for_eval"))
    result = _run("eval", "fidelity", "--out", tmp_path)
    _refused(result, "no_such_module_for_eval", "pip install 'eogp-index[eval]'")
    assert "matplotlib" not in result.output.split("needs", 1)[1].split(":", 1)[0]


def test_query_before_any_ingest_answers_no_rows_and_says_why(workspace, tmp_path):
    root, _, _ = workspace
    fit = _run("fit", root / "model", "--data", root / "shard.jsonl", "--out", tmp_path / "empty", "-k", "8",
               "--curvature-examples", "8", "--pca-examples", "8", "--max-tokens", "24")
    assert fit.exit_code == 0, fit.output
    result = _run("query", tmp_path / "empty", "--text", "t1 t2 t3", "--where", "num_tokens > 3", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"query": "t1 t2 t3", "results": []}]
    assert "nothing has been ingested" in result.stderr and f"eogp ingest {tmp_path / 'empty'}" in result.stderr


def test_a_bad_filter_is_one_line_without_lance_source_paths(workspace):
    root, _, _ = workspace
    result = _run("query", root / "idx", "--text", "t1 t2", "--where", "kynd = 'a'")
    _refused(result, "kynd", "backticks")
    assert ".rs:" not in result.output and "Traceback" not in result.output


def test_explain_by_module_and_stored_text(workspace, tmp_path):
    root, _, _ = workspace
    fit = _run("fit", root / "model", "--data", root / "shard.jsonl", "--out", tmp_path / "txt", "-k", "8",
               "--curvature-examples", "12", "--pca-examples", "12", "--max-tokens", "24")
    assert fit.exit_code == 0, fit.output
    ingest = _run("ingest", tmp_path / "txt", root / "shard.jsonl", "--id-field", "id", "--store-text", "--json")
    assert ingest.exit_code == 0, ingest.output
    hits = json.loads(_run("query", tmp_path / "txt", "--text", "t1 t2 t3", "-k", "2", "--by-module",
                           "--json").stdout)[0]["results"]
    assert all(abs(sum(h["modules"].values()) - h["score"]) <= 1e-5 * abs(h["score"]) for h in hits)
    assert all(h["text"].split()[0].startswith("t") for h in hits)  # the stored document text
    explained = _run("explain", tmp_path / "txt", "--text", "t1 t2 t3", "--id", hits[0]["id"], "--json")
    assert explained.exit_code == 0, explained.output
    (e,) = json.loads(explained.stdout)
    assert set(e) >= {"id", "score", "score_projected", "train_tokens", "query_tokens", "modules"}
    assert e["id"] == hits[0]["id"] and abs(e["score"] - hits[0]["score"]) <= 1e-4 * abs(hits[0]["score"])
    assert [t["token"] for t in e["train_tokens"]] == e["text"].split()
    shown = _run("explain", tmp_path / "txt", "--text", "t1 t2 t3", "--top", "2", "--no-color")
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("document tokens:") == 2 and "\x1b[" not in shown.output
    _refused(_run("explain", tmp_path / "txt", "--text", "t1"), "--id ID (repeatable) or --top N")


def test_projection_memory_limit_applies_modules_in_turn_with_the_same_answer(workspace):
    root, _, _ = workspace
    args = ("query", root / "idx", "--text", "t1 t2 t3 t4", "-k", "4", "--json")
    kept = json.loads(_run(*args).stdout)
    in_turn = _run(*args, "--projection-memory-gb", "1e-9")  # no P fits: each module's P is read per batch
    assert in_turn.exit_code == 0, in_turn.output
    assert json.loads(in_turn.stdout) == kept
    _refused(_run(*args, "--projection-memory-gb", "0"), "--projection-memory-gb")
