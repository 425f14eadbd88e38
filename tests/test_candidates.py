"""FAISS first pass: real FAISS binary indexes over a real LanceDB table of real (tiny GPT-2) codes.

The candidate path must map FAISS results back to the right rows (also after further ingests),
equal the exact scan when every row is a candidate, apply filters to the candidates, and refuse
indexes it cannot answer for. The FAISS distance of a weighted query code to a replicated row
must be exactly ``(R·K − Σ_j σ_j w_j β_j)/2`` (candidates module docstring).
"""

import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest

from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2
from eogp_index.search.candidates import (
    FORMAT_VERSION,
    CandidateIndex,
    FaissConfig,
    _check_unique,
    build,
    candidate_ids,
    id_keys,
    open_candidates,
    query_codes,
    query_levels,
    replicate_codes,
)
from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError, InputError
from eogp_index.store.codecs import SignLayout, pack_signs, unpack_signs
from eogp_index.store.table import list_column_to_numpy

pa = pytest.importorskip("pyarrow")
faiss = pytest.importorskip("faiss")


def top_influential_with_candidates(index, query, k, C, *, where=None, direction="positive", faiss_name="default"):
    """The candidates route through the query builder, as users reach it."""
    return (index.search(query).limit(k).where(where).direction(direction)
            .candidates(C, faiss_name=faiss_name).to_arrow())

SEED = 3
TRAIN = make_examples(60, seed=11)
MORE = make_examples(20, seed=12, prefix="more")
QUERIES = make_examples(3, seed=13, prefix="q", masked_prompt=True)


def _query(i=0):
    return {"input_ids": list(QUERIES[i].input_ids), "labels": list(QUERIES[i].labels)}


def _create(path):
    index = AttributionIndex.create(
        path, make_tiny_gpt2(SEED), TinyTokenizer(), TRAIN, model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=24, batch_size=4),
        gradients=GradientConfig(batch_size=8), progress=False)
    index.ingest(TRAIN, progress=False)
    return index


#: Replicas of the three main test indexes: the weighted query codes are what they exercise.
WEIGHTED = 4


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """Three FAISS indexes with ``WEIGHTED`` replicas, and ``plain``: flat with one replica (plain Hamming)."""
    index = _create(tmp_path_factory.mktemp("cand") / "idx")
    for kind in ("flat", "ivf", "hnsw"):
        build(index, kind, FaissConfig(kind=kind, replicas=WEIGHTED, nlist=4 if kind == "ivf" else None),
              progress=False)
    build(index, "plain", FaissConfig(kind="flat", replicas=1), progress=False)
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
    loaded = CandidateIndex.load(index.path, kind)
    meta = json.loads((index.path / "faiss" / f"{kind}.json").read_text())
    assert loaded.ntotal == n == meta["rows"] and meta["kind"] == kind and loaded.config.kind == kind
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
        np.testing.assert_allclose(approx.column("score").to_numpy(), exact.column("score").to_numpy(),
                                   rtol=1e-5, atol=1e-6)
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
    other = AttributionIndex.open(path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(),
                                  gradients=GradientConfig(batch_size=8))
    assert other.ingest(MORE, progress=False) == len(MORE)
    by_id = _signs_by_id(other)
    n = len(by_id)
    for kind in ("flat", "ivf", "hnsw"):
        cand = CandidateIndex.load(path, kind)
        assert cand.ntotal == n - len(MORE)
        assert cand.extend(other) == len(MORE)
        assert cand.extend(other) == 0  # nothing twice
        reloaded = CandidateIndex.load(path, kind)
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
    other = AttributionIndex.open(path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(),
                                  gradients=GradientConfig(batch_size=8))
    other.ingest(MORE, progress=False)
    n = other.store.count()
    exact = other.top_influential(_query(2), k=n, direction="positive")
    approx = top_influential_with_candidates(other, _query(2), k=n, C=n, faiss_name="flat")
    assert approx.column("id").to_pylist() == exact.column("id").to_pylist()
    assert CandidateIndex.load(path, "flat").ntotal == n


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
        got = top_influential_with_candidates(index, _query(), k=k, C=C, where=where, direction=direction,
                                              faiss_name="flat")
        assert got.column("id").to_pylist() == expected
        np.testing.assert_allclose(got.column("score").to_numpy(), sub[order], rtol=1e-5, atol=1e-6)
        assert set(got.column("group").to_pylist()) == {1}


