"""`where` filters on the hot copy (eogp_index.store.filters): DataFusion over the hot columns in
Lance's dialect, checked against Lance itself on a real table on disk, and filtered searches
checked against scoring every row and then filtering."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tinymodels import TinyTokenizer, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from eogp_index.errors import InputError
from eogp_index.store.filters import HotFilter, UnplannedFilter, matching_positions
from eogp_index.store.table import RowInfo, build_rows

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]
ROWS, COMMITS = 90, 6

#: Filters DataFusion plans over the hot columns; each must select what Lance selects.
FILTERS = [
    "source = 'web'",
    "source != 'web'",
    "source IN ('web', 'books')",
    "source NOT IN ('web')",
    "source IS NULL",
    "source IS NOT NULL",
    "source = 'o''k'",
    "source LIKE '%o%'",
    "lower(source) = 'web'",
    "title LIKE 'doc 1%'",
    "title NOT LIKE '%5'",
    "title ILIKE 'DOC 2%'",
    "title < 'doc 2'",
    "title IS NULL",
    "n > 10",
    "n <= 3",
    "n BETWEEN 5 AND 9",
    "n IS NULL",
    "n = 7 OR source = 'books'",
    "(n > 5 AND flag) OR title = 'doc 3'",
    "score_x > 0.5",
    "score_x < 0",
    "score_x >= 0.25 AND score_x < 0.75",
    "flag",
    "NOT flag",
    "flag = false",
    "flag IS NULL",
    "`group` = 1",
    "`group` IN (0, 2) AND NOT (`with space` > 10)",
    "`with space` >= 20",
    "id >= 'row-5'",
    "position % 2 = 0",
    "num_tokens > 8 AND shard = 'synthetic'",
    "true",
    "false",
    "n > 1 + 2",
    "lower(source) LIKE 'w%'",
    "NOT (n = 3) -- a comment",
]
#: Filters only Lance takes (its own extensions): evaluated by Lance, same answers.
LANCE_ONLY = ["SOURCE = 'web'", "_rowid < 5", "regexp_match(title, 'doc 1.')"]


def _row_metadata(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "source": [None, "web", "books", "o'k"][i % 4],
        "title": None if i % 11 == 0 else f"doc {i}",
        "n": None if i % 7 == 0 else int(i % 23),
        "score_x": None if i % 13 == 0 else float(rng.uniform(-1, 1)),
        "flag": None if i % 5 == 0 else bool(i % 2),
        "group": i % 3,
        "with space": i % 31,
    }


def _write_rows(index, start: int, n: int, seed: int) -> None:
    coords = np.random.default_rng(seed).standard_normal((n, index.layout.num_coords)).astype(np.float32)
    rows = range(start, start + n)
    info = RowInfo(
        ids=[f"row-{i}" for i in rows],
        shards=["synthetic"] * n,
        positions=list(rows),
        num_tokens=[5 + i % 9 for i in rows],
        num_loss_tokens=[4 + i % 9 for i in rows],
        truncated=[False] * n,
        metadata=[_row_metadata(i) for i in rows],
    )
    index.store.add(build_rows(info, index.codec.encode(coords), schema=index.store.schema))


def _open(path):
    return AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer(), gradients=GradientConfig(batch_size=8)
    )


@pytest.fixture(scope="module")
def rich_template(fitted_index_template, tmp_path_factory):
    """An index whose table holds typed metadata with nulls, in several commits (fragments)."""
    path = tmp_path_factory.mktemp("rich") / "index"
    shutil.copytree(fitted_index_template, path)
    shutil.rmtree(path / "examples.lance")
    index = _open(path)
    for k in range(COMMITS):
        _write_rows(index, k * ROWS // COMMITS, ROWS // COMMITS, seed=k)
    return path


@pytest.fixture
def rich(rich_template, tmp_path):
    path = tmp_path / "index"
    shutil.copytree(rich_template, path)
    return _open(path)


def _lance_positions(index, where: str) -> np.ndarray:
    """Hot positions of Lance's answer to ``where`` (the system of record evaluates it)."""
    hot = index.hot_codes()
    rowaddr = index.store.dataset().to_table(columns=[], filter=where, with_row_address=True).column("_rowaddr")
    return hot.positions(np.sort(rowaddr.to_numpy()))


@pytest.mark.parametrize("where", FILTERS)
def test_datafusion_on_hot_columns_selects_what_lance_selects(rich, where):
    hot = rich.hot_codes()
    assert hot.dictionaries, "the few-valued string columns are dictionary-coded for filters"
    ours = HotFilter(hot.filterable).positions(where)  # DataFusion plans it: no fallback
    assert ours.dtype == np.int64 and np.all(np.diff(ours) > 0)
    assert np.array_equal(ours, _lance_positions(rich, where)), where
    assert np.array_equal(rich.stored.matching_rows(where), ours)


@pytest.mark.parametrize("where", LANCE_ONLY)
def test_lance_extensions_are_evaluated_by_lance(rich, where):
    hot = rich.hot_codes()
    with pytest.raises(UnplannedFilter):
        HotFilter(hot.filterable).positions(where)
    expected = _lance_positions(rich, where)
    assert expected.size > 0
    assert np.array_equal(rich.stored.matching_rows(where), expected)


