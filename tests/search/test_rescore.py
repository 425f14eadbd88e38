"""The rescoring tier on a real index (tiny GPT-2, LanceDB on disk): what ingest writes beside the
one-bit codes, and queries rescoring the one-bit top rows from it on every route."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2
from torchrun import run_torchrun_eogp

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import ConfigError, InputError
from eogp_index.search.first_pass import FlatConfig, build
from eogp_index.store.codecs import TierCodec, list_column_to_numpy
from eogp_index.store.stored_index import StoredIndex

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]
ROWS = 40


@pytest.fixture(scope="module")
def tiered_template(tmp_path_factory):
    """An index with the default tier (int8), 40 rows in four commits."""
    path = tmp_path_factory.mktemp("tiered") / "index"
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        make_examples(ROWS, seed=11),
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=ROWS, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    for start in range(0, ROWS, 10):
        index.add_batch(make_examples(ROWS, seed=11)[start : start + 10])
    return path


@pytest.fixture
def tiered(tiered_template, tmp_path):
    path = tmp_path / "index"
    shutil.copytree(tiered_template, path)
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


def _ids_of(table):
    return table.column("id").to_pylist()


def _tier_of_every_row(index):
    """ids and the tier's coordinates ``(n, K)`` of every stored row, read from the table."""
    tier = index.stored.tier
    table = index.stored.store.read(["id", *tier.columns])
    return table.column("id").to_pylist(), tier.decode(tier.from_arrow(table))


def _one_bit_of_every_row(index):
    table = index.stored.store.read(["id", "signs", "scales"])
    codec = index.stored.codec
    return table.column("id").to_pylist(), codec.decode(codec.from_arrow(table))


def test_the_manifest_and_table_hold_the_tier_and_the_hot_copy_does_not(tiered):
    manifest = json.loads((tiered.path / "manifest.json").read_text())
    k = [m["k"] for m in manifest["modules"]]
    assert manifest["format_version"] == 4
    assert manifest["tier"] == {"code": "int8", "bytes_per_example": sum(ki + 2 for ki in k)}
    schema = tiered.stored.store.schema
    # One record per row: the int8 codes' bytes, then each module's FP16 scale (schemas/store.md).
    assert str(schema.field("tier").type) == f"fixed_size_list<item: uint8>[{sum(k) + 2 * len(k)}]"
    assert "tier_scales" not in schema.names
    hot = tiered.stored.hot_codes()
    assert "tier" not in hot.filterable.column_names and "tier_scales" not in hot.filterable.column_names
    assert not any("tier" in p.name for p in (tiered.path / "hot").rglob("*"))
    assert "tier" not in tiered.stored.rows(np.zeros(0, np.uint64)).column_names


def test_ingested_tier_codes_are_the_coordinates_quantized_per_module(tiered):
    """The stored tier decodes to the examples' coordinates within half a step of each module's scale."""
    examples = make_examples(ROWS, seed=11)
    x = tiered.encoder.project(examples)
    ids, decoded = _tier_of_every_row(tiered)
    by_id = {ex.id: i for i, ex in enumerate(examples)}
    x = x[[by_id[i] for i in ids]]
    tier = tiered.stored.tier
    records = list_column_to_numpy(
        tiered.stored.store.read(["tier"]).column("tier"), tier.width + 2 * len(tier.layout.k), np.uint8
    )
    codes, scales = records[:, : tier.width].view(np.int8), records[:, tier.width :].copy().view("<f2")
    step = np.repeat(scales.astype(np.float32), tiered.stored.layout.k, axis=1)
    np.testing.assert_array_equal(codes * step, decoded)
    # Half a step, and the gradient pass's float32 batch-order rounding of x.
    assert np.all(np.abs(decoded - x) <= step * 0.5 + 1e-3 * np.abs(x).max())
    # Encoding the decoded tier again gives the stored codes back.
    again = tier.encode(decoded)
    stored = tier.from_arrow(tiered.stored.store.read(["tier"]))
    np.testing.assert_array_equal(again["tier"], stored["tier"])


def test_rescored_scores_are_the_float32_products_with_the_tier(tiered):
    answer = tiered.search(QUERY).limit(4).direction("both").to_arrow()
    assert answer.column_names[:5] == ["direction", "rank", "id", "score", "score_1bit"]
    y = tiered.query_coordinates([QUERY])[0]
    ids, tier = _tier_of_every_row(tiered)
    _, one_bit = _one_bit_of_every_row(tiered)
    row = {i: n for n, i in enumerate(ids)}
    for hit in answer.to_pylist():
        n = row[hit["id"]]
        assert hit["score"] == pytest.approx(float(tier[n] @ y), rel=1e-6, abs=1e-6)
        assert hit["score_1bit"] == pytest.approx(float(np.dot(one_bit[n].astype(np.float64), y)), rel=1e-5, abs=1e-5)
        assert (hit["score"] > 0) == (hit["direction"] == "positive")  # the sides keep their signs