def test_small_filter_is_rescored_entirely(index):
    """A filter matching at most C rows: every matching row is rescored, which is exact."""
    where = "`group` = 2"
    C = index.store.count(where)
    exact = index.top_influential(_query(), k=5, where=where, direction="both")
    got = top_influential_with_candidates(index, _query(), k=5, C=C, where=where, direction="both",
                                          faiss_name="hnsw")
    assert got.column("id").to_pylist() == exact.column("id").to_pylist()


def test_bad_filter_and_arguments(index):
    with pytest.raises(InputError, match="invalid where filter"):
        top_influential_with_candidates(index, _query(), k=3, C=10, where="no_such_column = 1", faiss_name="flat")
    with pytest.raises(ConfigError, match="at least k"):
        top_influential_with_candidates(index, _query(), k=10, C=5, faiss_name="flat")
    with pytest.raises(IndexNotFoundError, match="build-faiss"):
        top_influential_with_candidates(index, _query(), k=3, C=10, faiss_name="missing")
    with pytest.raises(ConfigError):
        FaissConfig(kind="lsh")


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
        CandidateIndex.load(index.path, "flat").extend(other)


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
    cand = CandidateIndex.from_codes(codes, [f"r{i}" for i in range(300)],
                                     FaissConfig(kind=kind, nlist=4, replicas=replicas))
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
    other = AttributionIndex.open(path, model=make_tiny_gpt2(SEED), tokenizer=TinyTokenizer(),
                                  gradients=GradientConfig(batch_size=8))
    built = build(other, "r3", FaissConfig(kind="flat", replicas=3), progress=False)
    meta = json.loads((path / "faiss" / "r3.json").read_text())
    assert meta["replicas"] == 3 and meta["d_bits"] == 3 * other.layout.nbytes * 8 and built.replicas == 3
    # A search config given at load time cannot change a build parameter.
    loaded = CandidateIndex.load(path, "r3", config=FaissConfig(replicas=1))
    assert loaded.replicas == 3 and loaded.config.replicas == 3
    with pytest.raises(ConfigError, match="replicas"):
        FaissConfig(replicas=0)
    with pytest.raises(ConfigError, match="replicas"):
        FaissConfig(replicas=17)


def test_format_version_1_is_refused(index, tmp_path):
    """A version-1 index (unreplicated signs) would answer with the wrong distances: rebuild it."""
    path = tmp_path / "copy"
    shutil.copytree(index.path, path)
    meta_path = path / "faiss" / "flat.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(IncompatibleIndexError, match=r"version 1 .*replicas.*eogp build-faiss"):
        CandidateIndex.load(path, "flat")


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
    gpu = CandidateIndex.load(index.path, "flat", config=FaissConfig(use_gpu="auto"))
    cpu = CandidateIndex.load(index.path, "flat", config=FaissConfig(use_gpu="never"))
    code = gpu.query_codes(np.concatenate([y, -y]), index.layout)
    for C in (1, 10, index.store.count() + 5):
        d_gpu, p_gpu = gpu.search_with_distances(code, C)
        d_cpu, p_cpu = cpu.search_with_distances(code, C)
        np.testing.assert_array_equal(d_gpu, d_cpu)
        np.testing.assert_array_equal(np.sort(gpu.ids_at(p_gpu[:, :C]).astype(str), axis=1),
                                      np.sort(cpu.ids_at(p_cpu[:, :C]).astype(str), axis=1))
    assert len(made) == 1  # built once, reused


def test_keys_are_stable_and_collisions_refused():
    keys = id_keys(["a", "b", "ex-1"])
    assert keys.dtype == np.int64 and (keys >= 0).all() and len(set(keys)) == 3
    assert (id_keys(["ex-1"]) == keys[2]).all()  # the same id always has the same key
    with pytest.raises(IncompatibleIndexError, match="collision"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "y"]), "here")
    with pytest.raises(InputError, match="more than once"):
        _check_unique(np.array([5, 5], np.int64), pa.array(["x", "x"]), "here")
