"""Stage 4: the LanceDB table of stored examples (the system of record).

One row per training example (schemas/store.md):

=================  ==========================================  =================================
column             type                                        meaning
=================  ==========================================  =================================
id                 string                                      unique example id
signs              fixed_size_list<uint8>[Σ⌈k_u/8⌉]             packed signs (1-bit precision)
scales             fixed_size_list<float16>[U]                 per-module scales (1-bit)
coords             fixed_size_list<float16|float32>[Σk_u]      coordinates (fp16/fp32 precision)
tier, tier_scales  fixed_size_list<int8|uint8|float16>, <f16>  the rescoring tier (format 3)
shard              string                                      source shard name
position           int64                                       line/row in the shard
num_tokens         int32                                       tokens after truncation
num_loss_tokens    int32                                       tokens that count in the loss
truncated          bool                                        cut to ``max_tokens``
(metadata)         as brought by the user                      typed, usable in SQL filters
=================  ==========================================  =================================

Each :meth:`Store.add` is one Lance commit, so a reader sees a batch entirely or not at all. The
table is read and written with pylance (``import lance``); LanceDB is not imported on these paths
(its import alone takes seconds).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from eogp_index.errors import InputError
from eogp_index.store.codecs import Encoded, fixed_size_list, list_column_to_numpy  # noqa: F401  (re-exported)

#: An ensemble's checkpoint ``j >= 1`` code column: ``signs_c1``, ``tier_scales_c2``
#: (:func:`~eogp_index.store.codecs.checkpoint_column`).
_CHECKPOINT_CODE = re.compile(r"(signs|scales|coords|tier|tier_scales)_c[1-9][0-9]*")


class _CodeNames(tuple):
    """A tuple of column names whose ``in`` also holds an ensemble's checkpoint code columns of
    the code columns it holds, so that every ``name in CODE_COLUMNS`` test (filters, the hot copy,
    the server's schema) treats checkpoint ``j``'s as checkpoint 0's."""

    def __contains__(self, name) -> bool:
        if tuple.__contains__(self, name):
            return True
        found = _CHECKPOINT_CODE.fullmatch(name) if isinstance(name, str) else None
        return found is not None and tuple.__contains__(self, found.group(1))


RESERVED_COLUMNS = _CodeNames(
    (
        "id",
        "signs",
        "scales",
        "coords",
        "shard",
        "position",
        "num_tokens",
        "num_loss_tokens",
        "truncated",
        "content_sha256",
        "content_kind",
        "text",
        "tier",
        "tier_scales",
    )
)


#: The code columns: never metadata, never in the hot copy's columns (the hot copy holds the
#: one-bit codes; the rescoring tier is read from the table by row address).
CODE_COLUMNS = _CodeNames(("signs", "scales", "coords", "tier", "tier_scales"))
#: The rescoring tier's columns are read a few rows at a time by row address. Lance's full-zip
#: layout reads each row's own bytes; its mini-block layout, which it picks for narrow columns
#: (``tier_scales``, a small int4 tier), reads a whole chunk of kilobytes for each row taken. The
#: field metadata is read when the table is created (by any writer: the first rows' schema) and
#: kept by every later append and compaction; rows of an older table without it append as before.
RANDOM_ACCESS = _CodeNames(("tier", "tier_scales"))
FULL_ZIP = {"lance-encoding:structural-encoding": "fullzip"}
#: Lance reads two byte ranges of one take as one read when fewer bytes than its block size (4 KiB
#: on a local disk) lie between them, and reads the gap too: the 16-byte tier scales of rows a few
#: hundred rows apart would cost kilobytes each. Takes by row address on a local disk open the
#: table with this block size, so that a take reads the rows' own bytes.
TAKE_BLOCK_SIZE = 64
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


def build_rows(
    info: RowInfo, encoded: Union[Encoded, Dict[str, np.ndarray]], *, schema: Optional[pa.Schema] = None
) -> pa.Table:
    """Assemble an Arrow table for :meth:`Store.add`; ``encoded``: the codes, or ``{table column:
    (n, w) array}`` (an ensemble's, split per checkpoint by :meth:`Codec.split`).

    Metadata values become typed, nullable columns (a list of scalars: an Arrow ``list``); with
    ``schema`` (the table's, once it exists) they are cast to it, and a value that does not fit
    raises :class:`InputError` naming the field. A field with no value yet (only nulls) makes no
    column; a field the table lacks comes after the table's columns (:meth:`Store.add` adds it).
    """
    columns: Dict[str, pa.Array] = {"id": pa.array(list(info.ids), pa.string())}
    for name, values in (encoded.columns() if isinstance(encoded, Encoded) else encoded).items():
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
            column = pa.array(values, type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(
                f"metadata field {name!r} has values that do not fit column type {target or 'inferred'}: {exc}",
                reason=f"metadata type mismatch in {name!r}",
            ) from exc
        if target is None and _untyped(column.type):
            continue  # only nulls (or empty lists) so far: the column is made when a value says its type
        columns[name] = column
    table = _for_random_access(pa.table(columns))
    if schema is not None:
        missing = [f.name for f in schema if f.name not in table.column_names]
        for name in missing:  # a metadata column absent from this batch: null, typed as the table's
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
        new = [name for name in table.column_names if name not in schema.names]  # added by Store.add
        table = table.select(schema.names + new)
    return table


def code_batch(columns: Dict[str, np.ndarray]) -> pa.Table:
    """Code columns ``{table column: (n, w) array}`` as a table written as :func:`build_rows`
    writes them (the tier's columns laid out for random access)."""
    return _for_random_access(pa.table({name: fixed_size_list(values) for name, values in columns.items()}))


def _for_random_access(table: pa.Table) -> pa.Table:
    """``table`` with the full-zip layout asked for its :data:`RANDOM_ACCESS` columns."""
    if not any(name in RANDOM_ACCESS for name in table.column_names):
        return table
    fields = [
        f.with_metadata({**(f.metadata or {}), **FULL_ZIP}) if f.name in RANDOM_ACCESS else f for f in table.schema
    ]
    return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def _untyped(kind: pa.DataType) -> bool:
    """Whether Arrow inferred no type: all nulls, or lists without a non-null item."""
    return pa.types.is_null(kind) or (pa.types.is_list(kind) and _untyped(kind.value_type))


#: A local table's version directory whose last change is this recent is checked again on the
#: next access: a commit within the file system's timestamp granularity of the one we saw would
#: otherwise leave the directory's modification time unchanged.
RACY_NS = 1_000_000_000
#: An object-store table (no cheap "did it change" check) is asked for its latest version at most
#: this often; a commit by this process is seen at once.
REMOTE_REFRESH_S = 1.0


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


class Store:
    """The Lance table of an index: one dataset, ``<uri>/<table_name>.lance``, read with pylance.

    A store follows the table's latest version without asking Lance on every access: a local
    table is re-read only when its ``_versions`` directory changed (one ``stat``), an
    object-store table at most every :data:`REMOTE_REFRESH_S` seconds. Commits made through this
    object are seen at once; commits by other processes on the next access (local) or within
    that interval (object stores). :meth:`refresh` with ``force=True`` asks Lance now.

    Args:
        uri: a directory or an object-store URI (``s3://bucket/prefix``) holding the table, laid
            out as LanceDB lays out its tables (so LanceDB opens it too).
        table_name: the table's name inside it.
    """

    def __init__(self, uri: str | Path, table_name: str = "examples"):
        from eogp_index.data.location import index_path, lance_target

        self.uri = str(uri)
        self.table_name = table_name
        self.local = _is_local(self.uri)
        # (index_path refuses a URL no layer reads, rather than a local folder named "s3:")
        self.path, self.storage_options = lance_target(index_path(self.uri) / f"{table_name}.lance")
        self._dataset = None  # the LanceDataset, opened when first needed
        self._version: Optional[int] = None  # the latest version seen (0: no table); None: not looked yet
        self._stamp: Optional[tuple] = None  # (mtime_ns, inode) of _versions when last checked, local
        self._checked_ns = 0  # wall clock of the last check (local) / monotonic clock (remote)
        self._schema: Optional[tuple] = None  # (dataset, its Arrow schema)
        self._take: Optional[tuple] = None  # (dataset, the same version opened for takes)
        #: monotonic time of the last removal of old versions through this object (set by
        #: ``maintenance.optimize``; ``maybe_optimize`` spaces them out)
        self.cleaned_at: Optional[float] = None

    # -- following the table's versions ------------------------------------------------------------
    def _versions_dir(self) -> str:
        return os.path.join(self.path, "_versions")

    def refresh(self, *, force: bool = False) -> None:
        """Follow commits made since the last look, cheaply (see the class docstring)."""
        if self.local:
            try:
                stat = os.stat(self._versions_dir())
            except FileNotFoundError:  # no table (yet, or any more)
                self._dataset, self._stamp, self._version = None, None, 0
                return
            stamp = (stat.st_mtime_ns, stat.st_ino)
            settled = self._checked_ns - stat.st_mtime_ns > RACY_NS
            if not force and self._version is not None and stamp == self._stamp and settled:
                return
            same_table = self._stamp is not None and stamp[1] == self._stamp[1]
            self._stamp, self._checked_ns = stamp, time.time_ns()
            if not force and same_table and self._is_latest_v2():
                return
        else:
            now = time.monotonic_ns()
            if not force and self._version is not None and now - self._checked_ns < REMOTE_REFRESH_S * 1e9:
                return
            self._checked_ns = now
        self._open_latest()

    def _manifest_v2(self, version: int) -> str:
        """Where Lance's V2 manifest naming (its default for new tables) puts version's
        manifest: ``_versions/{2^64 - 1 - version:020d}.manifest``, so that a listing finds the
        latest first."""
        return os.path.join(self._versions_dir(), f"{(1 << 64) - 1 - version:020d}.manifest")

    def _is_latest_v2(self) -> bool:
        """Whether the open dataset is still the latest version, answered with two ``stat`` calls.

        Versions are consecutive and a commit is the creation of the next manifest, so the open
        version is the latest exactly when the next one's manifest does not exist. Asking Lance
        instead (``latest_version``) lists ``_versions``, whose files pile up between cleanups:
        during a long ingest that listing, once per commit, made each commit slower than the last.
        False (ask Lance) for a table without V2 manifest names.
        """
        if self._dataset is None or not self._version:
            return False
        if not os.path.exists(self._manifest_v2(self._version)):
            return False
        return not os.path.exists(self._manifest_v2(self._version + 1))

    def _open_latest(self) -> None:
        import lance

        if self._dataset is None:
            try:
                self._dataset = lance.dataset(self.path, storage_options=self.storage_options)
            except (FileNotFoundError, ValueError, OSError):  # no table there
                self._dataset, self._version = None, 0
                return
        else:
            latest = self._dataset.latest_version
            if latest != self._dataset.version:
                self._dataset = self._dataset.checkout_version(latest)
        self._version = self._dataset.version

    def stamp(self) -> Optional[tuple]:
        """The local version directory's ``(mtime_ns, inode)`` at the current version, when no
        commit can hide behind it (its last change is older than :data:`RACY_NS` before it was
        looked at); None otherwise, and for object stores. See :meth:`adopt`."""
        self.refresh()
        if not self.local or self._stamp is None or self._checked_ns - self._stamp[0] <= RACY_NS:
            return None
        return self._stamp

    def settle(self) -> None:
        """Wait (at most :data:`RACY_NS`) until the last commit is old enough for :meth:`stamp`, then
        look again: what ``eogp optimize`` does before it records the hot copy's stamp."""
        if not self.local:
            return
        try:
            mtime = os.stat(self._versions_dir()).st_mtime_ns
        except FileNotFoundError:
            return
        wait = RACY_NS - (time.time_ns() - mtime)
        if wait > 0:
            time.sleep(wait / 1e9 + 0.01)
        self.refresh(force=True)

    def adopt(self, version: int, stamp: Optional[Sequence[int]]) -> bool:
        """Take ``version`` as the table's latest without opening the table (no Lance import, no
        manifest read), if its version directory still has ``stamp``, which :meth:`stamp` gave
        when ``version`` was the latest (the hot copy records it). Only before the first look."""
        if not self.local or stamp is None or self._version is not None:
            return False
        try:
            stat = os.stat(self._versions_dir())
        except FileNotFoundError:
            return False
        if (stat.st_mtime_ns, stat.st_ino) != tuple(stamp):
            return False
        self._stamp, self._version, self._checked_ns = tuple(stamp), int(version), time.time_ns()
        return True

    @property
    def table(self):
        """The table as a ``lance.LanceDataset`` at its latest version, or ``None`` before the first
        row is stored."""
        self.refresh()
        if self._dataset is None and self._version:  # adopted (or dropped under us): open it now
            self._open_latest()
        return self._dataset

    def dataset(self):
        """The pylance dataset behind the table, at its latest version (the table must exist)."""
        dataset = self.table
        if dataset is None:
            raise InputError(f"{self.path} holds no table yet; ingest first")
        return dataset

    @property
    def version(self) -> int:
        """The latest committed version (0 before the first commit); no I/O unless it changed."""
        self.refresh()
        return self._version or 0

    # -- writing ----------------------------------------------------------------------------------
    def add(self, rows: pa.Table) -> int:
        """Append rows in one commit; returns the table version after it.

        Columns of ``rows`` the table lacks (a new metadata field) are added to the table first,
        in a commit of their own that stores nothing: the rows already there hold null.
        """
        import lance

        if self.table is None:
            self._dataset = lance.write_dataset(rows, self.path, mode="create", storage_options=self.storage_options)
        else:
            names = self.schema.names  # (cached per dataset version)
            new = [field for field in rows.schema if field.name not in names]
            if new:  # a metadata field the table lacks: a null column for the rows stored before
                self._dataset.add_columns(new)  # (in place: the cached schema of this dataset is stale)
                self._schema = None
            # Committed from the open dataset: Lance rebases it over commits made meanwhile by
            # others (appends never conflict), without re-opening the table from its path,
            # which lists every version's manifest.
            self._dataset.insert(rows)
        self._version = self._dataset.version
        return self._version

    def drop(self) -> None:
        """Delete the table (``eogp fit --overwrite`` of an index whose table lives elsewhere)."""
        import lance

        if self.table is not None:
            lance.LanceDataset.drop(self.path, storage_options=self.storage_options, ignore_not_found=True)
        self._dataset, self._stamp, self._version = None, None, 0

    # -- reading ----------------------------------------------------------------------------------
    @property
    def schema(self) -> Optional[pa.Schema]:
        dataset = self.table
        if dataset is None:
            return None
        if self._schema is None or self._schema[0] is not dataset:  # Lance converts it on every call
            self._schema = (dataset, dataset.schema)
        return self._schema[1]

    def count(self, where: Optional[str] = None, *, dataset=None) -> int:
        """Rows matching ``where`` (all when None) in ``dataset`` (default: the table as it is now);
        0 before the first row."""
        dataset = self.table if dataset is None else dataset
        if dataset is None:
            return 0
        try:
            return dataset.count_rows(where) if where else dataset.count_rows()
        except (ValueError, OSError) as exc:
            if where is None:
                raise
            raise self.filter_error(where, exc) from exc

    def fragment_count(self) -> int:
        """Fragments of the latest version (from its manifest, already in memory)."""
        dataset = self.table
        return len(dataset.get_fragments()) if dataset is not None else 0

    def metadata_columns(self) -> List[str]:
        schema = self.schema
        if schema is None:
            return []
        return [name for name in schema.names if name not in CODE_COLUMNS]

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
            field="where",
        )

    def take_rows(self, rowaddr: Sequence[int] | np.ndarray, columns: Sequence[str]) -> pa.Table:
        """Rows by Lance row address ``(r,)`` (a list or a uint64 array), in the order given."""
        if len(rowaddr) == 0:
            return self.read(columns, "false")
        return self._take_dataset()._take_rows(pa.array(np.asarray(rowaddr, np.uint64)), columns=list(columns))

    def _take_dataset(self):
        """The dataset takes read: on a local disk the latest version opened again with
        :data:`TAKE_BLOCK_SIZE` (sharing the table's session: its caches), once per version."""
        import lance

        dataset = self.dataset()
        if not self.local:
            return dataset
        if self._take is None or self._take[0] is not dataset:
            again = lance.dataset(
                self.path,
                version=dataset.version,
                block_size=TAKE_BLOCK_SIZE,
                session=dataset.session(),
                storage_options=self.storage_options,
            )
            self._take = (dataset, again)
        return self._take[1]

    def take_reads(self) -> tuple[int, int]:
        """Read operations and bytes of the takes by row address since the last call (Lance's I/O
        statistics of the dataset takes read)."""
        stats = self._take_dataset().io_stats_incremental()
        return int(stats.read_iops), int(stats.read_bytes)

    # -- scalar indexes ---------------------------------------------------------------------------
    def create_scalar_index(self, column: str, kind: str = "BTREE") -> None:
        """Index a filter column (``BTREE`` for ranges and many distinct values, ``BITMAP`` for few).

        Lance uses the index for ``where`` filters on that column; see :meth:`explain`.
        """
        if self.table is None:
            raise InputError("the index has no rows yet; ingest before indexing columns")
        if column not in self.metadata_columns() or column in RESERVED_COLUMNS[:4]:
            raise InputError(f"no filterable column {column!r}; the table's columns are {self.metadata_columns()}")
        self.dataset().create_scalar_index(column, index_type=kind, replace=True)
        self.refresh(force=True)

    def index_names(self) -> List[str]:
        """Names of the table's scalar indexes."""
        dataset = self.table
        return [str(index.name) for index in dataset.describe_indices()] if dataset is not None else []

    def explain(self, where: str) -> str:
        """Lance's plan for a filter: shows ``ScalarIndexQuery`` when a scalar index is used."""
        return self.dataset().scanner(columns=[], filter=where, with_row_address=True).explain_plan()
