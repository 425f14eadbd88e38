"""Rescoring a batch of queries on a real index (tiny GPT-2, LanceDB on disk): each tier row is read
once however many queries and sides rescore it, the answers are each query's own, and the bytes
Lance reads from the tier stay within ``N`` rows of it per side."""

from __future__ import annotations

import numpy as np
import pytest
from tinymodels import make_examples, tiny_index

from eogp_index.client import AttributionIndex
from eogp_index.search import rescore
from eogp_index.search.rescore import rescored, tier_coordinates
from eogp_index.search.searchers import HotSearcher

ROWS = 48
QUERIES = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8], [5, 9, 2, 6, 5, 3, 1]]
SIDES = ("positive", "negative")


def _index(path, code: str = "int8") -> AttributionIndex:
    """An index with a ``code`` tier, 48 rows in four commits (four fragments)."""
    return tiny_index(path, make_examples(ROWS, seed=21), range(0, ROWS, 12), curvature_examples=ROWS, rescore=code)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """An index with the default tier (int8)."""
    return _index(tmp_path_factory.mktemp("tier_batch") / "index")


def _reference(index, hits, y_q, normalize: str = "none") -> np.ndarray:
    """The tier's score of each hit: its decoded coordinates times the query, summed in float64."""
    x = tier_coordinates(index.stored, hits.rowaddr).astype(np.float64)
    if normalize == "unit":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return (x @ y_q.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("take_bytes", [None, 200])
def test_a_batch_reads_each_row_once_and_answers_each_query_as_alone(tiered, monkeypatch, take_bytes):
    """Queries that share rows (one twice; both sides of each over half the table): the batch's
    answer is each query's own, bit for bit, its scores the tier's; Lance reads the distinct rows'
    tier bytes (in one take, or in takes of a few rows, the next read while one is scored)."""
    if take_bytes is not None:
        monkeypatch.setattr(rescore, "TAKE_BYTES", take_bytes)
    stored = tiered.stored
    k, n = 3, 15
    y = tiered.query_coordinates(QUERIES)
    found = HotSearcher(stored).top_k(y, n, SIDES)
    taken = np.concatenate([hits.rowaddr for by_side in found for hits in by_side.values()])
    distinct = np.unique(taken)
    assert distinct.size < taken.size  # the batch shares rows: the case of this test
    rescored(stored, found, y, k)  # the fragments' metadata, read once and cached
    stored.store.take_reads()
    batch = rescored(stored, found, y, k)
    reads, read = stored.store.take_reads()
    assert read == distinct.size * stored.tier.bytes_per_example
    # a row's codes and scales are one record (format 4): a read per row at most (neighbours merge)
    assert reads <= distinct.size
    for q, by_side in enumerate(found):
        (alone,) = rescored(stored, [by_side], y[q : q + 1], k)
        for side in SIDES:
            got, want = batch[q][side], alone[side]
            np.testing.assert_array_equal(got.rowaddr, want.rowaddr)
            np.testing.assert_array_equal(got.scores, want.scores)
            np.testing.assert_array_equal(got.scores_1bit, want.scores_1bit)
            np.testing.assert_allclose(got.scores, _reference(tiered, got, y[q]), rtol=1e-6, atol=1e-7)
            assert got.rowaddr.size and np.all(got.scores > 0 if side == "positive" else got.scores < 0)
    assert [h.rowaddr.tolist() for h in batch[0].values()] == [h.rowaddr.tolist() for h in batch[1].values()]


@pytest.mark.parametrize("factor", [1, 2, 5])
def test_a_query_reads_at_most_n_tier_rows_per_side(tiered, factor):
    """Bytes Lance reads from the tier for one query's rescoring, both sides: at most
    ``N = F · k`` rows' tier bytes per side (reads merged across the rows between would pass it)."""
    stored = tiered.stored
    k = 3
    question = tiered.search(QUERIES[2]).limit(k).direction("both").rescore(factor)
    question.to_arrow()  # the fragments' metadata, read once and cached
    stored.store.take_reads()
    answer = question.to_arrow()
    _, read = stored.store.take_reads()
    bound = factor * k * stored.tier.bytes_per_example * len(SIDES)
    assert 0 < read <= bound
    assert answer.num_rows > 0 and "score_1bit" in answer.column_names


def test_rescoring_every_row_in_a_batch_gives_each_querys_tier_ranking(tiered):
    """N at least every row: each query's sides are its tier ranking over the table, of their sign."""
    stored = tiered.stored
    k = 4
    y = tiered.query_coordinates(QUERIES)
    found = HotSearcher(stored).top_k(y, ROWS, SIDES)
    rows = stored.store.read(["id"], with_row_address=True).column("_rowaddr").to_numpy().astype(np.uint64)
    x = tier_coordinates(stored, rows).astype(np.float64)
    for q, by_side in enumerate(rescored(stored, found, y, k)):
        scores = (x @ y[q].astype(np.float64)).astype(np.float32)
        positive = [int(rows[i]) for i in np.lexsort((rows, -scores)) if scores[i] > 0][:k]
        negative = [int(rows[i]) for i in np.lexsort((rows, scores)) if scores[i] < 0][:k]
        assert by_side["positive"].rowaddr.tolist() == positive
        assert by_side["negative"].rowaddr.tolist() == negative


@pytest.mark.parametrize("code", ["int4", "fp16"])
@pytest.mark.parametrize("normalize", ["none", "unit"])
def test_int4_and_fp16_tiers_score_a_batch_as_their_decoded_coordinates(tmp_path, code, normalize):
    """The other tier codes (decoded before the kernel) and unit rows: each hit's score is its
    decoded tier coordinates (divided by their norm) times the query, each side of its sign."""
    index = _index(tmp_path / "index", code)
    stored = index.stored
    y = index.query_coordinates(QUERIES)
    found = HotSearcher(stored, normalize=normalize).top_k(y, 15, SIDES)
    for q, by_side in enumerate(rescored(stored, found, y, 4, normalize)):
        for side in SIDES:
            hits = by_side[side]
            assert hits.rowaddr.size
            np.testing.assert_allclose(hits.scores, _reference(index, hits, y[q], normalize), rtol=1e-5, atol=1e-7)
            assert np.all(hits.scores > 0 if side == "positive" else hits.scores < 0)
            assert np.all(np.diff(hits.scores) <= 0 if side == "positive" else np.diff(hits.scores) >= 0)
