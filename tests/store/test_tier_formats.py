"""Tiered indexes written before the tier's records (format 3) open, answer and take rows as then.

tests/fixtures/tier-v3/ holds a small real index with an int8 tier written by the code of commit
f0b7264 (tests/fixtures/make_tier_v3.py says how): its codes in the ``tier`` column, its scales in
``tier_scales``. Today's code writes each row's codes and scales as one record (format 4,
schemas/store.md) but must read that layout, answer the queries that code answered (every hit's
id, tier score and one-bit score), and keep the layout when rows are added.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.search.rescore import tier_coordinates

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "tier-v3"
ANSWERS = json.loads((DATA / "answers.json").read_text())


def _open(path):
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


@pytest.fixture()
def v3(tmp_path):
    """A copy of the fixture (opening writes the hot copy), opened with its tiny model."""
    path = tmp_path / "index"
    shutil.copytree(DATA / "index", path)
    return _open(path)


def _every_row(index):
    """Row addresses ``(n,)`` of the stored rows, by id."""
    rows = index.stored.store.read(["id"], with_row_address=True)
    order = np.argsort(rows.column("id").to_numpy(zero_copy_only=False))
    return rows.column("_rowaddr").to_numpy().astype(np.uint64)[order]


def test_the_fixture_is_format_3_with_the_scales_in_a_column_of_their_own(v3):
    assert v3.stored.manifest.format_version == 3 and not v3.stored.manifest.tier_records
    assert {"tier", "tier_scales"} <= set(v3.stored.store.schema.names)
    assert v3.stored.tier.columns == ("tier", "tier_scales")


def test_a_format_3_index_answers_as_the_code_that_wrote_it(v3):
    y = np.load(DATA / "queries.npy")
    queries = [f"q{i}" for i in range(len(y))]
    assert len(ANSWERS) == 12
    for answer in ANSWERS:
        builder = v3.search(queries, many=True).limit(4).direction("both").rescore(answer["factor"])
        if answer["where"] is not None:
            builder = builder.where(answer["where"])
        hits = builder.to_list(coordinates=y)[answer["query"]]
        expected = answer["hits"]
        assert hits.column("id").to_pylist() == expected["id"], answer
        assert hits.column("direction").to_pylist() == expected["direction"]
        for key in ("score", "score_1bit"):
            np.testing.assert_allclose(hits.column(key).to_numpy(), np.array(expected[key], np.float32), rtol=1e-6)
    np.testing.assert_array_equal(tier_coordinates(v3.stored, _every_row(v3)), np.load(DATA / "tier.npy"))


def test_rows_added_to_a_format_3_index_keep_its_layout_and_read_back(v3):
    before = v3.stored.store.count()
    added = make_examples(6, seed=29, prefix="new")
    v3.add_batch(added)
    again = _open(v3.path)
    assert again.stored.manifest.format_version == 3
    assert {"tier", "tier_scales"} <= set(again.stored.store.schema.names)
    assert again.stored.store.count() == before + 6
    tier = again.stored.tier
    rows = again.stored.store.read(["id", *tier.columns], "id LIKE 'new%'")
    x = again.encoder.project(added)
    order = [rows.column("id").to_pylist().index(ex.id) for ex in added]
    # the new rows' tier is their coordinates quantized as the codec quantizes them
    np.testing.assert_array_equal(tier.decode(tier.from_arrow(rows.take(order))), tier.decode(tier.encode(x)))
    # the old rows read as before
    old = _every_row(again)[:before]  # the fixture's ids ("ex-…") sort before the new ones
    np.testing.assert_array_equal(tier_coordinates(again.stored, old), np.load(DATA / "tier.npy"))
