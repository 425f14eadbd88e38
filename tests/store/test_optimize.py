"""Fragment hygiene (eogp_index.store.maintenance, `eogp optimize`): compaction, scalar indexes, old
versions, the hot copy; ingest compacting by itself; answers unchanged by any of it."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import numpy as np
import pytest
from click.testing import CliRunner
from tinymodels import make_examples

from eogp_index.cli import cli
from eogp_index.errors import ConfigError
from eogp_index.store.maintenance import (
    CLEANUP_INTERVAL,
    OptimizeReport,
    maybe_optimize,
    needs_optimize,
    optimize,
    small_fragments,
)
from eogp_index.store.stored_index import StoredIndex
from eogp_index.store.table import Store

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]
WHERE = "`group` = 1 AND name LIKE 'doc%'"


def _answers(index):
    """What users see: a filtered and an unfiltered search, and the hot copy's ids."""
    both = index.search(QUERY).limit(8).direction("both")
    return (
        both.to_arrow().to_pylist(),
        both.where(WHERE).to_arrow().to_pylist(),
        sorted(index.hot_codes().columns.column("id").to_pylist()),
    )


def _many_fragments(index, commits: int = 8):
    for k in range(commits):
        index.add_batch(make_examples(3, seed=200 + k, prefix=f"extra{k}"))


def test_optimize_compacts_removes_versions_and_rebuilds_the_hot_copy(fitted_index):
    index = fitted_index
    _many_fragments(index)
    before = _answers(index)
    fragments = len(index.store.dataset().get_fragments())
    versions = len(index.store.dataset().versions())
    assert fragments == 12 and needs_optimize(index.store, threshold=8) and not needs_optimize(index.store)

    report = index.optimize(retention=timedelta(0))
    assert isinstance(report, OptimizeReport)
    assert (report.fragments_before, report.fragments_after, report.rows, report.hot_rows) == (12, 1, 64, 64)
    assert report.versions_removed >= versions - 1 and len(index.store.dataset().versions()) == 1
    assert report.version_after > report.version_before
    state = json.loads((index.path / "hot" / "state.json").read_text())
    assert state["table_version"] == report.version_after and len(state["pieces"]) == 1
    assert state["stamp"] is not None  # the next process maps it without opening the table
    assert _answers(index) == before  # same rows, scores and metadata; only row addresses moved
    json.dumps(report.to_json())
    assert "12 → 1 fragments" in report.describe()

    again = optimize(index.stored, retention=timedelta(0))  # nothing left to do
    assert (again.fragments_removed, again.fragments_added, again.fragments_after) == (0, 0, 1)


def _rows(start: int, n: int = 4):
    import pyarrow as pa

    return pa.table({"id": [f"r{i}" for i in range(start, start + n)], "position": pa.array(range(start, start + n))})


@pytest.mark.parametrize("v2_names", [True, False])
def test_two_writers_see_each_other_at_once_and_lose_no_rows(tmp_path, v2_names):
    # Store.add commits from its open dataset and follows others' commits by probing for the
    # next version's manifest instead of listing every version: each handle must still see the
    # other's commits on its next access (all within the racy second) and never drop them. A
    # table with Lance's older manifest names (v2_names False) is followed by asking Lance.
    import lance

    a, b = Store(tmp_path), Store(tmp_path)
    if v2_names:
        a.add(_rows(0))
    else:
        lance.write_dataset(_rows(0), a.path, enable_v2_manifest_paths=False)
        assert os.path.exists(os.path.join(a.path, "_versions", "1.manifest"))
    assert b.version == 1 and b.count() == 4
    for i in range(1, 7):
        writer, reader = (a, b) if i % 2 else (b, a)
        writer.add(_rows(4 * i))
        assert reader.version == writer.version == i + 1 and reader.count() == 4 * (i + 1)
    stale = Store(tmp_path)
    assert stale.version == 7
    a.add(_rows(100)), a.add(_rows(200))  # `stale` holds version 7 while two commits land
    assert stale.add(_rows(300)) == 10  # committed over them, not instead of them
    ids = set(Store(tmp_path).read(["id"]).column("id").to_pylist())
    assert len(ids) == 40 and {"r0", "r27", "r100", "r203", "r303"} <= ids


