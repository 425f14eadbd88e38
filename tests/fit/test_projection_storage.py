"""How the projection is stored and loaded: P in FP16 (fp32 as an option), read lazily and, over a
memory limit, module by module; projection format 1 still read; the model and projection checked
by sampled fingerprints on open and by full hashes in `eogp verify`; the model frozen once opened.

All on real tiny models and real index directories.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index import config as config_module
from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import IncompatibleIndexError
from eogp_index.fit import projection as projection_module
from eogp_index.fit.curvature import ModuleCurvature
from eogp_index.fit.projection import build_projection, fit_pca
from eogp_index.gradients import model as model_module
from eogp_index.gradients.capture import GradientCapture
from eogp_index.gradients.loss import collate
from eogp_index.gradients.model import model_fingerprint, model_sha256
from eogp_index.store import files as files_module
from eogp_index.store.files import file_sha256
from eogp_index.store.manifest import MANIFEST_FILE, PROJECTION_FILE
from eogp_index.store.projection_file import load_projection, save_projection
from eogp_index.store.verify import verify_index

TRAIN = make_examples(24, seed=1)
QUERIES = make_examples(4, seed=2, prefix="q", masked_prompt=True)
DATA = Path(__file__).resolve().parents[1] / "fixtures"
#: FP16 unit roundoff: round-to-nearest moves a normal number by at most 2^-11 of itself, and
#: a subnormal (|x| < 2^-14) by at most half its spacing, 2^-25.
U16, SUBNORMAL_ERR = 2.0**-11, 2.0**-25


def _create(path, pca_dtype="fp16"):
    return AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        progress=False,
        projection=ProjectionConfig(variant="eogp", k=12, m=40, pca_dtype=pca_dtype),
        curvature=CurvatureConfig(num_examples=24, batch_size=4),
        gradients=GradientConfig(batch_size=5),
    )


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """The same fit twice (deterministic): P stored in FP16 (the default) and in FP32."""
    root = tmp_path_factory.mktemp("pstore")
    return {dtype: _create(root / dtype, dtype).path for dtype in ("fp16", "fp32")}


def _open(path, **gradients):
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=5, **gradients)
    )


def _first_stage(index):
    capture = GradientCapture(index.model, index.manifest.module_names, index.projection.first_stage_transform)
    out, _ = capture.run(collate([(e.input_ids, e.labels) for e in TRAIN + QUERIES]))
    return out


def test_p_is_fp16_by_default_and_recorded(indexes):
    for dtype, torch_dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        manifest = json.loads((indexes[dtype] / MANIFEST_FILE).read_text())
        assert manifest["projection"]["pca_dtype"] == dtype
        with safe_open(str(indexes[dtype] / PROJECTION_FILE), framework="pt") as handle:
            meta = handle.metadata()
            assert meta["format_version"] == "3" and meta["pca_dtype"] == dtype
            for name in manifest["modules"]:
                assert handle.get_tensor(f"{name['name']}/pca").dtype == torch_dtype
                # The eigenbases keep the float32 model's precision (full-width scores match kronfluence
                # to ~2e-7).
                assert handle.get_tensor(f"{name['name']}/gradient_eigenvectors").dtype == torch.float32
            assert meta["eigenvector_dtype"] == "float32"
    data = {dtype: _data_bytes(indexes[dtype] / PROJECTION_FILE) for dtype in indexes}
    p_bytes = sum(m["m"] * m["k"] for m in manifest["modules"]) * 2  # what FP16 saves: 2 bytes per entry
    assert data["fp32"] - data["fp16"] == p_bytes


def _data_bytes(path):
    """A safetensors file's tensor bytes: its size less the 8-byte length and the JSON header."""
    raw = path.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def test_fp16_coordinates_equal_fp32_within_the_rounding_of_p(indexes):
    """y = Pᵀz in float32 either way, so the difference is zᵀ(P − fl16(P)):
    |y16 − y32| ≤ 2^-11·(|z|ᵀ|P|) + 2^-25·‖z‖₁ from P's rounding, plus float32 accumulation
    (≤ m·2^-23·|z|ᵀ|P| over both products)."""
    i16, i32 = _open(indexes["fp16"]), _open(indexes["fp32"])
    z16, z32 = _first_stage(i16), _first_stage(i32)
    examples = TRAIN + QUERIES
    y16, y32 = i16.project(examples), i32.project(examples)
    offset = 0
    for name, module in i32.projection.modules.items():
        p32, p16 = module.pca, i16.projection.modules[name].pca
        assert p16.dtype == torch.float16 and p32.dtype == torch.float32
        assert torch.equal(p16, p32.half())  # the same fit, rounded once
        assert torch.equal(z16[name], z32[name])  # the first stage does not involve P
        z = z32[name].double().abs()
        bound = (U16 + module.m * 2.0**-23) * (z @ p32.double().abs()) + SUBNORMAL_ERR * z.sum(1, keepdim=True)
        diff = np.abs(y16[:, offset : offset + module.k] - y32[:, offset : offset + module.k])
        assert (diff <= bound.numpy()).all(), name
        assert diff.max() > 0  # FP16 did round something: the bound is exercised, not vacuous
        offset += module.k


