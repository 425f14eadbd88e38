"""End to end: the index equals kronfluence's EK-FAC scores, stores what the paper says, and
refuses what it cannot answer correctly."""

import json
import math
import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, kronfluence_scores, make_examples, make_tiny_gpt2, make_tiny_llama

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.store.codecs import decode, encode
from eogp_index.store.manifest import MANIFEST_FILE, Manifest, validate

TRAIN = make_examples(24, seed=1)
QUERIES = make_examples(4, seed=2, prefix="q", masked_prompt=True)


def _create(path, model, **kwargs):
    kwargs.setdefault("curvature", CurvatureConfig(num_examples=24, batch_size=4))
    kwargs.setdefault("gradients", GradientConfig(batch_size=5))
    return AttributionIndex.create(path, model, TinyTokenizer(), TRAIN, model_name="tiny", progress=False, **kwargs)


@pytest.mark.parametrize("make_model", [make_tiny_gpt2, make_tiny_llama], ids=["gpt2", "llama"])
def test_full_width_index_equals_kronfluence_ekfac(tmp_path, make_model):
    """m_u = k_u = d_u, no PCA, no quantization: the paper's scores are EK-FAC influence."""
    index = _create(
        tmp_path / "idx",
        make_model(),
        projection=ProjectionConfig(variant="ekfac-topk", k=10**9),
        storage=StorageConfig(precision="fp32"),
    )
    assert all(m.k == m.d_out * m.d_in for m in index.manifest.modules)
    index.ingest(TRAIN, progress=False)
    ids, ours = index.scores([{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in QUERIES])
    order = [ids.index(e.id) for e in TRAIN]
    reference = kronfluence_scores(index, QUERIES, TRAIN)
    rel = np.linalg.norm(ours[:, order] - reference) / np.linalg.norm(reference)
    assert rel < 1e-5, rel


@pytest.fixture(scope="module")
def eogp_index(tmp_path_factory):
    path = tmp_path_factory.mktemp("eogp") / "idx"
    # No rescoring tier: these tests check the one-bit scan's answers (tests/search/test_rescore.py the tier's).
    index = _create(
        path,
        make_tiny_gpt2(),
        projection=ProjectionConfig(variant="eogp", k=12, m=40),
        storage=StorageConfig(rescore="none"),
    )
    index.ingest(TRAIN, progress=False)
    return index


def test_one_bit_scores_are_scaled_sign_inner_products(eogp_index):
    index = eogp_index
    x = index.project(TRAIN)
    y = index.project(QUERIES)
    ids, scores = index.scores([{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in QUERIES])
    approx = decode(encode(x, index.layout, "1bit"), index.layout).astype(np.float64)
    expected = y.astype(np.float64) @ approx.T
    order = [ids.index(e.id) for e in TRAIN]
    np.testing.assert_allclose(scores[:, order], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_storage_and_manifest(eogp_index):
    index = eogp_index
    manifest = json.loads((index.path / MANIFEST_FILE).read_text())
    validate(manifest, source=index.path / MANIFEST_FILE)
    expected = sum(math.ceil(m["k"] / 8) + 2 for m in manifest["modules"])
    assert manifest["bytes_per_example"] == expected
    table = index.store.read(["signs", "scales"])
    assert table.column("signs").type.list_size + 2 * table.column("scales").type.list_size == expected
    assert table.num_rows == len(TRAIN)
    assert index.store.schema.field("group").type == "int64"  # metadata kept typed


def test_reingest_stores_nothing_new(eogp_index):
    assert eogp_index.ingest(TRAIN, progress=False) == 0
    assert eogp_index.store.count() == len(TRAIN)


def test_where_filter_equals_filter_after_scoring(eogp_index):
    query = {"input_ids": list(QUERIES[0].input_ids)}
    ids, scores = eogp_index.scores([query])
    ids_f, scores_f = eogp_index.scores([query], where="`group` = 1")
    expected = {i: s for i, s, e in zip(ids, scores[0], TRAIN) if True}
    keep = {e.id for e in TRAIN if e.metadata["group"] == 1}
    assert set(ids_f) == keep
    np.testing.assert_allclose(scores_f[0], [expected[i] for i in ids_f], rtol=1e-6)
    top = eogp_index.top_influential(query, k=3, where="`group` = 1", direction="both")
    assert top.column_names[:4] == ["direction", "rank", "id", "score"]
    pos = [r for r in top.to_pylist() if r["direction"] == "positive"]
    best = sorted(keep, key=lambda i: -expected[i])[:3]
    assert [r["id"] for r in pos] == best and all(r["group"] == 1 for r in pos)


def test_open_refuses_another_model_and_a_changed_projection(eogp_index, tmp_path):
    reopened = AttributionIndex.open(eogp_index.path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    assert reopened.store.count() == len(TRAIN)
    with pytest.raises(IncompatibleIndexError, match="built for model"):
        AttributionIndex.open(eogp_index.path, model=make_tiny_gpt2(seed=1), tokenizer=TinyTokenizer())
    copy = tmp_path / "copy"
    shutil.copytree(eogp_index.path, copy)
    data = (copy / "projection.safetensors").read_bytes()
    (copy / "projection.safetensors").write_bytes(data[:-4] + bytes(4))
    with pytest.raises(IncompatibleIndexError, match="projection"):
        AttributionIndex.open(copy, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["format_version"] = 99
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleIndexError, match="format version 99"):
        Manifest.load(copy)


def test_create_refuses_existing_index_unless_overwrite(eogp_index):
    with pytest.raises(ConfigError, match="already holds an index"):
        _create(eogp_index.path, make_tiny_gpt2(), projection=ProjectionConfig(k=4))


def test_srht_variant_and_budget(tmp_path):
    index = _create(tmp_path / "r", make_tiny_llama(), projection=ProjectionConfig(variant="eogp-r", budget_kb=0.25))
    assert index.manifest.bytes_per_example <= 256
    assert index.manifest.projection["variant"] == "eogp-r"
    index.ingest(TRAIN[:6], progress=False)
    top = index.top_influential({"input_ids": list(QUERIES[1].input_ids)}, k=2, direction="negative")
    assert top.num_rows == 2 and top.column("score").to_pylist() == sorted(top.column("score").to_pylist())


def test_proposition_2_on_real_gradients(eogp_index):
    """On the fitting set, PCA keeps at least as much half-whitened energy as the top-k axes."""
    from eogp_index.gradients.capture import GradientCapture
    from eogp_index.gradients.loss import collate

    index = eogp_index
    capture = GradientCapture(index.model, index.manifest.module_names, index.projection.first_stage_transform)
    first, _ = capture.run(collate([(e.input_ids, e.labels) for e in TRAIN]))
    for name, proj in index.projection.modules.items():
        z = first[name].double()
        pca_energy = ((z @ proj.pca.double()) ** 2).sum()
        axes_energy = (z[:, : proj.k] ** 2).sum()  # first-stage coords are ordered by eigenvalue
        assert pca_energy >= axes_energy * (1 - 1e-6), name


def test_table_can_live_at_another_uri(tmp_path):
    remote = tmp_path / "bucket" / "prefix"
    index = _create(tmp_path / "idx", make_tiny_gpt2(), projection=ProjectionConfig(k=8, m=32), table_uri=str(remote))
    index.ingest(TRAIN[:10], progress=False)
    assert (remote / "examples.lance").is_dir() and not (tmp_path / "idx" / "examples.lance").exists()
    reopened = AttributionIndex.open(tmp_path / "idx", model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    assert reopened.store.count() == 10
    hits = reopened.top_influential({"input_ids": list(QUERIES[0].input_ids)}, k=3, direction="positive")
    assert hits.num_rows == 3
    with pytest.raises(ConfigError, match="already holds a table"):
        _create(tmp_path / "idx2", make_tiny_gpt2(), projection=ProjectionConfig(k=8, m=32), table_uri=str(remote))
