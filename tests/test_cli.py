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
    lines = [
        json.dumps(
            {
                "id": f"d{i}",
                "text": " ".join(f"t{(i * 7 + j) % 63 + 1}" for j in range(6 + i % 9)),
                "kind": "ab"[i % 2],
                "n": i,
            }
        )
        for i in range(30)
    ]
    (root / "shard.jsonl").write_text("\n".join(lines) + "\n")
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
            "30",
            "--pca-examples",
            "30",
            "--max-tokens",
            "24",
            "--json",
        ],
    )
    assert fit.exit_code == 0, fit.output
    ingest = runner.invoke(
        cli,
        [
            "ingest",
            str(root / "idx"),
            str(root / "shard.jsonl"),
            "--id-field",
            "id",
            "--metadata",
            "kind",
            "--metadata",
            "n",
            "--json",
        ],
    )
    assert ingest.exit_code == 0, ingest.output
    return root, json.loads(fit.stdout), json.loads(ingest.stdout)


def _run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result


def test_fit_and_ingest_report_json(workspace):
    root, fitted, summary = workspace
    # the default variant with the default (int8) tier: each module's code chosen by its recall
    assert fitted["projection"]["variant"] == "auto" and all(m["k"] == 16 for m in fitted["modules"])
    assert summary["stored"] == 30 and summary["rejected"] == 0
    info = json.loads(_run("info", root / "idx", "--json").stdout)
    assert info["rows"] == 30 and info["bytes_per_example"] == 8 * (2 + 2)
    # The default rescoring tier: int8 of the same 16 coordinates, an FP16 scale per module.
    assert info["format_version"] == 4 and info["tier"] == {"code": "int8", "bytes_per_example": 8 * (16 + 2)}
    human = _run("info", root / "idx").output
    assert "bytes/row   32 (scanned) + 144 (rescoring tier, int8" in human


def test_fit_rescore_none_writes_a_format_2_index_without_a_tier(workspace, tmp_path):
    root, _, _ = workspace
    args = ["--data", root / "shard.jsonl", "-k", "16", "--curvature-examples", "30", "--pca-examples", "30"]
    fit = _run("fit", root / "model", *args, "--max-tokens", "24", "--out", tmp_path / "idx", "--rescore", "none")
    assert fit.exit_code == 0, fit.output
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and "tier" not in manifest
    ingest = _run("ingest", tmp_path / "idx", root / "shard.jsonl", "--id-field", "id", "--json")
    assert ingest.exit_code == 0, ingest.output
    import lance

    assert "tier" not in lance.dataset(str(tmp_path / "idx" / "examples.lance")).schema.names
    rows = json.loads(_run("query", tmp_path / "idx", "--text", "t1 t2 t3", "-k", "3", "--json").stdout)[0]["results"]
    assert rows and all("score_1bit" not in r for r in rows)
    assert "(no rescoring tier)" in _run("info", tmp_path / "idx").output
    bad = _run("fit", root / "model", *args, "--out", tmp_path / "other", "--rescore", "int2")
    assert bad.exit_code != 0 and "--rescore" in bad.output


def test_query_rescores_by_default_and_rescore_0_turns_it_off(workspace):
    root, _, _ = workspace
    query = ("query", root / "idx", "--text", "t1 t2 t3 t4", "-k", "3", "--json")
    rescored = json.loads(_run(*query).stdout)[0]["results"]
    assert rescored and all(set(r) >= {"score", "score_1bit"} for r in rescored)
    one_bit = json.loads(_run(*query, "--rescore", "0").stdout)[0]["results"]
    assert one_bit and all("score_1bit" not in r for r in one_bit)
    human = _run(*query[:-1]).output  # each hit shows the rescored score, then the one-bit one
    assert human.count("(1-bit ") == len(rescored) and "score_1bit" not in human
    assert "(1-bit " not in _run(*query[:-1], "--rescore", "0").output


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
    assert json.loads(built.stdout)["rows"] == 30 and json.loads(built.stdout)["kind"] == "flat"
    exact = json.loads(_run("query", root / "idx", "--text", "t5 t6 t7", "-k", "4", "--json").stdout)
    approx = json.loads(
        _run("query", root / "idx", "--text", "t5 t6 t7", "-k", "4", "--candidates", "30", "--json").output
    )
    assert [r["id"] for r in exact[0]["results"]] == [r["id"] for r in approx[0]["results"]]
    meta = json.loads((root / "idx" / "faiss" / "default.json").read_text())
    assert meta["kind"] == "flat" and meta["format_version"] == 3