def test_lazy_and_in_turn_modes_give_identical_coordinates(indexes):
    eager = _open(indexes["fp16"], projection_memory_gb=1024.0)
    lazy = eager.projection._lazy
    assert lazy.resident and not eager.projection.in_turn
    assert not lazy._kept  # opening read no P
    y_eager = eager.project(TRAIN)
    assert len(lazy._kept) == len(eager.manifest.modules)  # each P read once and kept
    in_turn = _open(indexes["fp16"], projection_memory_gb=1e-9)  # below one module's P
    assert in_turn.projection.in_turn and in_turn.projection.pca_bytes > 1e-9 * 2**30
    reads = []
    in_turn.projection._lazy._handle = _Counting(in_turn.projection._lazy._handle, reads)
    y_turn = in_turn.project(TRAIN)  # 24 examples in 5 batches
    assert not in_turn.projection._lazy._kept  # nothing kept between modules
    names = in_turn.manifest.module_names
    # Once per module for the 5 batches: the first stage of every batch, then each P applied to all.
    assert sorted(reads) == sorted(f"{n}/pca" for n in names)
    np.testing.assert_array_equal(y_eager, y_turn)
    # And the same scores through a query.
    q = {"input_ids": list(QUERIES[0].input_ids), "labels": list(QUERIES[0].labels)}
    np.testing.assert_array_equal(eager.query_coordinates([q]), in_turn.query_coordinates([q]))


class _Counting:
    """A safetensors handle that records which tensors are read."""

    def __init__(self, handle, reads):
        self.handle, self.reads = handle, reads

    def get_tensor(self, key):
        self.reads.append(key)
        return self.handle.get_tensor(key)


def _curvature_pair():
    """The recipe of tests/fixtures/make_projection_v1.py (same seeds): two modules' factors and P."""

    def orth(n, gen):
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q.float()

    gen = torch.Generator().manual_seed(0)
    curv = {}
    for name, (d_out, d_in) in {"a": (6, 5), "b": (4, 3)}.items():
        eig = (torch.rand(d_out, d_in, generator=gen, dtype=torch.float64) ** 3).float()
        curv[name] = ModuleCurvature(
            activation_eigenvectors=orth(d_in, gen), gradient_eigenvectors=orth(d_out, gen), eigenvalues=eig
        )
    proj = build_projection(curv, ProjectionConfig(variant="eogp", k=4, m=10, pca_dtype="fp32"), StorageConfig())
    for p in proj.modules.values():
        p.pca = fit_pca(torch.randn(20, p.m, generator=gen), p.k)
    return proj


