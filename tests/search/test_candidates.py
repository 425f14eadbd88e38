"""The flat first pass: a real FAISS RaBitQ index over a real LanceDB table of real (tiny GPT-2) codes.

The candidate path must map FAISS results back to the right rows (also after further ingests),
estimate each row's exact score ``⟨y, x_i⟩`` (``x_i`` the decoded one-bit code), equal the exact
scan when every row is a candidate, apply filters to the candidates, refuse indexes it cannot
answer for and files of older formats or retired kinds, and report the recall it reaches.
"""

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError, InputError
from eogp_index.search.first_pass import (
    DEFAULT_KIND,
    RETIRED_KINDS,
    FlatConfig,
    FlatFirstPass,
    build,
    load,
    make_config,
)
from eogp_index.search.first_pass import open_first_pass as open_candidates
from eogp_index.search.first_pass.faiss_flat import check_unique as _check_unique
from eogp_index.search.first_pass.faiss_flat import decode, id_keys
from eogp_index.search.first_pass.recall import SAMPLE_QUERIES, measure_on_stored_rows, measure_recall
from eogp_index.store.table import list_column_to_numpy

pa = pytest.importorskip("pyarrow")
faiss = pytest.importorskip("faiss")


def top_influential_with_candidates(index, query, k, C, *, where=None, direction="positive", faiss_name="default"):
    """The candidates route through the query builder, as users reach it."""
    return (
        index.search(query).limit(k).where(where).direction(direction).candidates(C, faiss_name=faiss_name).to_arrow()
    )


SEED = 3
TRAIN = make_examples(60, seed=11)
MORE = make_examples(20, seed=12, prefix="more")
QUERIES = make_examples(3, seed=13, prefix="q", masked_prompt=True)


def _query(i=0):
    return {"input_ids": list(QUERIES[i].input_ids), "labels": list(QUERIES[i].labels)}


def _create(path):
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(SEED),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=24, batch_size=4),
        gradients=GradientConfig(batch_size=8),
        storage=StorageConfig(rescore="none"),  # these tests check the one-bit scan itself
        progress=False,
    )
    index.ingest(TRAIN, progress=False)
    return index


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """The 60-row index with ``flat`` at its defaults and ``coarse``: flat trained on one row, queried with one bit."""
    index = _create(tmp_path_factory.mktemp("cand") / "idx")
    build(index, "flat", FlatConfig(), progress=False)
    build(index, "coarse", FlatConfig(train_rows=1, query_bits=1), progress=False)
    return index


def _codes_by_id(index):
    """``{id: (K,) decoded one-bit code}`` read from the table."""
    table = index.store.read(["id", "signs", "scales"])
    signs = list_column_to_numpy(table.column("signs"), index.layout.nbytes, np.uint8)
    scales = list_column_to_numpy(table.column("scales"), index.layout.num_modules, np.float32)
    return dict(zip(table.column("id").to_pylist(), decode(signs, scales, index.layout)))


def test_build_and_load(index):
    n = index.store.count()
    loaded = load(index.path, "flat")
    meta = json.loads((index.path / "faiss" / "flat.json").read_text())
    assert loaded.ntotal == n == meta["rows"] and meta["kind"] == "flat" == loaded.kind == DEFAULT_KIND
    assert meta["format_version"] == FlatFirstPass.FORMAT_VERSION == 3 and meta["d"] == index.layout.num_coords
    assert meta["table_version"] == index.store.version and loaded.build_params == {"train_rows": n}
    assert loaded._index.d == meta["d"] and isinstance(loaded.config, FlatConfig)
    for suffix in (".faissindex", ".ids.parquet", ".json"):
        assert (index.path / "faiss" / f"flat{suffix}").is_file()
    # A search parameter given at load time is used; a build parameter comes from the files.
    tuned = load(index.path, "coarse", config=FlatConfig(train_rows=999, query_bits=6))
    assert tuned.config == FlatConfig(train_rows=1, query_bits=6) and tuned.build_params == {"train_rows": 1}
    with pytest.raises(ConfigError, match="query_bits"):
        FlatConfig(query_bits=9)
    with pytest.raises(ConfigError, match="query coordinates must have shape"):
        loaded.search_with_distances(np.zeros((1, 3), np.float32), 5)


