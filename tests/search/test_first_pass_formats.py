"""First passes written by earlier versions: refused with the command that rebuilds them, and answering once rebuilt.

tests/fixtures/first-pass-v1/ holds a small real index with one first pass of each kind of the
time, built by the code of commit 24df466 (tests/fixtures/make_first_pass_v1.py says how), and
what that code's candidate path answered: every row it scored, with its exact score, per kind,
query, side, budget C and filter. Its flat pass ranks by Hamming distance (format eogp-faiss 2)
and its ivf, hnsw and clustered kinds are retired: today's code must refuse each file with the
rebuild command, without touching it, and the rebuilt pass must answer the same rows when every
row is a candidate.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from eogp_index.errors import IncompatibleIndexError
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
def test_a_first_pass_written_before_is_refused_with_the_command_that_rebuilds_it(stored, name):
    """flat's Hamming files (format eogp-faiss 2) and the retired kinds' files cannot answer as
    today's flat pass does: opening or querying one says why, and how to rebuild it, reading only."""
    why = r"version 2\b.*Hamming" if name == "flat" else f"kind '{name}', which is retired"
    rebuild = f"eogp build-candidates {stored.path} --kind flat --name {name}"
    with pytest.raises(IncompatibleIndexError, match=why) as raised:
        first_pass.load(stored.path, name)
    assert rebuild in str(raised.value)
    y = np.load(DATA / "queries.npy")
    with pytest.raises(IncompatibleIndexError, match=why):
        first_pass.candidate_top_k(stored, y[:1], 5, 20, ["positive", "negative"], name=name)
    assert json.loads((stored.path / "faiss" / f"{name}.json").read_text()) == json.loads(
        (DATA / "index" / "faiss" / f"{name}.json").read_text()
    )


def test_a_rebuilt_first_pass_answers_every_row_exactly(stored):
    """Rebuilt as the message says, the first pass answers; with every row a candidate, exactly
    the rows and scores the fixture's first passes answered then."""
    y = np.load(DATA / "queries.npy")
    first_pass.build(stored, "rebuilt", first_pass.FlatConfig(), progress=False)
    n = stored.count()
    answers = [a for a in ANSWERS if a["name"] == "flat" and a["C"] >= n]
    assert answers
    for answer in answers:
        found = first_pass.candidate_top_k(
            stored, y[answer["query"] : answer["query"] + 1], 5, answer["C"], ["positive", "negative"],
            where=answer["where"], name="rebuilt",
        )  # fmt: skip
        for side, expected in answer["sides"].items():
            rowaddr, scores, _ = found[side]
            assert sorted(rowaddr.tolist()) == sorted(expected["rowaddr"]), (answer["query"], side)
            order = np.argsort(rowaddr)
            expected_order = np.argsort(expected["rowaddr"])
            np.testing.assert_allclose(
                scores[order], np.array(expected["scores"], np.float32)[expected_order], rtol=1e-6
            )