def test_projection_format_1_file_is_still_read(tmp_path):
    """tests/fixtures/projection-v1.safetensors was written by the format-1 code (see make_projection_v1.py)."""
    path = DATA / "projection-v1.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["format_version"] == "1" and "pca_dtype" not in handle.metadata()
    loaded = load_projection(path)
    assert loaded.config.pca_dtype == "fp32" and loaded.names == ["a", "b"] and loaded.k == (4, 4)
    assert all(m.pca.dtype == torch.float32 for m in loaded.modules.values())
    rebuilt = _curvature_pair()
    gen = torch.Generator().manual_seed(3)
    for name, shape in (("a", (6, 5)), ("b", (4, 3))):
        a, g = torch.randn(3, 7, shape[1], generator=gen), torch.randn(3, 7, shape[0], generator=gen)
        torch.testing.assert_close(loaded.transform(name, a, g), rebuilt.transform(name, a, g), rtol=0, atol=0)
    # Saving it again writes format 3, keeping its fp32 P (the config read from a format-1 file) and
    # its float32 eigenvector columns.
    save_projection(loaded, tmp_path / "p2.safetensors")
    with safe_open(str(tmp_path / "p2.safetensors"), framework="pt") as handle:
        assert handle.metadata()["format_version"] == "3" and handle.get_tensor("a/pca").dtype == torch.float32
        assert handle.metadata()["eigenvector_dtype"] == "float32"
    # A version this code does not know is refused, naming what to do.
    tensors = {k: v for k, v in _load_all(path).items()}
    meta = dict(safe_open(str(path), framework="pt").metadata(), format_version="4")
    save_file(tensors, str(tmp_path / "p4.safetensors"), metadata=meta)
    with pytest.raises(IncompatibleIndexError, match="version 4.*Refit"):
        load_projection(tmp_path / "p4.safetensors")


def _load_all(path):
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def test_an_index_written_before_fp16_and_fingerprints_opens_and_projects_the_same(indexes, tmp_path):
    """A format-1 projection file (fp32 P) with a manifest that has no pca_dtype or fingerprints:
    P is the FP16 one upcast, so the coordinates are identical, and the full hashes are checked."""
    old = tmp_path / "old"
    shutil.copytree(indexes["fp16"], old)
    path = old / PROJECTION_FILE
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    tensors = {k: (v.float() if k.endswith("/pca") else v) for k, v in _load_all(path).items()}
    config = json.loads(meta["config"])
    del config["pca_dtype"]
    save_file(
        tensors,
        str(path),
        metadata={
            "format": "eogp-projection",
            "format_version": "1",
            "variant": meta["variant"],
            "damping_ratio": meta["damping_ratio"],
            "config": json.dumps(config),
            "modules": meta["modules"],
        },
    )
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    for key in ("pca_dtype", "fingerprint"):
        del manifest["projection"][key]
    del manifest["model"]["weights_fingerprint"]
    manifest["projection"]["sha256"] = file_sha256(path)
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    reopened = _open(old)
    assert reopened.manifest.pca_dtype == "fp32" and reopened.projection.config.pca_dtype == "fp32"
    np.testing.assert_array_equal(reopened.project(TRAIN), _open(indexes["fp16"]).project(TRAIN))
    with pytest.raises(IncompatibleIndexError, match="built for model"):  # the full hash, as before
        AttributionIndex.open(old, model=make_tiny_gpt2(seed=1), tokenizer=TinyTokenizer())