def test_build_candidates_builds_every_kind_and_refuses_options_of_another(workspace):
    root, _, _ = workspace
    from eogp_index.search.first_pass import kinds

    for kind in kinds():
        built = _run("build-candidates", root / "idx", "--kind", kind, "--name", f"cli-{kind}", "--json")
        assert built.exit_code == 0, built.output
        report = json.loads(built.stdout)
        assert report["kind"] == kind and report["rows"] == report["added"] == 30
    assert f"[{'|'.join(kinds())}]" in _run("build-candidates", "--help").output
    extended = _run("build-candidates", root / "idx", "--name", "cli-flat", "--extend", "--json")
    assert extended.exit_code == 0 and json.loads(extended.stdout)["added"] == 0
    retired = _run("build-candidates", root / "idx", "--kind", "clustered")
    assert retired.exit_code != 0 and "'clustered' first pass is retired" in retired.output
    unknown = _run("build-candidates", root / "idx", "--kind", "lsh")
    assert unknown.exit_code != 0 and "not a first-pass kind" in unknown.output


def test_build_candidates_reports_its_recall(workspace):
    """The recall of the exact top-20 among C candidates, measured on stored rows' own codes after
    the build: printed, in --json, recorded in the first pass's JSON; no warning at the target."""
    root, _, _ = workspace
    full = _run("build-candidates", root / "idx", "--kind", "flat", "--name", "recall-full", "--json")
    assert full.exit_code == 0, full.output
    recall = json.loads(full.stdout)["recall"]
    # 5 x 20 candidates hold every one of the 30 rows: the exact answer.
    assert recall["recall"] == 1.0 and recall["candidates"] == 100 and recall["k"] == 20
    assert recall["queries_from"] == "stored rows" and recall["queries"] == 30 and recall["target"] == 0.95
    meta = json.loads((root / "idx" / "faiss" / "recall-full.json").read_text())
    assert meta["recall"] == recall
    assert "warning" not in full.stderr
    human = _run("build-candidates", root / "idx", "--kind", "flat", "--name", "recall-full")
    assert "recall of the exact top-20 at 100 candidates: 1.000" in human.stdout


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


@pytest.mark.parametrize(
    "args, expected",
    [
        (["eval", "lds", "--out", "{tmp}", "--epochs", "0"], ["--epochs", "0 is not in the range x>=1"]),
        (["eval", "lds", "--out", "{tmp}", "--lr", "0"], ["--lr"]),
        (["eval", "lds", "--out", "{tmp}", "--cf-removals", "32,0"], ["--cf-removals"]),
        (
            ["eval", "fidelity", "--out", "{tmp}", "--budgets", "64,many"],
            ["--budgets", "'many' is not a valid integer"],
        ),
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
    ],
)
def test_bad_option_values_are_refused_without_a_traceback(tmp_path, args, expected):
    _refused(_run(*[a.replace("{tmp}", str(tmp_path)) for a in args]), *expected)


def test_eval_without_its_extra_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr("eogp_index.evaluation.cli._EXTRA_MODULES", ("matplotlib", "no_such_module_for_eval"))
    result = _run("eval", "fidelity", "--out", tmp_path)
    _refused(result, "no_such_module_for_eval", "pip install 'eogp-index[eval]'")
    assert "matplotlib" not in result.output.split("needs", 1)[1].split(":", 1)[0]


def test_query_before_any_ingest_answers_no_rows_and_says_why(workspace, tmp_path):
    root, _, _ = workspace
    fit = _run(
        "fit",
        root / "model",
        "--data",
        root / "shard.jsonl",
        "--out",
        tmp_path / "empty",
        "-k",
        "8",
        "--curvature-examples",
        "8",
        "--pca-examples",
        "8",
        "--max-tokens",
        "24",
    )
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


@pytest.mark.parametrize(
    "where, problem",
    [
        ("kind = 'a' ANDD n > 3", "at column 12: 'ANDD n > 3' is left over"),
        ("1=1; DROP TABLE x", "at column 4: ';' starts a second statement"),
        ("EXISTS (SELECT 1)", "at column 9: subqueries are not filters"),
        ("\"kind\" = 'a'", "write `kind`"),
    ],
)
def test_a_filter_that_is_not_one_condition_on_columns_is_refused_with_its_position(
    workspace, where, problem, tmp_path
):
    """query, select and scores refuse it alike, through the question's one check."""
    root, _, _ = workspace
    said = set()
    for command, out in (("query", None), ("select", "subset.jsonl"), ("scores", "scores.parquet")):
        args = [command, root / "idx", "--text", "t1 t2 t3", "--where", where]
        result = _run(*args, *(["--out", tmp_path / out] if out else []))
        _refused(result, problem, "backticks")
        said.add(result.output.strip().splitlines()[-1])
    assert len(said) == 1, said
    assert list(tmp_path.iterdir()) == []