def test_estimates_follow_the_exact_scores_of_the_right_rows(index):
    """FAISS's estimate for an id tracks the exact score of that id's stored row, ⟨y, x_i⟩: rows
    mapped to the wrong ids, or codes without their scales, would not."""
    by_id = _codes_by_id(index)
    y = index.query_coordinates([_query(1)])
    ids, scores = index.scores([_query(1)])
    exact = dict(zip(ids, scores[0]))
    for sign in (1, -1):
        np.testing.assert_allclose(  # the decoded code is what the exact scan scores
            [float(sign * y[0] @ by_id[i]) for i in ids], sign * scores[0], rtol=1e-4, atol=1e-4
        )
        for name in ("flat", "coarse"):
            cand = open_candidates(index, name)
            estimates, positions = cand.search_with_distances(sign * y, len(ids))
            found = cand.ids_at(positions)[0]
            assert sorted(found) == sorted(ids)  # flat: every row, each once
            assert list(estimates[0]) == sorted(estimates[0], reverse=True)
            truth = np.array([sign * exact[i] for i in found])
            if name == "flat":
                assert np.corrcoef(estimates[0], truth)[0, 1] > 0.95
        spread = np.std(list(exact.values()))
        estimates, positions = open_candidates(index, "flat").search_with_distances(sign * y, len(ids))
        errors = estimates[0] - np.array([sign * exact[i] for i in open_candidates(index, "flat").ids_at(positions)[0]])
        assert np.abs(errors).mean() < 0.3 * spread


def test_extend_after_further_ingests(index, tmp_path):
    """New rows are covered without a rebuild, estimated like the old ones, and never duplicated."""
    other = _copy(index, tmp_path)
    assert other.ingest(MORE, progress=False) == len(MORE)
    n = other.store.count()
    cand = load(other.path, "flat")
    assert cand.ntotal == n - len(MORE)
    assert cand.extend(other) == len(MORE)
    assert cand.extend(other) == 0  # nothing twice
    reloaded = load(other.path, "flat")
    assert reloaded.ntotal == n and reloaded.table_version == other.store.version
    assert len(np.unique(reloaded._keys)) == n and set(reloaded._ids.to_pylist()) == set(_codes_by_id(other))
    y = other.query_coordinates([_query()])
    ids, scores = other.scores([_query()])
    exact = dict(zip(ids, scores[0]))
    estimates, positions = reloaded.search_with_distances(y, n)
    found = reloaded.ids_at(positions)[0]
    assert sorted(found) == sorted(ids)
    new = [j for j, i in enumerate(found) if i.startswith("more")]
    assert len(new) == len(MORE)
    assert np.corrcoef(estimates[0][new], [exact[found[j]] for j in new])[0, 1] > 0.9


def test_all_rows_as_candidates_equal_the_exact_scan(index):
    kind = "flat"
    n = index.store.count()
    for direction in ("positive", "negative", "both"):
        exact = index.top_influential(_query(), k=5, direction=direction)
        approx = top_influential_with_candidates(index, _query(), k=5, C=n, direction=direction, faiss_name=kind)
        assert approx.column_names == exact.column_names
        assert approx.column("id").to_pylist() == exact.column("id").to_pylist()
        np.testing.assert_allclose(
            approx.column("score").to_numpy(), exact.column("score").to_numpy(), rtol=1e-5, atol=1e-6
        )
        if direction == "both":
            assert approx.column("direction").to_pylist() == exact.column("direction").to_pylist()


