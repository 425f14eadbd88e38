"""EOGP-rot: a randomized Hadamard rotation inside each module's PCA subspace, folded into P.

The rotation must be orthogonal for every k (float64), follow the spec in schemas/index.md, be
what the fit folds into the stored P, and leave everything downstream as it is: the codes are
signs of ``P'ᵀ z``, so the exact scan of them must equal a dense float64 reference, in both
directions and through FAISS candidates. An index written before the rotation existed (no
``projection.rotation`` in its manifest) still opens and answers.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import ROTATIONS, VARIANTS, CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError
from eogp_index.fit.projection import (
    HADAMARD_ROUNDS,
    HadamardRotation,
    _hadamard,
    rotate_directions,
    rotation_seed,
)
from eogp_index.store.codecs import unpack_signs
from eogp_index.store.manifest import MANIFEST_FILE, PROJECTION_FILE, Manifest, validate
from eogp_index.store.projection_file import load_projection
from eogp_index.store.table import list_column_to_numpy

TRAIN = make_examples(48, seed=21)
QUERIES = make_examples(3, seed=22, prefix="q", masked_prompt=True)
K, M = 24, 96  # k not a power of two: the rotation's two overlapping blocks are exercised


# --------------------------------------------------------------------------- the transform


@pytest.mark.parametrize("k", [1, 2, 3, 6, 8, 24, 48, 100, 1008])
def test_hadamard_rotation_is_orthogonal_for_any_k(k):
    gen = torch.Generator().manual_seed(k)
    rotation = HadamardRotation.draw(k, gen)
    r = rotation.matrix()
    assert r.dtype == torch.float64 and r.shape == (k, k)
    eye = torch.eye(k, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(r.T @ r, eye, rtol=0, atol=1e-12)
    x = torch.randn(5, k, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(rotation.apply(x), x @ r, rtol=0, atol=1e-12)  # apply is x R
    if k >= 3:  # it mixes coordinates: not a signed permutation
        assert r.abs().max() < 1 - 1e-6


def test_rotation_follows_the_spec():
    """schemas/index.md's recipe, written out densely, gives the same R (k = 6: p = 4, two blocks)."""
    k, seed = 6, rotation_seed(5, "h.0.mlp.c_fc")
    rotation = HadamardRotation.draw(k, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (HADAMARD_ROUNDS, 2, k), generator=gen).double() * 2 - 1
    perms = [torch.randperm(k, generator=gen) for _ in range(HADAMARD_ROUNDS)]
    p = 4
    h = _hadamard(p) / math.sqrt(p)
    expected = torch.eye(k, dtype=torch.float64)
    for (s1, s2), perm in zip(signs, perms):
        first, last = torch.eye(k, dtype=torch.float64), torch.eye(k, dtype=torch.float64)
        first[:p, :p], last[k - p :, k - p :] = h, h
        expected = expected @ torch.diag(s1) @ first @ torch.diag(s2) @ last
        expected = expected[:, perm]
    torch.testing.assert_close(rotation.matrix(), expected, rtol=0, atol=1e-14)
    assert rotation_seed(5, "h.0.mlp.c_fc") == seed != rotation_seed(6, "h.0.mlp.c_fc")
    assert rotation_seed(5, "h.1.mlp.c_fc") != seed and 0 <= seed < 2**63
    with pytest.raises(ConfigError, match="cannot rotate vectors of length"):
        rotation.apply(torch.zeros(2, k + 1))


def test_rotate_directions_in_blocks_equals_one_product():
    gen = torch.Generator().manual_seed(0)
    pca = torch.linalg.qr(torch.randn(300, 40, dtype=torch.float64, generator=gen))[0].float()
    rotation = HadamardRotation.draw(40, gen)
    rotated = rotate_directions(pca, rotation)
    assert rotated.dtype == torch.float32
    torch.testing.assert_close(rotated.double(), pca.double() @ rotation.matrix(), rtol=0, atol=1e-6)
    # Orthonormal columns stay orthonormal.
    torch.testing.assert_close(
        rotated.double().T @ rotated.double(), torch.eye(40, dtype=torch.float64), rtol=0, atol=1e-5
    )


