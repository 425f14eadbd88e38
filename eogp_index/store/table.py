"""Stage 4: the LanceDB table of stored examples (the system of record).

One row per training example (schemas/store.md):

=================  ==========================================  =================================
column             type                                        meaning
=================  ==========================================  =================================
id                 string                                      unique example id
signs              fixed_size_list<uint8>[Σ⌈k_u/8⌉]             packed signs (1-bit precision)
scales             fixed_size_list<float16>[U]                 per-module scales (1-bit)
coords             fixed_size_list<float16|float32>[Σk_u]      coordinates (fp16/fp32 precision)
shard              string                                      source shard name
position           int64                                       line/row in the shard
num_tokens         int32                                       tokens after truncation
num_loss_tokens    int32                                       tokens that count in the loss
truncated          bool                                        cut to ``max_tokens``
(metadata)         as brought by the user                      typed, usable in SQL filters
=================  ==========================================  =================================

Each :meth:`Store.add` is one Lance commit, so a reader sees a batch entirely or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pyarrow as pa

from eogp_index.errors import InputError
from eogp_index.store.codecs import Encoded, fixed_size_list, list_column_to_numpy  # noqa: F401  (re-exported)

RESERVED_COLUMNS = ("id", "signs", "scales", "coords", "shard", "position", "num_tokens", "num_loss_tokens",
                    "truncated", "content_sha256", "content_kind", "text")
CODE_COLUMNS = ("signs", "scales", "coords")
#: ", /home/.../rust/lance/src/dataset/scanner.rs:839:33": where in Lance's Rust source an error arose
_LANCE_SOURCE = re.compile(r",?\s*\S+\.rs:\d+:\d+")


@dataclass(frozen=True)
class RowInfo:
    """Bookkeeping columns of a batch of examples, in row order."""

    ids: Sequence[str]
    shards: Sequence[str]
    positions: Sequence[int]
    num_tokens: Sequence[int]
    num_loss_tokens: Sequence[int]
    truncated: Sequence[bool]
    metadata: Sequence[Dict[str, Any]]
    #: format 2: SHA-256 of each record's content, and its kind ("text", "chat", "tokens")
    content_sha256: Optional[Sequence[str]] = None
    content_kind: Optional[Sequence[str]] = None
    #: with ``--store-text``: the document as a person reads it (None: over the size cap)
    text: Optional[Sequence[Optional[str]]] = None


def build_rows(info: RowInfo, encoded: Encoded, *, schema: Optional[pa.Schema] = None) -> pa.Table:
    """Assemble an Arrow table for :meth:`Store.add`.

    Metadata values become typed columns; with ``schema`` (the table's, once it exists) they are
    cast to it, and a value that does not fit raises :class:`InputError` naming the field.
    """
    columns: Dict[str, pa.Array] = {"id": pa.array(list(info.ids), pa.string())}
    for name, values in encoded.columns().items():
        columns[name] = fixed_size_list(values)
    columns["shard"] = pa.array(list(info.shards), pa.string())
    columns["position"] = pa.array(list(info.positions), pa.int64())
    columns["num_tokens"] = pa.array(list(info.num_tokens), pa.int32())
    columns["num_loss_tokens"] = pa.array(list(info.num_loss_tokens), pa.int32())
    columns["truncated"] = pa.array(list(info.truncated), pa.bool_())
    for name in ("content_sha256", "content_kind", "text"):
        values = getattr(info, name)
        if values is not None:
            columns[name] = pa.array(list(values), pa.string())
    fields = sorted({key for row in info.metadata for key in row})
    for name in fields:
        if name in RESERVED_COLUMNS:
            raise InputError(f"metadata field {name!r} clashes with a reserved column; rename it", reason="reserved")
        values = [row.get(name) for row in info.metadata]
        target = schema.field(name).type if schema is not None and name in schema.names else None
        try:
            columns[name] = pa.array(values, type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(
                f"metadata field {name!r} has values that do not fit column type {target or 'inferred'}: {exc}",
                reason=f"metadata type mismatch in {name!r}",
            ) from exc
    table = pa.table(columns)
    if schema is not None:
        missing = [f.name for f in schema if f.name not in table.column_names]
        for name in missing:  # a metadata column absent from this batch: null, typed as the table's
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
        extra = [n for n in table.column_names if n not in schema.names]
        if extra:
            raise InputError(
                f"metadata fields {extra} are not columns of the existing table (its columns: {schema.names}); "
                "ingest with the same metadata fields as before",
                reason="new metadata fields",
            )
        table = table.select(schema.names)
    return table


class Store:
    """The LanceDB table of an index.

    Args:
        uri: a LanceDB URI (a local directory or an object-store URI LanceDB supports).
        table_name: the table's name inside it.
    """

    def __init__(self, uri: str | Path, table_name: str = "examples"):
        import lancedb

        self.uri = str(uri)
        self.table_name = table_name
        self._db = lancedb.connect(self.uri)
        self._table = None

    @property
    def table(self):
        """The LanceDB table, or ``None`` before the first row is stored."""
        if self._table is None and self.table_name in self._db.list_tables().tables:
            self._table = self._db.open_table(self.table_name)
        return self._table

    def add(self, rows: pa.Table) -> int:
        """Append rows in one commit; returns the table version after it."""
        if self.table is None:
            self._table = self._db.create_table(self.table_name, rows, mode="create", exist_ok=False)
        else:
            self._table.add(rows)
        return self._table.version

    def drop(self) -> None:
        """Delete the table (``eogp fit --overwrite`` of an index whose table lives elsewhere)."""
        self._db.drop_table(self.table_name)
        self._table = None

    @property
    def schema(self) -> Optional[pa.Schema]:
        return self.table.schema if self.table is not None else None

    def count(self, where: Optional[str] = None) -> int:
        if self.table is None:
            return 0
        return self.table.count_rows(where) if where else self.table.count_rows()

    @property
    def version(self) -> int:
        """The latest committed version (other processes may have committed since we opened)."""
        if self.table is None:
            return 0
        self.table.checkout_latest()
        return self.table.version

    def metadata_columns(self) -> List[str]:
        if self.table is None:
            return []
        return [name for name in self.table.schema.names if name not in CODE_COLUMNS]

    def existing_ids(self, where: Optional[str] = None) -> set[str]:
        """Ids already stored (optionally of the rows matching ``where``)."""
        if self.table is None:
            return set()
        ids = self.dataset().to_table(columns=["id"], filter=where).column("id")
        return set(ids.to_pylist())

    def dataset(self):
        """The pylance dataset behind the table, at its latest version."""
        self.table.checkout_latest()
        return self.table.to_lance()

    def read(self, columns: Sequence[str], where: Optional[str] = None, *, with_row_address: bool = False) -> pa.Table:
        """Read ``columns`` of the rows matching the SQL filter ``where`` (all rows if None).

        With ``with_row_address`` a ``_rowaddr`` uint64 column is added (Lance row addresses:
        stable until the table is compacted).
        """
        if self.table is None:
            empty = {c: pa.array([]) for c in columns}
            if with_row_address:
                empty["_rowaddr"] = pa.array([], pa.uint64())
            return pa.table(empty)
        try:
            return self.dataset().to_table(columns=list(columns), filter=where, with_row_address=with_row_address)
        except (ValueError, OSError) as exc:  # pylance reports bad filters as either
            if where is None:
                raise
            raise self.filter_error(where, exc) from exc

    def batches(self, scanner, where: Optional[str] = None) -> Iterator[pa.RecordBatch]:
        """Record batches of a Lance scanner, with a bad ``where`` reported as :class:`InputError`."""
        try:
            yield from scanner.to_batches()
        except (ValueError, OSError) as exc:
            if where is None:
                raise
            raise self.filter_error(where, exc) from exc

    def filter_error(self, where: str, exc: Exception) -> InputError:
        """What a user reads for a filter Lance refused: its reason, without Lance's source location."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        reason = _LANCE_SOURCE.sub("", reason).removeprefix("Invalid user input: ").strip()
        # Lance's list of valid fields includes its hidden row columns; the message lists ours instead.
        reason = re.sub(r"Valid fields are [^.]*\.", "", reason).strip().rstrip(".")
        return InputError(
            f"invalid where filter {where!r}: {reason[:300]}. Filters are SQL over the stored columns "
            f"{[c for c in self.metadata_columns() if c not in CODE_COLUMNS]}; quote names that are SQL "
            "keywords or contain spaces with backticks (`group` = 1), strings with single quotes",
            reason="invalid filter",
        )

    def take_rows(self, rowaddr: Sequence[int], columns: Sequence[str]) -> pa.Table:
        """Rows by Lance row address, in the order given."""
        if len(rowaddr) == 0:
            return self.read(columns, "false")
        return self.dataset()._take_rows(pa.array(list(rowaddr), pa.uint64()), columns=list(columns))

    def create_scalar_index(self, column: str, kind: str = "BTREE") -> None:
        """Index a filter column (``BTREE`` for ranges and many distinct values, ``BITMAP`` for few).

        Lance uses the index for ``where`` filters on that column; see :meth:`explain`.
        """
        import warnings

        if self.table is None:
            raise InputError("the index has no rows yet; ingest before indexing columns")
        if column not in self.metadata_columns() or column in RESERVED_COLUMNS[:4]:
            raise InputError(f"no filterable column {column!r}; the table's columns are {self.metadata_columns()}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # create_scalar_index is the documented call for this in lancedb 0.4x
            self.table.create_scalar_index(column, index_type=kind, replace=True)

    def explain(self, where: str) -> str:
        """Lance's plan for a filter: shows ``ScalarIndexQuery`` when a scalar index is used."""
        return self.dataset().scanner(columns=[], filter=where, with_row_address=True).explain_plan()
