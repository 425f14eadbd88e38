"""The bounded, resumable, distributed fit (eogp_index.fit): fitting sets, the on-disk stages,
a SIGKILLed fit resumed, label sampling seeded per batch on the right device, and two torchrun
workers against one process. Real tiny GPT-2s, real kronfluence, real files and processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2, make_word_tokenizer
from torchrun import run_torchrun_eogp

from eogp_index.cli import cli
from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.errors import ConfigError
from eogp_index.fit.cache import FIT_DIR, FitFolder
from eogp_index.fit.sampling import OverlappingFitSetsWarning, reservoir_sample, split_fit_sets
from eogp_index.fit.task import LanguageModelingTask, batch_seed
from eogp_index.gradients.loss import collate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = make_examples(48, seed=3)
# 16 curvature + 24 PCA examples out of 48: disjoint sets; 3 PCA batches of 8; 8 modules.
SETTINGS = dict(
    projection=ProjectionConfig(k=8, m=48, num_fit_examples=24),
    curvature=CurvatureConfig(num_examples=16, batch_size=8),
    gradients=GradientConfig(batch_size=8),
)


def create(path, **kwargs):
    options = {**SETTINGS, **kwargs}
    return AttributionIndex.create(
        path, make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, model_name="tiny", progress=False, **options
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted fit: its projection file's tensors."""
    path = tmp_path_factory.mktemp("reference") / "index"
    create(path)
    return load_file(str(path / "projection.safetensors"))


def assert_same_projection(path: Path, expected) -> None:
    got = load_file(str(path / "projection.safetensors"))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


# -- fitting sets ---------------------------------------------------------------------------------
def test_reservoir_sample_is_seeded_uniform_and_in_stream_order():
    stream = (i for i in range(1000))  # a one-pass iterator
    sample = reservoir_sample(stream, 10, seed=4)
    assert len(sample) == 10 and sample == sorted(sample) and len(set(sample)) == 10
    assert reservoir_sample(range(1000), 10, seed=4) == sample
    assert reservoir_sample(range(1000), 10, seed=5) != sample
    assert reservoir_sample(range(3), 10, seed=4) == [0, 1, 2]
    counts = [0] * 20
    for seed in range(2000):
        for item in reservoir_sample(range(20), 5, seed):
            counts[item] += 1
    # Each item is kept with probability 1/4: 500 of 2000 (binomial sd ≈ 19; ±150 is ~8 sd).
    assert all(350 < c < 650 for c in counts), counts


def test_fit_sets_are_disjoint_unless_too_few_and_then_the_warning_says_so():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sets = split_fit_sets(EXAMPLES, 16, 24, curvature_seed=0, pca_seed=0)
    assert sets.disjoint and len(sets.curvature) == 16 and len(sets.pca) == 24
    assert not {e.id for e in sets.curvature} & {e.id for e in sets.pca}
    assert split_fit_sets(EXAMPLES, 16, 24, curvature_seed=0, pca_seed=0) == sets  # seeded
    with pytest.warns(OverlappingFitSetsWarning, match=r"only 48 fitting examples.*overlap"):
        small = split_fit_sets(EXAMPLES, 40, 30, curvature_seed=0, pca_seed=0)
    assert not small.disjoint and len(small.curvature) == 40 and len(small.pca) == 30


def test_cli_samples_the_fitting_set_across_all_shards(tmp_path):
    from eogp_index.data.records import RecordSpec
    from eogp_index.fit.sampling import sample_shards

    for k in range(3):
        (tmp_path / f"part-{k}.jsonl").write_text(
            "".join(json.dumps({"text": f"t{k + 1} t{j % 60 + 1} t5"}) + "\n" for j in range(20))
        )
    examples, seen = sample_shards([str(tmp_path / "*.jsonl")], RecordSpec(), make_word_tokenizer(), 12, seed=1)
    assert seen == 60 and len(examples) == 12
    assert {e.shard for e in examples} == {"part-0.jsonl", "part-1.jsonl", "part-2.jsonl"}  # not the first 12
    again, _ = sample_shards([str(tmp_path / "*.jsonl")], RecordSpec(), make_word_tokenizer(), 12, seed=1)
    assert [e.id for e in again] == [e.id for e in examples]


# -- label sampling (bug 4) -----------------------------------------------------------------------
def _batch(examples):
    return collate([(e.input_ids, e.labels) for e in examples], 0)


def test_sampled_labels_depend_on_the_batch_not_on_the_batches_before():
    """A resumed fit samples what an uninterrupted one does: a batch's draw is its own."""
    model = make_tiny_gpt2()
    first, second = _batch(EXAMPLES[:4]), _batch(EXAMPLES[4:8])
    alone = LanguageModelingTask(seed=1).compute_train_loss(second, model, sample=True)
    task = LanguageModelingTask(seed=1)
    task.compute_train_loss(first, model, sample=True)
    after = task.compute_train_loss(second, model, sample=True)
    assert torch.equal(alone, after)
    other_seed = LanguageModelingTask(seed=2).compute_train_loss(second, model, sample=True)
    assert not torch.equal(alone, other_seed)  # the draw does depend on the stage's seed
    assert batch_seed(1, first) != batch_seed(1, second)


