"""The one-bit code's recall of the tier's top rows and the NDCG gap of the rescored top, measured
on the stored table: a real fit (tiny GPT-2, kronfluence, LanceDB on disk) with the default
variant and tier, ingested twice through the library's commit loop; each record against a float64
recomputation by hand from the table's columns; the default factor it sets; `eogp info` and
`eogp optimize`; the floor and the sample; a record of format version 1 still read.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, TableRecallConfig
from eogp_index.search.query import rescore_factor
from eogp_index.search.question import Question
from eogp_index.store import table_recall
from eogp_index.store.codecs import decode
from eogp_index.store.stored_index import StoredIndex

EXAMPLES = make_examples(160, seed=7)
SETTINGS = dict(
    projection=ProjectionConfig(k=8, m=48, num_fit_examples=64, held_out_fraction=0.25),
    curvature=CurvatureConfig(num_examples=32, batch_size=16),
    gradients=GradientConfig(batch_size=16),
    progress=False,
)


def _brute_force(stored: StoredIndex, y: np.ndarray, hashes) -> dict:
    """The record's figures by hand: every row's two scores in float64, each side of each query
    sorted by (score, position) with its own document's stored copies left out."""
    columns = [*stored.codec.columns, *stored.tier.columns, "content_sha256"]
    table = stored.store.read(columns)
    tier = stored.tier.decode(stored.tier.from_arrow(table)).astype(np.float64)
    bits = decode(stored.codec.from_arrow(table), stored.layout).astype(np.float64)
    y = np.asarray(y, np.float64)
    by_tier, by_bit = y @ tier.T, np.asarray(stored.one_bit(y), np.float64) @ bits.T
    row_hashes = table.column("content_sha256").to_pylist()
    n = table.num_rows
    t = min(20, n // 20)
    factors = [f for f in (1, 2, 3, 5, 10, 20, 50, 100) if f * t < n]
    ideal = sum(1 / np.log2(p + 2) for p in range(t))
    per_query, gaps, excluded = [], [], 0
    for q in range(len(y)):
        rows = [i for i in range(n) if row_hashes[i] != hashes[q]]
        excluded += n - len(rows)
        shares, gap = np.zeros(len(factors)), np.zeros(len(factors))
        for sign in (1.0, -1.0):
            top = sorted(rows, key=lambda i: (-sign * by_tier[q, i], i))[:t]
            ranked = sorted(rows, key=lambda i: (-sign * by_bit[q, i], i))
            for j, f in enumerate(factors):
                kept = ranked[: f * t]
                shares[j] += sum(i in set(kept) for i in top) / t / 2
                rescored = sorted(kept, key=lambda i: (-sign * by_tier[q, i], kept.index(i)))[:t]
                gap[j] += (1 - sum((i in top) / np.log2(p + 2) for p, i in enumerate(rescored)) / ideal) / 2
        per_query.append(shares)
        gaps.append(gap)
    per_query, gaps = np.array(per_query), np.array(gaps)
    return {
        "rows": n,
        "t": t,
        "factors": factors,
        "recall": per_query.mean(axis=0),
        "recall_se": per_query.std(axis=0, ddof=1) / np.sqrt(len(y)),
        "gap": gaps.mean(axis=0),
        "gap_se": gaps.std(axis=0, ddof=1) / np.sqrt(len(y)),
        "excluded": excluded,
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An index fitted with the defaults (an int8 tier, the variant left to the tier), its record
    after a first ingest of 120 rows, and after a second of 40."""
    path = tmp_path_factory.mktemp("table-recall") / "index"
    index = AttributionIndex.create(path, make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, model_name="tiny", **SETTINGS)
    index.ingest(EXAMPLES[:120])
    first = table_recall.read_record(path)
    index.ingest(EXAMPLES[120:])
    second = table_recall.read_record(path)
    return path, first, second


def _stored(path) -> StoredIndex:
    return StoredIndex.open(path)


def test_the_default_variant_with_a_tier_chooses_each_module_by_recall(built):
    path, _, _ = built
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tier"]["code"] == "int8" and manifest["projection"]["variant"] == "auto"
    modules = manifest["projection"]["fidelity"]["modules"]
    rotated = set(manifest["projection"]["rotation"].get("modules", []))
    for name, entry in modules.items():
        recall = entry["recall"]
        assert entry["code"] == ("eogp-rot" if recall["diff"] > recall["diff_se"] else "eogp")
        assert (name in rotated) == (entry["code"] == "eogp-rot")


def test_without_a_tier_the_default_variant_is_eogp_and_an_explicit_one_wins():
    assert ProjectionConfig(k=8).resolved("int8").variant == "auto"
    assert ProjectionConfig(k=8).resolved(None).variant == "eogp"
    assert ProjectionConfig(k=8, variant="eogp").resolved("int8").variant == "eogp"
    assert ProjectionConfig(k=8, variant="eogp-rot").resolved(None).variant == "eogp-rot"


def test_the_fit_saves_the_held_out_queries_as_a_query_projects_them(built):
    path, _, _ = built
    y, hashes = table_recall.load_queries(path)
    fitting = json.loads((path / "fit" / "fitting_set.json").read_text())
    held_out = [row[0] for row in fitting["pca_held_out"]]
    assert len(y) == len(hashes) == len(held_out) == 16
    by_id = {ex.id: ex for ex in EXAMPLES}
    assert list(hashes) == [by_id[i].content_sha256 for i in held_out]
    index = AttributionIndex.open(path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    queries = [{"input_ids": list(by_id[i].input_ids), "labels": list(by_id[i].labels)} for i in held_out]
    np.testing.assert_allclose(y, index.query_coordinates(queries), rtol=2e-3, atol=2e-3 * np.abs(y).max())


def test_the_record_after_an_ingest_equals_a_float64_recomputation(built):
    path, first, second = built
    stored = _stored(path)
    y, hashes = table_recall.load_queries(path)
    expected = _brute_force(stored, y, hashes)
    assert second["rows"] == second["rows_measured"] == expected["rows"] == 160 and second["sample"] is None
    assert second["t"] == expected["t"] == 8 and second["factors"] == expected["factors"] == [1, 2, 3, 5, 10]
    np.testing.assert_allclose(second["recall"], expected["recall"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(second["recall_se"], expected["recall_se"], rtol=0, atol=1e-12)
    assert second["excluded"] == expected["excluded"] > 0  # held-out documents ingested too: left out
    assert second["queries"] == 16 and second["tier"] == "int8" and second["table_version"] == stored.store.version
    np.testing.assert_allclose(second["gap"], expected["gap"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(second["gap_se"], expected["gap_se"], rtol=0, atol=1e-12)
    assert second["format_version"] == 2 and second["criterion"] == "ndcg_gap" and second["gap_target"] == 0.005
    within = [f for f, g in zip(second["factors"], second["gap"]) if g <= second["gap_target"]]
    assert second["factor"] == (within[0] if within else second["factors"][-1])
    assert second["reached"] == bool(within)
    reaching = [f for f, r in zip(second["factors"], second["recall"]) if r >= second["target"]]
    assert second["recall_factor"] == (reaching[0] if reaching else None)
    assert second["recall"][0] < 1.0  # the signs miss some of the tier's top rows at F = 1: the test can tell
    assert second["gap"][0] > 0.005  # and the rescored top loses NDCG there


def test_a_second_ingest_measures_again(built):
    _, first, second = built
    assert first["rows"] == 120 and second["rows"] == 160
    assert first["table_version"] < second["table_version"]
    assert first["t"] == 6 and first["factors"] == [1, 2, 3, 5, 10]


def _record_with(path, **changes):
    record = table_recall.read_record(path)
    record.update(changes)
    fields = {k: v for k, v in record.items() if k not in ("format", "format_version")}
    fields.pop("criterion")
    for name in ("factors", "recall", "recall_se", "gap", "gap_se"):
        fields[name] = tuple(record[name])
    table_recall.write_record(path, table_recall.TableRecall(**fields))


def test_the_default_factor_prefers_the_tables_over_the_fits(built, tmp_path):
    path, _, second = built
    copy = tmp_path / "index"
    shutil.copytree(path, copy)
    stored = _stored(copy)
    assert rescore_factor(Question(), stored) == second["factor"]
    _record_with(copy, factor=7)
    assert rescore_factor(Question(), stored) == 7 and stored.info()["bytes"]["rescore"] == 7
    assert rescore_factor(Question(rescore=2), stored) == 2  # an explicit factor wins
    (copy / table_recall.RECORD_FILE).unlink()
    assert rescore_factor(Question(), stored) == stored.manifest.rescore_factor  # the fit's


def test_info_prints_both_measurements_and_warns_when_none_reaches_the_target(built, tmp_path):
    from eogp_index.cli import cli

    path, _, second = built
    out = CliRunner().invoke(cli, ["info", str(path)])
    assert out.exit_code == 0, out.output
    assert "rescoring   at fit time, recall of the int8 tier's top-" in out.output
    assert f"on the table (version {second['table_version']}, 160 rows; 160 rows read)" in out.output
    assert f"default factor {second['factor']}" in out.output
    as_json = json.loads(CliRunner().invoke(cli, ["info", str(path), "--json"]).stdout)
    assert as_json["table_recall"] == second
    copy = tmp_path / "index"
    shutil.copytree(path, copy)
    _record_with(copy, reached=False, factor=10)
    out = CliRunner().invoke(cli, ["info", str(copy)])
    assert "NONE within NDCG@8 gap 0.005" in out.output
    assert "no factor measured on the table keeps the rescored top within NDCG gap 0.005" in out.output


def test_optimize_measures_and_a_large_table_is_sampled_by_fragment(built, tmp_path):
    from eogp_index.cli import cli

    path, _, second = built
    copy = tmp_path / "index"
    shutil.copytree(path, copy)
    (copy / table_recall.RECORD_FILE).unlink()
    out = CliRunner().invoke(cli, ["optimize", str(copy), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)["table_recall"]
    assert report == table_recall.read_record(copy)
    assert report["recall"] == second["recall"] and report["rows"] == 160
    # A table over max_rows: whole fragments drawn until they hold max_rows rows.
    stored = _stored(path)
    fragments = stored.store.table.get_fragments()
    assert len(fragments) > 1
    sampled = table_recall.measure_table_recall(stored, config=TableRecallConfig(max_rows=100, seed=3))
    assert sampled.sample == {"fragments": sampled.sample["fragments"], "of_fragments": len(fragments), "seed": 3}
    assert 100 <= sampled.rows_measured < 160 and sampled.rows == 160
    assert sampled.t == sampled.rows_measured // 20


def test_a_table_below_the_floor_is_not_measured(built):
    path, _, _ = built
    stored = _stored(path)
    assert table_recall.measure_table_recall(stored, config=TableRecallConfig(min_rows=161)) is None
    assert table_recall.measure_table_recall(stored, config=TableRecallConfig(min_rows=160)) is not None


def test_a_damaged_record_is_refused_with_the_fix(built, tmp_path):
    from eogp_index.errors import IncompatibleIndexError

    path, _, _ = built
    copy = tmp_path / "index"
    shutil.copytree(path, copy)
    record = json.loads((copy / table_recall.RECORD_FILE).read_text())
    record["format_version"] = 3
    (copy / table_recall.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(IncompatibleIndexError, match="eogp optimize"):
        table_recall.read_record(copy)
    record.update(format_version=2)
    del record["gap"]  # version 2 holds the gap
    (copy / table_recall.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(IncompatibleIndexError, match="gap"):
        table_recall.read_record(copy)


def test_a_record_of_format_version_1_still_reads_and_sets_the_factor(built, tmp_path):
    """A record written before the gap (the factor chosen by the recall, factors up to 20): read,
    validated, printed by `eogp info` as a recall choice, and its factor used by queries."""
    from eogp_index.cli import cli

    path, _, second = built
    copy = tmp_path / "index"
    shutil.copytree(path, copy)
    old = {k: v for k, v in second.items() if k not in ("criterion", "gap", "gap_se", "gap_target", "recall_factor")}
    old.update(format_version=1, factor=3, reached=True)
    (copy / table_recall.RECORD_FILE).write_text(json.dumps(old))
    table_recall._RECORDS.clear()
    assert table_recall.read_record(copy) == old
    assert rescore_factor(Question(), _stored(copy)) == 3
    out = CliRunner().invoke(cli, ["info", str(copy)])
    assert out.exit_code == 0, out.output
    assert "default factor 3, the smallest within recall 0.98" in out.output


def test_a_purge_drops_deleted_documents_from_the_held_out_queries(tmp_path):
    from eogp_index.store.table_recall import drop_queries, load_queries, save_queries

    coordinates = np.arange(12, dtype=np.float32).reshape(3, 4)
    save_queries(tmp_path, coordinates, ["a", "b", "c"])
    assert drop_queries(tmp_path, ["x"]) == 0
    assert drop_queries(tmp_path, ["b", "x"]) == 1
    kept, hashes = load_queries(tmp_path)
    assert hashes == ("a", "c")
    np.testing.assert_array_equal(kept, coordinates[[0, 2]])