def test_explain_by_module_and_stored_text(workspace, tmp_path):
    root, _, _ = workspace
    fit = _run(
        "fit",
        root / "model",
        "--data",
        root / "shard.jsonl",
        "--out",
        tmp_path / "txt",
        "-k",
        "8",
        "--curvature-examples",
        "12",
        "--pca-examples",
        "12",
        "--max-tokens",
        "24",
    )
    assert fit.exit_code == 0, fit.output
    ingest = _run("ingest", tmp_path / "txt", root / "shard.jsonl", "--id-field", "id", "--store-text", "--json")
    assert ingest.exit_code == 0, ingest.output
    hits = json.loads(_run("query", tmp_path / "txt", "--text", "t1 t2 t3", "-k", "2", "--by-module", "--json").stdout)[
        0
    ]["results"]
    assert all(abs(sum(h["modules"].values()) - h["score"]) <= 1e-5 * abs(h["score"]) for h in hits)
    assert all(h["text"].split()[0].startswith("t") for h in hits)  # the stored document text
    # In the terminal the terms are one readable line per hit; the raw, full-precision dict is --json's.
    printed = _run("query", tmp_path / "txt", "--text", "t1 t2 t3", "-k", "2", "--by-module")
    assert printed.exit_code == 0, printed.output
    assert printed.output.count("by module: ") == len(hits) and "modules=" not in printed.output
    assert "{" not in printed.output and repr(hits[0]["score"]) not in printed.output
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


def test_queries_file_answers_every_good_query_and_reports_the_bad_ones_by_line(workspace, tmp_path):
    root, _, _ = workspace
    lines = [
        '{"text": "t1 t2 t3 t4"}',
        '{"text": "t5 t6',
        '{"text": "t7 t8 t9"}',
        '{"text": "t1"}',
        '{"text": "t2 t3 \\ud800"}',
        "[1, 2]",
        '{"messages": [{"role": "user", "content": "t4 t5"}]}',
        '{"input_ids": [3, 4, 5, 6]}',
    ]
    queries = tmp_path / "queries.jsonl"
    queries.write_text("\n".join(lines) + "\n")
    result = _run("query", root / "idx", "--queries", queries, "-k", "2", "--json")
    assert result.exit_code == 1 and "Traceback" not in result.output
    answered = json.loads(result.stdout)
    assert [a["query"] for a in answered] == [json.loads(lines[i]) for i in (0, 2, 7)]
    assert all(len(a["results"]) == 4 for a in answered)
    reported = [line for line in result.stderr.splitlines() if line.startswith("queries.jsonl:")]
    assert [line.split(":")[1] for line in reported] == ["2", "4", "5", "6", "7"]
    assert "malformed JSON" in reported[0] and "no loss tokens" in reported[1] and "surrogate" in reported[2]
    assert "JSON list" in reported[3] and "no chat template" in reported[4]
    assert "5 of 8 queries were not answered" in result.stderr


def test_missing_model_and_model_without_tokenizer_are_clean_errors(workspace, tmp_path):
    root, _, _ = workspace
    _refused(
        _run("fit", "/nonexistent/model", "--data", root / "shard.jsonl", "--out", tmp_path / "i"),
        "model directory '/nonexistent/model' does not exist",
    )
    bare = tmp_path / "bare-model"
    make_tiny_gpt2().save_pretrained(bare)  # the same weights as the index's model, no tokenizer files
    _refused(
        _run("fit", bare, "--data", root / "shard.jsonl", "--out", tmp_path / "i"),
        "has no usable tokenizer",
        "tokenizer.save_pretrained",
    )
    _refused(_run("query", root / "idx", "--text", "t1 t2 t3", "--model", bare), "has no usable tokenizer")


