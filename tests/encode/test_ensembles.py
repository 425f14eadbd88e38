"""Checkpoint ensembles (docs/ensembles.md): `eogp fit A B`, query-time weights, explain's shares,
a changed checkpoint refused, and `eogp add-checkpoint` (equal to fitting both together, the other
columns' files untouched, completed after a kill).

Two tiny GPT-2 checkpoints of one architecture (seeds 0 and 1) with a saved word tokenizer, fitted
on one shard of 40 documents with a rescoring tier; the single-checkpoint indexes of each, fitted
with the same options on the same documents, are the reference: the ensemble's score is exactly
``w_A · score_A + w_B · score_B``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tinymodels import make_tiny_gpt2, make_tiny_llama, make_word_tokenizer, save_workspace
from torchrun import run_torchrun_eogp

from eogp_index.cli import cli
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.search.question import Question

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = (0.3, 0.7)
QUERIES = ["t1 t2 t3 t4 t5", "t9 t8 t7", "t20 t21 t22 t23 t24 t25"]
FIT = ["-k", "8", "--m", "32", "--curvature-examples", "20", "--pca-examples", "20", "--variant", "eogp"]


def _run(*args, ok: bool = True):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The workspace: checkpoints ``model`` (A) and ``b`` (B), the shard, and three indexes of it:
    ``ab`` (A and B, weights 0.3 and 0.7), ``a`` and ``b-only``."""
    root = tmp_path_factory.mktemp("ensembles")
    save_workspace(root, make_tiny_gpt2(0), 40)
    make_tiny_gpt2(1).save_pretrained(root / "b")
    make_word_tokenizer().save_pretrained(root / "b")
    (root / "weights.json").write_text(json.dumps({"weights": list(WEIGHTS)}))
    shard = root / "shard.jsonl"
    _run("fit", root / "model", root / "b", "--checkpoint-weights", root / "weights.json", "--data", shard,
         "--out", root / "ab", *FIT)  # fmt: skip
    _run("fit", root / "model", "--data", shard, "--out", root / "a", *FIT)
    _run("fit", root / "b", "--data", shard, "--out", root / "b-only", *FIT)
    for name in ("ab", "a", "b-only"):
        _run("ingest", root / name, shard)
    return root


def _open(path):
    from eogp_index.client import AttributionIndex

    return AttributionIndex.open(path)


@pytest.fixture(scope="module")
def opened(root):
    """The three indexes, opened once: ``{"ab", "a", "b"}``."""
    return {"ab": _open(root / "ab"), "a": _open(root / "a"), "b": _open(root / "b-only")}


def _scores(index, precision: str, **question) -> dict:
    ids, scores = index.scores(Question(queries=tuple(QUERIES), **question), precision=precision)
    return {i: scores[:, j] for j, i in enumerate(ids)}


def _close(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys()
    for key, value in found.items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-4 * np.abs(expected[key]).max())


def test_an_ensembles_manifest_names_each_checkpoint_and_its_columns(root):
    manifest = json.loads((root / "ab" / "manifest.json").read_text())
    assert [c["weight"] for c in manifest["checkpoints"]] == list(WEIGHTS)
    assert manifest["checkpoints"][1]["dir"] == "checkpoints/1"
    assert (root / "ab" / "checkpoints" / "1" / "projection.safetensors").is_file()
    assert sum(m["name"].startswith("c1/") for m in manifest["modules"]) == len(manifest["modules"]) // 2
    single = json.loads((root / "a" / "manifest.json").read_text())
    assert "checkpoints" not in single
    import lance

    shown = _run("info", root / "ab").stdout
    assert f"checkpoint  1: {root / 'b'}  weight 0.7" in shown
    names = lance.dataset(str(root / "ab" / "examples.lance")).schema.names
    assert {"signs", "scales", "tier", "signs_c1", "scales_c1", "tier_c1"} <= set(names)
    assert not {"tier_scales", "tier_scales_c1"} & set(names)  # each row's tier is one record (format 4)