@pytest.mark.parametrize(
    "where",
    [
        "source = 'web' AND n > 3",
        "title LIKE 'doc 1%' OR flag IS NULL",
        "`group` IN (1, 2)",
        "score_x < 0",
        "n IS NULL",
        "source = 'nothing'",
    ],
)
def test_filtered_search_equals_scoring_everything_then_filtering(rich, where):
    ids, scores = rich.scores([QUERY])  # every row, in table order (the order ties are broken in)
    keep = set(rich.store.read(["id"], where).column("id").to_pylist())  # Lance's answer
    kept = np.array([i for i, row_id in enumerate(ids) if row_id in keep], dtype=np.int64)
    for direction, sign in (("positive", -1.0), ("negative", 1.0)):
        table = rich.search(QUERY).where(where).limit(7).direction(direction).to_arrow()
        of_sign = kept[sign * scores[0][kept] < 0]  # a side holds only scores of its sign
        order = of_sign[np.lexsort((of_sign, sign * scores[0][of_sign]))][:7]
        assert table.column("id").to_pylist() == [ids[i] for i in order], (where, direction)
        np.testing.assert_allclose(table.column("score").to_numpy(), scores[0][order], rtol=1e-6)
        # The answer's metadata is the table's (from the hot copy).
        expected = rich.store.read(["id", "source", "n"], where).to_pylist()
        by_id = {row["id"]: row for row in expected}
        assert [{k: r[k] for k in ("id", "source", "n")} for r in table.to_pylist()] == [
            by_id[i] for i in table.column("id").to_pylist()
        ]
    # ... and the streaming route, where Lance evaluates the filter, agrees.
    both = rich.search(QUERY).where(where).limit(7).direction("both")
    assert both.to_arrow().column("id").to_pylist() == both.route("stream").to_arrow().column("id").to_pylist()


def test_a_repeated_filter_is_answered_from_the_cache_of_its_table_version(rich):
    where = "source = 'web' AND n > 3"
    first = rich.stored.matching_rows(where)
    assert rich.stored.matching_rows(where) is first  # same version: remembered
    _write_rows(rich, ROWS, 8, seed=99)  # a new commit: a new version, a new copy, evaluated again
    again = rich.stored.matching_rows(where)
    assert again is not first and again.size > first.size
    assert np.array_equal(again, _lance_positions(rich, where))


@pytest.mark.parametrize(
    "where, reason",
    [
        ("no_such_column = 1", "no_such_column"),
        ("n >", "n >"),
        ("title = 'x' AND AND", "AND AND"),
        ("id = 1", "id = 1"),
    ],
)
def test_a_bad_filter_is_an_input_error_naming_it_and_the_columns(rich, where, reason):
    with pytest.raises(InputError) as caught:
        rich.search(QUERY).where(where).to_arrow()
    message = str(caught.value)
    assert f"invalid where filter {where!r}" in message and reason in message
    assert "source" in message and "backticks" in message
    assert ".rs:" not in message and "/rust/" not in message, message


#: Filters Lance would run wrongly (it drops what follows a complete expression, and compares two
#: strings where double quotes were meant as a name): refused, at the position of the problem.
REFUSED = [
    ("source = 'web' ANDD n > 3", "at column 16: 'ANDD n > 3' is left over"),
    ("source = 'web' garbage", "at column 16: 'garbage' is left over"),
    ("1=1; DROP TABLE examples", "at column 4: ';' starts a second statement"),
    ("n > 3;", "at column 6: ';' starts a second statement"),
    ("SOURCE = 'web' AND flag flag", "at column 25: 'flag' is left over"),  # Lance's own names too
    ("n = 3\nOR n = 4 x", "at line 2, column 10"),
    ("EXISTS (SELECT 1)", "at column 9: subqueries are not filters"),
    ("n IN (SELECT n FROM examples)", "at column 7: subqueries are not filters"),
    ("n = 3 OR n = (select 1)", "at column 15: subqueries are not filters"),
    ("\"source\" = 'web'", "at column 1: the comparison 'source' = 'web' names no column"),
    ("1 = 1", "at column 1: the comparison 1 = 1 names no column"),
    ("n > 3 OR 'a' LIKE 'a%'", "at column 10: the comparison 'a' LIKE 'a%' names no column"),
    ("source = 'web' AND 2 BETWEEN 1 AND 3", "at column 20: the comparison 2 BETWEEN 1 AND 3 names no column"),
    # Names only Lance resolves (in any case) do not hide the rest of the filter from the check.
    ("SOURCE = 'web' OR 1 = 1", "at column 19: the comparison 1 = 1 names no column"),
    ("SOURCE = 'web' AND EXISTS (SELECT 1)", "at column 28: subqueries are not filters"),
]


@pytest.mark.parametrize("where, problem", REFUSED)
def test_a_filter_with_more_or_other_than_one_condition_on_columns_is_refused_where_it_goes_wrong(rich, where, problem):
    expect = f"invalid where filter {where!r}: {problem}"
    for run in (
        lambda: rich.search(QUERY).where(where).to_arrow(),
        lambda: rich.search(QUERY).where(where).route("stream").to_arrow(),
        lambda: rich.scores([QUERY], where=where),
        lambda: rich.stored.matching_rows(where),
    ):
        with pytest.raises(InputError) as caught:
            run()
        assert expect in str(caught.value) and "backticks" in str(caught.value), str(caught.value)
    if '"' in where:
        assert '"source" in double quotes is a string here, not a column: write `source`' in str(caught.value)


def test_filters_on_an_index_without_rows_match_nothing(fitted_index_template, tmp_path):
    path = tmp_path / "empty"
    shutil.copytree(fitted_index_template, path)
    shutil.rmtree(path / "examples.lance")
    index = _open(path)
    assert index.stored.matching_rows("`group` = 1").size == 0
    assert index.search(QUERY).where("`group` = 1").to_arrow().num_rows == 0


def test_matching_positions_needs_no_model(rich):
    from eogp_index.store.stored_index import StoredIndex

    stored = StoredIndex.open(rich.path)
    hot = stored.hot_codes()
    assert np.array_equal(matching_positions(hot, "n = 7", stored.store), _lance_positions(rich, "n = 7"))
