"""A shard's first pass (what a shard actor of `eogp serve --ray` holds for the candidates route),
without Ray: built over the shard's rows only, of the saved first pass's kind and parameters,
kept while the shard's fragments stay, rebuilt when they change, refused when the index has none
or when it was made from other codes."""

from __future__ import annotations

import numpy as np
import pytest
from tinymodels import make_examples, tiny_index

from eogp_index.cluster.shards import ShardIndex, _fragments
from eogp_index.errors import IncompatibleIndexError, IndexNotFoundError
from eogp_index.search import first_pass
from eogp_index.search.ranking import Hits

pytestmark = pytest.mark.cluster
SIDES = ("positive", "negative")


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """The tiny GPT-2's index, 24 rows in 3 fragments, with its first pass, and 4 projected queries."""
    path = tmp_path_factory.mktemp("shard-first-pass") / "index"
    created = tiny_index(path, make_examples(24, seed=3), (0, 8, 16))
    first_pass.build(created, progress=False)
    queries = [{"input_ids": [3, 9, 14, 2, 7, 11]}, {"input_ids": [5, 5, 21, 8, 1, 30, 2]}, {"input_ids": [4, 4, 4]}]
    return created, created.query_coordinates(queries)


def _shard(index, fragment_ids) -> ShardIndex:
    shard = ShardIndex.open(index.stored.path)
    version, _ = _fragments(shard)
    shard.assign(version, fragment_ids)
    return shard


def test_a_shards_first_pass_covers_its_rows_and_answers_as_the_exact_scan_at_full_budget(index):
    created, y = index
    shard = _shard(created, [0, 2])
    built = shard.first_pass("default")
    hot = shard.hot_codes()
    assert built.ntotal == hot.num_rows == 16 and built.kind == "flat"
    saved = first_pass.load(created.stored.path)
    assert built.build_params == saved.build_params and built is not saved
    assert sorted(built.ids_at(np.arange(built.ntotal)).tolist()) == sorted(hot.columns.column("id").to_pylist())
    from eogp_index.search.searchers import HotSearcher

    exact = HotSearcher(shard).top_k(y, 5, SIDES)
    found = shard.candidates_top_k(y, 5, hot.num_rows, SIDES, None, "default")
    for got, want in zip(found, exact):
        for side in SIDES:
            np.testing.assert_array_equal(got[side].rowaddr, want[side].rowaddr)
            np.testing.assert_allclose(got[side].scores, want[side].scores, rtol=1e-6)
    # Fewer candidates: rows of the shard only, their exact scores.
    every = HotSearcher(shard).scores(y)
    for q, by_side in enumerate(shard.candidates_top_k(y, 3, 4, SIDES, "`group` = 1", "default")):
        for hits in by_side.values():
            assert isinstance(hits, Hits) and hits.rowaddr.size <= 3
            at = np.searchsorted(every[0], hits.rowaddr)
            np.testing.assert_array_equal(every[0][at], hits.rowaddr)
            np.testing.assert_allclose(hits.scores, every[1][q][at], rtol=1e-6)
            assert set(hits.rowaddr.tolist()) <= set(shard.hot_codes().rowaddr.tolist())


def test_it_is_kept_while_the_fragments_stay_and_rebuilt_when_they_change(index):
    created, _ = index
    shard = _shard(created, [1])
    built = shard.first_pass("default")
    assert shard.first_pass("default") is built and shard.first_pass_rows() == {"default": 8}
    version, _ = _fragments(shard)
    shard.assign(version, [0, 1])  # another fragment: rebuilt over the 16 rows it holds now
    assert shard.first_pass_rows() == {}
    rebuilt = shard.first_pass("default")
    assert rebuilt is not built and rebuilt.ntotal == 16


def test_it_needs_the_saved_first_pass_of_these_codes(index, tmp_path):
    import json
    import shutil

    created, _ = index
    shard = _shard(created, [0])
    with pytest.raises(IndexNotFoundError, match="eogp build-candidates"):
        shard.first_pass("absent")
    folder = created.stored.path / "faiss"
    meta = json.loads((folder / "default.json").read_text())
    for suffix in (".faissindex", ".ids.parquet"):
        shutil.copy(folder / f"default{suffix}", folder / f"other{suffix}")
    (folder / "other.json").write_text(json.dumps({**meta, "name": "other", "projection_sha256": "0" * 64}))
    with pytest.raises(IncompatibleIndexError, match="projection sha256"):
        shard.first_pass("other")
