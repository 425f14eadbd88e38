"""FAISS first pass: real FAISS binary indexes over a real LanceDB table of real (tiny GPT-2) codes.

The candidate path must map FAISS results back to the right rows (also after further ingests),
equal the exact scan when every row is a candidate, apply filters to the candidates, and refuse
indexes it cannot answer for. The FAISS distance of a weighted query code to a replicated row
must be exactly ``(R·K − Σ_j σ_j w_j β_j)/2`` (eogp_index/search/first_pass/faiss_codes.py).
"""

import copy
import dataclasses
import json
import shutil
from datetime import timedelta

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError, InputError
from eogp_index.search.first_pass import (
    ClusteredConfig,
    ClusteredFirstPass,
    FaissFirstPass,
    FlatConfig,
    build,
    kind_class,
    load,
    make_config,
)
from eogp_index.search.first_pass import open_first_pass as open_candidates
from eogp_index.search.first_pass.faiss_binary import candidate_ids
from eogp_index.search.first_pass.faiss_codes import check_unique as _check_unique
from eogp_index.search.first_pass.faiss_codes import id_keys, query_codes, query_levels, replicate_codes
from eogp_index.search.first_pass.recall import SAMPLE_QUERIES, measure_on_stored_rows
from eogp_index.store.codecs import SignLayout, pack_signs, unpack_signs
from eogp_index.store.table import list_column_to_numpy

pa = pytest.importorskip("pyarrow")
faiss = pytest.importorskip("faiss")


def top_influential_with_candidates(index, query, k, C, *, where=None, direction="positive", faiss_name="default"):
    """The candidates route through the query builder, as users reach it."""
    return (
        index.search(query).limit(k).where(where).direction(direction).candidates(C, faiss_name=faiss_name).to_arrow()
    )


FORMAT_VERSION = FaissFirstPass.FORMAT_VERSION
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


#: Replicas of the three main test indexes: the weighted query codes are what they exercise.
WEIGHTED = 4


def _faiss_config(kind, **params):
    """A FAISS kind's configuration; IVF with 4 lists, so that a small store fills them."""
    return make_config(kind, **params, **({"nlist": 4} if kind == "ivf" else {}))


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """Three FAISS indexes with ``WEIGHTED`` replicas, and ``plain``: flat with one replica (plain Hamming)."""
    index = _create(tmp_path_factory.mktemp("cand") / "idx")
    for kind in ("flat", "ivf", "hnsw"):
        build(index, kind, _faiss_config(kind, replicas=WEIGHTED), progress=False)
    build(index, "plain", FlatConfig(replicas=1), progress=False)
    return index


def _signs_by_id(index):
    table = index.store.read(["id", "signs"])
    signs = list_column_to_numpy(table.column("signs"), index.layout.nbytes, np.uint8)
    return dict(zip(table.column("id").to_pylist(), signs))


def _hamming(a, b):
    return int(np.unpackbits(np.bitwise_xor(a, b)).sum())