def test_ingest_removes_old_versions_at_most_once_per_interval(tmp_path):
    # Lance's cleanup reads every manifest; during an ingest it runs at the first compaction and
    # then at most once per CLEANUP_INTERVAL x retention, not at every compaction.
    store = Store(tmp_path)
    for i in range(6):
        store.add(_rows(4 * i))
    first = maybe_optimize(store, threshold=2, retention=timedelta(0))
    assert first is not None and first.versions_removed >= 6 and store.cleaned_at is not None
    for i in range(6, 10):
        store.add(_rows(4 * i))
    hour = timedelta(hours=1)
    cleaned = store.cleaned_at
    second = maybe_optimize(store, threshold=2, retention=hour)
    assert second is not None and second.fragments_after == 1  # compacted, but not cleaned
    assert store.cleaned_at == cleaned and second.versions_removed == 0
    store.cleaned_at -= CLEANUP_INTERVAL * hour.total_seconds()  # as if a quarter hour had passed
    for i in range(10, 14):
        store.add(_rows(4 * i))
    third = maybe_optimize(store, threshold=2, retention=hour)
    assert third is not None and store.cleaned_at > cleaned
    assert store.count() == 56


def test_filters_after_compaction_equal_lance(fitted_index):
    index = fitted_index
    _many_fragments(index)
    index.hot_codes()
    optimize(index, retention=None, rebuild_hot=False)  # the next query finds its copy stale
    for where in (WHERE, "`group` IN (0, 2)", "name < 'doc2'", "_rowid < 3"):
        hot = index.hot_codes()
        lance = index.store.dataset().to_table(columns=[], filter=where, with_row_address=True)
        expected = hot.positions(np.sort(lance.column("_rowaddr").to_numpy()))
        assert np.array_equal(index.stored.matching_rows(where), expected), where


def test_candidates_after_compaction_are_still_exact(fitted_index):
    pytest.importorskip("faiss")
    from eogp_index.search.first_pass import build

    index = fitted_index
    _many_fragments(index)
    build(index.stored, progress=False)  # built on the fragments before compaction
    exact = index.search(QUERY).limit(6).direction("both")
    expected = (exact.to_arrow().to_pylist(), exact.where(WHERE).to_arrow().to_pylist())
    optimize(index, retention=timedelta(0))
    n = index.store.count()
    found = exact.candidates(n)  # every row a candidate: the exact answer, also filtered
    assert found.to_arrow().to_pylist() == expected[0]
    assert found.where(WHERE).to_arrow().to_pylist() == expected[1]


def test_optimize_refreshes_scalar_indexes(fitted_index):
    index = fitted_index
    index.store.create_scalar_index("group", "BITMAP")
    _many_fragments(index, 3)  # rows the index does not cover yet
    report = optimize(index)
    assert report.indices == index.store.index_names() and len(report.indices) == 1
    assert "ScalarIndexQuery" in index.store.explain("`group` = 1")
    assert index.store.count("`group` = 1") == index.stored.matching_rows("`group` = 1").size


def test_a_plain_store_can_be_optimized_and_bad_settings_are_refused(fitted_index):
    _many_fragments(fitted_index, 3)
    report = optimize(fitted_index.store, retention=None)
    assert report.fragments_after == 1 and report.hot_rows is None and report.versions_removed == 0
    with pytest.raises(ConfigError, match="retention"):
        optimize(fitted_index, retention=5)
    with pytest.raises(ConfigError, match="target_rows"):
        optimize(fitted_index, target_rows=0)
    with pytest.raises(ConfigError, match="needs a Store"):
        optimize(object())