def test_open_checks_fingerprints_and_verify_hashes_everything(indexes, tmp_path, monkeypatch):
    path = indexes["fp16"]
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["model"]["weights_fingerprint"] == model_fingerprint(make_tiny_gpt2())
    # A changed weight the fingerprint covers (the tiny model's tensors are all under 64 KiB: whole).
    changed = make_tiny_gpt2()
    with torch.no_grad():
        changed.transformer.h[1].mlp.c_fc.weight[7, 3] += 1e-3
    with pytest.raises(IncompatibleIndexError, match="weights fingerprint"):
        AttributionIndex.open(path, model=changed, tokenizer=TinyTokenizer())
    report = verify_index(path, model=make_tiny_gpt2())
    assert report["ok"] and report["model"]["ok"] and report["projection"]["ok"]
    assert not verify_index(path, model=changed)["ok"]

    # What a sample can miss: with large tensors sampled (threshold lowered so the tiny model's
    # are), a change between two sampled chunks leaves the fingerprint as it was; open accepts
    # it, and only verify's full hash sees it.
    monkeypatch.setattr(model_module, "FINGERPRINT_WHOLE_TENSOR_BYTES", 0)
    monkeypatch.setattr(model_module, "FINGERPRINT_CHUNKS", 4)
    monkeypatch.setattr(model_module, "FINGERPRINT_CHUNK_BYTES", 16)
    copy = tmp_path / "sampled"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["model"]["weights_fingerprint"] = model_fingerprint(make_tiny_gpt2())
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    weight = make_tiny_gpt2().transformer.h[1].mlp.c_fc.weight  # Conv1D (16, 32): 512 floats
    sampled = {i for s, e in model_module.fingerprint_ranges(weight.numel(), 4) for i in range(s, e)}
    missed = next(i for i in range(weight.numel()) if i not in sampled)

    def subtle():
        model = make_tiny_gpt2()
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.view(-1)[missed] += 1e-3
        return model

    assert model_fingerprint(subtle()) == manifest["model"]["weights_fingerprint"]
    assert model_sha256(subtle()) != manifest["model"]["weights_sha256"]
    AttributionIndex.open(copy, model=subtle(), tokenizer=TinyTokenizer())  # not caught by the sample
    report = verify_index(copy, model=subtle())  # a model as loaded (open swaps GPT-2's Conv1D in place)
    assert (
        not report["ok"]
        and not report["model"]["ok"]
        and report["model"]["fingerprint"] == report["model"]["expected_fingerprint"]
    )


