"""``where`` filters evaluated on the hot copy, in the SQL dialect Lance uses.

Lance evaluates a filter with DataFusion: it parses the string with sqlparser in a MySQL-like
dialect (backticks quote names, ``"double quotes"`` are strings) and plans it with DataFusion.
Here the same string goes to DataFusion's own parser, in the MySQL dialect and without
lower-casing names, over the hot copy's columns (:class:`~eogp_index.store.hot.HotCodes`,
memory-mapped Arrow). A filter then costs one pass over the columns it names: no round trip
through Lance, no search of row addresses. The answer is the sorted positions of the matching
rows in the hot copy, which the scan takes as they are.

Filters that DataFusion cannot plan or run here are handed to Lance, which reads the table:
Lance's own extensions (unquoted names in any case, its ``_rowid``/``_rowaddr`` columns,
``regexp_match`` as a predicate) and filters neither accepts, whose error Lance words
(:meth:`~eogp_index.store.table.Store.filter_error`). Either way the answer is cached on the hot
copy, that is per table version: a repeated filter costs a dictionary lookup.

Before either engine sees it, :func:`check_filter` parses the whole string with DataFusion's
parser over the table's columns and refuses, naming the position, what Lance would otherwise
drop or answer wrongly: text left over after the expression (``a = 1 ANDD b > 2`` would run as
``a = 1``), a second statement (``1=1; DROP TABLE x``), a subquery, and a comparison that names
no column (``"kind" = 'function'`` compares two strings: names take backticks, not double quotes).

Example:
    >>> positions = matching_positions(stored.hot_codes(), "module = 'json' AND n_chars < 100", stored.store)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import re
from collections import OrderedDict
from typing import List, Optional

import numpy as np
import pyarrow as pa

from eogp_index.store.hot import HotCodes, numpy_to_arrow
from eogp_index.store.table import CODE_COLUMNS, Store

#: The position column added to the columns DataFusion sees (not a stored column).
ROW_COLUMN = "_eogp_row"
#: Filters remembered per hot copy (most recently used kept), and the bytes their answers may hold.
CACHE_ENTRIES = 64
CACHE_BYTES = 256 << 20
#: DataFusion's settings for Lance's dialect: MySQL's quoting, names kept as written.
DATAFUSION_SETTINGS = {
    "datafusion.sql_parser.dialect": "MySQL",
    "datafusion.sql_parser.enable_ident_normalization": "false",
}


#: Lance's hidden row columns, which a filter may name.
LANCE_ROW_COLUMNS = ("_rowid", "_rowaddr", "_rowoffset")
#: DataFusion's operators that compare, and its expressions that do: each must involve a column.
COMPARISON_OPERATORS = frozenset({"=", "!=", "<", "<=", ">", ">=", "IS DISTINCT FROM", "IS NOT DISTINCT FROM"})
COMPARISON_VARIANTS = frozenset({"Like", "RLike", "SimilarTo", "Between", "InList"})
SUBQUERY_VARIANTS = frozenset({"Exists", "InSubquery", "ScalarSubquery"})
#: DataFusion's wording of a syntax error: ``SQL error: ParserError("Expected: ..., found: x at Line: 1, Column: 19")``.
_SYNTAX_ERROR = re.compile(
    r'SQL error: (?:Parser|Tokenizer)Error\("(?P<what>.*?)(?: at Line: (?P<line>\d+), '
    r'Column: (?P<column>\d+))?"\)',
    re.S,
)

_NAMED_TABLE = re.compile(r"Error during planning: table '[^']*' not found")
#: ``Schema error: No field named "KIND".`` (quoted) or ``... named kynd.``; not a dotted path.
_UNKNOWN_NAME = re.compile(r'Schema error: No field named (?:"([^"]+)"|([^\s."]+))\.(?:\s|$)')
MAX_UNKNOWN_NAMES = 16


class UnplannedFilter(Exception):
    """DataFusion could not plan or run a filter over the hot columns (Lance evaluates it)."""


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


class HotFilter:
    """DataFusion over one hot copy's columns; made once per copy, on its first filter.

    Args:
        columns: the copy's non-code columns (``HotCodes.filterable``), ``n >= 1`` rows.
    """

    def __init__(self, columns: pa.Table):
        n = columns.num_rows
        batches: List[pa.RecordBatch] = []
        at = 0
        for batch in columns.to_batches():
            if batch.num_rows == 0:
                continue
            rows = numpy_to_arrow(np.arange(at, at + batch.num_rows, dtype=np.uint32 if n < (1 << 32) else np.uint64))
            batches.append(pa.RecordBatch.from_arrays([*batch.columns, rows], names=[*batch.schema.names, ROW_COLUMN]))
            at += batch.num_rows
        # Contiguous runs of batches, one per core: each partition's matches come out in row order,
        # so the answer is sorted without sorting it.
        parts = max(1, min(_cpu_count(), len(batches)))
        size = -(-len(batches) // parts) if batches else 1
        partitions = [batches[i : i + size] for i in range(0, len(batches), size)]
        self._context = _context(parts)
        self._context.register_record_batches("hot", partitions)
        self._frame = self._context.table("hot")

    def positions(self, where: str) -> np.ndarray:
        """Sorted ``(m,)`` int64 positions of the rows matching ``where``.

        Raises:
            UnplannedFilter: DataFusion refused the filter (or failed running it).
        """
        from datafusion import col

        try:
            frame = self._frame.filter(self._frame.parse_sql_expr(where)).select(col(ROW_COLUMN))
            partitions = frame.collect_partitioned()
        except Exception as exc:  # DataFusion raises plain Exceptions for parse, plan and run errors
            raise UnplannedFilter(str(exc)) from exc
        parts = [batch.column(0).to_numpy() for part in partitions for batch in part if batch.num_rows]
        if not parts:
            return np.zeros(0, np.int64)
        return np.concatenate(parts).astype(np.int64)


def _context(partitions: int = 1):
    """A DataFusion session in Lance's dialect, ``partitions`` wide."""
    from datafusion import SessionConfig, SessionContext

    config = SessionConfig().with_target_partitions(partitions)
    for key, value in DATAFUSION_SETTINGS.items():
        config = config.set(key, value)
    return SessionContext(config)


