"""Shared fixtures. The helpers they use live in tests/tinymodels.py."""

from __future__ import annotations

import gc
import os

# numpy's and scipy's OpenBLAS start one thread per core; on a busy 2-core machine each small
# product then waits for a descheduled thread, far slower than one thread. Set before numpy
# loads OpenBLAS (it reads the variable only then), and inherited by the suite's child processes.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2  # noqa: E402

# The tokenizer and shard writers of the record, reader and ingest tests.
pytest_plugins = ["shards"]


def pytest_collection_finish(session):
    """Freeze what collection left alive (torch, transformers, every test module's constants):
    kronfluence calls gc.collect() several times per fit, and each call would otherwise walk
    those objects again. What the tests create is collected as usual."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def tiny_tokenizer():
    return TinyTokenizer()


@pytest.fixture(scope="session")
def fitted_index_template(tmp_path_factory):
    """A real index (tiny GPT-2, EOGP k=16, 1 bit, no rescoring tier: the one-bit scan's answers)
    with 40 examples, built once per session."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig

    path = tmp_path_factory.mktemp("template") / "index"
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        make_examples(40, seed=11),
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=40, batch_size=8),
        storage=StorageConfig(rescore="none"),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    # Several commits, so the table has several fragments.
    for start in range(0, 40, 10):
        index.add_batch(make_examples(40, seed=11)[start : start + 10])
    return path


@pytest.fixture
def fitted_index(fitted_index_template, tmp_path):
    """A private copy of the session's fitted index, opened."""
    import shutil

    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    path = tmp_path / "index"
    shutil.copytree(fitted_index_template, path)
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )
