"""First passes written before they became kinds of eogp_index.search.first_pass still open and answer the same.

tests/fixtures/first-pass-v1/ holds a small real index with one first pass of each kind, built by
the code of commit 24df466 (tests/fixtures/make_first_pass_v1.py says how), and what that code's
candidate path answered: every row it scored, with its exact score, per kind, query, side,
budget C and filter. Today's code must open the same files and answer exactly the same rows.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from eogp_index.search import first_pass
from eogp_index.store.stored_index import StoredIndex

pytest.importorskip("faiss")

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "first-pass-v1"
ANSWERS = json.loads((DATA / "answers.json").read_text())


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A copy of the fixture (opening writes the hot copy), opened without a model."""
    path = tmp_path_factory.mktemp("v1") / "index"
    shutil.copytree(DATA / "index", path)
    first_pass.clear_cache()
    return StoredIndex.open(path)


def test_the_fixture_holds_every_kind_of_the_time():
    assert sorted({a["name"] for a in ANSWERS}) == ["clustered", "flat", "hnsw", "ivf"]


@pytest.mark.parametrize("name", ["flat", "ivf", "hnsw", "clustered"])
def test_a_first_pass_written_before_opens_with_its_parameters(stored, name):
    saved = json.loads((DATA / "index" / "faiss" / f"{name}.json").read_text())
    opened = first_pass.load(stored.path, name)
    assert opened.kind == saved["kind"] == name and opened.ntotal == stored.count() == saved["rows"]
    assert opened.table_version == saved["table_version"] == stored.store.version  # no refresh needed
    assert opened.build_params == {
        **({"replicas": saved["replicas"]} if "replicas" in saved else {}),
        **saved["params"],
    }


@pytest.mark.parametrize("name", ["flat", "ivf", "hnsw", "clustered"])
def test_it_answers_the_same_rows_with_the_same_scores(stored, name):
    y = np.load(DATA / "queries.npy")
    answers = [a for a in ANSWERS if a["name"] == name]
    assert len(answers) == 12
    for answer in answers:
        found = first_pass.candidate_top_k(
            stored,
            y[answer["query"] : answer["query"] + 1],
            5,
            answer["C"],
            ["positive", "negative"],
            where=answer["where"],
            name=name,
        )
        for side, expected in answer["sides"].items():
            rowaddr, scores, _ = found[side]
            assert rowaddr.tolist() == expected["rowaddr"], (name, answer["query"], answer["C"], side)
            np.testing.assert_allclose(scores, np.array(expected["scores"], np.float32), rtol=1e-6)
    # The files were only read: nothing was rebuilt or extended.
    assert json.loads((stored.path / "faiss" / f"{name}.json").read_text()) == json.loads(
        (DATA / "index" / "faiss" / f"{name}.json").read_text()
    )
