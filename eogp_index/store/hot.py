"""The hot copy of the stored rows that queries read.

The LanceDB table stays the system of record, but a query must not wait on it: decoding a wide
``list<uint8>`` column runs far below memory bandwidth, and every round trip through Lance (a
filter, a take of the hits' rows) costs milliseconds. So a query reads a copy of the table held
in memory-mapped files:

* the codes (``signs`` and ``scales``, or ``coords``) in scanning dtypes, which the scan reads;
* every other column (ids, bookkeeping, metadata, text) as Arrow, which filters are evaluated on
  (:mod:`eogp_index.store.filters`) and the hits' rows are taken from.

On disk (``<index>/hot/``, schemas/store.md)::

    state.json        which pieces of which segments make up the copy of table version v
    seg-<name>/       one segment: the rows of some fragments, in row-address order
        segment.json  its fragments: [id, physical rows, deletions, first row, end row], and
                      the dictionaries of its dictionary-coded string columns
        rowaddr.npy   (n,) uint64 Lance row addresses
        signs.npy, scales.npy  or  coords.npy      the codes, (n, w) in scanning dtypes
        columns.arrow every other column, an uncompressed Arrow IPC file
        dict-<i>.npy  (n,) int32 codes of string column i when it has few distinct values (-1: null)

Opening the copy of the table's current version reads ``state.json`` and maps the files: no
step reads the rows, and none grows with the number of fragments. When the table has moved on,
the fragments still cached in a segment are reused, the others (new ones, or ones rewritten by a
compaction or deletions) are read from Lance into a new segment; more than
:data:`MAX_SEGMENTS` segments are merged into one. :func:`load_hot` with ``consolidate=True``
(what ``eogp optimize`` does) leaves a single segment, which opens without copying anything.

Before a segment is written, the free disk under ``<index>/hot`` is checked against the bytes it
takes (the arrays exactly, the Arrow columns estimated from the table's data files), and every
array file is allocated on disk before it is mapped: a write into a mapped hole of a full file
system would kill the process (SIGBUS). Without the room, :class:`~eogp_index.errors.NoSpaceError`
names the index, the bytes needed and the bytes free; nothing half-written is left, and the
table is untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from eogp_index.errors import EOGPError, NoSpaceError
from eogp_index.store.codecs import Codec, Encoded
from eogp_index.store.table import CODE_COLUMNS, Store

#: Record batches read from Lance are sized in bytes, not rows: a few thousand rows of wide codes
#: can already be tens of megabytes.
BATCH_BYTES = 64 << 20
#: The Arrow columns are written in record batches of this many rows: filters run them in
#: parallel, and a string column's 32-bit offsets never overflow.
ARROW_CHUNK_ROWS = 1 << 16
#: A copy made of more segments than this is merged into one segment when it is refreshed.
MAX_SEGMENTS = 4
#: String columns with at most this many distinct values in a segment also get dictionary codes
#: (``dict-<i>.npy``), on which filters compare integers instead of strings.
DICTIONARY_MAX_VALUES = 1 << 16
#: ... and values of at most this many bytes in all (they are kept in ``segment.json``).
DICTIONARY_MAX_BYTES = 1 << 20
#: Version of the on-disk layout above; another version is rebuilt.
HOT_FORMAT = 1
STATE_FILE = "state.json"
#: Segments being written: ``TMP_PREFIX<segment>.<pid of the writer>``.
TMP_PREFIX = ".tmp-"
#: Room counted for each segment's small files (``segment.json``, the ``.npy`` headers) and the state.
SMALL_FILES_BYTES = 64 << 10
SEGMENT_FILE = "segment.json"
COLUMNS_FILE = "columns.arrow"

#: A fragment as the copy knows it: (fragment id, physical rows, deleted rows).
FragmentKey = Tuple[int, int, int]
#: (segment name, first row, end row) of a run of consecutive rows of one segment.
Piece = Tuple[str, int, int]


def numpy_to_arrow(values: np.ndarray, valid: Optional[np.ndarray] = None) -> pa.Array:
    """A 1-D numeric numpy array as an Arrow array, zero-copy (``valid``: False where null).

    ``pa.array`` imports pandas the first time it runs (a few hundred ms), which would land on a
    process's first query; building from buffers does not.
    """
    values = np.ascontiguousarray(values)
    bitmap = None if valid is None else pa.py_buffer(np.packbits(np.asarray(valid, bool), bitorder="little"))
    return pa.Array.from_buffers(
        pa.from_numpy_dtype(values.dtype),
        values.shape[0],
        [bitmap, pa.py_buffer(values)],
        null_count=-1 if valid is not None else 0,
    )


def strings_to_arrow(values: Sequence[str], type: pa.DataType = pa.string()) -> pa.Array:
    """Python strings as an Arrow ``string`` / ``large_string`` array, without ``pa.array`` (see
    :func:`numpy_to_arrow`)."""
    encoded = [v.encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, np.int64 if pa.types.is_large_string(type) else np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return pa.Array.from_buffers(type, len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


class StaleHotCopyError(EOGPError):
    """Row addresses from the table are not in the hot copy: the table changed underneath it."""


@dataclass(frozen=True)
class HotCodes:
    """Every stored row, in row-address order.

    Attributes:
        rowaddr: ``(n,)`` uint64 Lance row addresses (``fragment_id << 32 | offset``), sorted.
        encoded: the code columns (:class:`~eogp_index.store.codecs.Encoded`, scanning dtypes):
            ``signs`` ``(n, nbytes)`` uint8 and ``scales`` ``(n, U)`` float32 (1-bit), or
            ``coords`` ``(n, K)`` float32.
        version: the table version the copy reflects.
        columns: every other column of the table (``id``, bookkeeping, metadata), ``n`` rows in
            the same order, as the table types them.
        dictionaries: dictionary-coded copies of the string columns with few distinct values
            (at most :data:`DICTIONARY_MAX_VALUES`), for filters (:attr:`filterable`).
        cache: per-copy memo (filters evaluated on this version: :mod:`eogp_index.store.filters`).
    """

    rowaddr: np.ndarray
    encoded: Encoded
    version: int
    columns: pa.Table = field(default_factory=lambda: pa.table({}))
    dictionaries: Dict[str, pa.ChunkedArray] = field(default_factory=dict, compare=False, repr=False)
    cache: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def filterable(self) -> pa.Table:
        """:attr:`columns` with the low-cardinality string columns dictionary-coded (same values,
        several times faster to compare): what filters are evaluated on."""
        table = self.columns
        for name, column in self.dictionaries.items():
            table = table.set_column(table.schema.get_field_index(name), name, column)
        return table

    @property
    def codes(self) -> Optional[np.ndarray]:
        return self.encoded.signs

    @property
    def scales(self) -> Optional[np.ndarray]:
        return self.encoded.scales

    @property
    def coords(self) -> Optional[np.ndarray]:
        return self.encoded.coords

    @property
    def num_rows(self) -> int:
        return int(self.rowaddr.shape[0])

    def positions(self, rowaddr: np.ndarray) -> np.ndarray:
        """Row addresses → positions in the hot arrays, ``(r,)`` int64."""
        rowaddr = np.asarray(rowaddr, dtype=np.uint64)
        pos = np.searchsorted(self.rowaddr, rowaddr)
        if pos.size and (pos.max() >= self.num_rows or not np.array_equal(self.rowaddr[pos], rowaddr)):
            raise StaleHotCopyError(
                "the in-memory copy of the codes is older than the table (another process "
                "changed it during this query); run the query again"
            )
        return pos.astype(np.int64)

    def take(self, positions: np.ndarray, columns: Optional[Sequence[str]] = None) -> pa.Table:
        """The non-code columns (all, or ``columns``) of the rows at ``positions``, in that order."""
        table = self.columns if columns is None else self.columns.select(list(columns))
        positions = np.asarray(positions, np.int64)
        if positions.size == 0:
            return table.slice(0, 0)
        # One-row slices of the record batches, in the order asked: zero-copy until the final
        # combine. (Arrow's take on a many-chunk table first concatenates every chunk of every
        # column, hundreds of MB of text, which takes far longer than the scan.)
        batches = table.to_batches()
        starts = np.cumsum([0] + [b.num_rows for b in batches])
        chunk = np.searchsorted(starts, positions, side="right") - 1
        rows = [batches[c].slice(int(p - starts[c]), 1) for c, p in zip(chunk.tolist(), positions.tolist())]
        return pa.Table.from_batches(rows, schema=table.schema).combine_chunks()


def _fragment_keys(dataset) -> List[Tuple[Any, FragmentKey]]:
    """``[(fragment, key)]`` of a dataset version, by fragment id (metadata only)."""
    fragments = sorted(dataset.get_fragments(), key=lambda f: f.fragment_id)
    return [(f, (int(f.fragment_id), int(f.physical_rows), int(f.num_deletions))) for f in fragments]


def _column_names(schema: pa.Schema) -> List[str]:
    return [name for name in schema.names if name not in CODE_COLUMNS]


# -- disk space -------------------------------------------------------------------------------------
def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says a file system is full (or a quota reached): ``OSError`` ENOSPC or
    EDQUOT, as Python and pyarrow raise it."""
    return isinstance(exc, OSError) and (
        exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc)
    )


