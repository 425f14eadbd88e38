"""`eogp select` and `eogp scores` on a real tiny model and index, from JSONL, JSONL.gz and Parquet shards."""

import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tinymodels import make_tiny_gpt2, make_word_tokenizer

from eogp_index.cli import cli

__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

TARGETS = [{"text": "t3 t9 t27 t18 t54"}, {"prompt": "t5 t6", "completion": " t7 t8 t9"}, {"text": "t40 t41 t2 t3"}]


def _words(i: int, n: int) -> str:
    return " ".join(f"t{(i * 11 + j * j * 5 + j) % 63 + 1}" for j in range(n))  # no two documents alike


def _jsonl_lines():
    """Lines written as people write them: odd spacing, key order, escapes, a blank line."""
    lines = []
    for i in range(20):
        record = {
            "text": _words(i, 5 + i % 7),
            "id": f"a{i}",
            "source": "web" if i % 3 else "books",
            "note": "caf\u00e9 \u2028 x",
        }
        if i % 4 == 0:
            lines.append(json.dumps(record))  # ASCII escapes, ", " separators
        elif i % 4 == 1:
            lines.append(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
        elif i % 4 == 2:
            lines.append("  " + json.dumps(record, indent=None, sort_keys=True) + "   ")
        else:
            lines.append(
                json.dumps(
                    {
                        "prompt": _words(i, 3),
                        "completion": " " + _words(i + 1, 4),
                        "id": f"a{i}",
                        "source": "chat",
                        "note": "{}",
                    }
                )
            )
        if i == 5:
            lines.append("")
    return lines


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("select")
    make_tiny_gpt2().save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    lines = _jsonl_lines()
    (root / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    (root / "b.jsonl.gz").write_bytes(
        gzip.compress(
            "".join(
                json.dumps({"id": f"b{i}", "text": _words(i + 30, 6), "source": "news", "note": ""}) + "\n"
                for i in range(12)
            ).encode()
        )
    )
    pq.write_table(
        pa.table(
            {
                "id": [f"c{i}" for i in range(14)],
                "text": [_words(i + 60, 7) for i in range(14)],
                "source": ["code"] * 14,
                "note": ["n"] * 14,
                "stars": pa.array(range(14), pa.int16()),
                "tags": [[f"x{i}", "y"] for i in range(14)],
            }
        ),
        root / "c.parquet",
        row_group_size=5,
    )
    runner = CliRunner()
    fit = runner.invoke(
        cli,
        [
            "fit",
            str(root / "model"),
            "--data",
            str(root / "a.jsonl"),
            "--out",
            str(root / "idx"),
            "-k",
            "16",
            "--curvature-examples",
            "20",
            "--pca-examples",
            "20",
            "--max-tokens",
            "24",
        ],
    )
    assert fit.exit_code == 0, fit.output
    ingest = runner.invoke(
        cli,
        [
            "ingest",
            str(root / "idx"),
            str(root / "a.jsonl"),
            str(root / "b.jsonl.gz"),
            str(root / "c.parquet"),
            "--id-field",
            "id",
            "--metadata",
            "source",
        ],
    )
    assert ingest.exit_code == 0, ingest.output
    (root / "targets.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TARGETS))
    from eogp_index.client import AttributionIndex

    index = AttributionIndex.open(root / "idx")
    ids, scores = index.scores(TARGETS)
    sources = dict(zip(*[index.store.read(["id", "source"]).column(c).to_pylist() for c in ("id", "source")]))
    return root, {"ids": ids, "scores": scores.astype(np.float64), "source": sources}


def _run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def _select(root, out, *args):
    return json.loads(
        _run("select", root / "idx", "--queries", root / "targets.jsonl", "--out", root / out, *args, "--json").stdout
    )


def _reference(reference, how="mean", keep=None):
    per_query = reference["scores"]
    score = per_query.mean(0) if how == "mean" else per_query.max(0) if how == "max" else per_query.min(0)
    return (
        dict(zip(reference["ids"], score))
        if keep is None
        else {i: s for i, s in zip(reference["ids"], score) if keep(i)}
    )


def _top(scores: dict, n: int, largest=True):
    return sorted(scores, key=lambda i: -scores[i] if largest else scores[i])[:n]


def test_selected_jsonl_records_are_input_lines_plus_score(workspace):
    root, reference = workspace
    summary = _select(root, "subset.jsonl", "--top", "9", "--where", "shard != 'c.parquet'")
    assert summary["selected"] == 9
    out = [line.decode() for line in (root / "subset.jsonl").read_bytes().split(b"\n")[:-1]]  # U+2028 stays
    inputs = {json.loads(line)["id"]: line for line in _jsonl_lines() if line}
    inputs |= {
        json.loads(line)["id"]: line
        for line in gzip.decompress((root / "b.jsonl.gz").read_bytes()).decode().splitlines()
    }
    expected = _reference(reference, keep=lambda i: not i.startswith("c"))
    assert sorted(json.loads(line)["id"] for line in out) == sorted(_top(expected, 9))
    for line in out:
        record = json.loads(line)
        original = inputs[record["id"]].rstrip()
        assert line == original[:-1] + f', "score": {json.dumps(record["score"])}}}'  # byte for byte, plus score
        assert record["score"] == pytest.approx(expected[record["id"]], rel=1e-4, abs=1e-6)


def test_count_is_right_at_a_percentage_and_gzip_output(workspace):
    root, reference = workspace
    rows = sum(1 for s in reference["source"].values() if s != "books")
    summary = _select(root, "share.jsonl.gz", "--top", "25%", "--where", "source != 'books'")
    assert (
        summary["selected"]
        == math.floor(rows * 25 / 100)
        == len(gzip.decompress((root / "share.jsonl.gz").read_bytes()).splitlines())
    )
    assert _select(root, "all.jsonl", "--top", "100%")["selected"] == len(reference["ids"])


def test_parquet_output_keeps_the_input_columns(workspace):
    root, reference = workspace
    _select(root, "subset.parquet", "--top", "5", "--where", "source = 'code'")
    table = pq.read_table(root / "subset.parquet")
    source = pq.read_schema(root / "c.parquet")
    assert table.schema.names == source.names + ["score"]
    assert [table.schema.field(n).type for n in source.names] == list(source.types)
    expected = _reference(reference, keep=lambda i: i.startswith("c"))
    assert sorted(table.column("id").to_pylist()) == sorted(_top(expected, 5))
    original = pq.read_table(root / "c.parquet").to_pylist()
    for row in table.to_pylist():
        assert {k: v for k, v in row.items() if k != "score"} == original[int(row["id"][1:])]


def test_a_parquet_selection_of_jsonl_shards_holds_the_selected_rows(workspace):
    """From JSON Lines shards (records of two kinds, and gzip), a .parquet output is a Parquet file
    whose rows are the selected records, each with its score (not JSON lines before a footer)."""
    root, reference = workspace
    summary = _select(root, "from-jsonl.parquet", "--top", "100%", "--where", "shard != 'c.parquet'")
    as_lines = _select(root, "from-jsonl.jsonl", "--top", "100%", "--where", "shard != 'c.parquet'")
    table = pq.read_table(root / "from-jsonl.parquet")
    jsonl_rows = sum(1 for i in reference["ids"] if not i.startswith("c"))
    assert summary["selected"] == as_lines["selected"] == table.num_rows == jsonl_rows > 20
    lines = [json.loads(line) for line in (root / "from-jsonl.jsonl").read_bytes().split(b"\n")[:-1]]  # U+2028 stays
    by_id = {row["id"]: row for row in table.to_pylist()}
    assert set(by_id) == {line["id"] for line in lines}
    for line in lines:  # every field of every record, null where a record of the other kind has none
        row = by_id[line["id"]]
        assert {k: v for k, v in row.items() if v is not None and k != "score"} == {
            k: v for k, v in line.items() if k != "score"
        }
        assert row["score"] == pytest.approx(line["score"], rel=1e-6)
    assert {"prompt", "completion", "text"} <= set(table.column_names)


def test_max_rule_negative_direction_ids_only(workspace):
    root, reference = workspace
    _select(root, "worst.jsonl", "--top", "6", "--score", "max", "--direction", "negative", "--ids-only")
    rows = [json.loads(line) for line in (root / "worst.jsonl").read_text().splitlines()]
    # LESS's rule, harmful side: a document's lowest score over the targets, most negative first.
    expected = _reference(reference, how="min")
    assert [r["id"] for r in rows] == _top(expected, 6, largest=False)
    assert set(rows[0]) == {"id", "score"}
    np.testing.assert_allclose([r["score"] for r in rows], [expected[r["id"]] for r in rows], rtol=1e-5, atol=1e-7)


def test_a_changed_shard_is_refused(workspace):
    root, _ = workspace
    path = root / "b.jsonl.gz"
    saved = path.read_bytes()
    lines = gzip.decompress(saved).decode().splitlines()
    try:
        path.write_bytes(
            gzip.compress("".join(line.replace('"text": "', '"text": "t1 ') + "\n" for line in lines).encode())
        )
        result = CliRunner().invoke(
            cli,
            [
                "select",
                str(root / "idx"),
                "--queries",
                str(root / "targets.jsonl"),
                "--top",
                "3",
                "--where",
                "source = 'news'",
                "--out",
                str(root / "changed.jsonl"),
            ],
        )
    finally:
        path.write_bytes(saved)
    assert result.exit_code == 1 and "has changed since it was ingested" in result.output
    assert not (root / "changed.jsonl").exists()


def test_sigkill_while_writing_leaves_no_output_file(workspace):
    root, _ = workspace
    out = root / "killed" / "subset.jsonl"
    out.parent.mkdir()
    # Killed for real, after the first record has been written to the file.
    script = (
        "import os, signal, sys\n"
        "from eogp_index.search import select\n"
        "line = select._Writer.line\n"
        "def line_then_die(self, raw):\n"
        "    line(self, raw); self.handle.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "select._Writer.line = line_then_die\n"
        "from eogp_index.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "select",
            str(root / "idx"),
            "--queries",
            str(root / "targets.jsonl"),
            "--top",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == -9, done.stderr
    assert os.listdir(out.parent) == []


def test_scores_export_every_row_and_query(workspace):
    root, reference = workspace
    summary = json.loads(
        _run(
            "scores", root / "idx", "--queries", root / "targets.jsonl", "--out", root / "scores.parquet", "--json"
        ).stdout
    )
    table = pq.read_table(root / "scores.parquet")
    n = len(reference["ids"])
    assert summary["rows"] == table.num_rows == n * len(TARGETS)
    assert table.schema.names[:3] == ["id", "query", "score"] and "source" in table.schema.names
    got = {(r["id"], r["query"]): r["score"] for r in table.select(["id", "query", "score"]).to_pylist()}
    want = {(i, q): reference["scores"][q, j] for j, i in enumerate(reference["ids"]) for q in range(len(TARGETS))}
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-7)
    assert {r["id"]: r["source"] for r in table.select(["id", "source"]).to_pylist()} == reference["source"]


def test_a_moved_shard_without_stored_text_is_refused(workspace):
    root, _ = workspace
    path = root / "b.jsonl.gz"
    path.rename(root / "b.moved")
    try:
        result = CliRunner().invoke(
            cli,
            [
                "select",
                str(root / "idx"),
                "--queries",
                str(root / "targets.jsonl"),
                "--top",
                "3",
                "--where",
                "source = 'news'",
                "--out",
                str(root / "moved.jsonl"),
            ],
        )
        ids_only = CliRunner().invoke(
            cli,
            [
                "select",
                str(root / "idx"),
                "--queries",
                str(root / "targets.jsonl"),
                "--top",
                "3",
                "--where",
                "source = 'news'",
                "--ids-only",
                "--out",
                str(root / "moved-ids.jsonl"),
            ],
        )
    finally:
        (root / "b.moved").rename(path)
    assert result.exit_code == 1 and "cannot be read" in result.output and "--ids-only" in result.output
    assert not (root / "moved.jsonl").exists()
    assert ids_only.exit_code == 0 and len((root / "moved-ids.jsonl").read_text().splitlines()) == 3


def test_selection_does_not_depend_on_the_batches_and_ties_keep_the_lower_rows(workspace):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import SelectOptions
    from eogp_index.search.select import _best, select_documents

    root, _ = workspace
    index = AttributionIndex.open(root / "idx")
    for options in (SelectOptions(top="7"), SelectOptions(top="30%", score="max", direction="negative")):
        whole = select_documents(index, TARGETS, options)
        batched = select_documents(index, TARGETS, options, batch_bytes=1)  # one row per batch
        np.testing.assert_array_equal(whole.rowaddr, batched.rowaddr)
        np.testing.assert_array_equal(whole.scores, batched.scores)
    rowaddr = np.array([9, 3, 7, 1, 5], np.uint64)
    addr, key = _best(rowaddr, np.array([2.0, 1.0, 1.0, 0.5, 1.0], np.float32), 3)
    assert sorted(addr.tolist()) == [3, 5, 9]


def test_normalize_unit_selects_the_top_cosines_of_a_float64_reference(workspace):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents
    from eogp_index.store.codecs import decode

    root, reference = workspace
    index = AttributionIndex.open(root / "idx")
    hot = index.stored.hot_codes()
    ids = hot.columns.column("id").to_pylist()
    x = decode(hot.encoded, index.layout).astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    y = index.query_coordinates(TARGETS).astype(np.float64)
    cosine = (y @ x.T) / np.where(norms > 0, norms, 1.0)  # (queries, rows): each code divided by its norm
    mean, low = dict(zip(ids, cosine.mean(0))), dict(zip(ids, cosine.min(0)))

    # CLI, --score mean: the best 7 by the mean cosine, best first.
    summary = _select(root, "cosine.jsonl", "--top", "7", "--normalize", "unit", "--ids-only")
    rows = [json.loads(line) for line in (root / "cosine.jsonl").read_text().splitlines()]
    assert summary["selected"] == 7 and [r["id"] for r in rows] == _top(mean, 7)
    np.testing.assert_allclose([r["score"] for r in rows], [mean[r["id"]] for r in rows], rtol=1e-5, atol=1e-7)
    # Unit normalization changes the selection here (the test would not see a no-op).
    assert _top(mean, 7) != _top(_reference(reference), 7)

    # Python, LESS's rule on the harmful side, under a filter, whatever the batches.
    options = SelectOptions(top="40%", score="max", direction="negative")
    targets = Question(queries=tuple(TARGETS), where="source != 'code'", normalize="unit")
    picked = select_documents(index, targets, options)
    kept = {i: s for i, s in low.items() if reference["source"][i] != "code"}
    got = index.stored.rows(picked.rowaddr, ["id"]).column("id").to_pylist()
    assert got == _top(kept, math.floor(len(kept) * 40 / 100), largest=False)
    np.testing.assert_allclose(picked.scores, [kept[i] for i in got], rtol=1e-5, atol=1e-7)
    batched = select_documents(index, targets, options, batch_bytes=1)
    np.testing.assert_array_equal(batched.rowaddr, picked.rowaddr)
    np.testing.assert_array_equal(batched.scores, picked.scores)
    with pytest.raises(ValueError, match="normalize must be one of"):
        Question(queries=tuple(TARGETS), normalize="l2")


def _tier_reference(index, targets, normalize="none"):
    """ids and every row's score ``(queries, rows)`` from the rescoring tier, in float64: the
    stored int8 codes times their scales, against the queries' unquantized coordinates."""
    from eogp_index.store.codecs import list_column_to_numpy

    tier = index.stored.tier
    table = index.store.read(["id", "tier"])
    # Each row's record: the int8 codes' bytes, then each module's FP16 scale (schemas/store.md).
    records = list_column_to_numpy(table.column("tier"), tier.width + 2 * len(tier.layout.k), np.uint8)
    codes = records[:, : tier.width].view(np.int8).astype(np.float64)
    scales = records[:, tier.width :].copy().view("<f2").astype(np.float64)
    x = codes * np.repeat(scales, tier.layout.k, axis=1)
    if normalize == "unit":
        norms = np.linalg.norm(x, axis=1)
        x = x / np.where(norms > 0, norms, 1.0)[:, None]
    y = index.query_coordinates(targets).astype(np.float64)
    return table.column("id").to_pylist(), y @ x.T


def test_precision_rescore_scores_every_row_from_the_tier_on_every_surface(workspace):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents

    root, reference = workspace
    index = AttributionIndex.open(root / "idx")
    assert index.stored.tier is not None and index.stored.tier.code == "int8"
    ids, exact = _tier_reference(index, TARGETS)
    scale = np.abs(exact).max()

    # Python: every row, from the tier, within 1e-5 of the float64 reference.
    got_ids, got = index.scores(TARGETS, precision="rescore")
    assert got.dtype == np.float32 and sorted(got_ids) == sorted(ids)
    order = [got_ids.index(i) for i in ids]
    np.testing.assert_allclose(got[:, order], exact, rtol=1e-5, atol=1e-5 * scale)
    # ... which are not the one-bit scores (the test would see a precision that changed nothing).
    assert np.abs(reference["scores"] - exact[:, [ids.index(i) for i in reference["ids"]]]).max() > 1e-3 * scale

    # CLI scores: the same, in Parquet.
    _run(
        "scores", root / "idx", "--queries", root / "targets.jsonl", "--precision", "rescore",
        "--out", root / "tier.parquet",
    )  # fmt: skip
    table = pq.read_table(root / "tier.parquet")
    by_key = {(r["id"], r["query"]): r["score"] for r in table.select(["id", "query", "score"]).to_pylist()}
    np.testing.assert_allclose(
        [[by_key[(i, q)] for i in ids] for q in range(len(TARGETS))], exact, rtol=1e-5, atol=1e-5 * scale
    )

    # CLI select: the tier's best 6 by the mean, best first.
    mean = dict(zip(ids, exact.mean(0)))
    summary = _select(root, "tier.jsonl", "--top", "6", "--precision", "rescore", "--ids-only")
    rows = [json.loads(line) for line in (root / "tier.jsonl").read_text().splitlines()]
    assert summary["selected"] == 6 and [r["id"] for r in rows] == _top(mean, 6)
    np.testing.assert_allclose([r["score"] for r in rows], [mean[r["id"]] for r in rows], rtol=1e-5, atol=1e-5 * scale)

    # Python select, LESS's rule, unit norms, a filter, one row a batch: streamed, the same answer.
    _, cosine = _tier_reference(index, TARGETS, normalize="unit")
    low = {i: s for i, s in zip(ids, cosine.min(0)) if reference["source"][i] != "code"}
    options = SelectOptions(top="5", score="max", direction="negative", precision="rescore")
    question = Question(queries=tuple(TARGETS), where="source != 'code'", normalize="unit")
    picked = select_documents(index, question, options, batch_bytes=1)
    assert index.stored.rows(picked.rowaddr, ["id"]).column("id").to_pylist() == _top(low, 5, largest=False)
    np.testing.assert_allclose(picked.scores, sorted(low.values())[:5], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(select_documents(index, question, options).rowaddr, picked.rowaddr)

    with pytest.raises(ValueError, match="precision must be one of"):
        SelectOptions(precision="int8")
    bad = CliRunner().invoke(cli, ["select", str(root / "idx"), "--text", "t1 t2", "--precision", "2bit",
                                   "--out", str(root / "never.jsonl")])  # fmt: skip
    assert bad.exit_code != 0 and "2bit" in bad.output and not (root / "never.jsonl").exists()


def test_precision_rescore_on_an_index_without_a_tier_is_refused_saying_how_to_get_one(fitted_index, tmp_path):
    from eogp_index.config import SelectOptions
    from eogp_index.errors import ConfigError

    query = [3, 1, 4, 1, 5, 9, 2, 6]
    assert fitted_index.stored.tier is None
    for call in (
        lambda: fitted_index.scores([query], precision="rescore"),
        lambda: fitted_index.select([query], SelectOptions(top="3", precision="rescore")),
        lambda: __import__("eogp_index.search.select").search.select.write_scores(
            fitted_index.encoder, [query], tmp_path / "s.parquet", precision="rescore"
        ),
    ):
        with pytest.raises(ConfigError, match=r"has none .*--rescore int8") as refused:
            call()
        assert refused.value.field == "precision"
    assert not (tmp_path / "s.parquet").exists()
    # The one-bit precision still answers there.
    ids, scores = fitted_index.scores([query])
    assert scores.shape == (1, 40) and len(ids) == 40
