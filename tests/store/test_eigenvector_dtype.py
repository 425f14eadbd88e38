"""The kept eigenvector columns in 16 bits for a half-precision model: a bf16 index stores and
holds them in float16 (projection format 3, config.EIGENVECTOR_DTYPES), its first stage is the
float32 computation of those columns, within float16 rounding of the unrounded ones, and an index
written before (format 2, float32 columns) opens and answers as it did. On a real tiny Llama run
in bf16 and a real index directory."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tinymodels import TinyTokenizer, make_examples, make_tiny_llama

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.errors import IncompatibleIndexError
from eogp_index.fit.curvature import load_curvature
from eogp_index.fit.fitting import CURVATURE_DIR
from eogp_index.fit.plan import shape_of_model
from eogp_index.fit.projection import first_stage_from_curvature
from eogp_index.store.files import file_fingerprint, file_sha256, safetensors_header
from eogp_index.store.index_plan import plan_of_index
from eogp_index.store.manifest import MANIFEST_FILE, PROJECTION_FILE
from eogp_index.store.projection_file import load_projection

TRAIN = make_examples(16, seed=31)
QUERIES = make_examples(3, seed=32, prefix="q")
KEYS = ("gradient_eigenvectors", "activation_eigenvectors")
#: float16 unit roundoff (11 significant bits, round to nearest) and the largest rounding of a
#: subnormal (|x| < 2^-14, spaced 2^-24); float32's unit roundoff.
U_F16, SUBNORMAL_ERR, U_F32 = 2.0**-11, 2.0**-25, 2.0**-24


@pytest.fixture(scope="module")
def bf16_index(tmp_path_factory):
    """A bf16 index with a few documents ingested; m = 40 keeps some rows and columns out."""
    index = AttributionIndex.create(
        tmp_path_factory.mktemp("eig") / "idx",
        make_tiny_llama(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny-llama",
        dtype="bfloat16",
        projection=ProjectionConfig(k=8, m=40, num_fit_examples=16),
        curvature=CurvatureConfig(num_examples=16, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    index.ingest(TRAIN, progress=False)
    return index


def _answers(index):
    """Each query's top 5 stored documents and their scores."""
    return [
        index.top_influential(list(q.input_ids), k=5, direction="positive").select(["id", "score"]).to_pylist()
        for q in QUERIES
    ]


def test_a_bf16_index_stores_and_holds_its_eigenvector_columns_in_16_bits(bf16_index):
    header = safetensors_header(bf16_index.path / PROJECTION_FILE)
    assert header["__metadata__"]["format_version"] == "3"
    assert header["__metadata__"]["eigenvector_dtype"] == "float16"
    narrower = 0
    for entry in bf16_index.manifest.modules:
        for key in KEYS:
            stored = header[f"{entry.name}/{key}"]
            assert stored["dtype"] == "F16", (entry.name, key)
            begin, end = stored["data_offsets"]
            assert end - begin == 2 * stored["shape"][0] * stored["shape"][1]
        narrower += header[f"{entry.name}/gradient_eigenvectors"]["shape"][1] < entry.d_out
        held = bf16_index.projection.modules[entry.name]
        assert held.gradient_eigenvectors.dtype == held.activation_eigenvectors.dtype == torch.float16
    assert narrower  # some module keeps only some rows: the columns are a selection, not all of Q_S