def no_space_error(cache_dir: Path, needed: int) -> NoSpaceError:
    """The error for a hot copy of ``needed`` bytes that ``cache_dir``'s file system has no room for."""
    free = _free_bytes(cache_dir)
    index = cache_dir.parent
    more = f" (at least {needed - free:,} bytes more)" if needed > free else ""
    return NoSpaceError(
        f"no room on disk for the hot copy of the index {index}: it takes about {needed:,} bytes in "
        f"{cache_dir}, and that file system has {free:,} bytes free. The stored rows are intact, and "
        f"searches stream them from the table meanwhile (slower). Free space there{more}, then run "
        f"`eogp optimize {index}` to write the copy",
        path=str(cache_dir),
        needed=needed,
        free=free,
    )


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def segment_bytes(codec: Codec, schema: pa.Schema, rows: int, column_bytes: int) -> int:
    """Disk a segment of ``rows`` rows takes: row addresses and codes exactly, dictionary codes of
    every string column at most, ``column_bytes`` of Arrow columns, and its small files."""
    names = _column_names(schema)
    strings = sum(
        pa.types.is_string(schema.field(n).type) or pa.types.is_large_string(schema.field(n).type) for n in names
    )
    codes = sum(width * np.dtype(dtype).itemsize for width, dtype in codec.widths().values())
    return rows * (8 + codes + 4 * strings) + column_bytes + SMALL_FILES_BYTES


