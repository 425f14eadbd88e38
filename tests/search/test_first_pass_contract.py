"""The contract every first-pass kind keeps, run against each registered kind (a new kind is covered by registering it).

On a real LanceDB index of tiny GPT-2 codes, each kind is built with its default configuration
and must: reopen from disk as itself; answer every side with exact scores, within its budget; give
the exact answer when the budget covers every row; apply filters; follow ingests; and refuse an
index whose codes it was not built from.
"""

import copy
import dataclasses
import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError
from eogp_index.search import first_pass

pytest.importorskip("faiss")

KINDS = first_pass.kinds()
QUERY = make_examples(1, seed=13, prefix="q", masked_prompt=True)[0]
QUERY = {"input_ids": list(QUERY.input_ids), "labels": list(QUERY.labels)}
MORE = make_examples(5, seed=12, prefix="more")
WHERE = "`group` = 1"
#: Search parameters at which a kind reaches every row when its budget covers them all. A kind
#: whose search parameter limits what it can reach (lists probed, a graph's beam) adds it here.
GENEROUS: dict = {}


@dataclasses.dataclass(frozen=True)
class NoKindsConfig(first_pass.FirstPassConfig):
    """A configuration no kind registered: every kind refuses to open with it."""


def _open(path):
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


@pytest.fixture(scope="module")
def index(fitted_index_template, tmp_path_factory):
    """The session's 40-row index, with one first pass of every kind named after its kind."""
    path = tmp_path_factory.mktemp("contract") / "index"
    shutil.copytree(fitted_index_template, path)
    index = _open(path)
    for kind in KINDS:
        first_pass.build(index, kind, first_pass.kind_class(kind).Config(), progress=False)
    return index


def _generous(index, kind):
    opened = first_pass.open_first_pass(index, kind)
    opened.set_search(**GENEROUS)
    return opened


def _exact(index, k, direction, where=None):
    return index.search(QUERY).limit(k).where(where).direction(direction).to_arrow().to_pylist()


def _candidates(index, kind, k, C, direction, where=None):
    return index.search(QUERY).limit(k).where(where).direction(direction).candidates(C, faiss_name=kind)


def test_the_registry_holds_each_kind_once_with_its_own_frozen_config():
    assert len(KINDS) == len(set(KINDS)) >= 1 and first_pass.DEFAULT_KIND in KINDS
    for kind in KINDS:
        cls = first_pass.kind_class(kind)
        config = first_pass.make_config(kind)
        assert cls.kind == kind and issubclass(cls, first_pass.FirstPass) and config == cls.Config()
        assert first_pass.class_for(config) is cls
        assert all("search" in f.metadata and f.metadata.get("help") for f in dataclasses.fields(config))
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, getattr(config, field))
    with pytest.raises(ConfigError, match="unknown first-pass kind"):
        first_pass.kind_class("lsh")
    with pytest.raises(ConfigError, match="no parameter"):
        first_pass.make_config(KINDS[0], no_such_parameter=1)
    for retired in first_pass.RETIRED_KINDS:
        assert retired not in KINDS
        with pytest.raises(ConfigError, match=f"{retired!r} first pass is retired.*--kind {first_pass.DEFAULT_KIND}"):
            first_pass.make_config(retired)


@pytest.mark.parametrize("kind", KINDS)
def test_it_reopens_from_disk_as_itself_and_answers_alike(index, kind):
    built = first_pass.open_first_pass(index, kind)
    reopened = first_pass.load(index.path, kind)
    assert type(reopened) is first_pass.kind_class(kind) and reopened.kind == kind
    assert reopened.ntotal == built.ntotal == index.store.count()
    assert reopened.table_version == index.store.version and reopened.build_params == built.build_params
    assert type(reopened.config) is reopened.Config
    y = index.query_coordinates([QUERY])
    for C in (8, index.store.count()):
        ours = built.top_k(index.stored, y, 4, C, ["positive", "negative"])
        theirs = reopened.top_k(index.stored, y, 4, C, ["positive", "negative"])
        for side in ours:
            np.testing.assert_array_equal(ours[side][0], theirs[side][0])
            np.testing.assert_array_equal(ours[side][1], theirs[side][1])
    with pytest.raises(ConfigError, match=f"pass a {first_pass.kind_class(kind).Config.__name__}"):
        first_pass.load(index.path, kind, config=NoKindsConfig())


