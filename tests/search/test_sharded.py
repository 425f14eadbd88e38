"""Streaming and scale-out scans equal the hot exact scan; filters equal filter-after-scan."""

import json
import os

import numpy as np
import pytest
from torchrun import run_torchrun_eogp

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]


def test_stream_equals_hot_scan_both_directions(fitted_index):
    hot = fitted_index.top_influential(QUERY, k=7, direction="both")
    streamed = fitted_index.top_influential(QUERY, k=7, direction="both", stream=True)
    assert hot.column("id").to_pylist() == streamed.column("id").to_pylist()
    np.testing.assert_allclose(hot.column("score").to_numpy(), streamed.column("score").to_numpy(), rtol=1e-6)


def test_filtered_top_k_equals_filter_after_scan(fitted_index):
    ids, scores = fitted_index.scores([QUERY])
    group = dict(
        zip(
            fitted_index.store.read(["id", "group"]).column("id").to_pylist(),
            fitted_index.store.read(["id", "group"]).column("group").to_pylist(),
        )
    )
    allowed = [(s, i) for i, s in zip(ids, scores[0]) if group[i] == 2]
    expected = [i for s, i in sorted(allowed, key=lambda t: -t[0])[:5]]
    for stream in (False, True):
        got = fitted_index.top_influential(QUERY, k=5, where="`group` = 2", direction="positive", stream=stream)
        assert got.column("id").to_pylist() == expected


def test_scalar_index_is_used_by_filters(fitted_index):
    store = fitted_index.store
    store.create_scalar_index("group", "BITMAP")
    store.create_scalar_index("num_tokens", "BTREE")
    plan = store.explain("`group` = 2 AND num_tokens > 8")
    assert "ScalarIndexQuery" in plan
    before = fitted_index.top_influential(QUERY, k=5, where="`group` = 2 AND num_tokens > 8")
    assert all(r["group"] == 2 and r["num_tokens"] > 8 for r in before.to_pylist())


@pytest.mark.distributed
def test_two_torchrun_workers_merge_to_the_exact_top_k(fitted_index):
    expected = fitted_index.top_influential(QUERY, k=6, direction="both")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]
        ),
    )
    # The workers load the model named in the manifest: point it at a saved copy of the tiny model.
    model_dir = fitted_index.path / "model"
    conftest = __import__("tinymodels")
    conftest.make_tiny_gpt2().save_pretrained(model_dir)
    conftest.make_word_tokenizer().save_pretrained(model_dir)
    manifest_path = fitted_index.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["name"] = str(model_dir)
    manifest_path.write_text(json.dumps(manifest))
    queries = fitted_index.path / "queries.jsonl"
    queries.write_text(json.dumps({"input_ids": QUERY}) + "\n")
    out = run_torchrun_eogp(
        "query", str(fitted_index.path), "--queries", str(queries), "-k", "6", "--direction", "both", "--device", "cpu",
        "--json", env=env,
    )  # fmt: skip
    result = json.loads(out.stdout[out.stdout.index("[") :])[0]
    got = [r["id"] for r in result["results"]]
    assert got == expected.column("id").to_pylist()