def _lance_column_bytes(fragments: Sequence[Any], rows: int, codec: Codec) -> int:
    """An estimate of the Arrow columns of ``fragments``' ``rows`` rows: their data files' bytes
    less the codes in them."""
    files = sum(d.file_size_bytes or 0 for f in fragments for d in f.metadata.data_files())
    codes = sum(width * np.dtype(dtype).itemsize for width, dtype in codec.widths().values())
    return max(0, files - rows * codes)


def _reserved_memmap(path: Path, dtype, shape: Tuple[int, ...]) -> np.memmap:
    """``np.lib.format.open_memmap(path, "w+", ...)`` with the file's disk blocks allocated first.

    The file numpy creates is a hole: its blocks are allocated only as the mapping is written,
    and on a full file system that write kills the process with SIGBUS. Allocated here, a full
    disk is an ``OSError`` (ENOSPC) instead.
    """
    array = np.lib.format.open_memmap(path, "w+", dtype, shape)
    size = path.stat().st_size
    if size:
        with open(path, "r+b") as f:
            allocate = getattr(os, "posix_fallocate", None)
            try:
                if allocate is None:
                    raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
                allocate(f.fileno(), 0, size)
            except OSError as exc:
                if is_no_space(exc):
                    raise
                # No allocation call here: writing the zeros allocates the blocks as well.
                f.seek(array.offset)
                chunk = bytes(1 << 20)
                for at in range(array.offset, size, len(chunk)):
                    f.write(chunk[: min(len(chunk), size - at)])
                f.flush()
    return array