def _weighted_distance(y, signs, layout, replicas):
    """The module docstring's formula in float64: ``(R·K − Σ_j σ_j w_j β_j) / 2`` per (query, row)."""
    sigma = np.where(np.asarray(y) >= 0, 1.0, -1.0)
    v = sigma * query_levels(y, replicas).astype(np.float64)
    beta = unpack_signs(signs, layout).astype(np.float64)
    return (replicas * layout.num_coords - v @ beta.T) / 2


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_build_and_load(index, kind):
    n = index.store.count()
    loaded = load(index.path, kind)
    meta = json.loads((index.path / "faiss" / f"{kind}.json").read_text())
    assert loaded.ntotal == n == meta["rows"] and meta["kind"] == kind and loaded.kind == kind
    R = WEIGHTED
    assert meta["format_version"] == FORMAT_VERSION == 2 and meta["replicas"] == R == loaded.replicas
    assert meta["table_version"] == index.store.version and meta["d_bits"] == R * index.layout.nbytes * 8
    assert loaded._index.d == meta["d_bits"] and loaded.code_bytes == R * index.layout.nbytes
    for suffix in (".faissindex", ".ids.parquet", ".json"):
        assert (index.path / "faiss" / f"{kind}{suffix}").is_file()
    # A stored row's own (replicated) signs find that row at distance 0 (every kind, after a reload).
    by_id = _signs_by_id(index)
    some = list(by_id)[7]
    own = loaded.row_codes(by_id[some][None, :])
    np.testing.assert_array_equal(own, np.tile(by_id[some], R)[None, :])
    dist, pos = loaded.search_with_distances(own, 5)
    assert loaded.ids_at(pos)[0, 0] == some and dist[0, 0] == 0
    assert loaded.search(own, 5)[0, 0] == some
    with pytest.raises(ConfigError, match="query codes must have shape"):
        loaded.search_with_distances(by_id[some][None, :], 5)  # unreplicated signs: refused, not misread


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_all_rows_as_candidates_equal_the_exact_scan(index, kind):
    n = index.store.count()
    cand = open_candidates(index, kind)
    cand.set_search(nprobe=1000)  # IVF: every list, so that all n rows are found
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


def test_faiss_ids_map_to_the_right_rows(index):
    """The distance FAISS reports for an id is the weighted distance to that id's stored signs."""
    by_id = _signs_by_id(index)
    y = index.query_coordinates([_query(1)])
    for kind in ("flat", "ivf", "hnsw", "plain"):
        cand = open_candidates(index, kind)
        for sign in (1, -1):
            code = cand.query_codes(sign * y, index.layout)
            dist, pos = cand.search_with_distances(code, 25)
            ids = cand.ids_at(pos)[0]
            found = [(d, i) for d, i in zip(dist[0], ids) if i is not None]
            assert len(found) >= (25 if kind != "ivf" else 1)
            for d, i in found:
                assert d == _hamming(code[0], cand.row_codes(by_id[i][None, :])[0]), (kind, i)
                assert d == _weighted_distance(sign * y, by_id[i][None, :], index.layout, cand.replicas)[0, 0]
            assert list(dist[0][: len(found)]) == sorted(d for d, _ in found)
    # plain (one replica) is Hamming on pack_signs(y), as before replicas.
    plain = open_candidates(index, "plain")
    np.testing.assert_array_equal(plain.query_codes(y, index.layout), pack_signs(y, index.layout))
    # flat is exhaustive: its C nearest are the true C nearest by the weighted distance.
    cand = open_candidates(index, "flat")
    truth = np.sort(_weighted_distance(y, np.stack(list(by_id.values())), index.layout, cand.replicas)[0])[:25]
    dist, _ = cand.search_with_distances(cand.query_codes(y, index.layout), 25)
    np.testing.assert_array_equal(dist[0], truth)


