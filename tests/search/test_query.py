"""The query path: the builder, its routes and its errors, on a real index (tiny GPT-2, LanceDB on disk)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.data.records import Example
from eogp_index.errors import ConfigError, InputError
from eogp_index.search.ranking import Hits
from eogp_index.store.stored_index import StoredIndex

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]


def _ids(table):
    return table.column("id").to_pylist()


def test_builder_equals_top_influential_and_full_scores(fitted_index):
    built = fitted_index.search(QUERY).where("`group` != 1").limit(6).direction("both").to_arrow()
    direct = fitted_index.top_influential(QUERY, k=6, where="`group` != 1", direction="both")
    assert _ids(built) == _ids(direct)
    # Both equal sorting the exact full score vector (ties: table order).
    ids, scores = fitted_index.scores([QUERY], where="`group` != 1")
    order = np.lexsort((np.arange(len(ids)), -scores[0]))[:6]
    assert _ids(built)[:6] == [ids[i] for i in order]
    np.testing.assert_allclose(built.column("score").to_numpy()[:6], scores[0][order], rtol=1e-6)


def test_every_route_gives_the_same_answer(fitted_index):
    hot = fitted_index.search(QUERY).limit(5).direction("both")
    expected = _ids(hot.to_arrow())
    assert _ids(hot.route("stream").to_arrow()) == expected
    assert _ids(hot.route("sharded").to_arrow()) == expected  # one worker without torchrun


def test_a_filtered_query_gives_the_same_answer_on_every_route(fitted_index):
    """The hot route evaluates filters on the hot copy (DataFusion), the others in Lance."""
    for where in ("`group` = 2", "name LIKE 'doc1%' OR `group` = 0", "num_tokens > 10 AND shard = 'synthetic'"):
        hot = fitted_index.search(QUERY).where(where).limit(5).direction("both")
        expected = hot.to_arrow().to_pylist()
        assert hot.route("stream").to_arrow().to_pylist() == expected, where
        assert hot.route("sharded").to_arrow().to_pylist() == expected, where


def test_a_batch_of_64_queries_answers_each_as_alone(fitted_index):
    rng = np.random.default_rng(0)
    queries = [[int(t) for t in rng.integers(1, 60, size=rng.integers(4, 12))] for _ in range(64)]
    together = fitted_index.search(queries, many=True).limit(3).where("`group` != 1").direction("positive").to_list()
    assert len(together) == 64
    for q in (0, 17, 63):
        alone = fitted_index.search(queries[q]).limit(3).where("`group` != 1").direction("positive").to_arrow()
        assert _ids(together[q]) == _ids(alone)
        np.testing.assert_allclose(together[q].column("score").to_numpy(), alone.column("score").to_numpy(), rtol=1e-5)


def test_many_queries_answer_each_on_its_own(fitted_index):
    queries = [QUERY, QUERY[::-1], {"input_ids": [7, 7, 2, 4]}]
    together = fitted_index.search(queries, many=True).limit(4).to_list()
    alone = [fitted_index.search(q).limit(4).to_arrow() for q in queries]
    assert [_ids(t) for t in together] == [_ids(t) for t in alone]


def test_a_bad_direction_or_k_is_a_config_error_naming_the_fix(fitted_index):
    with pytest.raises(ConfigError, match=r"direction must be one of \['positive', 'negative', 'both'\]"):
        fitted_index.top_influential(QUERY, direction="up")
    with pytest.raises(ConfigError, match="k must be a positive integer"):
        fitted_index.search(QUERY).limit(0)
    with pytest.raises(ConfigError, match="candidates C=3 must be at least k=5"):
        fitted_index.search(QUERY).limit(5).candidates(3)


def test_a_bad_filter_names_the_columns_without_lance_source_paths(fitted_index):
    for where in ("no_such_column = 1", "num_tokens >"):
        for route in ("hot", "stream"):
            with pytest.raises(InputError) as caught:
                fitted_index.search(QUERY).where(where).route(route).to_arrow()
            message = str(caught.value)
            assert where in message and "num_tokens" in message and "backticks" in message
            assert ".rs:" not in message and "/rust/" not in message, message


def test_an_index_with_no_rows_answers_with_no_rows(fitted_index_template, tmp_path):
    path = tmp_path / "empty"
    shutil.copytree(fitted_index_template, path)
    shutil.rmtree(path / "examples.lance")
    index = AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    assert index.info()["rows"] == 0
    for route in ("hot", "stream"):
        table = index.search(QUERY).limit(3).direction("both").route(route).to_arrow()
        assert table.num_rows == 0 and "id" in table.column_names
    ids, scores = index.scores([QUERY])
    assert ids == [] and scores.shape == (1, 0)


def test_ingest_skips_reruns_and_refuses_an_id_stored_from_elsewhere(fitted_index):
    stored = make_examples(40, seed=11)
    assert fitted_index.ingest(stored[:5], progress=False) == 0  # same ids, same places: a rerun
    moved = Example.from_ids(stored[0].id, stored[0].input_ids, shard="other.jsonl", position=7)
    with pytest.raises(InputError, match=f"duplicate id '{stored[0].id}': already stored from synthetic:row 0"):
        fitted_index.ingest([moved], progress=False)
    fresh = make_examples(3, seed=99, prefix="new")
    assert fitted_index.ingest(fresh + fresh, progress=False) == 3  # repeated within one call: stored once
    assert fitted_index.info()["rows"] == 43


def test_hits_rank_ties_in_table_order():
    hits = Hits.best(np.array([9, 3, 5, 1], np.uint64), np.array([1.0, 2.0, 2.0, 0.5], np.float32), 3, "positive")
    assert hits.rowaddr.tolist() == [3, 5, 9]
    merged = Hits.merge(
        [Hits.best(np.array([7], np.uint64), np.array([2.0], np.float32), 1, "negative"), hits], 2, "negative"
    )
    assert merged.rowaddr.tolist() == [9, 3] and merged.scores.tolist() == [1.0, 2.0]


def test_stored_index_opens_without_the_model_or_torch(fitted_index):
    info = StoredIndex.open(fitted_index.path).info()
    assert info == fitted_index.info()
    code = (
        "import sys; from eogp_index.store.stored_index import StoredIndex; "
        f"s = StoredIndex.open({str(fitted_index.path)!r}); print(s.info()['rows'], s.store.read(['id']).num_rows); "
        "heavy = [m for m in ('torch', 'transformers', 'kronfluence') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["40 40", "[]"]