def test_eogp_optimize_command(fitted_index):
    _many_fragments(fitted_index, 2)
    result = CliRunner().invoke(cli, ["optimize", str(fitted_index.path), "--retention", "0", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["fragments_before"], report["fragments_after"], report["hot_rows"]) == (6, 1, 46)
    bad = CliRunner().invoke(cli, ["optimize", str(fitted_index.path), "--retention", "soon"])
    assert bad.exit_code != 0 and "not a duration" in bad.output


def test_ingest_compacts_past_the_threshold_and_ends_ready_to_query(fitted_index, tmp_path):
    from ingest.pipeline import run_ingest
    from ingest.records import RecordSpec

    index = fitted_index
    shard = tmp_path / "more.jsonl"
    records = [
        {"id": f"ing-{i}", "input_ids": [1 + (i * 7 + j) % 60 for j in range(6 + i % 5)], "kind": i % 2}
        for i in range(30)
    ]
    # 3 rows per commit; more than 4 small fragments make it compact. The first run sees the
    # shard's first 12 records (as if cut short), the rerun all 30: it stores the rest, once.
    shard.write_text("".join(json.dumps(r) + "\n" for r in records[:12]))
    first = run_ingest(
        index, [str(shard)], spec=RecordSpec(id_field="id"), batch_size=3, progress=False, optimize_threshold=4
    )
    assert first.stored == 12 and first.optimized >= 1
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    second = run_ingest(
        index, [str(shard)], spec=RecordSpec(id_field="id"), batch_size=3, progress=False, optimize_threshold=4
    )
    assert (second.stored, second.skipped_existing) == (18, 12) and second.optimized >= 1
    ids = index.store.read(["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 70
    assert small_fragments(index.store) <= 4
    # The run ended with the hot copy up to date: a new process maps it as it is.
    state = json.loads((index.path / "hot" / "state.json").read_text())
    assert state["table_version"] == index.store.version and state["rows"] == 70
    fresh = StoredIndex.open(index.path)
    assert sorted(fresh.hot_codes().columns.column("id").to_pylist()) == sorted(ids)


def test_client_ingest_compacts_too(fitted_index):
    index = fitted_index
    index.gradients = type(index.gradients)(batch_size=2)
    added = index.ingest(make_examples(12, seed=300, prefix="cli"), progress=False, optimize_threshold=4)
    assert added == 12
    assert len(index.store.dataset().get_fragments()) <= 4
    ids = index.store.read(["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 52 and index.hot_codes().num_rows == 52


def test_distributed_ingest_compacts_on_rank_zero(fitted_index, tmp_path):
    """The torchrun entry point as one worker: rank 0's commits, then its compactions."""
    from tinymodels import make_tiny_gpt2, make_word_tokenizer

    from eogp_index.config import GradientConfig
    from ingest.distributed import run_distributed_ingest
    from ingest.records import RecordSpec

    model_dir = tmp_path / "model"  # the fixture's model, loadable by the worker
    make_tiny_gpt2().save_pretrained(model_dir)
    make_word_tokenizer().save_pretrained(model_dir)
    shard = tmp_path / "d.jsonl"
    shard.write_text(
        "".join(json.dumps({"id": f"d-{i}", "input_ids": [2 + i % 50, 3, 4, 5 + i % 7]}) + "\n" for i in range(20))
    )
    options = dict(
        spec=RecordSpec(id_field="id"),
        batch_size=2,
        progress=False,
        optimize_threshold=3,
        gradients=GradientConfig(batch_size=2, device="cpu"),
        model_path=str(model_dir),
        shard_root=tmp_path,
    )
    summary = run_distributed_ingest(fitted_index.path, [str(shard)], **options)
    assert summary.stored == 20 and summary.optimized >= 2 and summary.workers == 1
    store = StoredIndex.open(fitted_index.path).store
    assert small_fragments(store) <= 3 and summary.table_version == store.version
    again = run_distributed_ingest(fitted_index.path, [str(shard)], **options)
    assert (again.stored, again.skipped_existing) == (0, 20)
    ids = store.read(["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 60