def test_extend_after_further_ingests(index, tmp_path):
    """New rows are covered without a rebuild, found by their own signs, and never duplicated."""
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    other = AttributionIndex.open(
        path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    assert other.ingest(MORE, progress=False) == len(MORE)
    by_id = _signs_by_id(other)
    n = len(by_id)
    for kind in ("flat", "ivf", "hnsw"):
        cand = load(path, kind)
        assert cand.ntotal == n - len(MORE)
        assert cand.extend(other) == len(MORE)
        assert cand.extend(other) == 0  # nothing twice
        reloaded = load(path, kind)
        assert reloaded.ntotal == n and reloaded.table_version == other.store.version
        keys = reloaded._keys
        assert len(np.unique(keys)) == n and set(reloaded._ids.to_pylist()) == set(by_id)
        reloaded.set_search(nprobe=1000)
        for ex in MORE[::5]:  # new rows are stored replicated like the old ones
            dist, pos = reloaded.search_with_distances(reloaded.row_codes(by_id[ex.id][None, :]), 3)
            assert reloaded.ids_at(pos)[0, 0] == ex.id and dist[0, 0] == 0
        y = other.query_coordinates([_query()])
        code = reloaded.query_codes(y, other.layout)
        everything = reloaded.search(code, n)[0]
        if kind == "flat":  # the weighted distances of new rows follow the formula too
            dist, pos = reloaded.search_with_distances(code, n)
            for d, i in zip(dist[0], reloaded.ids_at(pos)[0]):
                assert d == _weighted_distance(y, by_id[i][None, :], other.layout, reloaded.replicas)[0, 0]
        if kind != "hnsw":  # flat and IVF with every list probed reach every row exactly once
            assert sorted(everything) == sorted(by_id)
        else:
            found = [i for i in everything if i is not None]
            assert len(found) == len(set(found))


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
        cands = set(candidate_ids(cand, y, index.layout, C, direction))
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
    got = top_influential_with_candidates(index, _query(), k=5, C=C, where=where, direction="both", faiss_name="hnsw")
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


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
def test_weighted_distance_is_exact_with_padding_bits(kind, replicas):
    """On a real FAISS index, the distance of query_codes(y) to a row is exactly
    ``(R·K − Σ_j σ_j w_j β_j)/2`` (float64 reference), with odd k (padding bits in every replica)."""
    layout = SignLayout((13, 7, 20))
    rng = np.random.default_rng(replicas)
    codes = pack_signs(rng.standard_normal((300, layout.num_coords)), layout)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    y[0, :5] = 0.0  # zeros are +1 (pack_signs' convention) with the lowest level
    y[1, 3:6] = -0.0
    y[2] *= np.exp(3 * rng.standard_normal(layout.num_coords)).astype(np.float32)  # heavy-tailed |y|
    cand = kind_class(kind).from_codes(codes, [f"r{i}" for i in range(300)], _faiss_config(kind, replicas=replicas))
    cand.set_search(nprobe=4, ef_search=300)
    assert cand._index.d == replicas * layout.nbytes * 8
    query = cand.query_codes(y, layout)
    # Padding bits are 0 in every replica of the query, as in the stored codes.
    padding = ~np.tile(pack_signs(np.ones((1, layout.num_coords)), layout)[0], replicas)
    assert not (query & padding).any() and not (cand.row_codes(codes) & padding).any()
    levels = query_levels(y, replicas)
    assert levels.min() >= replicas % 2 and levels.max() <= replicas and ((replicas - levels) % 2 == 0).all()
    reference = _weighted_distance(y, codes, layout, replicas)
    dist, pos = cand.search_with_distances(query, 300)
    for q in range(3):
        found = pos[q] >= 0
        assert found.all() if kind != "hnsw" else found.sum() >= 250  # HNSW may not reach every node
        np.testing.assert_array_equal(dist[q][found], reference[q][pos[q][found]])
        hamming = np.unpackbits(replicate_codes(codes, replicas) ^ query[q], axis=1).sum(axis=1)
        np.testing.assert_array_equal(hamming, reference[q])
        if kind == "flat":
            np.testing.assert_array_equal(np.sort(dist[q]), np.sort(reference[q]))
    assert list(cand.ids_at(pos[:1, :3])[0]) == [f"r{i}" for i in pos[0, :3]]


def test_query_levels_follow_y():
    """Levels grow with |y|, use every level for a spread-out query, and are all 1 for one replica."""
    y = np.linspace(-3, 3, 601, dtype=np.float32)[None, :]
    for R in (2, 3, 4, 8):
        w = query_levels(y, R)[0]
        order = np.argsort(np.abs(y[0]), kind="stable")
        assert (np.diff(w[order]) >= 0).all()
        assert set(w.tolist()) == set(range(R % 2, R + 1, 2))
    assert (query_levels(y, 1) == 1).all()
    assert (query_levels(np.zeros((1, 8), np.float32), 4) == 0).all()  # all ties: a constant distance
    codes = query_codes(-y, SignLayout((601,)), 3)
    assert codes.shape == (1, 3 * 76)


def test_replicas_are_recorded_and_kept(index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    other = AttributionIndex.open(
        path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    built = build(other, "r3", FlatConfig(replicas=3), progress=False)
    meta = json.loads((path / "faiss" / "r3.json").read_text())
    assert meta["replicas"] == 3 and meta["d_bits"] == 3 * other.layout.nbytes * 8 and built.replicas == 3
    # A search config given at load time cannot change a build parameter.
    loaded = load(path, "r3", config=FlatConfig(replicas=1))
    assert loaded.replicas == 3 and loaded.config.replicas == 3
    with pytest.raises(ConfigError, match="replicas"):
        FlatConfig(replicas=0)
    with pytest.raises(ConfigError, match="replicas"):
        FlatConfig(replicas=17)


def test_format_version_1_is_refused(index, tmp_path):
    """A version-1 index (unreplicated signs) would answer with the wrong distances: rebuild it."""
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    meta_path = path / "faiss" / "flat.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(IncompatibleIndexError, match=r"version 1 .*replicas.*eogp build-candidates"):
        load(path, "flat")


def test_gpu_flat_path_maps_positions(index, monkeypatch):
    """The GPU flat path (labels = insertion positions), with a CPU stand-in for GpuIndexBinaryFlat."""
    made = []

    def fake_gpu_flat(resources, flat):
        copy_ = faiss.IndexBinaryFlat(flat.d)
        copy_.add(faiss.vector_to_array(flat.xb).reshape(flat.ntotal, flat.code_size))
        made.append(copy_)
        return copy_

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "StandardGpuResources", lambda: object(), raising=False)
    monkeypatch.setattr(faiss, "GpuIndexBinaryFlat", fake_gpu_flat, raising=False)
    y = index.query_coordinates([_query()])
    gpu = load(index.path, "flat", config=FlatConfig(use_gpu="auto"))
    cpu = load(index.path, "flat", config=FlatConfig(use_gpu="never"))
    code = gpu.query_codes(np.concatenate([y, -y]), index.layout)
    for C in (1, 10, index.store.count() + 5):
        d_gpu, p_gpu = gpu.search_with_distances(code, C)
        d_cpu, p_cpu = cpu.search_with_distances(code, C)
        np.testing.assert_array_equal(d_gpu, d_cpu)
        np.testing.assert_array_equal(
            np.sort(gpu.ids_at(p_gpu[:, :C]).astype(str), axis=1), np.sort(cpu.ids_at(p_cpu[:, :C]).astype(str), axis=1)
        )
    assert len(made) == 1  # built once, reused


def test_keys_are_stable_and_collisions_refused():
    keys = id_keys(["a", "b", "ex-1"])
    assert keys.dtype == np.int64 and (keys >= 0).all() and len(set(keys)) == 3
    assert (id_keys(["ex-1"]) == keys[2]).all()  # the same id always has the same key
    with pytest.raises(IncompatibleIndexError, match="collision"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "y"]), "here")
    with pytest.raises(InputError, match="more than once"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "x"]), "here")