@functools.lru_cache(maxsize=8)
def _checking_frame(schema: pa.Schema):
    """An empty DataFusion table of ``schema``'s filterable columns and Lance's row columns, to
    parse filters against (parsing resolves names, so it needs the columns)."""
    fields = [f for f in schema if f.name not in CODE_COLUMNS and f.name not in LANCE_ROW_COLUMNS]
    fields += [pa.field(name, pa.uint64()) for name in LANCE_ROW_COLUMNS]
    context = _context()
    context.register_record_batches("examples", [[pa.RecordBatch.from_pylist([], pa.schema(fields))]])
    return context.table("examples")


def _syntax_problem(where: str, error: str) -> Optional[str]:
    """DataFusion's syntax error as a sentence with its position; None for another error."""
    found = _SYNTAX_ERROR.search(error)
    if found is None:
        return None
    what = found["what"].replace('\\"', '"')  # Rust's debug quoting of the token found
    what = what.replace("Expected: end of expression", "expected the end of the filter")
    what = what.replace("Expected: ", "expected ")
    if found["column"] is None:
        return f"the filter ends too early ({what})"
    line, column = int(found["line"]), int(found["column"])
    at = f"column {column}" if "\n" not in where else f"line {line}, column {column}"
    rest = where.splitlines()[line - 1][column - 1 :] if line <= len(where.splitlines()) else ""
    if rest.startswith(";"):
        return f"at {at}: ';' starts a second statement; a filter is one SQL expression"
    if "expected the end of the filter" in what:
        return (
            f"at {at}: {rest[:40]!r} is left over after a complete expression; join conditions with "
            "AND / OR, and check the spelling of keywords"
        )
    return f"at {at}: {what}"


def _walk(expr) -> List:
    """``expr`` and every expression under it (DataFusion ``Expr``), parents first."""
    from datafusion.common import RexType

    out, todo = [], [expr]
    while todo:
        node = todo.pop()
        out.append(node)
        if node.rex_type() != RexType.Call or node.variant_name() in SUBQUERY_VARIANTS:
            continue
        try:
            todo.extend(reversed(node.rex_call_operands()))  # operands in the order written
        except Exception:  # noqa: BLE001 - an expression DataFusion's Python API cannot open: a leaf here
            continue
    return out


def _names_a_column(expr) -> bool:
    from datafusion.common import RexType

    return any(node.rex_type() == RexType.Reference for node in _walk(expr))


def _as_written(expr) -> str:
    """DataFusion's rendering of ``expr`` with its literals as SQL writes them (``Utf8("a")`` → ``'a'``)."""
    shown = re.sub(r'Utf8(?:View)?\("((?:[^"\\]|\\.)*)"\)', r"'\1'", expr.canonical_name())
    return re.sub(r"\b(?:U?Int\d+|Float\d+|Boolean|Decimal128)\(([^()]*)\)", r"\1", shown)


def _position(where: str, *needles: str) -> str:
    for needle in needles:
        at = where.lower().find(needle.lower()) if needle else -1
        if at >= 0:
            return f"at column {at + 1}: "
    return ""


def _subquery_problem(where: str) -> str:
    found = re.search(r"(?i)\bselect\b", where)
    at = f"at column {found.start() + 1}: " if found else ""
    return f"{at}subqueries are not filters; compare the stored columns with values"


