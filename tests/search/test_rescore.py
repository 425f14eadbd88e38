"""The rescoring tier on a real index (tiny GPT-2, LanceDB on disk): what ingest writes beside the
one-bit codes, and queries rescoring the one-bit top rows from it on every route."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import InputError
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
    table = index.stored.store.read(["id", "tier", "tier_scales"])
    tier = index.stored.tier
    return table.column("id").to_pylist(), tier.decode(tier.from_arrow(table))


def _one_bit_of_every_row(index):
    table = index.stored.store.read(["id", "signs", "scales"])
    codec = index.stored.codec
    return table.column("id").to_pylist(), codec.decode(codec.from_arrow(table))


def test_the_manifest_and_table_hold_the_tier_and_the_hot_copy_does_not(tiered):
    manifest = json.loads((tiered.path / "manifest.json").read_text())
    k = [m["k"] for m in manifest["modules"]]
    assert manifest["format_version"] == 3
    assert manifest["tier"] == {"code": "int8", "bytes_per_example": sum(ki + 2 for ki in k)}
    schema = tiered.stored.store.schema
    assert str(schema.field("tier").type) == f"fixed_size_list<item: int8>[{sum(k)}]"
    assert str(schema.field("tier_scales").type) == f"fixed_size_list<item: halffloat>[{len(k)}]"
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
    table = tiered.stored.store.read(["tier_scales"])
    scales = list_column_to_numpy(table.column("tier_scales"), len(tiered.stored.layout.k), np.float32)
    step = np.repeat(scales, tiered.stored.layout.k, axis=1)
    # Half a step, and the gradient pass's float32 batch-order rounding of x.
    assert np.all(np.abs(decoded - x) <= step * 0.5 + 1e-3 * np.abs(x).max())
    # Encoding the decoded tier again gives the stored codes back.
    tier = tiered.stored.tier
    again = tier.encode(decoded)
    stored = tier.from_arrow(tiered.stored.store.read(["tier", "tier_scales"]))
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


@pytest.mark.parametrize("code", ["int8", "int4", "fp16"])
def test_tier_codes_round_trip(code):
    """Codes encode, survive Arrow, and decode within half a step (fp16: its rounding)."""
    from eogp_index.store.codecs import SignLayout, fixed_size_list

    layout = SignLayout((5, 16, 3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 24)).astype(np.float32) * np.array([1.0] * 5 + [30.0] * 16 + [0.01] * 3, np.float32)
    x[2, 5:21] = 0.0  # a zero module: scale 0, codes 0
    tier = TierCodec(code, layout)
    columns = tier.encode(x)
    import pyarrow as pa

    table = pa.table({name: fixed_size_list(values) for name, values in columns.items()})
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
    assert tier.width == {"int8": 24, "int4": 3 + 8 + 2, "fp16": 24}[code]
    assert tier.bytes_per_example == {"int8": 24 + 6, "int4": 13 + 6, "fp16": 48}[code]


def test_fp16_and_none_storage_have_no_tier():
    assert StorageConfig(rescore="none").tier is None
    assert StorageConfig(precision="fp16").tier is None
    assert StorageConfig().tier == "int8"
