"""The hot copy: equal to the table, extended by new fragments, used by filtered scans."""

import numpy as np

from tinymodels import make_examples
from eogp_index.store.hot import load_hot
from eogp_index.store.table import list_column_to_numpy


def _table_codes(index):
    t = index.store.read(["signs", "scales"], with_row_address=True)
    order = np.argsort(t.column("_rowaddr").to_numpy())
    return (t.column("_rowaddr").to_numpy()[order],
            list_column_to_numpy(t.column("signs"), index.layout.nbytes, np.uint8)[order],
            list_column_to_numpy(t.column("scales"), index.layout.num_modules, np.float32)[order])


def test_hot_copy_equals_table_and_follows_new_fragments(fitted_index):
    index = fitted_index
    hot = index.hot_codes()
    rowaddr, codes, scales = _table_codes(index)
    assert np.array_equal(hot.rowaddr, rowaddr) and np.array_equal(hot.codes, codes)
    assert np.array_equal(hot.scales, scales)
    cached = sorted(p.name for p in (index.path / "hot").iterdir())
    assert len(cached) == len(index.store.dataset().get_fragments()) == 4

    index.add_batch(make_examples(5, seed=99, prefix="new"))
    hot2 = index.hot_codes()  # the table moved on: only the new fragment is read
    assert hot2.version > hot.version and hot2.num_rows == 45
    assert set(p.name for p in (index.path / "hot").iterdir()) > set(cached)
    rowaddr, codes, _ = _table_codes(index)
    assert np.array_equal(hot2.codes, codes)


def test_compaction_rebuilds_the_hot_copy(fitted_index):
    index = fitted_index
    before = index.scores([[1, 2, 3, 4, 5]])
    index.hot_codes()
    index.store.table.optimize()  # compaction rewrites fragments: row addresses change
    after = index.scores([[1, 2, 3, 4, 5]])
    by_id = dict(zip(before[0], before[1][0]))
    np.testing.assert_allclose([by_id[i] for i in after[0]], after[1][0], rtol=1e-6)
    assert len(list((index.path / "hot").iterdir())) == len(index.store.dataset().get_fragments())


def test_in_memory_only_when_no_cache_dir(fitted_index):
    hot = load_hot(fitted_index.store, fitted_index.codec, cache_dir=None)
    assert hot.num_rows == 40