@pytest.mark.parametrize("precision", ["1bit", "rescore"])
def test_scores_are_the_weighted_sum_of_each_checkpoints_index(opened, precision):
    ab, a, b = opened["ab"], opened["a"], opened["b"]
    found, score_a, score_b = (_scores(index, precision) for index in (ab, a, b))
    _close(found, {i: WEIGHTS[0] * score_a[i] + WEIGHTS[1] * score_b[i] for i in found})
    # weights asked at query time replace the fitted ones; each checkpoint alone is its own index
    _close(_scores(ab, precision, checkpoint_weights=(1.0, 0.0)), score_a)
    _close(_scores(ab, precision, checkpoint_weights=[0, 2]), {i: 2 * v for i, v in score_b.items()})


@pytest.mark.parametrize("route", ["hot", "stream"])
@pytest.mark.parametrize("rescore", [0, None])
def test_the_top_hits_of_each_route_carry_the_weighted_sum(opened, route, rescore):
    ab, a, b = opened["ab"], opened["a"], opened["b"]
    reference = _scores(a, "1bit" if rescore == 0 else "rescore"), _scores(b, "1bit" if rescore == 0 else "rescore")
    for q, query in enumerate(QUERIES):
        hits = ab.search(Question(queries=(query,), k=8, route=route, rescore=rescore)).to_arrow().to_pylist()
        assert hits
        for hit in hits:
            expected = WEIGHTS[0] * reference[0][hit["id"]][q] + WEIGHTS[1] * reference[1][hit["id"]][q]
            assert math.isclose(hit["score"], expected, rel_tol=1e-4, abs_tol=1e-6), (hit, expected)


def test_a_first_pass_and_the_plan_cover_every_checkpoint(root, opened, tmp_path):
    """A first pass of an ensemble decodes every checkpoint's code: with every row a candidate its
    answer is the exact weighted scan; the plan counts two checkpoints' codes."""
    from eogp_index.store.index_plan import plan_of_index

    index = tmp_path / "ab"
    shutil.copytree(root / "ab", index)
    _run("build-candidates", index)
    ab = _open(index)
    for query in QUERIES:
        exact = ab.search(Question(queries=(query,), k=8, rescore=0)).to_arrow().to_pylist()
        first = ab.search(Question(queries=(query,), k=8, rescore=0, candidates=40)).to_arrow().to_pylist()
        assert [h["id"] for h in first] == [h["id"] for h in exact]
        np.testing.assert_allclose([h["score"] for h in first], [h["score"] for h in exact], rtol=1e-5)
    pair, single = plan_of_index(root / "ab"), plan_of_index(root / "a")
    assert pair.options.checkpoints == 2 and single.options.checkpoints == 1
    assert pair.per_example.bytes == 2 * single.per_example.bytes


def test_bad_checkpoint_weights_are_refused_naming_the_field(root, opened):
    ab = opened["ab"]
    for weights in [(1.0,), (1.0, 2.0, 3.0)]:
        with pytest.raises(ConfigError, match="2 checkpoint") as caught:
            ab.search(Question(queries=(QUERIES[0],), checkpoint_weights=weights)).to_arrow()
        assert caught.value.field == "checkpoint_weights"
    for weights in [(1.0, float("nan")), ("a", 1.0), (True, 1.0), (), "1,2"]:
        with pytest.raises(ConfigError) as caught:
            Question(queries=(QUERIES[0],), checkpoint_weights=weights)
        assert caught.value.field == "checkpoint_weights"
    refused = _run("query", root / "ab", "--text", QUERIES[0], "--checkpoint-weights", "1", ok=False)
    assert refused.exit_code != 0 and "checkpoint_weights has 1 weights" in refused.output
    answered = _run("query", root / "ab", "--text", QUERIES[0], "--checkpoint-weights", "1,0", "--json")
    top = json.loads(answered.stdout)[0]["results"][0]
    assert top["id"] in _scores(opened["a"], "rescore")