def _tier_ranking(tiered, k, where_rows=None):
    y = tiered.query_coordinates([QUERY])[0]
    ids, tier = _tier_of_every_row(tiered)
    scores = (tier @ y).astype(np.float32)
    keep = np.arange(len(ids)) if where_rows is None else where_rows
    positive = [ids[i] for i in sorted(keep, key=lambda i: -scores[i]) if scores[i] > 0][:k]
    negative = [ids[i] for i in sorted(keep, key=lambda i: scores[i]) if scores[i] < 0][:k]
    return positive + negative


@pytest.mark.parametrize("route", ["hot", "stream", "sharded", "candidates"])
def test_rescoring_every_row_gives_the_tiers_exact_ranking_on_every_route(tiered, route):
    k = 5
    question = tiered.search(QUERY).limit(k).direction("both").rescore(ROWS)  # N = 200 >= every row
    if route == "candidates":
        build(tiered.stored, "default", FlatConfig(), progress=False)
        answer = question.candidates(ROWS).to_arrow()
    else:
        answer = question.route(route).to_arrow()
    assert answer.column("id").to_pylist() == _tier_ranking(tiered, k)
    # ... which here is not the one-bit ranking (so the rescoring is what made it).
    assert answer.column("id").to_pylist() != _ids_of(tiered.search(QUERY).limit(k).rescore(0).to_arrow())


def test_rescoring_keeps_where_aggregate_by_module_and_group_by(tiered):
    where_rows = [i for i, ex in enumerate(make_examples(ROWS, seed=11)) if ex.metadata["group"] != 1]
    ids = [ex.id for ex in make_examples(ROWS, seed=11)]
    stored_ids, _ = _tier_of_every_row(tiered)
    filtered = tiered.search(QUERY).where("`group` != 1").limit(3).rescore(ROWS).to_arrow()
    assert filtered.column("id").to_pylist() == _tier_ranking(tiered, 3, [stored_ids.index(ids[i]) for i in where_rows])
    terms = tiered.search(QUERY).limit(3).by_module().to_arrow().to_pylist()
    for hit in terms:  # the terms are the tier's, summing to the rescored score
        assert sum(hit["modules"].values()) == pytest.approx(hit["score"], rel=1e-4, abs=1e-5)
    both = tiered.search([QUERY, QUERY], many=True).aggregate("mean").limit(3).to_arrow()
    alone = tiered.search(QUERY).limit(3).to_arrow()
    assert both.column("id").to_pylist() == alone.column("id").to_pylist()
    groups = tiered.search(QUERY).group_by("group").to_arrow()
    assert groups.num_rows == len({ex.metadata["group"] for ex in make_examples(ROWS, seed=11)})
    with pytest.raises(InputError, match="tier"):  # the tier's columns are codes, not stored columns
        tiered.search(QUERY).group_by("tier").to_arrow()


def test_rescore_zero_answers_with_the_one_bit_scan(tiered):
    off = tiered.search(QUERY).limit(5).rescore(0).to_arrow()
    assert "score_1bit" not in off.column_names
    y = tiered.query_coordinates([QUERY])[0]
    ids, one_bit = _one_bit_of_every_row(tiered)
    scores = one_bit @ y
    expected = [ids[i] for i in np.lexsort((np.arange(len(ids)), -scores)) if scores[i] > 0][:5]
    expected += [ids[i] for i in np.lexsort((np.arange(len(ids)), scores)) if scores[i] < 0][:5]
    assert off.column("id").to_pylist() == expected