# -- segments ---------------------------------------------------------------------------------------
class _Dictionary:
    """The running dictionary of one string column while a segment is written: its distinct
    values and each row's code (``-1`` for null), until it has too many values to be worth it."""

    def __init__(self, path: Path, rows: int):
        self.path = path
        self.codes = _reserved_memmap(path, np.int32, (rows,))
        self.values: Dict[str, int] = {}
        self.bytes = 0
        self.nulls = False

    def add(self, column: pa.ChunkedArray, at: int) -> bool:
        """Code the rows ``at:at+len(column)``; False once the column has too many values."""
        import pyarrow.compute as pc

        encoded = pc.dictionary_encode(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
        local = encoded.dictionary.to_pylist()
        if (
            len(self.values) + len(local) > DICTIONARY_MAX_VALUES
            and sum(v not in self.values for v in local) + len(self.values) > DICTIONARY_MAX_VALUES
        ):
            return False
        fresh = [v for v in local if v is not None and v not in self.values]
        self.bytes += sum(len(v.encode("utf-8")) for v in fresh)
        if self.bytes > DICTIONARY_MAX_BYTES:
            return False
        mapping = np.fromiter((self.values.setdefault(v, len(self.values)) for v in local), np.int32, len(local))
        indices = encoded.indices
        codes = mapping[indices.fill_null(0).to_numpy()] if len(local) else np.zeros(len(indices), np.int32)
        if indices.null_count:
            self.nulls = True
            codes[indices.is_null().to_numpy(zero_copy_only=False)] = -1
        self.codes[at : at + len(codes)] = codes
        return True


class _SegmentWriter:
    """Writes one segment from record batches; nothing is visible under its name until :meth:`close`.

    ``column_bytes``: the Arrow columns' bytes, estimated; with the arrays' own, what the free
    disk is checked against before anything is written (:class:`~eogp_index.errors.NoSpaceError`).
    """

    def __init__(self, folder: Path, codec: Codec, schema: pa.Schema, rows: int, column_bytes: int):
        self.folder = folder
        self.array_bytes = segment_bytes(codec, schema, rows, 0)
        self.needed = self.array_bytes + column_bytes
        # The Arrow columns' bytes in the batches seen so far: a full disk is reported with the
        # columns' size extrapolated from them, when that is more than the estimate.
        self.column_bytes_seen = self.rows_seen = 0
        if self.needed > _free_bytes(folder.parent):
            raise no_space_error(folder.parent, self.needed)
        # The writer's pid in the name: another process tidying the folder leaves it alone.
        self.tmp = folder.with_name(f"{TMP_PREFIX}{folder.name}.{os.getpid()}")
        self.tmp.mkdir(parents=True)
        self.rows = rows
        self.at = 0
        self.names = _column_names(schema)
        self.schema = pa.schema([schema.field(n) for n in self.names])
        self.arrays: Dict[str, np.memmap] = {}
        self.dictionaries: Dict[str, _Dictionary] = {}
        try:
            self.arrays["rowaddr"] = _reserved_memmap(self.tmp / "rowaddr.npy", np.uint64, (rows,))
            for name, (width, dtype) in codec.widths().items():
                self.arrays[name] = _reserved_memmap(self.tmp / f"{name}.npy", dtype, (rows, width))
            self.sink = pa.OSFile(str(self.tmp / COLUMNS_FILE), "wb")
            self.writer = pa.ipc.new_file(self.sink, self.schema)
            # String columns get dictionary codes for filters, until they show too many values.
            for i, name in enumerate(self.names):
                field_type = self.schema.field(name).type
                if pa.types.is_string(field_type) or pa.types.is_large_string(field_type):
                    self.dictionaries[name] = _Dictionary(self.tmp / f"dict-{i}.npy", rows)
        except BaseException as exc:
            self.abort()
            if is_no_space(exc):
                raise no_space_error(folder.parent, self.needed) from exc
            raise

    def write(self, rowaddr: np.ndarray, encoded: Encoded, columns: pa.Table) -> None:
        n = rowaddr.shape[0]
        self.arrays["rowaddr"][self.at : self.at + n] = rowaddr
        for name, values in encoded.columns().items():
            self.arrays[name][self.at : self.at + n] = values
        columns = columns.select(self.names).cast(self.schema)
        self.column_bytes_seen += columns.nbytes
        self.rows_seen += n
        for batch in columns.to_batches(max_chunksize=ARROW_CHUNK_ROWS):
            self.writer.write_batch(batch)
        for name in list(self.dictionaries):
            if not self.dictionaries[name].add(columns.column(name), self.at):
                dropped = self.dictionaries.pop(name)
                del dropped.codes
                dropped.path.unlink()
        self.at += n

    def close(self, fragments: List[list]) -> str:
        if self.at != self.rows:
            raise StaleHotCopyError(
                f"the table changed while its hot copy was written ({self.at} rows read, "
                f"{self.rows} expected); run the query again"
            )
        self.writer.close()
        self.sink.close()
        for array in self.arrays.values():
            array.flush()
        self.arrays.clear()
        dictionaries = {}
        for name, d in self.dictionaries.items():
            d.codes.flush()
            values = sorted(d.values, key=d.values.__getitem__)
            dictionaries[name] = {"file": d.path.name, "values": values, "nulls": d.nulls}
        self.dictionaries.clear()
        (self.tmp / SEGMENT_FILE).write_text(
            json.dumps({"format": HOT_FORMAT, "rows": self.rows, "fragments": fragments, "dictionaries": dictionaries})
        )
        self.tmp.rename(self.folder)  # a half-written segment is never picked up
        return self.folder.name

    def abort(self) -> None:
        # Closed and unmapped before the files go: an open file keeps its disk space after it is removed.
        sink = getattr(self, "sink", None)
        if sink is not None and not sink.closed:
            try:
                sink.close()
            except OSError:
                pass  # a full disk refuses the last bytes; the file is removed below
        self.arrays.clear()
        self.dictionaries.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def failed(self, exc: BaseException, cache_dir: Path) -> BaseException:
        """Remove what was written; the error to raise for ``exc`` (a full disk said as such)."""
        self.abort()
        if not is_no_space(exc):
            return exc
        seen = self.array_bytes + self.column_bytes_seen * self.rows // max(1, self.rows_seen)
        return no_space_error(cache_dir, max(self.needed, seen))


def _new_segment_name(version: int) -> str:
    return f"seg-{version}-{uuid.uuid4().hex[:12]}"


def _read_fragments(dataset, fragments: Sequence[Any], codec: Codec, sink) -> None:
    """Stream ``fragments`` (in this order) from Lance into ``sink(rowaddr, encoded, columns)``."""
    names = _column_names(dataset.schema)
    scanner = dataset.scanner(
        columns=names + list(codec.columns),
        fragments=list(fragments),
        with_row_address=True,
        batch_size_bytes=BATCH_BYTES,
        scan_in_order=True,
    )
    for batch in scanner.to_batches():
        if batch.num_rows == 0:
            continue
        table = pa.Table.from_batches([batch])
        sink(batch.column("_rowaddr").to_numpy().astype(np.uint64), codec.from_arrow(batch), table.select(names))


class _Segment:
    """One segment's files, memory-mapped."""

    def __init__(self, folder: Path, codec: Codec):
        meta = json.loads((folder / SEGMENT_FILE).read_text())
        if meta.get("format") != HOT_FORMAT:
            raise FileNotFoundError(f"{folder}: hot copy format {meta.get('format')}, not {HOT_FORMAT}")
        self.name = folder.name
        self.rows = int(meta["rows"])
        self.fragments: List[list] = meta["fragments"]
        # "c" (copy-on-write) maps the file without copying and keeps the arrays writeable, which
        # the compiled scan kernels were compiled for; nothing ever writes to them.
        self.rowaddr = np.load(folder / "rowaddr.npy", mmap_mode="c")
        # named as the combined codes (an ensemble's checkpoints joined), as the segment writes them
        self.codes = {name: np.load(folder / f"{name}.npy", mmap_mode="c") for name in codec.widths()}
        for name, (width, _) in codec.widths().items():
            if self.codes[name].ndim != 2 or self.codes[name].shape[1] != width:
                # another layout: codes of fewer checkpoints (eogp add-checkpoint), read again
                raise ValueError(f"{folder}: {name} of width {self.codes[name].shape[1:]}, not {width}")
        with pa.memory_map(str(folder / COLUMNS_FILE), "r") as source:
            self.columns = pa.ipc.open_file(source).read_all()
        if self.rowaddr.shape[0] != self.rows or self.columns.num_rows != self.rows:
            raise FileNotFoundError(f"{folder}: incomplete hot copy segment")
        # {column: (codes (n,) int32, dictionary values as an Arrow array, whether any is null)}
        self.dictionaries = {}
        for name, d in meta.get("dictionaries", {}).items():
            values = strings_to_arrow(d["values"], self.columns.schema.field(name).type)
            self.dictionaries[name] = (np.load(folder / d["file"], mmap_mode="c"), values, bool(d["nulls"]))

    def dictionary_column(self, name: str, start: int, stop: int) -> pa.ChunkedArray:
        """Rows ``start:stop`` of a dictionary-coded column, chunked as the Arrow file is."""
        codes, values, nulls = self.dictionaries[name]
        chunks = []
        for a in range(start, stop, ARROW_CHUNK_ROWS):
            part = codes[a : min(stop, a + ARROW_CHUNK_ROWS)]
            indices = numpy_to_arrow(np.maximum(part, 0), valid=part >= 0) if nulls else numpy_to_arrow(part)
            chunks.append(pa.DictionaryArray.from_arrays(indices, values))
        return pa.chunked_array(chunks, pa.dictionary(pa.int32(), values.type))


def _segment_folders(cache_dir: Path) -> List[Path]:
    return (
        sorted(p for p in cache_dir.iterdir() if p.is_dir() and p.name.startswith("seg-")) if cache_dir.exists() else []
    )


# -- the copy ---------------------------------------------------------------------------------------
def _empty(codec: Codec, schema: Optional[pa.Schema], version: int) -> HotCodes:
    columns = pa.schema([schema.field(n) for n in _column_names(schema)]).empty_table() if schema else pa.table({})
    return HotCodes(rowaddr=np.zeros(0, np.uint64), encoded=codec.empty(), version=version, columns=columns)


def _in_memory(dataset, codec: Codec) -> HotCodes:
    """The copy read straight from Lance, kept in memory only."""
    return fragments_in_memory(dataset, codec, [f.fragment_id for f, _ in _fragment_keys(dataset)])


def fragments_in_memory(
    dataset, codec: Codec, fragment_ids: Sequence[int], previous: Optional[HotCodes] = None
) -> HotCodes:
    """The copy of only the fragments ``fragment_ids`` of ``dataset`` (a Lance dataset, at the
    version the copy is pinned to), in memory, in row-address order: a shard's part of the table.

    ``previous``: an in-memory copy of an older version made by this function; the rows of its
    fragments that are unchanged since (same fragment id, physical rows and deletions: the keys
    are kept in its ``cache``) are reused, and only the new or changed fragments read from Lance.
    The codes are written into arrays of their final size, so that building the copy holds it
    once (plus one record batch), not its pieces and their concatenation.
    """
    wanted = set(int(f) for f in fragment_ids)
    fragments = [(f, key) for f, key in _fragment_keys(dataset) if key[0] in wanted]
    before: Dict[FragmentKey, Tuple[int, int]] = previous.cache.get("fragments", {}) if previous is not None else {}
    sizes = [before[key][1] - before[key][0] if key in before else f.count_rows() for f, key in fragments]
    rows = int(sum(sizes))
    if rows == 0:
        hot = _empty(codec, dataset.schema, dataset.version)
        hot.cache["fragments"] = {key: (0, 0) for _, key in fragments}
        return hot
    rowaddr = np.empty(rows, np.uint64)
    arrays = {name: np.empty((rows, width), dtype) for name, (width, dtype) in codec.widths().items()}
    tables: List[pa.Table] = []
    spans: Dict[FragmentKey, Tuple[int, int]] = {}
    at = 0

    def sink(addr, codes, columns):
        nonlocal at
        n = addr.shape[0]
        rowaddr[at : at + n] = addr
        for name, values in codes.columns().items():
            arrays[name][at : at + n] = values
        tables.append(columns)
        at += n

    for (f, key), size in zip(fragments, sizes):  # fragment order is row-address order
        start = at
        if key in before:
            a, b = before[key]
            sink(
                previous.rowaddr[a:b],
                Encoded(**{n: v[a:b] for n, v in previous.encoded.columns().items()}),
                previous.columns.slice(a, b - a),
            )
        else:
            _read_fragments(dataset, [f], codec, sink)
        if at - start != size:
            raise StaleHotCopyError(
                f"fragment {key[0]} of table version {dataset.version} read {at - start} rows, not {size}; "
                "the table changed while it was read: load the copy again"
            )
        spans[key] = (start, at)
    columns = pa.concat_tables(tables, promote_options="default").combine_chunks()
    hot = HotCodes(rowaddr=rowaddr, encoded=Encoded(**arrays), version=dataset.version, columns=columns)
    hot.cache["fragments"] = spans
    pa.default_memory_pool().release_unused()  # the record batches read: back to the system
    return hot


def _assemble(pieces: Sequence[Piece], segments: Dict[str, _Segment], codec: Codec, version: int) -> HotCodes:
    """The copy made of ``pieces``: views of the mapped files for one piece, else one copy."""
    parts = [(segments[name], start, stop) for name, start, stop in pieces]
    # Dictionary codes of the columns every piece has them for: filters read these instead.
    coded = set.intersection(*(set(seg.dictionaries) for seg, _, _ in parts))
    dictionaries = {
        name: pa.chunked_array([chunk for seg, a, b in parts for chunk in seg.dictionary_column(name, a, b).chunks])
        for name in sorted(coded)
    }
    if len(parts) == 1:
        seg, start, stop = parts[0]
        return HotCodes(
            rowaddr=seg.rowaddr[start:stop],
            encoded=Encoded(**{n: v[start:stop] for n, v in seg.codes.items()}),
            version=version,
            columns=seg.columns.slice(start, stop - start),
            dictionaries=dictionaries,
        )
    rowaddr = np.concatenate([seg.rowaddr[a:b] for seg, a, b in parts])
    encoded = Encoded(**{n: np.concatenate([seg.codes[n][a:b] for seg, a, b in parts]) for n in codec.widths()})
    columns = pa.concat_tables([seg.columns.slice(a, b - a) for seg, a, b in parts])
    return HotCodes(rowaddr=rowaddr, encoded=encoded, version=version, columns=columns, dictionaries=dictionaries)


def _read_state(cache_dir: Path) -> Optional[dict]:
    try:
        state = json.loads((cache_dir / STATE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError, OSError):
        return None
    return state if isinstance(state, dict) and state.get("format") == HOT_FORMAT else None


def _open_state(cache_dir: Path, state: Optional[dict], codec: Codec, version: int) -> Optional[HotCodes]:
    """The copy ``state`` describes, if it is of table ``version`` and its files are whole."""
    if state is None or state.get("table_version") != version or not state.get("pieces"):
        return None
    try:
        pieces = [tuple(p) for p in state["pieces"]]
        segments = {name: _Segment(cache_dir / name, codec) for name in {p[0] for p in pieces}}
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError, OSError, pa.ArrowInvalid):
        return None  # half removed (another process is rewriting it): build it again
    return _assemble(pieces, segments, codec, version)  # type: ignore[arg-type]


def _write_state(
    cache_dir: Path, version: int, pieces: Sequence[Piece], rows: int, stamp: Optional[Sequence[int]]
) -> None:
    """Record the copy of ``version``; ``stamp`` (:meth:`Store.stamp`) lets the next process trust
    that the table is still at ``version`` without opening it."""
    tmp = cache_dir / f".{STATE_FILE}.{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(
            json.dumps(
                {
                    "format": HOT_FORMAT,
                    "table_version": version,
                    "rows": rows,
                    "stamp": list(stamp) if stamp is not None else None,
                    "pieces": [list(p) for p in pieces],
                }
            )
        )
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: the state in place stays the one recorded
        raise
    os.replace(tmp, cache_dir / STATE_FILE)