def _semantic_problem(where: str, expr) -> Optional[str]:
    """A subquery, or a comparison without a column, in the parsed filter; None if neither."""
    from datafusion.common import RexType

    for node in _walk(expr):
        variant = node.variant_name()
        if variant == "Alias":  # ``n > 3 AS x``: DataFusion reads a trailing alias into the expression
            found = re.search(r"(?i)\bas\s+(`[^`]*`|\S+)\s*$", where)
            at = f"at column {found.start() + 1}: " if found else ""
            return f"{at}{found[0].strip() if found else 'an alias'!r} is left over; a filter has no alias"
        if variant in SUBQUERY_VARIANTS or node.rex_type() == RexType.ScalarSubquery:
            return _subquery_problem(where)
        compares = variant in COMPARISON_VARIANTS or (
            variant == "BinaryExpr" and node.rex_call_operator() in COMPARISON_OPERATORS
        )
        if compares and not _names_a_column(node):
            literals = [str(n.python_value()) for n in _walk(node) if n.rex_type() == RexType.Literal]
            first = literals[0] if literals else ""
            at = _position(where, f'"{first}"', f"'{first}'", first)
            hint = (
                f'"{first}" in double quotes is a string here, not a column: write `{first}`'
                if f'"{first}"' in where
                else "name a column bare or in backticks (`name`), a string in single quotes"
            )
            return f"{at}the comparison {_as_written(node)} names no column, so it is the same for every row; {hint}"
    return None


@functools.lru_cache(maxsize=256)
def _problem(where: str, schema: pa.Schema) -> Optional[str]:
    for _ in range(MAX_UNKNOWN_NAMES + 1):
        try:
            expr = _checking_frame(schema).parse_sql_expr(where)
        except Exception as exc:  # DataFusion raises plain Exceptions
            if _NAMED_TABLE.search(str(exc)):  # only a subquery's FROM names a table
                return _subquery_problem(where)
            unknown = _UNKNOWN_NAME.search(str(exc))
            if unknown is None:
                return _syntax_problem(where, str(exc))
            # A name DataFusion does not resolve (Lance's in any case, or a misspelt one: Lance
            # judges those) is added as a column, so that the rest of the filter is still checked.
            schema = schema.append(pa.field(unknown[1] or unknown[2], pa.string()))
            continue
        return _semantic_problem(where, expr)
    return None


def check_filter(where: str, schema: Optional[pa.Schema], store: Store) -> None:
    """Refuse a filter that is not exactly one SQL expression over the stored columns.

    Args:
        schema: the columns filters see (the hot copy's, or the table's; None: no table yet).
        store: the table, whose columns the error lists.

    Raises:
        InputError: text left over after the expression, a second statement, a subquery, or a
            comparison naming no column; the message gives the position and the stored columns.
    """
    problem = _problem(where, schema if schema is not None else pa.schema([]))
    if problem is not None:
        raise store.filter_error(where, ValueError(problem))


def _cache(hot: HotCodes) -> "OrderedDict[str, np.ndarray]":
    return hot.cache.setdefault("filters", OrderedDict())


def cached_positions(hot: HotCodes, where: str) -> Optional[np.ndarray]:
    """The remembered answer of ``where`` on this copy, or None."""
    found = _cache(hot).get(where)
    if found is not None:
        _cache(hot).move_to_end(where)
    return found


def _remember(hot: HotCodes, where: str, positions: np.ndarray) -> None:
    cache = _cache(hot)
    cache[where] = positions
    while len(cache) > CACHE_ENTRIES or (len(cache) > 1 and sum(v.nbytes for v in cache.values()) > CACHE_BYTES):
        cache.popitem(last=False)


def matching_positions(hot: HotCodes, where: str, store: Store) -> np.ndarray:
    """Sorted ``(m,)`` int64 positions in ``hot`` of the rows matching the SQL filter ``where``.

    DataFusion evaluates it over the hot columns; a filter it refuses is evaluated by Lance on
    ``store`` (at the copy's version), whose error is raised when Lance refuses it too.

    Raises:
        InputError: a filter neither engine accepts, or one :func:`check_filter` refuses, naming
            it and the columns.
    """
    found = cached_positions(hot, where)
    if found is not None:
        return found
    check_filter(where, hot.columns.schema, store)  # the hot copy's columns: no need to open the table
    if hot.num_rows == 0:
        return np.zeros(0, np.int64)
    try:
        engine = hot.cache.get("engine")
        if engine is None:
            engine = hot.cache["engine"] = HotFilter(hot.filterable)
        positions = engine.positions(where)
    except UnplannedFilter:
        matching = store.read([], where, with_row_address=True)  # raises the InputError of a bad filter
        positions = hot.positions(np.sort(matching.column("_rowaddr").to_numpy()))
    _remember(hot, where, positions)
    return positions