@pytest.mark.parametrize("kind", KINDS)
def test_a_budget_of_every_row_gives_the_exact_answer(index, kind):
    _generous(index, kind)
    n = index.store.count()
    for direction in ("positive", "negative", "both"):
        assert _candidates(index, kind, 5, n, direction).to_arrow().to_pylist() == _exact(index, 5, direction)


@pytest.mark.parametrize("kind", KINDS)
def test_a_small_budget_scores_exactly_and_stays_within_it(index, kind):
    ids, scores = index.scores([QUERY])
    exact = dict(zip(ids, scores[0]))
    address = dict(zip(index.hot_codes().rowaddr.tolist(), index.hot_codes().columns.column("id").to_pylist()))
    y = index.query_coordinates([QUERY])
    C = 10
    for side in ("positive", "negative"):
        rowaddr, found, scored = first_pass.open_first_pass(index, kind).top_k(index.stored, y, 4, C, [side])[side]
        assert 4 <= len(rowaddr) <= scored <= C and len(set(rowaddr.tolist())) == len(rowaddr)
        np.testing.assert_allclose(found, [exact[address[a]] for a in rowaddr.tolist()], rtol=1e-5, atol=1e-6)
        got = _candidates(index, kind, 4, C, side).to_arrow()
        assert got.num_rows == 4
        np.testing.assert_allclose(
            got.column("score").to_numpy(), [exact[i] for i in got.column("id").to_pylist()], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("kind", KINDS)
def test_filters_apply_to_the_candidates(index, kind):
    _generous(index, kind)
    n = index.store.count()
    matching = index.store.count(WHERE)
    assert 4 < matching < n
    for direction in ("positive", "negative"):
        assert _candidates(index, kind, 4, n, direction, WHERE).to_arrow().to_pylist() == _exact(
            index, 4, direction, WHERE
        )
        assert _candidates(index, kind, 4, matching, direction, WHERE).to_arrow().to_pylist() == _exact(
            index, 4, direction, WHERE
        )  # the filter fits the budget: every matching row
        small = _candidates(index, kind, 4, 8, direction, WHERE).to_arrow()
        assert set(small.column("group").to_pylist()) <= {1}


@pytest.mark.parametrize("kind", KINDS)
def test_it_follows_ingests_and_a_reopen(index, kind, tmp_path):
    path = tmp_path / "grown"
    shutil.copytree(index.path, path)
    grown = _open(path)
    assert grown.ingest(MORE, progress=False) == len(MORE)
    n = grown.store.count()
    _generous(grown, kind)
    got = _candidates(grown, kind, n, n, "both").to_arrow().to_pylist()
    assert got == _exact(grown, n, "both") and {ex.id for ex in MORE} <= {row["id"] for row in got}
    reopened = first_pass.load(path, kind)
    assert reopened.ntotal == n and reopened.table_version == grown.store.version


@pytest.mark.parametrize("kind", KINDS)
def test_it_refuses_an_index_it_was_not_built_from(index, kind):
    other = copy.copy(index)
    other.stored = copy.copy(index.stored)
    other.stored.manifest = dataclasses.replace(
        index.manifest, projection={**index.manifest.projection, "sha256": "0" * 64}
    )
    with pytest.raises(IncompatibleIndexError, match=r"projection sha256.*build-candidates .* --kind " + kind):
        first_pass.load(index.path, kind).check_compatible(other.stored)
    with pytest.raises(IncompatibleIndexError, match="projection sha256"):
        _candidates(other, kind, 3, 10, "positive").to_arrow()
    fp16 = copy.copy(index)
    fp16.stored = copy.copy(index.stored)
    fp16.stored.manifest = dataclasses.replace(index.manifest, precision="fp16")
    with pytest.raises(IncompatibleIndexError, match="precision 'fp16'"):
        first_pass.build(fp16, "nope", first_pass.make_config(kind), progress=False)


def test_a_missing_first_pass_says_how_to_build_one(index):
    with pytest.raises(IndexNotFoundError, match="eogp build-candidates"):
        _candidates(index, "missing", 3, 10, "positive").to_arrow()