@pytest.mark.parametrize(
    "case", ["missing shard", "no match", "unsupported format", "reserved metadata", "store-text mismatch"]
)
def test_checks_that_need_no_model_run_before_it_loads(workspace, tmp_path, case):
    root, _, _ = workspace
    # No model can load from here: the refusal below must come before any loading is tried.
    no_model = ["--model", tmp_path / "no-model"]
    (tmp_path / "no-model").mkdir()
    (tmp_path / "data.csv").write_text("text\nt1 t2\n")
    shard = root / "shard.jsonl"
    args, expected = {
        "missing shard": ([tmp_path / "gone.jsonl"], ["gone.jsonl", "does not exist"]),
        "no match": ([tmp_path / "nothing-*.jsonl"], ["matches no file"]),
        "unsupported format": ([tmp_path / "data.csv"], ["data.csv"]),
        "reserved metadata": ([shard, "--metadata", "shard"], ["clash with the table's own columns"]),
        "store-text mismatch": ([shard, "--store-text"], ["ingested without stored text"]),
    }[case]
    _refused(_run("ingest", root / "idx", *args, *no_model), *expected)
    if case in ("missing shard", "no match", "unsupported format"):
        _refused(_run("fit", tmp_path / "no-model", "--data", args[0], "--out", tmp_path / "i"), *expected)
    if case == "missing shard":  # and an index already at --out
        _refused(_run("fit", tmp_path / "no-model", "--data", shard, "--out", root / "idx"), "already holds an index")


def test_p_out_of_memory_is_read_once_per_block_and_once_per_batch_of_queries(workspace, tmp_path, monkeypatch):
    import shutil

    from eogp_index.store.projection_file import LazyPca

    root, fitted, _ = workspace
    reads = []
    get = LazyPca.get
    monkeypatch.setattr(LazyPca, "get", lambda self, key: reads.append(key) or get(self, key))
    modules = len(fitted["modules"])
    index = shutil.copytree(root / "idx", tmp_path / "idx")
    lines = [
        json.dumps(
            {
                "id": f"new{i}",
                "text": " ".join(f"t{(i * 5 + j) % 63 + 1}" for j in range(5 + i % 7)),
                "kind": "ab"[i % 2],
                "n": 100 + i,
            }
        )
        for i in range(20)
    ]
    (tmp_path / "new.jsonl").write_text("\n".join(lines) + "\n")
    ingest = _run(
        "ingest",
        index,
        tmp_path / "new.jsonl",
        "--id-field",
        "id",
        "--metadata",
        "kind",
        "--metadata",
        "n",
        "--batch-size",
        "4",
        "--projection-memory-gb",
        "1e-9",
        "--block-documents",
        "8",
        "--json",
    )
    assert ingest.exit_code == 0, ingest.output
    assert json.loads(ingest.stdout)["stored"] == 20
    assert len(reads) == 3 * modules  # blocks of 8, 8 and 4 documents (5 gradient batches)
    assert not (index / "ingest-cache").exists()
    # 20 queries in 3 gradient batches of 8: each module's P read once for all of them.
    (tmp_path / "queries.jsonl").write_text(
        "\n".join(json.dumps({"text": json.loads(line)["text"]}) for line in lines) + "\n"
    )
    reads.clear()
    queried = _run(
        "query", index, "--queries", tmp_path / "queries.jsonl", "-k", "3", "--projection-memory-gb", "1e-9", "--json"
    )
    assert queried.exit_code == 0, queried.output
    assert len(json.loads(queried.stdout)) == 20 and len(reads) == modules and len(set(reads)) == modules


def test_query_a_behaviour_normalized_and_grouped(workspace, tmp_path):
    root, _, _ = workspace
    behaviour = tmp_path / "behaviour.jsonl"
    texts = ["t1 t2 t3 t4", "t5 t6 t7", "t8 t9 t10 t11 t12"]
    behaviour.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    one = _run(
        "query", root / "idx", "--queries", behaviour, "--aggregate", "mean", "--normalize", "unit", "-k", "3", "--json"
    )
    assert one.exit_code == 0, one.output
    answers = json.loads(one.stdout)
    assert len(answers) == 1 and answers[0]["query"] == {"aggregate": "mean", "queries": [{"text": t} for t in texts]}
    assert len(answers[0]["results"]) == 6
    grouped = _run(
        "query",
        root / "idx",
        "--queries",
        behaviour,
        "--aggregate",
        "sum",
        "--group-by",
        "kind",
        "--where",
        "n < 20",
        "-k",
        "3",
        "--json",
    )
    assert grouped.exit_code == 0, grouped.output
    groups = json.loads(grouped.stdout)[0]["groups"]
    assert sorted(g["kind"] for g in groups) == ["a", "b"] and sum(g["rows"] for g in groups) == 20
    assert sum(g["top_positive"] for g in groups) == 3 and groups[0]["sum"] >= groups[1]["sum"]
    human = _run("query", root / "idx", "--queries", behaviour, "--aggregate", "mean", "--group-by", "kind")
    assert human.exit_code == 0 and "mean of 3 queries" in human.output and "share+" in human.output
    per_document = _run("query", root / "idx", "--text", "t1 t2 t3", "--group-by", "id")
    assert per_document.exit_code == 0 and "… 5 more groups" in per_document.output  # 30 rows: 20 + 5 shown
    bad = _run("query", root / "idx", "--text", "t1 t2", "--group-by", "source")
    assert bad.exit_code != 0 and "group by one of" in bad.output and "Traceback" not in bad.output