def _writing(entry: Path) -> bool:
    """Whether ``entry`` is a segment another live process is still writing (``TMP_PREFIX…<pid>``)."""
    if not entry.name.startswith(TMP_PREFIX):
        return False
    pid = entry.name.rpartition(".")[2]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_unused(cache_dir: Path, keep: set) -> None:
    """Remove segments (and leftovers of an older layout) not in ``keep``, except those another
    live process is writing. A process still mapping one keeps reading it: the files live on until
    it unmaps them."""
    for entry in cache_dir.iterdir():
        if entry.name in keep or entry.name == STATE_FILE or _writing(entry):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f".{STATE_FILE}."):
            continue  # another process's state being written
        else:
            entry.unlink(missing_ok=True)


def _merge_pieces(pieces: List[Piece]) -> List[Piece]:
    """Join pieces that continue each other in the same segment."""
    out: List[Piece] = []
    for name, start, stop in pieces:
        if out and out[-1][0] == name and out[-1][2] == start:
            out[-1] = (name, out[-1][1], stop)
        else:
            out.append((name, start, stop))
    return out


def load_hot(store: Store, codec: Codec, cache_dir: Optional[Path], *, consolidate: bool = False) -> HotCodes:
    """The hot copy of ``store`` at its current version.

    With ``cache_dir`` the copy is kept there (module docstring): a copy of this version is
    mapped as it is; otherwise the cached fragments are reused and the others read from Lance.
    ``consolidate`` leaves one segment, so that the next process maps it without copying.
    ``cache_dir=None`` reads everything from Lance into memory.
    """
    state = _read_state(Path(cache_dir)) if cache_dir is not None else None
    if state is not None and not consolidate:
        # A copy recorded with the version directory's stamp, which has not changed since: the
        # table is at that version, and nothing needs Lance (or its import) to say so.
        store.adopt(state.get("table_version", -1), state.get("stamp"))
    version = store.version
    if version == 0:
        return _empty(codec, None, 0)
    if cache_dir is None:
        return _in_memory(store.dataset(), codec)
    cache_dir = Path(cache_dir)
    if not consolidate:
        hot = _open_state(cache_dir, state, codec, version)
        if hot is not None:
            return hot
    dataset = store.dataset()
    if dataset.version != version:  # a commit since the look above: copy the newer version
        version = dataset.version
    cache_dir.mkdir(parents=True, exist_ok=True)
    fragments = _fragment_keys(dataset)
    # Where each cached fragment's rows are: {key: (segment, first row, end row)}.
    cached: Dict[FragmentKey, Piece] = {}
    segments: Dict[str, _Segment] = {}
    names = _column_names(dataset.schema)
    for folder in _segment_folders(cache_dir):
        try:
            seg = _Segment(folder, codec)
        except (FileNotFoundError, ValueError, KeyError, OSError, pa.ArrowInvalid):
            continue  # another layout, or half removed: rebuilt below
        if seg.columns.schema.names != names:
            continue  # the table has gained a column (a new metadata field) since: its fragments are read again
        segments[seg.name] = seg
        for fid, physical, deleted, start, stop in seg.fragments:
            cached.setdefault((fid, physical, deleted), (seg.name, start, stop))
    missing = [(f, key) for f, key in fragments if key not in cached]
    if missing:
        rows = sum(f.count_rows() for f, _ in missing)
        name = _read_segment(dataset, [f for f, _ in missing], [k for _, k in missing], rows, codec, cache_dir)
        segments[name] = _Segment(cache_dir / name, codec)
        for fid, physical, deleted, start, stop in segments[name].fragments:
            cached[(fid, physical, deleted)] = (name, start, stop)
    pieces = _merge_pieces([cached[key] for _, key in fragments if cached[key][2] > cached[key][1]])
    used = {p[0] for p in pieces}
    whole = len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == segments[pieces[0][0]].rows
    if pieces and (len(used) > MAX_SEGMENTS or (consolidate and not whole)):
        name = _merge_segments(pieces, segments, fragments, cached, codec, cache_dir, version, dataset.schema)
        segments[name] = _Segment(cache_dir / name, codec)
        pieces, used = [(name, 0, segments[name].rows)], {name}
    rows = sum(stop - start for _, start, stop in pieces)
    stamp = store.stamp()
    try:
        _write_state(cache_dir, version, pieces, rows, stamp if store.version == version else None)
    except OSError as exc:
        if is_no_space(exc):
            raise no_space_error(cache_dir, SMALL_FILES_BYTES) from exc
        raise
    _remove_unused(cache_dir, used)
    if not pieces:
        return _empty(codec, dataset.schema, version)
    return _assemble(pieces, segments, codec, version)