def test_the_sampler_makes_its_generator_on_the_probabilities_device(monkeypatch):
    """torch.multinomial refuses a CPU generator for CUDA probabilities: the generator must be
    made where the probabilities are, at sampling time (a GPU run is the full check)."""
    import eogp_index.fit.task as task_module

    seen = []
    real_multinomial = torch.multinomial

    def multinomial(probs, num_samples, *, generator=None):
        seen.append((generator.device if generator is not None else None, probs.device))
        return real_multinomial(probs, num_samples, generator=generator)

    made = []
    real_generator = torch.Generator

    def generator(device="cpu"):
        made.append(torch.device(device))
        return real_generator(device=device)

    monkeypatch.setattr(task_module.torch, "multinomial", multinomial)
    monkeypatch.setattr(task_module.torch, "Generator", generator)
    LanguageModelingTask(seed=0).compute_train_loss(_batch(EXAMPLES[:2]), make_tiny_gpt2(), sample=True)
    assert seen and all(g == p for g, p in seen)
    assert made == [p for _, p in seen]  # one generator per draw, made on the probabilities' device


def test_kronfluence_runs_with_the_chosen_cuda_device_current(monkeypatch):
    """Bug 6: kronfluence puts the model on the *current* CUDA device; --device cuda:1 must make
    cuda:1 current while it runs, and restore the previous one (a GPU run is the full check)."""
    from eogp_index.fit import curvature

    calls = []
    monkeypatch.setattr(curvature.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(curvature.torch.cuda, "set_device", lambda device: calls.append(str(device)))
    with curvature.kronfluence_device("cuda:1"):
        assert calls == ["cuda:1"]
    assert calls == ["cuda:1", "0"]
    with curvature.kronfluence_device("cpu"):
        pass
    assert calls == ["cuda:1", "0"]


# -- the stages on disk ---------------------------------------------------------------------------
def test_fit_caches_float16_coordinates_per_batch_and_cleans_up(tmp_path, monkeypatch, reference):
    """The cache holds each module's first-stage coordinates (float16) and P is fitted from it."""
    from eogp_index.fit.cache import FitFolder as Folder
    from eogp_index.gradients.capture import GradientCapture, project_examples

    kept = {}
    real_finish = Folder.finish

    def keep_then_finish(self):
        kept.update({name: self.read_module(name, 3) for name in self.record["settings"]["modules"]})
        real_finish(self)

    monkeypatch.setattr(Folder, "finish", keep_then_finish)
    index = create(tmp_path / "index")
    assert_same_projection(tmp_path / "index", reference)
    sets = split_fit_sets(EXAMPLES, 16, 24, curvature_seed=0, pca_seed=0)
    capture = GradientCapture(index.model, index.manifest.module_names, index.projection.first_stage_transform)
    direct = project_examples(capture, sets.pca, batch_size=8, pad_token_id=0, device="cpu")
    for name, z in direct.items():
        assert kept[name].dtype == torch.float16 and kept[name].shape == z.shape == (24, 48)
        assert torch.allclose(kept[name].float(), z, rtol=1e-3, atol=1e-4 * z.abs().max()), name  # fp16 rounding
    fit_dir = tmp_path / "index" / FIT_DIR
    assert sorted(p.name for p in fit_dir.iterdir()) == ["fitting_set.json"]  # caches gone after the index is written
    record = json.loads((fit_dir / "fitting_set.json").read_text())
    assert [e[0] for e in record["pca"]] == [e.id for e in sets.pca] and record["disjoint"] is True
    assert index.manifest.curvature["disjoint_from_pca"] is True


KILLED_FIT = textwrap.dedent("""
    import sys, time
    import torch
    # The parent's thread count: reductions (kronfluence's eigendecomposition) must run as the
    # reference fit's did for the resumed projection to be bit-identical.
    torch.set_num_threads(int(sys.argv[3]))
    sys.path[:0] = ["tests", "tests/fit"]
    from test_fit import create
    from eogp_index.fit.cache import FitFolder

    stage = sys.argv[2]
    method = "write_batch" if stage == "coords" else "write_module"
    real = getattr(FitFolder, method)

    def slow(self, *args):
        real(self, *args)
        print(f"wrote {stage}", flush=True)
        time.sleep(30)  # the parent kills us here, with one file of this stage complete

    setattr(FitFolder, method, slow)
    create(sys.argv[1])
""")


@pytest.mark.parametrize("stage", ["coords", "pca"])
def test_fit_killed_mid_stage_resumes_to_the_same_projection(tmp_path, reference, caplog, stage):
    path = tmp_path / "index"
    script = tmp_path / "killed_fit.py"
    script.write_text(KILLED_FIT)
    child = subprocess.Popen(
        [sys.executable, str(script), str(path), stage, str(torch.get_num_threads())],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []
    try:
        for line in child.stdout:  # blocks until the child has written one file of the stage
            output.append(line)
            if line.startswith(f"wrote {stage}"):
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL, "".join(output)[-3000:]
    assert not (path / "manifest.json").exists()
    folder_files = {
        "coords": list((path / FIT_DIR / "coords").glob("batch-*.safetensors")),
        "pca": list((path / FIT_DIR / "pca").glob("module-*.npy")),
    }
    assert len(folder_files[stage]) == 1  # killed with one of 3 batches / 8 modules written

    with caplog.at_level(logging.INFO, logger="eogp_index.fit"):
        create(path)  # the same call again: resumes
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "resuming the interrupted fit" in message and "reusing the curvature factors" in message
    reused = {"coords": ["1 of 3 batches", "0 of 8 fitted modules"], "pca": ["3 of 3 batches", "1 of 8 fitted modules"]}
    assert all(part in message for part in reused[stage]), message
    assert_same_projection(path, reference)


def test_an_interrupted_fit_with_other_settings_is_refused_and_overwrite_starts_over(tmp_path, reference):
    path = tmp_path / "index"
    sets = split_fit_sets(EXAMPLES, 16, 24, curvature_seed=0, pca_seed=0)
    FitFolder(path, {"made": "elsewhere"}, sets.curvature, sets.pca, disjoint=True).begin()
    with pytest.raises(ConfigError, match=r"interrupted fit with other settings.*settings\.made.*--overwrite"):
        create(path)
    create(path, mode="overwrite")
    assert_same_projection(path, reference)
    with pytest.raises(ConfigError, match="already holds an index"):
        create(path)


# -- two torchrun workers (gloo) against one process ----------------------------------------------
@pytest.mark.distributed
def test_two_process_fit_splits_the_work_and_equals_a_one_process_fit(tmp_path):
    model_dir = tmp_path / "model"
    make_tiny_gpt2().save_pretrained(model_dir)
    make_word_tokenizer().save_pretrained(model_dir)
    shard = tmp_path / "fit.jsonl"
    shard.write_text(
        "".join(
            json.dumps({"text": " ".join(f"t{(i * 7 + j) % 63 + 1}" for j in range(6 + i % 9))}) + "\n"
            for i in range(48)
        )
    )
    args = [
        "fit",
        str(model_dir),
        "--fit-data",
        str(shard),
        "-k",
        "8",
        "--curvature-examples",
        "16",
        "--pca-examples",
        "24",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--json",
    ]
    # torchrun gives each worker one thread; the reference gets one too, so that both run the
    # same float operations (the batches are computed identically whichever rank has them).
    two = run_torchrun_eogp(*args, "--out", str(tmp_path / "two"), env={**os.environ, "OMP_NUM_THREADS": "1"})
    # The one-process fit runs the same CLI in this process (no second start-up), on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "one")])
    finally:
        torch.set_num_threads(threads)
    assert one.exit_code == 0, one.output[-4000:]
    # The work was split: 6 batches and 8 modules, half each; curvature on rank 0 (CPU).
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: first-stage coordinates of 3 of the 6 batches left" in two.stderr
        assert f"[rank {rank}] rank {rank}: PCA of 4 of the 8 modules left" in two.stderr
    assert "rank 0 fits the curvature" in two.stderr
    expected = load_file(str(tmp_path / "one" / "projection.safetensors"))
    got = load_file(str(tmp_path / "two" / "projection.safetensors"))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        # Curvature ran in one process in both; every batch and every module's PCA ran the
        # same operations on the same inputs. The tolerance allows for a summation order
        # changed by the BLAS blocking, never seen here (the tensors come out bit-identical).
        assert torch.allclose(got[name].double(), tensor.double(), rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("n, m", [(12, 40), (40, 12)])  # the Gram route (n < m) and the covariance route
def test_fit_pca_upcasts_the_fp16_cache_in_blocks_with_the_same_result(monkeypatch, n, m):
    """fit_pca never makes a float64 copy of a whole module's cache: it upcasts column (Gram) or
    row (covariance) blocks of at most _UPCAST_BYTES. Many small blocks give the one-block result,
    up to float64 summation order, and the same subspace."""
    from eogp_index.fit import projection as projection_module

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(n, m, generator=gen).half()
    whole = projection_module.fit_pca(z, 6).double()
    monkeypatch.setattr(projection_module, "_UPCAST_BYTES", 8 * max(n, m) * 3)  # 3 columns/rows a block
    blocked = projection_module.fit_pca(z, 6).double()
    assert blocked.shape == whole.shape == (m, 6)
    # Directions are defined up to sign: compare the projectors onto the fitted subspace.
    torch.testing.assert_close(blocked @ blocked.T, whole @ whole.T, rtol=0, atol=1e-5)