def test_a_changed_projection_file_is_refused(indexes, tmp_path, monkeypatch):
    copy = tmp_path / "changed"
    shutil.copytree(indexes["fp16"], copy)
    data = bytearray((copy / PROJECTION_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside the tensors (the file is fingerprinted whole: < 64 MiB)
    (copy / PROJECTION_FILE).write_bytes(bytes(data))
    with pytest.raises(IncompatibleIndexError, match="projection file's fingerprint"):
        _open(copy)
    report = verify_index(copy, model=make_tiny_gpt2())
    assert not report["projection"]["ok"] and report["model"]["ok"]

    # Sampled files: the header (names, dtypes, shapes, offsets, metadata), evenly spaced chunks
    # and each tensor's ends are read. A tensor's last byte is caught; a byte between samples is not.
    monkeypatch.setattr(files_module, "FINGERPRINT_WHOLE_FILE_BYTES", 0)
    monkeypatch.setattr(files_module, "FINGERPRINT_CHUNKS", 2)
    monkeypatch.setattr(files_module, "FINGERPRINT_CHUNK_BYTES", 8)
    monkeypatch.setattr(files_module, "FINGERPRINT_TENSOR_END_BYTES", 4)
    shutil.rmtree(copy)
    shutil.copytree(indexes["fp16"], copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["projection"]["fingerprint"] = files_module.file_fingerprint(copy / PROJECTION_FILE)
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    _open(copy)  # unchanged: accepted
    raw = (copy / PROJECTION_FILE).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8 : 8 + header_len])[f"{manifest['modules'][0]['name']}/pca"]
    begin, end = (8 + header_len + x for x in entry["data_offsets"])
    for offset, caught in ((end - 1, True), ((begin + end) // 2, False)):
        data = bytearray(raw)
        data[offset] ^= 0x01
        (copy / PROJECTION_FILE).write_bytes(bytes(data))
        if caught:
            with pytest.raises(IncompatibleIndexError, match="fingerprint"):
                _open(copy)
        else:
            _open(copy)  # a sample misses it...
        assert not verify_index(copy, model=make_tiny_gpt2())["projection"]["ok"]  # ...the full hash does not


def test_opened_and_created_indexes_never_train_the_model(indexes, tmp_path):
    model = make_tiny_gpt2()
    assert all(p.requires_grad for p in model.parameters())
    index = AttributionIndex.open(
        shutil.copytree(indexes["fp16"], tmp_path / "i"),
        model=model,
        tokenizer=TinyTokenizer(),
        gradients=GradientConfig(batch_size=5),
    )
    index.ingest(TRAIN[:6], progress=False, store_text=1 << 16)
    index.top_influential({"input_ids": list(QUERIES[0].input_ids)}, k=3)
    index.explain({"input_ids": list(QUERIES[0].input_ids)}, TRAIN[0].id)
    assert not any(p.requires_grad or p.grad is not None for p in index.model.parameters())
    created = _create(tmp_path / "c")
    created.ingest(TRAIN[:6], progress=False)
    assert not any(p.requires_grad or p.grad is not None for p in created.model.parameters())


def test_memory_limit_option_and_default(monkeypatch):
    with pytest.raises(Exception, match="projection_memory_gb"):
        GradientConfig(projection_memory_gb=0)
    monkeypatch.setenv(config_module.PROJECTION_MEMORY_ENV, "0.5")
    assert config_module.default_projection_memory() == 1 << 29
    monkeypatch.delenv(config_module.PROJECTION_MEMORY_ENV)
    assert 0 < config_module.default_projection_memory() <= config_module.available_memory()
    assert math.isfinite(config_module.default_projection_memory())


def test_fp16_p_is_upcast_in_blocks_without_changing_the_result(monkeypatch):
    """A large FP16 P is applied in row blocks of float32 (so it never needs a float32 copy of
    itself); the blocks give z·P as one upcast does (z rounded to FP16 as the fit's PCA saw it),
    up to float32 summation order."""
    gen = torch.Generator().manual_seed(0)
    z, p = torch.randn(5, 300, generator=gen), torch.randn(300, 7, generator=gen).half()
    whole = z.half().double() @ p.double()
    monkeypatch.setattr(projection_module, "_UPCAST_BYTES", 4 * 7 * 64)  # 64 rows per block: 5 blocks
    blocked = projection_module.apply_pca(z, p)
    assert blocked.dtype == torch.float32
    torch.testing.assert_close(blocked.double(), whole, rtol=1e-5, atol=1e-5)


def test_safetensors_are_written_one_tensor_at_a_time_and_read_back_exactly(tmp_path):
    """write_safetensors: a file safetensors reads back bit for bit (any dtype mix, odd sizes,
    tensors aligned to their element size), whose returned SHA-256 is the file's; a tensor is
    cast to its entry's dtype as it is written."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a/f32": torch.randn(3, 5, generator=gen),
        "b/i64": torch.arange(7),
        "c/f16": torch.randn(5, 3, generator=gen).half(),
        "d/odd": torch.randn(3, generator=gen).half(),
        "e/f64": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "g/bf16": torch.randn(3, 3, generator=gen).bfloat16(),
        "h/bool": torch.tensor([True, False, True]),
    }
    entries = [files_module.TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in tensors.items()]
    entries.append(files_module.TensorEntry("f/cast", torch.float16, (4, 2), lambda: torch.ones(4, 2)))
    path = tmp_path / "t.safetensors"
    digest = files_module.write_safetensors(path, entries, {"note": "x"})
    assert digest == file_sha256(path) and [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"note": "x"}
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
        assert handle.get_tensor("f/cast").dtype == torch.float16
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0
    header = json.loads(raw[8 : 8 + header_len])
    itemsize = {"F64": 8, "I64": 8, "F32": 4, "F16": 2, "BF16": 2, "BOOL": 1}
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % itemsize[entry["dtype"]] == 0, name


def test_save_holds_one_module_p_at_a_time(tmp_path):
    """save_projection reads each module's P (through its loader, as a fit's P is read from
    fit/pca/) only when it is written, and has released it before reading the next: saving never
    holds every module's P. The file loads back to the same P."""
    import gc
    import weakref

    proj = _curvature_pair()
    fitted = {name: module.pca.clone() for name, module in proj.modules.items()}
    alive, reads = [], []

    def loader(name):
        gc.collect()
        reads.append((name, [ref() is not None for ref in alive]))
        tensor = fitted[name].clone()
        alive.append(weakref.ref(tensor))
        return tensor

    for name, module in proj.modules.items():
        module.pca = None
        module.pca_loader = functools.partial(loader, name)
    save_projection(proj, tmp_path / "p.safetensors")
    assert [name for name, _ in reads] == ["a", "b"]
    assert reads[1][1] == [False]  # a's P was gone when b's was read
    loaded = load_projection(tmp_path / "p.safetensors")
    for name in fitted:
        assert torch.equal(loaded.modules[name].pca, fitted[name])
