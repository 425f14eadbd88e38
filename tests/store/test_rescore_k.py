"""A rescoring tier wider than the one-bit code (``eogp fit --rescore-k``), on real tiny indexes
(tiny GPT-2, LanceDB on disk): what the fit stores, what ingest writes, how queries score it, the
refusals, and the bytes ``eogp plan`` and ``eogp info`` report."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2, save_workspace, tiny_index

from eogp_index.cli import cli
from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.fit.plan import make_plan, model_shape
from eogp_index.fit.projection import module_rotation
from eogp_index.store.codecs import prefix_columns, unpack_signs
from eogp_index.store.stored_index import StoredIndex

QUERIES = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
ROWS = 24
K, WIDE = 16, 32


def _create(path, variant="eogp", rescore_k=None, rescore="int8", examples=None):
    examples = examples if examples is not None else make_examples(ROWS, seed=11)
    tiny_index(path, examples, list(range(0, ROWS, 20)), curvature_examples=ROWS, store_text=4096,
               variant=variant, k=K, rescore=rescore, rescore_k=rescore_k)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """The same data fitted three ways: eogp and eogp-rot with a tier of 2k per module, and eogp
    at k with a tier of the same coordinates."""
    root = tmp_path_factory.mktemp("rescore_k")
    return {
        "eogp": _create(root / "eogp", rescore_k=WIDE),
        "eogp-rot": _create(root / "rot", "eogp-rot", rescore_k=WIDE),
        "plain": _create(root / "plain"),
    }


def _open(path):
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


def _copy(indexes, name, tmp_path):
    path = tmp_path / name
    shutil.copytree(indexes[name], path)
    return path


def test_the_tier_holds_rescore_k_coordinates_per_module(indexes, tmp_path):
    index = _open(_copy(indexes, "eogp", tmp_path))
    manifest = json.loads((index.path / "manifest.json").read_text())
    modules = manifest["modules"]
    assert [m["k"] for m in modules] == [K] * len(modules)
    assert manifest["tier"] == {
        "code": "int8",
        "bytes_per_example": (WIDE + 2) * len(modules),
        "k": [WIDE] * len(modules),
    }
    assert manifest["bytes_per_example"] == (K // 8 + 2) * len(modules)
    schema = index.stored.store.schema
    # each row's record: WIDE int8 codes and one FP16 scale per module
    assert str(schema.field("tier").type) == f"fixed_size_list<item: uint8>[{(WIDE + 2) * len(modules)}]"
    assert str(schema.field("signs").type) == f"fixed_size_list<item: uint8>[{K // 8 * len(modules)}]"
    projection = index.stored.projection
    assert projection.k == (K,) * len(modules) and projection.tier_k == (WIDE,) * len(modules)
    assert all(tuple(p.pca.shape) == (p.m, WIDE) for p in projection.modules.values())
    y = index.query_coordinates(QUERIES)
    assert y.shape == (2, WIDE * len(modules))


@pytest.mark.parametrize("variant", ["eogp", "eogp-rot"])
def test_the_stored_signs_are_those_of_the_first_k_tier_coordinates(indexes, tmp_path, variant):
    index = _open(_copy(indexes, variant, tmp_path))
    stored = index.stored
    examples = make_examples(ROWS, seed=11)
    x = index.encoder.project(examples)  # (n, T): the tier's coordinates, unquantized
    table = stored.store.read(["id", "signs", *stored.tier.columns])
    order = [table.column("id").to_pylist().index(ex.id) for ex in examples]
    signs = unpack_signs(list_column(table, "signs", stored.layout.nbytes, np.uint8)[order], stored.layout)
    first_k = prefix_columns(x, stored.coordinates, stored.layout)
    assert first_k.shape == (ROWS, stored.layout.num_coords)
    np.testing.assert_array_equal(signs, np.where(first_k >= 0, 1.0, -1.0))
    # the tier's codes are of all T coordinates: its dequantized values are within half a step
    tier = stored.tier.decode(stored.tier.from_arrow(table.take(order)))
    scales = np.repeat(stored.tier.from_arrow(table.take(order))["tier_scales"].astype(np.float32), WIDE, axis=1)
    assert np.all(np.abs(tier - x) <= 0.5 * scales + 1e-6 * np.abs(x).max())


def list_column(table, name, width, dtype):
    from eogp_index.store.codecs import list_column_to_numpy

    return list_column_to_numpy(table.column(name), width, dtype)


def test_eogp_rot_rotates_the_first_k_directions_only(indexes):
    """P_tier = [P[:, :k] R, P[:, k:]]: the rotation of the one-bit code's k directions, the
    tier's further ones as the PCA gives them (so the tier's dot products are unchanged)."""
    plain = StoredIndex.open(indexes["eogp"]).projection
    rotated = StoredIndex.open(indexes["eogp-rot"]).projection
    for name, module in plain.modules.items():
        p, q = module.pca.double(), rotated.modules[name].pca.double()
        rotation = module_rotation(rotated.config.seed, name, K)
        torch.testing.assert_close(q[:, K:], p[:, K:], rtol=0, atol=1e-3)
        torch.testing.assert_close(q[:, :K], rotation.apply(p[:, :K]), rtol=0, atol=2e-3)
        # P Pᵀ, what a full-precision score sees, is the same
        torch.testing.assert_close(q @ q.T, p @ p.T, rtol=0, atol=5e-3)


@pytest.mark.parametrize("variant", ["eogp", "eogp-rot"])
def test_rescored_scores_are_the_tier_dotted_with_the_query_coordinates(indexes, tmp_path, variant):
    index = _open(_copy(indexes, variant, tmp_path))
    stored = index.stored
    y = index.query_coordinates(QUERIES).astype(np.float64)  # (2, T)
    table = stored.store.read(["id", *stored.tier.columns])
    ids = table.column("id").to_pylist()
    tier = stored.tier.decode(stored.tier.from_arrow(table)).astype(np.float64)  # (n, T)
    answers = index.search(QUERIES, many=True).limit(5).rescore(5).to_list()
    for q, answer in enumerate(answers):
        assert answer.num_rows > 0 and "score_1bit" in answer.column_names
        for row in answer.to_pylist():
            reference = tier[ids.index(row["id"])] @ y[q]
            assert math.isclose(row["score"], reference, rel_tol=1e-5, abs_tol=1e-6 * abs(reference))
        # each side is the best 5 of its sign by the tier's score among the one-bit top 25
        positive = [r["score"] for r in answer.to_pylist() if r["direction"] == "positive"]
        assert positive == sorted(positive, reverse=True)


def test_the_one_bit_scores_are_those_of_an_index_fitted_at_k(indexes, tmp_path):
    """The one-bit code keeps the first k of the 2k PCA directions: the directions a fit at k gives."""
    wide, plain = _open(_copy(indexes, "eogp", tmp_path)), _open(_copy(indexes, "plain", tmp_path))
    assert plain.stored.manifest.tier.get("k") is None
    y_wide, y_plain = wide.query_coordinates(QUERIES), plain.query_coordinates(QUERIES)
    np.testing.assert_allclose(wide.stored.one_bit(y_wide), y_plain, rtol=1e-4, atol=1e-5 * np.abs(y_plain).max())
    for a, b in zip(
        wide.search(QUERIES, many=True).limit(8).rescore(0).to_list(),
        plain.search(QUERIES, many=True).limit(8).rescore(0).to_list(),
    ):
        assert a.column("id").to_pylist() == b.column("id").to_pylist()
        np.testing.assert_allclose(a.column("score").to_numpy(), b.column("score").to_numpy(), rtol=1e-4)


def test_every_one_bit_route_scans_the_first_k_coordinates(indexes, tmp_path):
    index = _open(_copy(indexes, "eogp", tmp_path))
    hot = [t.column("id").to_pylist() for t in index.search(QUERIES, many=True).limit(6).to_list()]
    stream = [t.column("id").to_pylist() for t in index.search(QUERIES, many=True).limit(6).route("stream").to_list()]
    assert hot == stream
    by_module = index.search(QUERIES[0]).limit(3).by_module().to_arrow().to_pylist()
    for row in by_module:
        assert math.isclose(sum(row["modules"].values()), row["score"], rel_tol=1e-4)


def test_refusals():
    with pytest.raises(ConfigError, match="--rescore-k.*--rescore none"):
        StorageConfig(rescore="none", rescore_k=32)
    with pytest.raises(ConfigError, match="--rescore-k.*--precision fp16"):
        StorageConfig(precision="fp16", rescore_k=32)
    with pytest.raises(ConfigError, match="rescore_k"):
        StorageConfig(rescore_k=0)
    with pytest.raises(ConfigError, match="--rescore-k 8 is below the one-bit code's k=16"):
        StorageConfig(rescore_k=8).check_rescore_k(16)


def test_a_rescore_k_below_k_is_refused_before_the_curvature_fit(tmp_path):
    with pytest.raises(ConfigError, match="--rescore-k 8 is below the one-bit code's k=16"):
        AttributionIndex.create(
            tmp_path / "index",
            make_tiny_gpt2(),
            TinyTokenizer(),
            make_examples(12, seed=1),
            model_name="tiny",
            projection=ProjectionConfig(k=K, m=64),
            storage=StorageConfig(rescore_k=8),
            curvature=CurvatureConfig(num_examples=12, batch_size=8),
            progress=False,
        )
    assert not (tmp_path / "index" / "curvature").exists()
    result = CliRunner().invoke(
        cli,
        [
            "fit",
            "tiny",
            "--data",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(tmp_path / "x"),
            "-k",
            "16",
            "--rescore-k",
            "8",
        ],
    )
    assert result.exit_code != 0 and "--rescore-k 8 is below the one-bit code's k=16" in result.output
    result = CliRunner().invoke(
        cli,
        [
            "fit",
            "tiny",
            "--data",
            str(tmp_path / "none.jsonl"),
            "--out",
            str(tmp_path / "x"),
            "--rescore",
            "none",
            "--rescore-k",
            "32",
        ],
    )
    assert result.exit_code != 0 and "--rescore none stores no tier" in result.output


def test_a_tier_manifest_without_tier_k_opens_as_before(indexes, tmp_path):
    path = _copy(indexes, "plain", tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 4 and "k" not in manifest["tier"]
    stored = StoredIndex.open(path)
    assert stored.coordinates.k == stored.layout.k and stored.manifest.tier_k == stored.manifest.k
    y = np.ones((1, stored.layout.num_coords), np.float32)
    assert stored.one_bit(y) is y
    assert stored.projection.tier_k == stored.layout.k


def test_a_projection_whose_tier_k_disagrees_with_the_manifest_is_refused(indexes, tmp_path):
    path = _copy(indexes, "eogp", tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["tier"]["k"]  # the manifest now says: a tier of the one-bit k
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleIndexError, match="tier"):
        StoredIndex.open(path).projection


def test_info_reports_both_tiers_and_what_a_query_reads(indexes, tmp_path):
    path = _copy(indexes, "eogp", tmp_path)
    stored = StoredIndex.open(path)
    modules = len(stored.manifest.modules)
    one_bit, tier = (K // 8 + 2) * modules, (WIDE + 2) * modules
    data = stored.info(hits=2, rescore=3)["bytes"]
    assert data == {
        "code": "int8",
        "tier_k": WIDE * modules,
        "one_bit_bytes_per_row": one_bit,
        "tier_bytes_per_row": tier,
        "one_bit_bytes": ROWS * one_bit,
        "tier_bytes": ROWS * tier,
        "hits": 2,
        "rescore": 3,
        "sides": 2,
        "rescored_rows": 6,
        "query_bytes": ROWS * one_bit + 2 * 6 * tier,
    }
    result = CliRunner().invoke(cli, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)["bytes"]
    assert printed["rescored_rows"] == min(printed["rescore"] * printed["hits"], ROWS)
    text = CliRunner().invoke(cli, ["info", str(path)]).output
    assert f"bytes/row   {one_bit:,} (scanned) + {tier:,} (rescoring tier, int8, {WIDE * modules:,} coordinates" in text
    assert "query reads" in text


def test_plan_reports_both_tiers_and_what_a_query_reads(tmp_path):
    shape = model_shape(str(save_workspace(tmp_path, make_tiny_gpt2(), 4) / "model"))
    plan = make_plan(
        shape,
        ProjectionConfig(k=K, m=64),
        rescore="int4",
        rescore_k=WIDE,
        documents=1000,
        query_hits=10,
        query_rescore=5,
        max_tokens=24,
    )
    modules = len(plan.modules)
    assert all(r.k == K and r.tier_k == WIDE and r.tier_bytes_per_example == WIDE // 2 + 2 for r in plan.modules)
    assert all(r.pca_bytes == r.m * WIDE * 2 for r in plan.modules)  # P has the tier's columns (fp16)
    one_bit, tier = (K // 8 + 2) * modules, (WIDE // 2 + 2) * modules
    tiers = plan.to_json()["tiers"]
    assert tiers == {
        "code": "int4",
        "tier_k": WIDE * modules,
        "one_bit_bytes_per_row": one_bit,
        "tier_bytes_per_row": tier,
        "one_bit_bytes": 1000 * one_bit,
        "tier_bytes": 1000 * tier,
        "hits": 10,
        "rescore": 5,
        "sides": 2,
        "rescored_rows": 50,
        "query_bytes": 1000 * one_bit + 2 * 50 * tier,
    }
    assert plan.memory.ingest.disk_bytes == 1000 * (one_bit + tier)
    none = make_plan(shape, ProjectionConfig(k=K, m=64), rescore="none", documents=1000, max_tokens=24)
    assert none.to_json()["tiers"]["tier_bytes"] == 0 and none.tiers.query_bytes == 1000 * one_bit
    with pytest.raises(ConfigError, match="below the one-bit code's k"):
        make_plan(shape, ProjectionConfig(k=K, m=64), rescore_k=8, max_tokens=24)
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(tmp_path / "model"),
            "-k",
            "16",
            "--m",
            "64",
            "--rescore-k",
            "32",
            "--max-tokens",
            "24",
            "--documents",
            "1000",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tiers"]["tier_bytes_per_row"] == (WIDE + 2) * modules


def test_eogp_r_draws_the_first_k_rows_as_an_srht_of_k_rows():
    from eogp_index.fit.projection import make_srht, srht_apply

    alone = make_srht(48, K, torch.Generator().manual_seed(3))
    signs, rows = make_srht(48, K, torch.Generator().manual_seed(3), width=WIDE)
    assert torch.equal(signs, alone[0]) and torch.equal(rows[:K], alone[1]) and len(set(rows.tolist())) == WIDE
    z = torch.randn(5, 48, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(srht_apply(z, signs, rows, k=K)[:, :K], srht_apply(z, *alone), rtol=0, atol=1e-6)


def test_the_widths_of_each_variant_with_a_wider_tier():
    storage = StorageConfig(rescore_k=WIDE)
    # PCA variants: the default m is at least the tier's width; an explicit m caps it
    assert ProjectionConfig(k=K).dims(100_000, 4, "1bit", WIDE) == (16384, K)
    m, k = ProjectionConfig(k=K, m=24).dims(100_000, 4, "1bit", WIDE)
    assert (m, k, storage.tier_k(k, m)) == (24, K, 24)
    # ekfac-topk keeps the top rescore_k axes, its one-bit code the top k
    assert ProjectionConfig(variant="ekfac-topk", k=K).dims(100_000, 4, "1bit", WIDE) == (WIDE, K)
    # a module smaller than rescore_k keeps all its coordinates in the tier
    assert ProjectionConfig(variant="ekfac-topk", k=K).dims(20, 4, "1bit", WIDE) == (20, K)


def test_explain_splits_the_tier_score_over_all_its_coordinates(indexes, tmp_path):
    index = _open(_copy(indexes, "eogp", tmp_path))
    hit = index.search(QUERIES[0]).limit(1).direction("positive").to_arrow().to_pylist()[0]
    explanation = index.explain(QUERIES[0], hit["id"])
    assert math.isclose(explanation.score, hit["score"], rel_tol=1e-4)
    example = next(ex for ex in make_examples(ROWS, seed=11) if ex.id == hit["id"])
    projected = float(index.query_coordinates([QUERIES[0]])[0].astype(np.float64) @ index.encoder.project([example])[0])
    assert math.isclose(explanation.score_projected, projected, rel_tol=1e-3)


def test_block_ingest_writes_the_wide_tier_of_per_batch_ingest(indexes, tmp_path):
    import dataclasses

    from eogp_index.config import IngestConfig

    examples = [dataclasses.replace(ex, id=f"new-{i}") for i, ex in enumerate(make_examples(12, seed=29))]
    resident = _open(_copy(indexes, "eogp", tmp_path / "resident"))
    blocked = AttributionIndex.open(
        _copy(indexes, "eogp", tmp_path / "blocked"),
        model=make_tiny_gpt2(),
        tokenizer=TinyTokenizer(),
        gradients=GradientConfig(batch_size=4, projection_memory_gb=1e-9),  # below one module's P
    )
    assert blocked.projection.in_turn
    resident.add_batch(examples[:4]), resident.add_batch(examples[4:8]), resident.add_batch(examples[8:])
    assert blocked.ingest(examples, IngestConfig(block_documents=8, batch_size=4, progress=False)) == 12
    wanted = [ex.id for ex in examples]

    def rows(index):
        table = index.stored.store.read(["id", "signs", "scales", *index.stored.tier.columns], f"id IN {tuple(wanted)}")
        by_id = {row["id"]: row for row in table.to_pylist()}
        return [by_id[i] for i in wanted]

    assert rows(blocked) == rows(resident)