def test_an_index_without_a_tier_opens_and_answers_as_format_2(fitted_index):
    """The fixture index is fitted with rescore none: today's format, one-bit answers."""
    manifest = json.loads((fitted_index.path / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and "tier" not in manifest
    assert "tier" not in fitted_index.stored.store.schema.names
    reopened = StoredIndex.open(fitted_index.path)
    assert reopened.tier is None and reopened.manifest.tier is None
    default = fitted_index.search(QUERY).limit(5).to_arrow()
    assert "score_1bit" not in default.column_names
    assert default.to_pylist() == fitted_index.search(QUERY).limit(5).rescore(0).to_arrow().to_pylist()


@pytest.mark.parametrize("record", [True, False], ids=["format-4-records", "format-3-columns"])
@pytest.mark.parametrize("code", ["int8", "int4", "fp16"])
def test_tier_codes_round_trip(code, record):
    """Codes encode, survive Arrow in either table layout, and decode within half a step (fp16:
    its rounding); the rescoring kernel's arrays read from the table score as the decoded tier."""
    from eogp_index.store.codecs import SignLayout, fixed_size_list

    layout = SignLayout((5, 16, 3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 24)).astype(np.float32) * np.array([1.0] * 5 + [30.0] * 16 + [0.01] * 3, np.float32)
    x[2, 5:21] = 0.0  # a zero module: scale 0, codes 0
    tier = TierCodec(code, layout, record=record)
    columns = tier.encode(x)
    import pyarrow as pa

    table = pa.table({name: fixed_size_list(values) for name, values in tier.split(columns).items()})
    assert table.column_names == list(tier.columns)
    assert table.column_names == (["tier"] if record or code == "fp16" else ["tier", "tier_scales"])
    back = tier.from_arrow(table)
    for name in columns:
        np.testing.assert_array_equal(back[name], columns[name])
    decoded = tier.decode(back)
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    assert np.all(decoded[2, 5:21] == 0)
    if code == "fp16":
        np.testing.assert_array_equal(decoded, x.astype(np.float16).astype(np.float32))
    else:
        step = np.repeat(columns["tier_scales"].astype(np.float32), layout.k, axis=1)
        assert np.all(np.abs(decoded - x) <= step * 0.5 * (1 + 1e-3))
        q = 127 if code == "int8" else 7
        assert np.all(np.abs(np.rint(decoded / np.where(step > 0, step, 1))) <= q)
    from eogp_index.search.kernels.rescore import pair_scores

    codes, scales, offsets = tier.kernel_arrays(table)
    y = rng.normal(size=(2, 24)).astype(np.float32)
    rows, queries = np.repeat(np.arange(7), 2), np.tile(np.arange(2), 7)
    out = np.empty(14, np.float64)
    pair_scores(codes, scales, offsets, y, rows, queries, out)
    np.testing.assert_allclose(
        out, np.einsum("pk,pk->p", decoded[rows].astype(np.float64), y[queries]), rtol=1e-6, atol=1e-9
    )
    assert tier.width == {"int8": 24, "int4": 3 + 8 + 2, "fp16": 24}[code]
    assert tier.bytes_per_example == {"int8": 24 + 6, "int4": 13 + 6, "fp16": 48}[code]


def test_fp16_and_none_storage_have_no_tier():
    assert StorageConfig(rescore="none").tier is None
    assert StorageConfig(precision="fp16").tier is None
    assert StorageConfig().tier == "int8"


def _hits(table):
    """(direction, id, score, score_1bit) of each hit."""
    return [(r.get("direction"), r["id"], r["score"], r.get("score_1bit")) for r in table.to_pylist()]


def _same_hits(got, expected):
    assert [(d, i) for d, i, _, _ in got] == [(d, i) for d, i, _, _ in expected]
    for (_, _, score, one_bit), (_, _, want, want_1bit) in zip(got, expected):
        assert score == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert one_bit == pytest.approx(want_1bit, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("route", ["stream", "sharded", "candidates"])
@pytest.mark.parametrize("how", ["plain", "unit", "aggregate"])
def test_every_route_gives_the_hot_routes_rescored_answer(tiered, route, how):
    """The default factor (N = 5 k < the rows): each route's one-bit top N, rescored, is the hot
    route's, ids, scores and one-bit scores; each side keeps its sign."""
    question = tiered.search(QUERY).limit(3).direction("both")
    if how == "unit":
        question = question.normalize("unit")
    elif how == "aggregate":
        question = tiered.search([QUERY, QUERY[::-1]], many=True).aggregate("mean").limit(3).direction("both")
    hot = question.route("hot").to_arrow()
    assert "score_1bit" in hot.column_names and 0 < hot.num_rows
    if route == "candidates":
        build(tiered.stored, "default", FlatConfig(), progress=False)
        if how == "unit":  # first passes pick candidates for unnormalized scores
            with pytest.raises(ConfigError, match="normalize='unit' needs an exact scan"):
                question.candidates(ROWS)
            return
        answer = question.candidates(ROWS).to_arrow()  # every row a candidate: the exact one-bit top N
    else:
        answer = question.route(route).to_arrow()
    _same_hits(_hits(answer), _hits(hot))
    for direction, _, score, _ in _hits(answer):
        assert (score > 0) if direction == "positive" else (score < 0)


def test_rescoring_reorders_the_one_bit_top_rows(tiered):
    """Some hit's rescored order differs from its one-bit order (else the route tests see nothing)."""
    answer = tiered.search(QUERY).limit(5).direction("positive").to_arrow()
    one_bit = answer.column("score_1bit").to_pylist()
    assert one_bit != sorted(one_bit, reverse=True) or _ids_of(answer) != _ids_of(
        tiered.search(QUERY).limit(5).direction("positive").rescore(0).to_arrow()
    )


@pytest.mark.parametrize("normalize", ["none", "unit"])
def test_the_torch_kernels_give_the_hot_routes_rescored_answer(tiered, normalize):
    """The torch route's searcher (its kernels on the CPU here; on a CUDA device too when there is
    one), its one-bit top N rescored from the tier: the hot route's answer."""
    import torch

    from eogp_index.search.rescore import rescored
    from eogp_index.search.searchers import TorchSearcher

    k, sides = 3, ("positive", "negative")
    factor = 5
    hot = tiered.search(QUERY).limit(k).direction("both").normalize(normalize).rescore(factor).route("hot")
    expected = _hits(hot.to_arrow())
    y = tiered.query_coordinates([QUERY])
    count = factor * k
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        found = TorchSearcher(tiered.stored, device, normalize=normalize).top_k(y, count, sides)
        (best,) = rescored(tiered.stored, found, y, k, normalize)
        got = [(side, i, s, b) for side in sides for i, s, b in _side_rows(tiered, best[side])]
        assert [(d, i) for d, i, _, _ in got] == [(d, i) for d, i, _, _ in expected], device
        np.testing.assert_allclose([h[2] for h in got], [h[2] for h in expected], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose([h[3] for h in got], [h[3] for h in expected], rtol=1e-4, atol=1e-5)


def _side_rows(index, hits):
    ids = index.stored.rows(hits.rowaddr, ["id"]).column("id").to_pylist() if hits.rowaddr.size else []
    return zip(ids, hits.scores.tolist(), hits.scores_1bit.tolist())


def test_group_by_counts_the_rescored_hits_as_the_top_rows(tiered):
    """A roll-up's top_positive / top_negative count the ranked answer's hits (the rescored ones),
    its sums every row's one-bit score."""
    k = 4
    groups = tiered.search(QUERY).group_by("group").limit(k).to_arrow().to_pylist()
    ranked = tiered.search(QUERY).limit(k).direction("both").to_arrow().to_pylist()
    group_of = {ex.id: ex.metadata["group"] for ex in make_examples(ROWS, seed=11)}
    for side in ("positive", "negative"):
        counted = {g["group"]: g[f"top_{side}"] for g in groups if g[f"top_{side}"]}
        hits = [group_of[r["id"]] for r in ranked if r["direction"] == side]
        assert counted == {g: hits.count(g) for g in set(hits)}
    _, one_bit = _one_bit_of_every_row(tiered)
    y = tiered.query_coordinates([QUERY])[0].astype(np.float64)
    ids, _ = _one_bit_of_every_row(tiered)
    total = {}
    for i, score in zip(ids, one_bit.astype(np.float64) @ y):
        total[group_of[i]] = total.get(group_of[i], 0.0) + score
    assert {g["group"]: g["sum"] for g in groups} == pytest.approx(total, rel=1e-5, abs=1e-6)
    # Without rescoring the counts are the one-bit top k.
    off = tiered.search(QUERY).group_by("group").limit(k).rescore(0).to_arrow().to_pylist()
    plain = tiered.search(QUERY).limit(k).direction("both").rescore(0).to_arrow().to_pylist()
    hits = [group_of[r["id"]] for r in plain if r["direction"] == "positive"]
    assert {g["group"]: g["top_positive"] for g in off if g["top_positive"]} == {g: hits.count(g) for g in set(hits)}


@pytest.mark.distributed
def test_two_torchrun_workers_give_the_hot_routes_rescored_answer(tiered):
    import os

    # The workers measure the query on the CPU; so does the reference (on a GPU machine the
    # fixture's index would measure it on the GPU, in another float order).
    on_cpu = AttributionIndex.open(
        tiered.path,
        model=make_tiny_gpt2(),
        tokenizer=TinyTokenizer(),
        gradients=GradientConfig(batch_size=8, device="cpu"),
    )
    expected = _hits(on_cpu.search(QUERY).limit(4).direction("both").to_arrow())
    model_dir = tiered.path / "model"  # the workers load the model the manifest names
    make_tiny_gpt2().save_pretrained(model_dir)
    __import__("tinymodels").make_word_tokenizer().save_pretrained(model_dir)
    manifest_path = tiered.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["name"] = str(model_dir)
    manifest_path.write_text(json.dumps(manifest))
    queries = tiered.path / "queries.jsonl"
    queries.write_text(json.dumps({"input_ids": QUERY}) + "\n")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = run_torchrun_eogp(
        "query", str(tiered.path), "--queries", str(queries), "-k", "4", "--direction", "both", "--device", "cpu", "--json",
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    result = json.loads(out.stdout[out.stdout.index("[") :])[0]["results"]
    _same_hits([(r["direction"], r["id"], r["score"], r["score_1bit"]) for r in result], expected)
