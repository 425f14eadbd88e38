"""Behaviour queries (a set of queries as one measurement), unit-normalized scores and roll-ups by
metadata, checked against kronfluence and float64 references on real tiny indexes."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest
from tinymodels import TinyTokenizer, kronfluence_scores, make_examples, make_tiny_gpt2, make_tiny_llama

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, InputError
from eogp_index.search.normalize import row_norms, unit_normalized
from eogp_index.search.scan import SignLayout, pack_signs, scan_top_k, score_reference
from eogp_index.store.codecs import Encoded, decode

TRAIN = make_examples(20, seed=1)
BEHAVIOUR = make_examples(3, seed=2, prefix="q", masked_prompt=True)
QUERIES = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3, 3, 9]]


def _records(examples):
    return [{"input_ids": list(e.input_ids), "labels": list(e.labels)} for e in examples]


@pytest.mark.parametrize("make_model", [make_tiny_gpt2, make_tiny_llama], ids=["gpt2", "llama"])
def test_a_behaviour_query_equals_kronfluence_on_the_mean_loss_of_the_set(tmp_path, make_model):
    """At full width, the mean over a set of queries is kronfluence's aggregated query gradient / n."""
    index = AttributionIndex.create(
        tmp_path / "idx",
        make_model(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        progress=False,
        projection=ProjectionConfig(variant="ekfac-topk", k=10**9),
        storage=StorageConfig(precision="fp32"),
        curvature=CurvatureConfig(num_examples=20, batch_size=4),
        gradients=GradientConfig(batch_size=5),
    )
    index.ingest(TRAIN, progress=False)
    reference = kronfluence_scores(index, BEHAVIOUR, TRAIN, aggregate_queries=True)[0]
    for how, divisor in (("mean", len(BEHAVIOUR)), ("sum", 1)):
        table = (
            index.search(_records(BEHAVIOUR), many=True).aggregate(how).limit(len(TRAIN)).direction("both").to_arrow()
        )
        # Every row is on the side of its score's sign: the two sides hold every score.
        ours = dict(zip(table.column("id").to_pylist(), table.column("score").to_numpy().astype(np.float64)))
        got = np.array([ours[e.id] for e in TRAIN])
        rel = np.linalg.norm(got - reference / divisor) / np.linalg.norm(reference / divisor)
        assert rel <= 1e-4, (how, rel)


def _cosine_reference(index, y):
    """float64 ``⟨y, x̂_i⟩ / ‖x̂_i‖`` of every stored row (hot order), from the decoded codes."""
    hot = index.stored.hot_codes()
    x = decode(hot.encoded, index.layout).astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    return hot, (y.astype(np.float64) @ x.T) / np.where(norms > 0, norms, 1.0)


def test_aggregated_hits_rank_the_mean_of_the_queries_scores(fitted_index):
    table = fitted_index.search(QUERIES, many=True).aggregate("mean").limit(5).direction("both").to_arrow()
    ids, scores = fitted_index.scores(QUERIES)
    mean = scores.astype(np.float64).mean(axis=0)
    top = np.lexsort((np.arange(len(ids)), -mean))[:5]
    bottom = np.lexsort((np.arange(len(ids)), mean))[:5]
    assert table.column("id").to_pylist() == [ids[i] for i in top] + [ids[i] for i in bottom]
    np.testing.assert_allclose(table.column("score").to_numpy(), mean[np.r_[top, bottom]], rtol=1e-5)
    with pytest.raises(ConfigError, match="aggregate"):
        fitted_index.search(QUERIES, many=True).to_arrow()
    with pytest.raises(ConfigError, match="aggregate must be one of"):
        fitted_index.search(QUERIES, many=True).aggregate("median")


@pytest.mark.parametrize("route", ["hot", "stream"])
def test_normalized_hits_rank_by_cosine_to_a_float64_reference(fitted_index, route):
    y = fitted_index.query_coordinates([QUERIES[0]])
    hot, cosine = _cosine_reference(fitted_index, y)
    ids = hot.columns.column("id").to_pylist()
    table = (
        fitted_index.search(QUERIES[0]).normalize("unit").route(route).limit(6).direction("both").by_module().to_arrow()
    )
    top = np.lexsort((np.arange(len(ids)), -cosine[0]))[:6]
    bottom = np.lexsort((np.arange(len(ids)), cosine[0]))[:6]
    assert table.column("id").to_pylist() == [ids[i] for i in top] + [ids[i] for i in bottom]
    np.testing.assert_allclose(table.column("score").to_numpy(), cosine[0][np.r_[top, bottom]], rtol=1e-5)
    # Each hit's module terms still sum to its (normalized) score.
    terms = [sum(m.values()) for m in table.column("modules").to_pylist()]
    np.testing.assert_allclose(terms, table.column("score").to_numpy(), rtol=1e-4)
    # Unit normalization changes the ranking on this index (the test would not see a no-op).
    plain = fitted_index.search(QUERIES[0]).limit(6).direction("both").to_arrow()
    assert plain.column("id").to_pylist() != table.column("id").to_pylist()


def _adversarial_store(seed=0):
    """Rows with huge and tiny FP16 norms, exact ties (copies scaled by powers of two: equal
    cosines), a zero row, and modules whose widths are not multiples of 8 (padding bits)."""
    layout = SignLayout((24, 40, 13))
    rng = np.random.default_rng(seed)
    n = 700
    x = rng.standard_normal((n, layout.num_coords)).astype(np.float32)
    codes = pack_signs(x, layout)
    kind = rng.integers(0, 4, n)
    scales = np.where(
        kind[:, None] == 0,
        rng.uniform(1e4, 6e4, (n, 3)),  # huge
        np.where(
            kind[:, None] == 1,
            rng.uniform(6e-8, 1e-5, (n, 3)),  # tiny (FP16 subnormals)
            np.where(kind[:, None] == 2, rng.uniform(0.5, 2.0, (n, 3)), rng.uniform(1e-3, 1e3, (n, 3))),
        ),
    ).astype(np.float16)  # mixed inside a row
    scales[[5, 17, 40]] = rng.uniform(0.5, 2.0, (3, 3))  # (normal FP16: exact after scaling by 2^±12)
    for src, dst, power in ((5, 600, 4), (5, 601, -6), (17, 602, 10), (17, 603, -12), (40, 604, 3)):
        codes[dst] = codes[src]
        scales[dst] = (scales[src].astype(np.float64) * 2.0**power).astype(np.float16)
        assert np.array_equal(scales[dst].astype(np.float64), scales[src].astype(np.float64) * 2.0**power)
    scales[650] = 0  # a zero code: no direction, scores 0
    return layout, codes, scales.astype(np.float32)


def test_normalized_exact_top_k_equals_a_float64_reference_on_adversarial_rows():
    layout, codes, scales = _adversarial_store()
    rng = np.random.default_rng(1)
    y = rng.standard_normal((3, layout.num_coords)).astype(np.float32)
    # The first query leans to row 5's signs, so that it and its tied copies head the ranking.
    y[0] = decode(Encoded(signs=codes[5:6], scales=np.ones((1, 3), np.float32)), layout)[0] + 0.1 * y[0]
    norms = np.sqrt((scales.astype(np.float64) ** 2) @ np.asarray(layout.k, np.float64))
    np.testing.assert_array_equal(row_norms(Encoded(signs=codes, scales=scales), layout), norms)
    reference = score_reference(codes, scales, y, layout) / np.where(norms > 0, norms, 1.0)
    unit = unit_normalized(Encoded(signs=codes, scales=scales), layout)
    k = 20
    subset = np.flatnonzero(rng.random(codes.shape[0]) < 0.5)
    for rows in (None, subset):
        top = scan_top_k(codes, unit.scales, y, layout, k, rows=rows, chunk_rows=128)
        candidates = np.arange(codes.shape[0]) if rows is None else subset
        for q in range(y.shape[0]):
            ref = reference[q, candidates]
            best = candidates[np.lexsort((candidates, -ref))[:k]]
            worst = candidates[np.lexsort((candidates, ref))[:k]]
            assert top.largest_indices[q].tolist() == best.tolist()
            assert top.smallest_indices[q].tolist() == worst.tolist()
            scale = np.abs(ref).max()
            np.testing.assert_allclose(top.largest_scores[q], reference[q, best], rtol=1e-6, atol=1e-6 * scale)
            np.testing.assert_allclose(top.smallest_scores[q], reference[q, worst], rtol=1e-6, atol=1e-6 * scale)
    # The tied copies come out together at the top, in row order; unnormalized, huge rows win instead.
    full = scan_top_k(codes, unit.scales, y[:1], layout, 3, smallest=False)
    assert full.largest_indices[0].tolist() == [5, 600, 601]
    assert full.largest_scores[0][0] == full.largest_scores[0][1] == full.largest_scores[0][2]
    plain = scan_top_k(codes, scales, y[:1], layout, 3, smallest=False)
    assert plain.largest_indices[0].tolist() != [5, 600, 601]


def _group_reference(values, scores, k):
    """float64 roll-up of one query: ``{value: (rows, sum, max, top+, top-, pos, neg)}``."""
    order_pos = np.lexsort((np.arange(scores.size), -scores))[:k]
    order_neg = np.lexsort((np.arange(scores.size), scores))[:k]
    out = {}
    for i, (v, s) in enumerate(zip(values, scores)):
        rows, total, best, tp, tn, pos, neg = out.get(v, (0, 0.0, -np.inf, 0, 0, 0.0, 0.0))
        out[v] = (
            rows + 1,
            total + s,
            max(best, s),
            tp + (i in order_pos),
            tn + (i in order_neg),
            pos + max(s, 0.0),
            neg + min(s, 0.0),
        )
    return out


@pytest.mark.parametrize("column", ["group", "name", "shard"])
def test_group_sums_equal_a_float64_reference(fitted_index, column):
    where = "`group` != 2 OR num_tokens > 10"
    search = (
        fitted_index.search(QUERIES, many=True)
        .aggregate("mean")
        .normalize("unit")
        .where(where)
        .limit(4)
        .group_by(column)
    )
    groups = search.to_arrow()
    y = fitted_index.query_coordinates(QUERIES).astype(np.float64).mean(axis=0, keepdims=True)
    hot, cosine = _cosine_reference(fitted_index, y)
    rows = fitted_index.stored.matching_rows(where, hot)
    assert 0 < rows.size < hot.num_rows
    values = hot.columns.column(column).take(rows).to_pylist()
    scores = cosine[0, rows]
    expected = _group_reference(values, scores, 4)
    assert groups.column_names == [
        column,
        "rows",
        "sum",
        "mean",
        "max",
        "top_positive",
        "top_negative",
        "share_positive",
        "share_negative",
    ]
    got = {r[column]: r for r in groups.to_pylist()}
    assert set(got) == set(expected)
    total_pos = sum(v[5] for v in expected.values())
    total_neg = sum(v[6] for v in expected.values())
    scale = np.abs(scores).sum()
    for value, (n, total, best, tp, tn, pos, neg) in expected.items():
        row = got[value]
        assert (row["rows"], row["top_positive"], row["top_negative"]) == (n, tp, tn), value
        assert row["sum"] == pytest.approx(total, rel=1e-5, abs=1e-6 * scale)
        assert row["mean"] == pytest.approx(total / n, rel=1e-5, abs=1e-6 * scale)
        assert row["max"] == pytest.approx(best, rel=1e-5, abs=1e-6 * scale)
        assert row["share_positive"] == pytest.approx(pos / total_pos, abs=1e-5)
        assert row["share_negative"] == pytest.approx(neg / total_neg, abs=1e-5)
    sums = groups.column("sum").to_numpy()
    assert np.all(np.diff(sums) <= 0), "groups are sorted by sum, most positive first"
    assert sum(r["top_positive"] for r in got.values()) == 4
    negative = search.direction("negative").to_arrow()
    assert np.all(np.diff(negative.column("sum").to_numpy()) >= 0)


def test_group_by_errors_name_the_fix(fitted_index):
    with pytest.raises(InputError, match="group by one of .*'group'"):
        fitted_index.search(QUERIES[0]).group_by("source").to_arrow()
    with pytest.raises(ConfigError, match="group_by scores every matching row"):
        fitted_index.search(QUERIES[0]).route("stream").group_by("group")
    with pytest.raises(ConfigError, match="normalize must be one of"):
        fitted_index.search(QUERIES[0]).normalize("l2")
    empty = fitted_index.search(QUERIES[0]).where("num_tokens > 100000").group_by("group").to_arrow()
    assert empty.num_rows == 0 and "share_negative" in empty.column_names
    # One roll-up per query when the queries are not aggregated.
    each = fitted_index.search(QUERIES, many=True).group_by("group").to_list()
    assert len(each) == 3 and all(pc.sum(t["rows"]).as_py() == 40 for t in each)


def test_roll_up_of_dictionary_and_plain_columns_with_nulls_and_ties():
    import pyarrow as pa

    from eogp_index.search.rollup import roll_up

    scores = np.array([3.0, -1.0, 3.0, 0.5, -2.0, 1.0, -1.0])
    values = ["a", "b", "a", None, "b", "c", None]
    for column in (pa.array(values), pa.array(values).dictionary_encode(), pa.chunked_array([values[:3], values[3:]])):
        rows = roll_up(column, scores, 2, "source").to_pylist()
        assert [r["source"] for r in rows] == ["a", "c", None, "b"]  # by sum, most positive first
        by = {r["source"]: r for r in rows}
        assert (by["a"]["rows"], by["a"]["sum"], by["a"]["top_positive"]) == (2, 6.0, 2)  # the tied 3.0s
        assert (by[None]["rows"], by[None]["sum"], by[None]["max"]) == (2, -0.5, 0.5)
        assert by["b"]["top_negative"] == 2 and by["b"]["share_negative"] == pytest.approx(3 / 4)
        assert by[None]["top_negative"] == 0  # -1.0 ties with b's -1.0, which comes first in table order
        assert sum(r["share_positive"] for r in rows) == pytest.approx(1.0)


def test_window_rows_roll_up_to_their_documents_by_parent_id(tmp_path):
    """Rows that are windows of longer documents carry a ``parent_id``: grouping by it gives each
    document's summed influence, the sum of its windows' exact scores."""
    from eogp_index.data.records import Example

    windows = [
        Example.from_ids(
            id=f"doc{i // 3}-w{i % 3}",
            input_ids=list(e.input_ids),
            labels=list(e.labels),
            shard="windows",
            position=i,
            metadata={"parent_id": f"doc{i // 3}"},
        )
        for i, e in enumerate(make_examples(15, seed=5))
    ]
    index = AttributionIndex.create(
        tmp_path / "idx",
        make_tiny_gpt2(),
        TinyTokenizer(),
        windows,
        model_name="tiny",
        progress=False,
        projection=ProjectionConfig(variant="eogp", k=8, m=32),
        curvature=CurvatureConfig(num_examples=15, batch_size=5),
        gradients=GradientConfig(batch_size=5),
    )
    index.ingest(windows, progress=False)
    documents = index.search(QUERIES[1]).limit(2).group_by("parent_id").to_arrow().to_pylist()
    ids, scores = index.scores([QUERIES[1]])
    expected = {}
    for example_id, score in zip(ids, scores[0].astype(np.float64)):
        expected.setdefault(example_id.split("-")[0], []).append(score)
    assert {d["parent_id"]: d["rows"] for d in documents} == {doc: 3 for doc in expected}
    for d in documents:
        assert d["sum"] == pytest.approx(sum(expected[d["parent_id"]]), rel=1e-5, abs=1e-7)
        assert d["max"] == pytest.approx(max(expected[d["parent_id"]]), rel=1e-6)
    assert [d["parent_id"] for d in documents] == sorted(expected, key=lambda doc: -sum(expected[doc]))


def test_top_positions_equal_a_stable_sort_with_ties_and_sorted_input():
    from eogp_index.search.rollup import top_positions

    rng = np.random.default_rng(3)
    for trial in range(200):
        n, k = int(rng.integers(1, 50)), int(rng.integers(1, 12))
        scores = (rng.integers(-3, 4, n) if trial % 2 else rng.standard_normal(n)).astype(np.float32)
        if trial % 5 == 0:
            scores = np.sort(scores)[:: -1 if trial % 10 else 1].copy()  # every row enters a heap
        largest, smallest = top_positions(scores, k)
        assert largest.tolist() == np.lexsort((np.arange(n), -scores))[:k].tolist()
        assert smallest.tolist() == np.lexsort((np.arange(n), scores))[:k].tolist()