def test_the_first_stage_is_float32_math_on_the_16_bit_columns(bf16_index):
    """Bit for bit the float32 first stage of the held columns upcast, and within float16 rounding
    of the first stage with the unrounded float32 columns of kronfluence's factors."""
    names = bf16_index.manifest.module_names
    factors = load_curvature(bf16_index.path / CURVATURE_DIR, names)
    gen = torch.Generator().manual_seed(5)
    rounded_somewhere = False
    for entry in bf16_index.manifest.modules:
        held = bf16_index.projection.modules[entry.name]
        unrounded = first_stage_from_curvature(factors[entry.name], entry.m, bf16_index.manifest.damping_ratio)
        assert unrounded.gradient_eigenvectors.dtype == torch.float32
        assert torch.equal(unrounded.local_index, held.local_index) and torch.equal(unrounded.whiten, held.whiten)
        assert torch.equal(unrounded.gradient_eigenvectors.half(), held.gradient_eigenvectors)
        a = torch.randn(3, 6, entry.d_in, generator=gen)
        g = torch.randn(3, 6, entry.d_out, generator=gen)
        z = held.first_stage(a, g)
        assert z.dtype == torch.float32
        upcast = first_stage_from_curvature(factors[entry.name], entry.m, bf16_index.manifest.damping_ratio)
        upcast.gradient_eigenvectors = held.gradient_eigenvectors.float()
        upcast.activation_eigenvectors = held.activation_eigenvectors.float()
        assert torch.equal(z, upcast.first_stage(a, g))
        # Per token, with columns rounded by at most e = u|q| + s per entry: |g·q̃ - g·q| <= E_g =
        # u(|g|·|q|) + s‖g‖₁ (and E_a alike), so |Δ((g·q)(a·p))| <= E_g(|a|·|p|) + (|g|·|q| + E_g)E_a;
        # plus float32 rounding of both computations over sums of d_out, d_in and T terms.
        q_s, q_a = unrounded.gradient_eigenvectors.double(), unrounded.activation_eigenvectors.double()
        c = q_a.shape[1]
        rows, cols = held.local_index // c, held.local_index % c
        g64, a64 = g.double().abs(), a.double().abs()
        gs, aa = g64 @ q_s.abs(), a64 @ q_a.abs()  # (B, T, r), (B, T, c)
        e_g = U_F16 * gs + SUBNORMAL_ERR * g64.sum(-1, keepdim=True)
        e_a = U_F16 * aa + SUBNORMAL_ERR * a64.sum(-1, keepdim=True)
        rounding = (e_g[:, :, rows] * aa[:, :, cols] + (gs + e_g)[:, :, rows] * e_a[:, :, cols]).sum(1)
        magnitude = (gs[:, :, rows] * aa[:, :, cols]).sum(1)  # (B, m)
        arithmetic = 2 * (entry.d_out + entry.d_in + a.shape[1] + 2) * U_F32
        bound = (rounding + arithmetic * magnitude) * held.whiten.double()
        diff = (z.double() - unrounded.first_stage(a, g).double()).abs()
        assert (diff <= bound).all(), entry.name
        rounded_somewhere |= bool(diff.max() > 0)
    assert rounded_somewhere  # the columns were rounded: the bound is exercised, not vacuous


def _as_format_2(path):
    """Rewrite a projection file as eogp-index wrote it before format 3: float32 eigenvector
    columns (here the float16 ones upcast, the same numbers) and no eigenvector_dtype."""
    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors = {key: t.float() if key.endswith(KEYS) else t for key, t in tensors.items()}
    del meta["eigenvector_dtype"]
    save_file(tensors, str(path), metadata={**meta, "format_version": "2"})


def test_an_index_with_float32_eigenvector_columns_opens_and_answers_the_same(bf16_index, tmp_path):
    old = shutil.copytree(bf16_index.path, tmp_path / "old")
    _as_format_2(old / PROJECTION_FILE)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    manifest["projection"].update(
        sha256=file_sha256(old / PROJECTION_FILE), fingerprint=file_fingerprint(old / PROJECTION_FILE)
    )
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    reopened = AttributionIndex.open(
        old,
        model=make_tiny_llama().to(torch.bfloat16),
        tokenizer=TinyTokenizer(),
        gradients=GradientConfig(batch_size=8),
    )
    for module in reopened.projection.modules.values():
        assert module.gradient_eigenvectors.dtype == torch.float32  # held as stored
    again = AttributionIndex.open(
        bf16_index.path,
        model=make_tiny_llama().to(torch.bfloat16),
        tokenizer=TinyTokenizer(),
        gradients=GradientConfig(batch_size=8),
    )
    np.testing.assert_array_equal(reopened.project(TRAIN), again.project(TRAIN))
    assert _answers(reopened) == _answers(again)
    # Its plan counts the columns as the file holds them: float32, exactly twice the new index's.
    shape = shape_of_model(again.model, again.manifest.module_names, name="tiny-llama")
    plan, new = plan_of_index(old, shape=shape), plan_of_index(bf16_index.path, shape=shape)
    assert plan.shared.eigenbasis_dtype == "float32" and plan.shared.eigenbasis_exact
    assert new.shared.eigenbasis_dtype == "float16"
    assert plan.shared.eigenbasis_bytes_max == 2 * new.shared.eigenbasis_bytes_max
    # Held in float32, the first stage needs no float32 copy of them; held in float16 it makes one.
    assert all(r.eigenbasis_upcast_bytes == 0 for r in plan.modules)
    assert all(r.eigenbasis_upcast_bytes == 2 * r.eigenbasis_bytes for r in new.modules)


def test_a_file_whose_columns_disagree_with_its_eigenvector_dtype_is_refused(bf16_index, tmp_path):
    path = tmp_path / PROJECTION_FILE
    shutil.copy(bf16_index.path / PROJECTION_FILE, path)
    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    save_file(tensors, str(path), metadata={**meta, "eigenvector_dtype": "bfloat16"})
    with pytest.raises(IncompatibleIndexError, match="stored as F16 but the file says eigenvector_dtype 'bfloat16'"):
        load_projection(path)