def test_ingest_skip_rejects_each_record_with_a_lone_surrogate_and_a_cut_gzip_by_line_and_keeps_the_rest(
    workspace, tmp_path
):
    import gzip
    import shutil

    from badtext import bad_records

    root, _, _ = workspace
    index = shutil.copytree(root / "idx", tmp_path / "idx")
    cases = bad_records(documents=True)
    good = [{"text": f"t{i} t{i + 1} t{i + 2} t{i + 3}"} for i in range(1, 40, 4)]
    lines = []
    for i, record in enumerate(good):
        lines.append({**record, "id": f"good-{i}", "kind": "a", "n": i})
        if i < len(cases):
            lines.append({**cases[i][1], "id": f"bad-{i}", "kind": "b", "n": 100 + i})
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))  # surrogates as \ud800
    packed = gzip.compress("".join(json.dumps({**good[0], "id": f"gz-{i}"}) + "\n" for i in range(3000)).encode())
    (tmp_path / "b-cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (tmp_path / "c.jsonl").write_text(json.dumps({**good[1], "id": "last"}) + "\n")
    result = _run(
        "ingest", index, tmp_path / "a.jsonl", tmp_path / "b-cut.jsonl.gz", tmp_path / "c.jsonl",
        "--id-field", "id", "--metadata", "kind", "--metadata", "n", "--on-error", "skip", "--json",
    )  # fmt: skip
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    summary = json.loads(result.stdout)
    rejects = [json.loads(line) for line in open(summary["rejects_path"])]
    surrogates = [r for r in rejects if r["shard"] == "a.jsonl"]
    assert [r["record_id"] for r in surrogates] == [f"bad-{i}" for i in range(len(cases))]
    for (case, _, field), reject in zip(cases, surrogates):
        assert f"field '{field}" in reject["reason"] and "surrogate" in reject["reason"], (case, reject)
    (cut,) = [r for r in rejects if r["shard"] == "b-cut.jsonl.gz"]
    assert "or any after it" in cut["reason"] and cut["location"] == f"b-cut.jsonl.gz:{cut['position'] + 1}"
    assert summary["stored"] == len(good) + cut["position"] + 1  # a.jsonl's good records, the gzip's read lines, c
    assert summary["rejected"] == len(cases) + 1


def test_queries_file_reports_a_lone_surrogate_in_any_field_of_any_kind_by_line(workspace, tmp_path):
    from badtext import bad_records

    root, _, _ = workspace
    cases = bad_records()
    lines = []
    for _, record, _ in cases:
        lines += [{"text": "t1 t2 t3 t4"}, record]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = _run("query", root / "idx", "--queries", tmp_path / "q.jsonl", "-k", "2", "--json")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(json.loads(result.stdout)) == len(cases)  # every good query answered
    reported = [line for line in result.stderr.splitlines() if line.startswith("q.jsonl:")]
    assert [int(line.split(":")[1]) for line in reported] == list(range(2, 2 * len(cases) + 1, 2))
    for (case, _, field), line in zip(cases, reported):
        assert f"field '{field}" in line and "surrogate" in line, (case, line)


def test_torchrun_workers_beyond_the_nodes_gpus_are_refused_with_the_fix(monkeypatch):
    """--device auto under torchrun: worker LOCAL_RANK takes cuda:LOCAL_RANK; a worker with no GPU
    of its own gets an error naming --nproc_per_node and --device cpu, not CUDA's invalid ordinal."""
    import torch

    from eogp_index.cliutil import worker_device
    from eogp_index.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert worker_device("auto") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="--nproc_per_node 1 .*--device cpu"):
        worker_device("auto")
    assert worker_device("cpu") == "cpu"