# ---------------------------------------------------------------------------------------------
# the clustered kind: a copy of the codes grouped by scale profile, scanned exactly cell by cell
# ---------------------------------------------------------------------------------------------

CLUSTERED_VERSION = ClusteredFirstPass.FORMAT_VERSION
load_candidates = load

#: Few cells, two sign lists: a 60-row store still has several cells to skip or visit.
CLUSTERED = ClusteredConfig(lists=2, scale_cells=4, z=1.0)


def _copy(index, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


def _exact(index, k, direction="positive", where=None):
    return index.search(_query()).limit(k).where(where).direction(direction).to_arrow()


def _check_exactly_rescored(index, got, direction, where=None):
    """Every returned row carries its exact score, and the rows are ordered as the exact scan
    orders them: best first, equal scores by row address (search/ranking.py)."""
    ids, scores = index.scores([_query()], where=where)
    exact = dict(zip(ids, scores[0]))
    got_scores = got.column("score").to_numpy()
    np.testing.assert_array_equal(got_scores, np.array([exact[i] for i in got.column("id").to_pylist()], np.float32))
    hot = index.hot_codes()
    address = dict(zip(hot.columns.column("id").to_pylist(), hot.rowaddr.tolist()))
    key = [(-s if direction == "positive" else s, address[i]) for s, i in zip(got_scores, got.column("id").to_pylist())]
    assert key == sorted(key)


def recall_at(index, k, C, direction, faiss_name, where=None):
    """Share of the exact top ``k`` (exact scan over the same rows) the candidate path returns."""
    exact = set(_exact(index, k, direction, where).column("id").to_pylist())
    got = top_influential_with_candidates(
        index, _query(), k, C, where=where, direction=direction, faiss_name=faiss_name
    )
    return len(exact & set(got.column("id").to_pylist())) / len(exact), got


def test_each_side_holds_only_rows_of_its_sign_on_every_route(index, tmp_path):
    """Fewer rows of a sign match than k: the side is shorter, never topped up with the other sign."""
    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
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
    routes.update(
        {
            name: search.candidates(other.store.count(), faiss_name=name)
            for name in ("flat", "ivf", "hnsw", "plain", "cl")
        }
    )
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


def test_clustered_build_save_load(index, tmp_path):
    other = _copy(index, tmp_path)
    built = build(other, "cl", CLUSTERED, progress=False)
    n = other.store.count()
    files = {p.name for p in (other.path / "faiss").iterdir() if p.name.startswith("cl.")}
    assert files == {"cl.json", "cl.codes.npy", "cl.scales.npy", "cl.rowaddr.npy", "cl.cells.npz"}
    meta = json.loads((other.path / "faiss" / "cl.json").read_text())
    assert meta["format"] == "eogp-clustered" and meta["format_version"] == CLUSTERED_VERSION == 1
    assert (
        meta["rows"] == n
        and meta["table_version"] == other.store.version
        and meta["params"] == {"lists": 2, "scale_cells": 4}
    )
    loaded = load_candidates(other.path, "cl")
    assert isinstance(loaded, ClusteredFirstPass) and loaded.ntotal == n == built.ntotal
    assert loaded.kind == "clustered" and loaded.config.scale_cells == 4
    # The copy holds every stored row once, with the table's bytes, grouped by cell.
    hot = other.hot_codes()
    pos = hot.positions(np.sort(np.asarray(loaded.rowaddr)))
    order = np.argsort(np.asarray(loaded.rowaddr))
    np.testing.assert_array_equal(np.asarray(loaded.codes)[order], hot.codes[pos])
    np.testing.assert_array_equal(np.asarray(loaded.scales, np.float32)[order], hot.scales[pos])
    cells = loaded.cells.assign(np.asarray(loaded.codes), np.asarray(loaded.scales))
    assert np.all(np.diff(cells) >= 0) and loaded.offsets[-1] == n
    np.testing.assert_array_equal(np.bincount(cells, minlength=loaded.cells.num_cells), loaded.counts)


@pytest.mark.parametrize("direction", ["positive", "negative", "both"])
def test_clustered_results_are_exact_scores_in_exact_order(index, tmp_path, direction):
    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    n = other.store.count()
    for C in (20, 40, n):
        got = top_influential_with_candidates(other, _query(), k=6, C=C, direction=direction, faiss_name="cl")
        for side in ("positive", "negative") if direction == "both" else (direction,):
            part = got.filter(pa.compute.equal(got.column("direction"), side)) if direction == "both" else got
            assert part.num_rows == 6
            _check_exactly_rescored(other, part, side)
    # Every row within the budget: the exact answer, ties and all.
    assert got.to_pylist() == _exact(other, 6, direction).to_pylist()


def test_clustered_recall_is_measured_against_the_exact_scan(index, tmp_path):
    """Recall@k is the overlap with the exact scan of the same rows (also filtered); it reaches 1
    with every row in the budget, and a small budget scans at most C rows."""
    other = _copy(index, tmp_path)
    cand = build(other, "cl", CLUSTERED, progress=False)
    n = other.store.count()
    for direction in ("positive", "negative"):
        assert recall_at(other, 5, n, direction, "cl")[0] == 1.0
        assert recall_at(other, 5, n, direction, "cl", where="`group` = 1")[0] == 1.0
        r, got = recall_at(other, 5, 16, direction, "cl")
        assert 0.0 <= r <= 1.0 and got.num_rows == 5
        y = other.query_coordinates([_query()])
        scanned = cand.top_k(other.stored, y, 5, 16, [direction])[direction][2]
        assert 5 <= scanned <= 16


def test_clustered_filter_equals_exact_scan_of_candidates(index, tmp_path):
    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    where = "`group` = 1"
    for direction in ("positive", "negative"):
        got = top_influential_with_candidates(other, _query(), 4, 24, where=where, direction=direction, faiss_name="cl")
        assert set(got.column("group").to_pylist()) == {1} and got.num_rows == 4
        _check_exactly_rescored(other, got, direction, where=where)
    matching = other.store.count(where)
    small = top_influential_with_candidates(other, _query(), 4, matching, where=where, faiss_name="cl")
    assert small.to_pylist() == _exact(other, 4, where=where).to_pylist()


def test_clustered_follows_a_growing_and_compacted_table(index, tmp_path):
    """New rows go to the delta (scanned in full), a large delta is merged, a compaction (row
    addresses change) rebuilds the copy: answers stay exact and addresses current."""
    from eogp_index.store.maintenance import optimize

    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    other.ingest(MORE[:5], progress=False)
    n = other.store.count()
    everything = top_influential_with_candidates(other, _query(), n, n, direction="both", faiss_name="cl")
    assert everything.to_pylist() == _exact(other, n, "both").to_pylist()
    cand = open_candidates(other, "cl")
    assert cand.meta["delta_rows"] == 5 and cand.ntotal == n and cand.table_version == other.store.version
    assert load_candidates(other.path, "cl").meta["delta_rows"] == 5  # saved
    # A new row that is the best answer is found by a small budget too: the delta is always scanned.
    ids = set(ex.id for ex in MORE[:5])
    y = other.query_coordinates([_query()])
    top = cand.top_k(other.stored, y, 3, 16, ["positive"])["positive"]
    exact = _exact(other, 3).column("id").to_pylist()
    if exact[0] in ids:
        assert other.stored.rows(top[0][:1]).column("id").to_pylist()[0] == exact[0]
    optimize(other, retention=timedelta(0))  # compaction: every row address changes
    got = top_influential_with_candidates(other, _query(), n, n, direction="both", faiss_name="cl")
    assert got.to_pylist() == _exact(other, n, "both").to_pylist()
    cand = open_candidates(other, "cl")
    assert cand.meta["delta_rows"] == 0 and cand.ntotal == n
    assert set(np.asarray(cand.rowaddr).tolist()) == set(other.hot_codes().rowaddr.tolist())
    # The FAISS kinds map their positions to the new addresses too (ids joined once per version).
    flat = open_candidates(other, "flat")
    assert flat.ntotal == n
    addr = flat.rowaddr_of(other.stored, np.arange(n))
    assert set(addr.tolist()) == set(other.hot_codes().rowaddr.tolist())
    faiss_hits = top_influential_with_candidates(other, _query(), 5, n, direction="both", faiss_name="flat")
    assert faiss_hits.to_pylist() == _exact(other, 5, "both").to_pylist()


def test_clustered_refuses_incompatible_indexes(index, tmp_path):
    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    cand = load_candidates(other.path, "cl")
    for changes in ({"projection": {**other.manifest.projection, "sha256": "0" * 64}}, {"table": "other_table"}):
        with pytest.raises(IncompatibleIndexError, match="build-candidates"):
            cand.check_compatible(_with_manifest(other, **changes))
    meta_path = other.path / "faiss" / "cl.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, format_version=99)))
    with pytest.raises(IncompatibleIndexError, match="version"):
        load_candidates(other.path, "cl")
    meta_path.write_text(json.dumps(dict(meta, rows=meta["rows"] + 1)))
    with pytest.raises(IncompatibleIndexError, match="interrupted"):
        load_candidates(other.path, "cl")
    with pytest.raises(ConfigError):
        ClusteredConfig(scale_cells=0)
    with pytest.raises(ConfigError):
        ClusteredConfig(first_fraction=0)


def test_clustered_delta_is_merged_past_its_threshold(index, tmp_path, monkeypatch):
    import eogp_index.search.first_pass.clustered as clustered

    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    trained = load_candidates(other.path, "cl").cells.scale_centroids
    monkeypatch.setattr(clustered, "_DELTA_MIN_ROWS", 3)
    monkeypatch.setattr(clustered, "_DELTA_SHARE", 0.0)
    other.ingest(MORE[:2], progress=False)  # 2 rows: kept in the delta
    assert open_candidates(other, "cl").meta["delta_rows"] == 2
    other.ingest(MORE[2:4], progress=False)  # 4 rows: merged into the clustered copy
    cand = open_candidates(other, "cl")
    n = other.store.count()
    assert cand.meta["delta_rows"] == 0 and cand.meta["rows"] == n == cand.ntotal
    np.testing.assert_array_equal(cand.cells.scale_centroids, trained)  # merged, not retrained
    got = top_influential_with_candidates(other, _query(), n, n, direction="both", faiss_name="cl")
    assert got.to_pylist() == _exact(other, n, "both").to_pylist()


def test_clustered_cell_path_is_exact_after_compaction(index, tmp_path):
    """After a delta and a compaction (every row address changes, the copy is rebuilt), budgets
    below the row count go through the cells: every returned row still carries its exact score
    under its current address, in the exact scan's order, and at most C rows are scanned."""
    from eogp_index.store.maintenance import optimize

    other = _copy(index, tmp_path)
    build(other, "cl", CLUSTERED, progress=False)
    other.ingest(MORE[:5], progress=False)
    before = open_candidates(other, "cl")
    assert before.meta["delta_rows"] == 5
    optimize(other, retention=timedelta(0))
    n = other.store.count()
    cand = open_candidates(other, "cl")
    assert cand.meta["delta_rows"] == 0 and cand.ntotal == n and cand.table_version == other.store.version
    assert set(np.asarray(cand.rowaddr).tolist()) == set(other.hot_codes().rowaddr.tolist())
    y = other.query_coordinates([_query()])
    for direction in ("positive", "negative"):
        for C in (16, n - 1):
            got = top_influential_with_candidates(other, _query(), 5, C, direction=direction, faiss_name="cl")
            assert got.num_rows == 5
            _check_exactly_rescored(other, got, direction)
            scanned = cand.top_k(other.stored, y, 5, C, [direction])[direction][2]
            assert 5 <= scanned <= C < n
        # Recall is the overlap with the exact scan of the same (compacted) rows.
        r, got = recall_at(other, 5, 16, direction, "cl")
        exact = set(_exact(other, 5, direction).column("id").to_pylist())
        assert r == len(exact & set(got.column("id").to_pylist())) / 5


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "plain"])
def test_recall_with_every_row_a_candidate_is_one(index, kind):
    """Recall is measured against the exact scan of every row: with every row within the budget
    each kind finds the whole exact top-20 of both sides, stored rows' own codes as queries."""
    recall = measure_on_stored_rows(load(index.path, kind), index.stored, C=2 * index.store.count())
    assert recall.recall == recall.positive == recall.negative == 1.0
    assert recall.queries == SAMPLE_QUERIES and recall.queries_from == "stored rows" and not recall.below_target


def test_coarse_first_pass_records_a_low_recall(index, tmp_path):
    """IVF over 16 lists visiting one: few candidates reach the exact top-20, and the recall says so,
    recorded in the first pass's JSON."""
    other = _copy(index, tmp_path)
    built = build(other, "coarse", make_config("ivf", nlist=16, nprobe=1, train_points_per_list=1), progress=False)
    recall = built.record_recall(other.stored)
    assert recall.candidates == 5 * recall.k == 100 and recall.below_target and recall.recall < 0.95
    assert json.loads((other.path / "faiss" / "coarse.json").read_text())["recall"] == recall.to_json()
    assert load(other.path, "coarse").meta["recall"]["recall"] == recall.recall