def test_variant_tables():
    assert VARIANTS["eogp-rot"] == "pca" and ROTATIONS["eogp-rot"] == "hadamard"
    assert set(VARIANTS) == set(ROTATIONS)
    assert ProjectionConfig(variant="eogp-rot", k=8).rotation == "hadamard"
    assert ProjectionConfig(variant="eogp", k=8).rotation == "none"


# --------------------------------------------------------------------------- end to end


def _create(path, variant, pca_dtype="fp16"):
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        projection=ProjectionConfig(variant=variant, k=K, m=M, num_fit_examples=48, pca_dtype=pca_dtype),
        curvature=CurvatureConfig(num_examples=48, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        storage=StorageConfig(rescore="none"),  # these tests check the one-bit scan itself
        progress=False,
    )
    index.ingest(TRAIN, progress=False)
    return index


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """``eogp`` and ``eogp-rot`` fitted on the same documents with the same settings, P in fp32."""
    root = tmp_path_factory.mktemp("rotation")
    plain = _create(root / "eogp", "eogp", "fp32")  # 48 documents: the curvature and PCA sets overlap
    rotated = _create(root / "rot", "eogp-rot", "fp32")
    return plain, rotated


def _queries():
    return [{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in QUERIES]


def test_the_fit_folds_the_rotation_into_p(indexes):
    plain, rotated = indexes
    p_plain = load_projection(plain.path / PROJECTION_FILE)
    p_rot = load_projection(rotated.path / PROJECTION_FILE)
    for name, module in p_rot.modules.items():
        assert module.rotation is None  # nothing about R is stored: it is in P
        r = HadamardRotation.draw(module.k, torch.Generator().manual_seed(rotation_seed(0, name))).matrix()
        expected = p_plain.modules[name].pca.double() @ r
        torch.testing.assert_close(module.pca.double(), expected, rtol=0, atol=1e-5)
    # The projected coordinates are EOGP's, rotated module by module.
    x_plain, x_rot = plain.project(TRAIN).astype(np.float64), rotated.project(TRAIN).astype(np.float64)
    for off, (name, module) in zip(rotated.layout.coord_offsets, p_rot.modules.items()):
        r = HadamardRotation.draw(module.k, torch.Generator().manual_seed(rotation_seed(0, name))).matrix().numpy()
        block = slice(off, off + module.k)
        np.testing.assert_allclose(x_rot[:, block], x_plain[:, block] @ r, rtol=0, atol=1e-4 * np.abs(x_plain).max())


def test_manifest_records_the_variant_and_rotation(indexes):
    plain, rotated = indexes
    data = json.loads((rotated.path / MANIFEST_FILE).read_text())
    validate(data, source=rotated.path / MANIFEST_FILE)
    assert data["format_version"] == 2  # no bump: the codes mean what they meant
    assert data["projection"]["variant"] == "eogp-rot"
    assert data["projection"]["rotation"] == {"kind": "hadamard", "rounds": HADAMARD_ROUNDS, "seed": 0}
    assert rotated.manifest.rotation["kind"] == "hadamard" and rotated.manifest.variant == "eogp-rot"
    assert json.loads((plain.path / MANIFEST_FILE).read_text())["projection"]["rotation"] == {"kind": "none"}


def test_scan_of_rotated_codes_equals_a_dense_float64_reference(indexes):
    _, index = indexes
    y = index.query_coordinates(_queries()).astype(np.float64)
    table = index.store.read(["id", "signs", "scales"])
    layout = index.layout
    signs = unpack_signs(list_column_to_numpy(table.column("signs"), layout.nbytes, np.uint8), layout).astype(
        np.float64
    )
    scales = list_column_to_numpy(table.column("scales"), layout.num_modules, np.float16).astype(np.float64)
    dense = np.zeros((len(y), table.num_rows))
    for u, (off, k) in enumerate(zip(layout.coord_offsets, layout.k)):
        dense += (y[:, off : off + k] @ signs[:, off : off + k].T) * scales[:, u]
    # The stored signs are those of the rotated coordinates.
    x = index.project(TRAIN)
    by_id = {ex.id: i for i, ex in enumerate(TRAIN)}
    rows = [by_id[i] for i in table.column("id").to_pylist()]
    clear = np.abs(x[rows]) > 1e-6 * np.abs(x).max()
    np.testing.assert_array_equal(signs[clear] > 0, x[rows][clear] >= 0)

    ids, scores = index.scores(_queries())
    order = [ids.index(i) for i in table.column("id").to_pylist()]
    np.testing.assert_allclose(scores[:, order], dense, rtol=1e-5, atol=1e-6 * np.abs(dense).max())
    # Top-k in both directions is the dense ranking (ties: table order, as the scan breaks them).
    for q in range(len(y)):
        for direction, sign in (("positive", 1), ("negative", -1)):
            hits = index.top_influential(_queries()[q], k=5, direction=direction)
            expected = np.lexsort((np.arange(table.num_rows), -sign * dense[q]))[:5]
            assert hits.column("id").to_pylist() == [table.column("id")[i].as_py() for i in expected]
            np.testing.assert_allclose(
                hits.column("score").to_numpy(), dense[q][expected], rtol=1e-5, atol=1e-6 * np.abs(dense).max()
            )


def test_faiss_candidates_over_rotated_codes_equal_the_exact_scan(indexes, tmp_path):
    pytest.importorskip("faiss")
    from eogp_index.search.first_pass import FlatConfig, build

    _, index = indexes
    path = tmp_path / "rot"
    shutil.copytree(index.path, path)
    copy = AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    build(copy, "flat", FlatConfig(), progress=False)
    n = copy.store.count()
    for direction in ("positive", "negative", "both"):
        exact = copy.top_influential(_queries()[0], k=5, direction=direction)
        approx = copy.search(_queries()[0]).limit(5).direction(direction).candidates(n, faiss_name="flat").to_arrow()
        assert approx.column("id").to_pylist() == exact.column("id").to_pylist()
        np.testing.assert_allclose(approx.column("score").to_numpy(), exact.column("score").to_numpy(), rtol=1e-5)


def test_an_index_written_before_the_rotation_field_opens_and_answers(indexes, tmp_path):
    """Today's EOGP index with its manifest as written before `projection.rotation` existed."""
    plain, _ = indexes
    path = tmp_path / "old"
    shutil.copytree(plain.path, path)
    manifest_path = path / MANIFEST_FILE
    data = json.loads(manifest_path.read_text())
    del data["projection"]["rotation"]
    manifest_path.write_text(json.dumps(data, indent=2) + "\n")
    validate(data, source=manifest_path)
    assert Manifest.load(path).rotation == {"kind": "none"}
    old = AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
    ids_old, scores_old = old.scores(_queries())
    ids_now, scores_now = plain.scores(_queries())
    assert ids_old == ids_now
    np.testing.assert_array_equal(scores_old, scores_now)
    hits = old.top_influential(_queries()[1], k=4, direction="both")
    assert (
        hits.num_rows == 8
        and hits.column("id").to_pylist()
        == plain.top_influential(_queries()[1], k=4, direction="both").column("id").to_pylist()
    )
    # It still takes ingests.
    assert old.ingest(make_examples(4, seed=23, prefix="late"), progress=False) == 4


def test_default_precision_p_in_fp16_works_end_to_end(tmp_path):
    """The shipped defaults (P stored in FP16) with the rotation: fit, ingest, query."""
    index = _create(tmp_path / "idx", "eogp-rot")
    assert index.manifest.pca_dtype == "fp16" and index.manifest.variant == "eogp-rot"
    hits = index.top_influential(_queries()[0], k=3, direction="positive")
    ids, scores = index.scores(_queries()[:1])
    assert hits.column("id").to_pylist() == [ids[i] for i in np.lexsort((np.arange(len(ids)), -scores[0]))[:3]]