def _read_segment(
    dataset, fragments: Sequence[Any], keys: Sequence[FragmentKey], rows: int, codec: Codec, cache_dir: Path
) -> str:
    """Read ``fragments`` from Lance into a new segment; its name."""
    column_bytes = _lance_column_bytes(fragments, rows, codec)
    writer = _SegmentWriter(cache_dir / _new_segment_name(dataset.version), codec, dataset.schema, rows, column_bytes)
    try:
        _read_fragments(dataset, fragments, codec, writer.write)
        # Each fragment's rows are contiguous: count them from the row addresses written.
        fragment_of = writer.arrays["rowaddr"][: writer.at] >> np.uint64(32)
        spans = []
        for fid, physical, deleted in keys:
            start = int(np.searchsorted(fragment_of, np.uint64(fid), side="left"))
            stop = int(np.searchsorted(fragment_of, np.uint64(fid), side="right"))
            spans.append([fid, physical, deleted, start, stop])
        return writer.close(spans)
    except BaseException as exc:
        error = writer.failed(exc, cache_dir)
        if error is exc:
            raise
        raise error from exc


def _merge_segments(
    pieces: Sequence[Piece],
    segments: Dict[str, _Segment],
    fragments,
    cached,
    codec: Codec,
    cache_dir: Path,
    version: int,
    schema: pa.Schema,
) -> str:
    """Copy ``pieces`` into one new segment; its name.

    The pieces are the fragments' rows in fragment order, so fragment ``j`` lands right after
    fragments ``0..j-1``.
    """
    rows = sum(stop - start for _, start, stop in pieces)
    column_bytes = sum(segments[name].columns.slice(a, b - a).nbytes for name, a, b in pieces)
    writer = _SegmentWriter(cache_dir / _new_segment_name(version), codec, schema, rows, column_bytes)
    try:
        for name, start, stop in pieces:
            seg = segments[name]
            step = max(1, BATCH_BYTES // max(1, sum(v.shape[1] * v.itemsize for v in seg.codes.values())))
            for a in range(start, stop, step):
                b = min(stop, a + step)
                writer.write(
                    np.asarray(seg.rowaddr[a:b]),
                    Encoded(**{n: v[a:b] for n, v in seg.codes.items()}),
                    seg.columns.slice(a, b - a),
                )
        spans, at = [], 0
        for _, key in fragments:
            _, start, stop = cached[key]
            length = max(0, stop - start)
            spans.append([*key, at, at + length])
            at += length
        return writer.close(spans)
    except BaseException as exc:
        error = writer.failed(exc, cache_dir)
        if error is exc:
            raise
        raise error from exc