def test_explain_shows_each_checkpoints_share_and_they_sum_to_the_score(root, opened):
    ab = opened["ab"]
    ids = [hit["id"] for hit in ab.search(Question(queries=(QUERIES[0],), k=3)).to_arrow().to_pylist()][:3]
    for explanation in ab.explain_many(QUERIES[0], ids):
        shares = explanation.checkpoints
        assert len(shares) == 2 and list(shares)[1].startswith("1: ")
        assert math.isclose(sum(shares.values()), explanation.score, rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(
            sum(t.contribution for t in explanation.query_tokens), explanation.score, rel_tol=1e-2, abs_tol=1e-3
        )
    shown = _run("explain", root / "ab", "--text", QUERIES[0], "--id", ids[0], "--no-color")
    assert "checkpoints (weighted shares of the score)" in shown.stdout and "1: " in shown.stdout


def test_a_changed_checkpoint_is_refused_naming_it(root, tmp_path):
    index = tmp_path / "ab"
    shutil.copytree(root / "ab", index)
    changed = tmp_path / "b"
    make_tiny_gpt2(2).save_pretrained(changed)
    make_word_tokenizer().save_pretrained(changed)
    manifest = json.loads((index / "manifest.json").read_text())
    manifest["checkpoints"][1]["name"] = str(changed)  # the checkpoint at its path was retrained since
    (index / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleIndexError, match="checkpoint 1"):
        _open(index)
    # eogp verify hashes every checkpoint: the first is intact, the second's model differs
    verified = _run("verify", root / "ab", "--json")
    assert json.loads(verified.stdout)["ok"] and len(json.loads(verified.stdout)["checkpoints"]) == 1
    report = json.loads(_run("verify", index, "--json", ok=False).stdout)
    assert not report["ok"] and report["model"]["ok"] and report["projection"]["ok"]
    assert not report["checkpoints"][0]["model"]["ok"] and report["checkpoints"][0]["projection"]["ok"]
    assert "c1/model    DIFFERS" in _run("verify", index, ok=False).stdout


def test_checkpoints_of_another_architecture_or_tokenizer_are_refused_at_fit(root, tmp_path):
    make_tiny_llama(0).save_pretrained(tmp_path / "llama")
    make_word_tokenizer().save_pretrained(tmp_path / "llama")
    out = _run("fit", root / "model", tmp_path / "llama", "--data", root / "shard.jsonl", "--out", tmp_path / "x",
               *FIT, ok=False)  # fmt: skip
    assert out.exit_code != 0 and "llama" in out.output and "config differs" in out.output
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_tiny_gpt2(3).save_pretrained(tmp_path / "other")
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w0").save_pretrained(
        tmp_path / "other"
    )
    out = _run("fit", root / "model", tmp_path / "other", "--data", root / "shard.jsonl", "--out", tmp_path / "y",
               *FIT, ok=False)  # fmt: skip
    assert out.exit_code != 0 and "tokenizer's vocabulary" in out.output and "other" in out.output
    assert not (tmp_path / "x" / "manifest.json").exists() and not (tmp_path / "y" / "manifest.json").exists()


def test_checkpoint_weights_from_a_trainer_state(tmp_path):
    from eogp_index.errors import InputError
    from eogp_index.fit.fitting import checkpoint_weights_from

    state = tmp_path / "trainer_state.json"
    history = [{"step": 50, "learning_rate": 4e-4}, {"step": 100, "learning_rate": 3e-4}, {"step": 150, "loss": 1.0},
               {"step": 200, "learning_rate": 1e-4}]  # fmt: skip
    state.write_text(json.dumps({"global_step": 200, "log_history": history}))
    weights = checkpoint_weights_from(str(state), ["run/checkpoint-100", "run/checkpoint-200"])
    assert weights == pytest.approx([0.75, 0.25])
    assert checkpoint_weights_from("uniform", ["a", "b"]) is None
    (tmp_path / "w.json").write_text("[1, 2]")
    assert checkpoint_weights_from(str(tmp_path / "w.json"), ["a", "b"]) == [1.0, 2.0]
    with pytest.raises(InputError, match="w.json"):
        checkpoint_weights_from(str(tmp_path / "w.json"), ["a", "b", "c"])
    with pytest.raises(InputError, match="cannot tell the step of checkpoint run/final"):
        checkpoint_weights_from(str(state), ["run/final"])