def test_queries_extend_a_stale_faiss_index(index, tmp_path):
    """A query after an ingest covers the new rows (the FAISS index is extended, not bypassed)."""
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    other = AttributionIndex.open(
        path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    other.ingest(MORE, progress=False)
    n = other.store.count()
    exact = other.top_influential(_query(2), k=n, direction="positive")
    approx = top_influential_with_candidates(other, _query(2), k=n, C=n, faiss_name="flat")
    assert approx.column("id").to_pylist() == exact.column("id").to_pylist()
    assert load(path, "flat").ntotal == n


def test_where_filter_applies_to_the_candidates(index):
    where = "`group` = 1"
    matching = index.store.count(where)
    C, k = 12, 4
    assert matching > C  # the candidate path, not the small-filter shortcut
    y = index.query_coordinates([_query()])
    cand = open_candidates(index, "flat")
    for direction in ("positive", "negative"):
        _, positions = cand.search_with_distances(y if direction == "positive" else -y, C)
        cands = set(cand.ids_at(positions)[0])
        assert len(cands) == C
        ids, scores = index.scores([_query()], where=where)
        keep = [j for j, i in enumerate(ids) if i in cands]
        sub = scores[0, keep]
        order = np.argsort(-sub if direction == "positive" else sub, kind="stable")[:k]
        expected = [ids[keep[j]] for j in order]
        got = top_influential_with_candidates(
            index, _query(), k=k, C=C, where=where, direction=direction, faiss_name="flat"
        )
        assert got.column("id").to_pylist() == expected
        np.testing.assert_allclose(got.column("score").to_numpy(), sub[order], rtol=1e-5, atol=1e-6)
        assert set(got.column("group").to_pylist()) == {1}


def test_small_filter_is_rescored_entirely(index):
    """A filter matching at most C rows: every matching row is rescored, which is exact."""
    where = "`group` = 2"
    C = index.store.count(where)
    exact = index.top_influential(_query(), k=5, where=where, direction="both")
    got = top_influential_with_candidates(index, _query(), k=5, C=C, where=where, direction="both", faiss_name="flat")
    assert got.column("id").to_pylist() == exact.column("id").to_pylist()


def test_bad_filter_and_arguments(index):
    with pytest.raises(InputError, match="invalid where filter"):
        top_influential_with_candidates(index, _query(), k=3, C=10, where="no_such_column = 1", faiss_name="flat")
    with pytest.raises(ConfigError, match="at least k"):
        top_influential_with_candidates(index, _query(), k=10, C=5, faiss_name="flat")
    with pytest.raises(IndexNotFoundError, match="build-candidates"):
        top_influential_with_candidates(index, _query(), k=3, C=10, faiss_name="missing")
    with pytest.raises(ConfigError):
        make_config("lsh")


def _with_manifest(index, **changes):
    """A copy of ``index`` whose manifest differs (as if the index had been built otherwise)."""
    other = copy.copy(index)
    other.stored = copy.copy(index.stored)
    other.stored.manifest = dataclasses.replace(index.manifest, **changes)
    return other


def test_refuses_other_indexes(index):
    fp16 = _with_manifest(index, precision="fp16")
    with pytest.raises(IncompatibleIndexError, match="precision 'fp16'"):
        build(fp16, "nope", progress=False)
    with pytest.raises(IncompatibleIndexError, match="precision 'fp16'"):
        top_influential_with_candidates(fp16, _query(), k=3, C=10, faiss_name="flat")
    other = _with_manifest(index, projection={**index.manifest.projection, "sha256": "0" * 64})
    with pytest.raises(IncompatibleIndexError, match="projection sha256"):
        top_influential_with_candidates(other, _query(), k=3, C=10, faiss_name="flat")
    with pytest.raises(IncompatibleIndexError, match="projection sha256"):
        load(index.path, "flat").extend(other)


def test_keys_are_stable_and_collisions_refused():
    keys = id_keys(["a", "b", "ex-1"])
    assert keys.dtype == np.int64 and (keys >= 0).all() and len(set(keys)) == 3
    assert (id_keys(["ex-1"]) == keys[2]).all()  # the same id always has the same key
    with pytest.raises(IncompatibleIndexError, match="collision"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "y"]), "here")
    with pytest.raises(InputError, match="more than once"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "x"]), "here")


