"""How the rescoring tier lies on disk for its reads: a query takes a few tier rows by row address,
so the tier's columns are written in Lance's full-zip layout (each row's bytes alone), on a real
index (tiny GPT-2, LanceDB on disk), through ingest, compaction and appends to older tables."""

from __future__ import annotations

import re
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from lance.file import LanceFileReader
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.store.codecs import OneBitCodec, SignLayout, TierCodec
from eogp_index.store.table import FULL_ZIP, RANDOM_ACCESS, RowInfo, Store, build_rows

ROWS = 24
QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]


def _layouts(table_path) -> dict:
    """``{column: {page layout names}}`` over every data file of the table's latest version."""
    table_path = Path(table_path)
    dataset = lance.dataset(str(table_path))
    names = dataset.schema.names
    found: dict = {}
    for fragment in dataset.get_fragments():
        for data_file in fragment.data_files():
            meta = LanceFileReader(str(table_path / "data" / data_file.path)).metadata()
            for name, column in zip(names, _top_level_columns(meta, dataset.schema)):
                for page in column.pages:
                    found.setdefault(name, set()).update(
                        re.findall(r"(MiniBlockLayout|FullZipLayout)", str(page.encoding))[:1]
                    )
    return found


def _top_level_columns(meta, schema):
    """The file's columns of the schema's top-level fields (a fixed-size list is one column)."""
    assert len(meta.columns) == len(schema.names), "every column here is one Lance column"
    return meta.columns


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    path = tmp_path_factory.mktemp("tier_io") / "index"
    index = AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        make_examples(ROWS, seed=5),
        model_name="tiny",
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=ROWS, batch_size=8),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    for start in range(0, ROWS, 8):
        index.add_batch(make_examples(ROWS, seed=5)[start : start + 8])
    return index


def test_ingest_writes_the_tier_full_zip_and_compaction_keeps_it(tiered):
    table_path = tiered.stored.store.path
    schema = tiered.stored.store.schema
    assert "tier" in schema.names
    for name in (n for n in RANDOM_ACCESS if n in schema.names):
        assert schema.field(name).metadata == {k.encode(): v.encode() for k, v in FULL_ZIP.items()}
    before = _layouts(table_path)
    assert before["tier"] == {"FullZipLayout"} and "tier_scales" not in before
    # Lance lays out a narrow column such as the one-bit scales in mini-blocks by itself: the
    # layout above is the metadata's doing, not Lance's default for these widths.
    assert before["scales"] == {"MiniBlockLayout"}
    assert len(tiered.stored.store.dataset().get_fragments()) > 1
    tiered.optimize()
    assert len(tiered.stored.store.dataset().get_fragments()) == 1
    after = _layouts(table_path)
    assert after["tier"] == {"FullZipLayout"}
    found = tiered.search(QUERY).limit(3).to_arrow()  # rescored (default factor) after compaction
    assert found.num_rows > 0 and "score_1bit" in found.column_names


def _rows(layout: SignLayout, tier: TierCodec, n: int, seed: int) -> pa.Table:
    x = np.random.default_rng(seed).standard_normal((n, layout.num_coords)).astype(np.float32)
    encoded = {**OneBitCodec(layout).encode(x).columns(), **tier.split(tier.encode(x))}
    ids = [f"r{seed}-{i}" for i in range(n)]
    info = RowInfo(
        ids=ids,
        shards=["s"] * n,
        positions=list(range(n)),
        num_tokens=[4] * n,
        num_loss_tokens=[3] * n,
        truncated=[False] * n,
        metadata=[{} for _ in ids],
    )
    return build_rows(info, encoded)


def test_rows_append_to_a_table_written_before_the_layout_and_read_back_the_same(tmp_path):
    layout = SignLayout(k=(16, 8))
    tier = TierCodec("int8", layout)
    old = _rows(layout, tier, 10, seed=1)
    plain = pa.schema([f.remove_metadata() for f in old.schema])  # as an older version wrote it
    store = Store(tmp_path / "t.lance")
    store.add(pa.Table.from_arrays(old.columns, schema=plain))
    assert store.schema.field("tier").metadata is None
    new = _rows(layout, tier, 6, seed=2)
    store.add(new)
    back = store.read(["id", *tier.columns])
    assert back.num_rows == 16
    assert store.schema.field("tier").metadata is None  # an older table keeps its layout
    want = np.concatenate([tier.decode(tier.from_arrow(old)), tier.decode(tier.from_arrow(new))])
    np.testing.assert_array_equal(tier.decode(tier.from_arrow(back)), want)
    rowaddr = store.read(["id"], with_row_address=True).column("_rowaddr").to_numpy()
    taken = store.take_rows(rowaddr[[12, 3]].tolist(), list(tier.columns))
    np.testing.assert_array_equal(tier.decode(tier.from_arrow(taken)), want[[12, 3]])