def _data_files(index: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in (index / "examples.lance" / "data").rglob("*")}


_KILLED_ADD = """
import sys, time
from eogp_index.encode.checkpoints import add_checkpoint

def on_batch(done):
    print("batch", done, flush=True)
    time.sleep(600)  # the test kills the process here, with one batch computed

add_checkpoint(sys.argv[1], sys.argv[2], weight=float(sys.argv[3]), on_batch=on_batch)
"""


def test_add_checkpoint_equals_fitting_both_together_rewrites_no_column_and_completes_after_a_kill(
    root, opened, tmp_path
):
    index = tmp_path / "a"
    shutil.copytree(root / "a", index)
    before = _data_files(index)
    script = tmp_path / "killed_add.py"
    script.write_text(_KILLED_ADD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(index), str(root / "b"), str(WEIGHTS[1])],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}"),
    )
    output = []
    try:
        for line in child.stdout:
            output.append(line)
            if line.strip() == "batch 1":
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.wait(timeout=300)
    assert child.returncode == -signal.SIGKILL, "".join(output)[-3000:]
    assert "checkpoints" not in json.loads((index / "manifest.json").read_text())  # the manifest is written last
    assert (index / "checkpoints" / "1" / "checkpoint.json").exists()  # the fit is kept

    added = _run("add-checkpoint", index, root / "b", "--weight", WEIGHTS[1], "--json")
    report = json.loads(added.stdout)
    assert report["checkpoint"] == 1 and report["rows"] == 40 and report["weights"] == [1.0, WEIGHTS[1]]
    after = _data_files(index)
    assert all(after.get(path) == stamp for path, stamp in before.items())  # checkpoint 0's files as they were
    assert len(after) > len(before)  # its columns in new files
    grown = _open(index)
    for precision in ("1bit", "rescore"):
        _close(_scores(grown, precision), _scores(opened["ab"], precision, checkpoint_weights=(1.0, WEIGHTS[1])))


# -- two torchrun workers (gloo) against one process ----------------------------------------------
@pytest.mark.distributed
def test_an_ensemble_fitted_by_two_torchrun_workers_equals_a_one_process_fit(tmp_path):
    """`eogp fit A B` under torchrun: each checkpoint's first stage and PCA are split between the
    ranks (as one checkpoint's are), and every checkpoint's projection and the manifest equal a
    one-process fit's."""
    import torch
    from safetensors.torch import load_file

    save_workspace(tmp_path, make_tiny_gpt2(0), 48)
    make_tiny_gpt2(1).save_pretrained(tmp_path / "b")
    make_word_tokenizer().save_pretrained(tmp_path / "b")
    args = ["fit", tmp_path / "model", tmp_path / "b", "--fit-data", tmp_path / "shard.jsonl", "-k", "8",
            "--curvature-examples", "16", "--pca-examples", "24", "--batch-size", "4", "--device", "cpu"]  # fmt: skip
    args = [str(a) for a in args]
    # torchrun gives each worker one thread; the reference gets one too (the same float operations)
    two = run_torchrun_eogp(*args, "--out", str(tmp_path / "two"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(*args, "--out", tmp_path / "one")
    finally:
        torch.set_num_threads(threads)
    for rank in (0, 1):  # once per checkpoint
        assert two.stderr.count(f"[rank {rank}] rank {rank}: PCA of 4 of the 8 modules left") == 2, two.stderr[-4000:]
    one, both = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("one", "two"))
    assert both == one and len(both["checkpoints"]) == 2
    for file in ("projection.safetensors", "checkpoints/1/projection.safetensors"):
        expected, got = load_file(str(tmp_path / "one" / file)), load_file(str(tmp_path / "two" / file))
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.allclose(got[name].double(), tensor.double(), rtol=1e-5, atol=1e-7), (file, name)
