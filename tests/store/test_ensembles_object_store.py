"""Checkpoint ensembles at an object-store URL (moto's S3 server on loopback): `eogp fit A B
--out s3://...`, ingest, query and explain answer what the same ensemble on a local directory
answers, and `eogp add-checkpoint s3://... B` (its fit's files written through the location
layer, its columns by Lance's ``add_columns`` through Lance's object store, its UDF checkpoint
file in the index's local cache) answers what the local addition does.

Two tiny GPT-2 checkpoints of one architecture (seeds 0 and 1), one shard of 24 documents.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from s3server import s3_server
from tinymodels import make_tiny_gpt2, make_word_tokenizer, save_workspace

from eogp_index.cli import cli
from eogp_index.data import location
from eogp_index.search.question import Question

pytestmark = pytest.mark.objectstore

BUCKET = "eogp-ens"
DOCUMENTS = 24
WEIGHTS = (0.3, 0.7)
QUERIES = ["t1 t2 t3 t4 t5", "t9 t8 t7", "t20 t21 t22 t23 t24 t25"]
FIT = ["-k", "8", "--m", "32", "--curvature-examples", "20", "--pca-examples", "20", "--variant", "eogp"]


def _ok(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """moto's server with the bucket; checkpoints ``model`` (A) and ``b`` (B); the ensemble of A
    and B fitted and ingested at ``s3://eogp-ens/ab`` and in ``root/ab``; A's index fitted in
    ``root/a``, copied to ``s3://eogp-ens/a``, both ingested, then B added to both. Yields each
    index opened: ``{"ab": {"local": ..., "s3": ...}, "a": {...}}``."""
    import pyarrow.fs as pafs

    from eogp_index.client import AttributionIndex

    root = tmp_path_factory.mktemp("ensembles_s3")
    with s3_server(BUCKET, tmp_path_factory.mktemp("cache")):
        save_workspace(root, make_tiny_gpt2(0), DOCUMENTS)
        make_tiny_gpt2(1).save_pretrained(root / "b")
        make_word_tokenizer().save_pretrained(root / "b")
        (root / "weights.json").write_text(json.dumps({"weights": list(WEIGHTS)}))
        shard = root / "shard.jsonl"
        paths = {name: {"local": root / name, "s3": f"s3://{BUCKET}/{name}"} for name in ("ab", "a")}
        for where in ("local", "s3"):
            _ok("fit", root / "model", root / "b", "--checkpoint-weights", root / "weights.json", "--data", shard,
                "--out", paths["ab"][where], *FIT)  # fmt: skip
        # A alone is fitted once; its copy at the URL is what a fit there writes (tested in
        # test_object_store.py), so the addition is the part under test
        _ok("fit", root / "model", "--data", shard, "--out", paths["a"]["local"], *FIT)
        remote = location.index_path(paths["a"]["s3"])
        pafs.copy_files(str(root / "a"), remote.fs_path, pafs.LocalFileSystem(), remote.filesystem)
        for where in ("local", "s3"):
            for name in ("ab", "a"):
                _ok("ingest", paths[name][where], shard)
            added = _ok("add-checkpoint", paths["a"][where], root / "b", "--weight", WEIGHTS[1], "--json")
            assert json.loads(added.stdout)["rows"] == DOCUMENTS
        assert not (Path.cwd() / "s3:").exists() and not (root / "s3:").exists()
        yield {
            name: {where: AttributionIndex.open(path) for where, path in both.items()} for name, both in paths.items()
        }


def _scores(index, precision: str) -> dict:
    ids, scores = index.scores(Question(queries=tuple(QUERIES)), precision=precision)
    return {i: scores[:, j] for j, i in enumerate(ids)}


def _equal(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys() and len(found) == DOCUMENTS
    for key, value in found.items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-5 * np.abs(expected[key]).max())


@pytest.mark.parametrize("precision", ["1bit", "rescore"])
def test_an_ensemble_on_s3_answers_as_the_local_one(indexes, precision):
    _equal(_scores(indexes["ab"]["s3"], precision), _scores(indexes["ab"]["local"], precision))


@pytest.mark.parametrize("precision", ["1bit", "rescore"])
def test_a_checkpoint_added_on_s3_answers_as_the_local_addition(indexes, precision):
    _equal(_scores(indexes["a"]["s3"], precision), _scores(indexes["a"]["local"], precision))


def test_the_added_checkpoints_files_are_in_the_bucket_and_its_udf_file_is_gone(indexes):
    remote = indexes["a"]["s3"].path
    manifest = json.loads((remote / "manifest.json").read_text())
    assert [c["weight"] for c in manifest["checkpoints"]] == [1.0, WEIGHTS[1]]
    assert (remote / "checkpoints" / "1" / "projection.safetensors").is_file()
    assert (remote / "checkpoints" / "1" / "checkpoint.json").is_file()
    import lance

    target, options = location.lance_target(remote / "examples.lance")
    names = lance.dataset(target, storage_options=options).schema.names
    assert {"signs_c1", "scales_c1", "tier_c1"} <= set(names) and "tier_scales_c1" not in names
    assert not list(location.local_cache_dir(remote).rglob("add-columns.sqlite"))
    import pyarrow.fs as pafs

    # kronfluence writes local files: checkpoint 1's factors are in its folder's local cache, as
    # checkpoint 0's are; no fit stage is left behind in the bucket
    for name in ("a", "ab"):
        where = indexes[name]["s3"].path
        keys = {i.path.removeprefix(where.fs_path + "/") for i in
                where.filesystem.get_file_info(pafs.FileSelector(where.fs_path, recursive=True))}  # fmt: skip
        assert {"checkpoints/1/fit/fitting_set.json", "checkpoints/1/projection.safetensors"} <= keys, name
        assert not any(k.startswith("checkpoints/1/curvature/") for k in keys), name
        assert (location.local_cache_dir(where / "checkpoints" / "1") / "curvature").is_dir(), name
        assert not any(k.startswith(("fit/coords", "checkpoints/1/fit/coords")) for k in keys), name


def test_explain_on_s3_shows_the_local_ensembles_shares(indexes):
    remote, local = indexes["ab"]["s3"], indexes["ab"]["local"]
    ids = [hit["id"] for hit in local.search(Question(queries=(QUERIES[0],), k=3)).to_arrow().to_pylist()][:3]
    for found, expected in zip(remote.explain_many(QUERIES[0], ids), local.explain_many(QUERIES[0], ids)):
        assert list(found.checkpoints) == list(expected.checkpoints) and len(found.checkpoints) == 2
        np.testing.assert_allclose(list(found.checkpoints.values()), list(expected.checkpoints.values()), rtol=1e-5)
        assert found.score == pytest.approx(expected.score, rel=1e-5)