def _copy(index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


def test_each_side_holds_only_rows_of_its_sign_on_every_route(index, tmp_path):
    """Fewer rows of a sign match than k: the side is shorter, never topped up with the other sign."""
    other = _copy(index, tmp_path)
    ids, scores = other.scores([_query()])
    order = np.argsort(scores[0])
    chosen = [ids[i] for i in (*order[:2], *order[-3:])]  # the two most negative, the three most positive
    where = "id IN (" + ", ".join(f"'{i}'" for i in chosen) + ")"
    exact = dict(zip(ids, scores[0]))
    expected = [("positive", i) for i in sorted(chosen, key=lambda i: -exact[i]) if exact[i] > 0] + [
        ("negative", i) for i in sorted(chosen, key=lambda i: exact[i]) if exact[i] < 0
    ]
    assert [side for side, _ in expected] == ["positive"] * 3 + ["negative"] * 2
    search = other.search(_query()).where(where).limit(8).direction("both")
    routes = {"hot": search, "stream": search.route("stream"), "sharded": search.route("sharded")}
    routes.update({name: search.candidates(other.store.count(), faiss_name=name) for name in ("flat", "coarse")})
    for route, query in routes.items():
        got = query.to_arrow()
        assert list(zip(got.column("direction").to_pylist(), got.column("id").to_pylist())) == expected, route
    for direction, sign in (("positive", 1), ("negative", -1)):
        got = search.direction(direction).to_arrow()
        assert got.num_rows == (3 if sign > 0 else 2) and all(sign * s > 0 for s in got.column("score").to_pylist())
    nothing_hurts = "id IN (" + ", ".join(f"'{ids[i]}'" for i in order[-3:]) + ")"
    assert search.where(nothing_hurts).direction("negative").to_arrow().num_rows == 0
    helps = search.where(nothing_hurts).by_module().to_arrow()  # one side empty, the other with its terms
    assert helps.column("direction").to_pylist() == ["positive"] * 3 and all(helps.column("modules").to_pylist())


def test_older_formats_and_retired_kinds_are_refused_with_the_rebuild_command(index, tmp_path):
    """A Hamming first pass (format versions 1 and 2) or one of a retired kind would answer from
    files this code cannot read: the message says why and how to rebuild."""
    other = _copy(index, tmp_path)
    meta_path = other.path / "faiss" / "flat.json"
    meta = json.loads(meta_path.read_text())
    for version in (1, 2):
        meta_path.write_text(json.dumps({**meta, "format_version": version}))
        with pytest.raises(
            IncompatibleIndexError, match=rf"version {version}\b.*Hamming.*build-candidates .* --kind flat"
        ):
            load(other.path, "flat")
    for kind in RETIRED_KINDS:
        meta_path.write_text(json.dumps({**meta, "kind": kind, "format": "eogp-clustered"}))
        with pytest.raises(IncompatibleIndexError, match=rf"kind '{kind}', which is retired.*--kind flat --name flat"):
            load(other.path, "flat")
        with pytest.raises(ConfigError, match=f"'{kind}' first pass is retired"):
            make_config(kind)


def test_recall_with_every_row_a_candidate_is_one(index):
    """Recall is measured against the exact scan of every row: with every row within the budget
    the whole exact top-20 of both sides is found, stored rows' own codes as queries."""
    recall = measure_on_stored_rows(load(index.path, "flat"), index.stored, C=2 * index.store.count())
    assert recall.recall == recall.positive == recall.negative == 1.0
    assert recall.queries == SAMPLE_QUERIES and recall.queries_from == "stored rows" and not recall.below_target


def test_recall_is_measured_on_real_codes_and_recorded(index, tmp_path):
    """On the real tiny codes, at a budget of 10 of 60 rows, the flat pass finds most of the exact
    top 5 of held-out queries, the one-bit coarse pass fewer; record_recall writes it to the JSON."""
    y = index.query_coordinates([_query(i) for i in range(len(QUERIES))])
    flat = measure_recall(load(index.path, "flat"), index.stored, y, k=5, C=10)
    coarse = measure_recall(load(index.path, "coarse"), index.stored, y, k=5, C=10)
    assert flat.queries == 3 and flat.candidates == 10 and flat.queries_from == "held-out documents"
    assert flat.recall >= 0.8 and flat.recall > coarse.recall
    other = _copy(index, tmp_path)
    built = load(other.path, "coarse")
    recall = built.record_recall(other.stored, C=20)
    assert recall.candidates == 20 and recall.k == 20
    assert json.loads((other.path / "faiss" / "coarse.json").read_text())["recall"] == recall.to_json()
    assert load(other.path, "coarse").meta["recall"]["recall"] == recall.recall
