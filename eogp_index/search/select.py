"""Data selection and score export: the documents most influential for a target set, as a file.

:func:`select_documents` ranks every stored row (matching ``where``) by its influence on a set
of target queries and keeps the top ``N`` or top ``P%``; :func:`write_selection` writes those
documents' original records, each with a ``score`` field, ready for fine-tuning;
:func:`write_scores` exports every (row, query) score. All three stream the table in record
batches (:data:`~eogp_index.search.searchers.STREAM_BATCH_BYTES`), so memory holds one batch,
the running selection and its records, never the whole table; outputs are written atomically
(:func:`atomic_output`).

A document's score over the target set:

* ``mean`` (the default): the mean of its scores over the queries, exact in one scan because
  scores are linear in the projected query gradient (``⟨ȳ, x_i⟩``);
* ``max``: its best score over the queries, LESS's rule (``direction="negative"``: its lowest).

With ``normalize="unit"`` each row is scored by its stored code divided by its exact norm
(cosine to the targets, as LESS selects), as the query builder's ``.normalize("unit")`` scores
it (:mod:`eogp_index.search.normalize`).

Example:
    >>> picked = select_documents(index, targets, SelectOptions(top="10%"))  # doctest: +SKIP
    >>> write_selection(index.stored, picked, "subset.jsonl.gz")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from eogp_index.config import SelectOptions, check_score_precision
from eogp_index.data.location import index_path, is_remote, upload
from eogp_index.data.records import content_sha256, location_of, record_content
from eogp_index.errors import ConfigError, InputError
from eogp_index.search.normalize import normalized_codes
from eogp_index.search.question import Question, check_question
from eogp_index.search.rescore import decoded_tier
from eogp_index.search.searchers import STREAM_BATCH_BYTES, exact_scores
from eogp_index.store.stored_index import StoredIndex, _record_from_text

__all__ = [
    "Question",
    "SelectOptions",
    "Selection",
    "select_documents",
    "write_selection",
    "write_scores",
    "write_score_batches",
    "atomic_output",
]


@dataclass(frozen=True)
class Selection:
    """Selected rows, best first: Lance row addresses ``(n,)`` uint64 and scores ``(n,)`` float32."""

    rowaddr: np.ndarray
    scores: np.ndarray
    options: SelectOptions


def scored_batches(
    stored: StoredIndex,
    y: np.ndarray,
    *,
    where: Optional[str] = None,
    columns: Sequence[str] = (),
    batch_bytes: int = STREAM_BATCH_BYTES,
    normalize: str = "none",
    precision: str = "1bit",
    fragment_ids: Optional[Sequence[int]] = None,
    version: Optional[int] = None,
) -> Iterator[Tuple[pa.RecordBatch, np.ndarray]]:
    """The matching rows in record batches, each with its exact scores ``(nq, b)`` float32
    (with ``normalize="unit"``, of each row's code divided by its norm), in table order.

    ``precision="1bit"`` scores the code the queries scan; ``"rescore"`` the rescoring tier
    (:func:`tier_scores`; ``y`` then holds the queries' coordinates at the tier's width). Only
    the scored code's columns, ``_rowaddr`` and ``columns`` are read, one batch at a time.
    ``fragment_ids`` and ``version``: only these fragments, of this table version
    (:func:`scored_fragments`).

    Raises:
        ConfigError: ``precision="rescore"`` on an index without a tier (:func:`require_tier`).
    """
    fragments = scored_fragments(
        stored,
        y,
        where=where,
        columns=columns,
        batch_bytes=batch_bytes,
        normalize=normalize,
        precision=precision,
        fragment_ids=fragment_ids,
        version=version,
    )
    for _, batches in fragments:
        yield from batches


def scored_fragments(
    stored: StoredIndex,
    y: np.ndarray,
    *,
    where: Optional[str] = None,
    columns: Sequence[str] = (),
    batch_bytes: int = STREAM_BATCH_BYTES,
    normalize: str = "none",
    precision: str = "1bit",
    fragment_ids: Optional[Sequence[int]] = None,
    version: Optional[int] = None,
) -> Iterator[Tuple[int, Iterator[Tuple[pa.RecordBatch, np.ndarray]]]]:
    """:func:`scored_batches` fragment by fragment: ``(fragment id, its scored batches)`` in the
    table's fragment order, each fragment scanned on its own.

    Scanning one fragment at a time makes the batches, and so every output written from them,
    the same whichever process scores which fragments: ``eogp scores --ray`` gives each shard
    some fragments (``fragment_ids``, at the pinned ``version``; None: every fragment of the
    latest version) and writes the shards' batches in this order.
    """
    check_score_precision(precision)
    tier = require_tier(stored) if precision == "rescore" else None
    dataset = pinned_table(stored, version)
    if dataset is None:
        return
    code_columns = stored.codec.columns if tier is None else tier.columns
    wanted = list(dict.fromkeys([*code_columns, *columns]))
    for fragment in table_fragments(dataset, fragment_ids):
        scanner = dataset.scanner(
            columns=wanted, filter=where, fragments=[fragment], with_row_address=True, batch_size_bytes=batch_bytes
        )
        yield fragment.fragment_id, _scored(stored, scanner, where, tier, y, normalize)


def _scored(stored: StoredIndex, scanner, where, tier, y: np.ndarray, normalize: str):
    for batch in stored.store.batches(scanner, where):
        if not batch.num_rows:
            continue
        if tier is not None:
            yield batch, tier_scores(tier, batch, y, normalize)
        else:
            codes = normalized_codes(stored.codec.from_arrow(batch), stored.layout, normalize)
            yield batch, exact_scores(codes, stored.one_bit(y), stored.layout)


def pinned_table(stored: StoredIndex, version: Optional[int] = None):
    """The table's ``lance.LanceDataset`` at ``version`` (None: the latest), or None before the
    first row is stored."""
    table = stored.store.table
    if table is None or version is None or table.version == version:
        return table
    return table.checkout_version(version)


def table_fragments(dataset, fragment_ids: Optional[Sequence[int]] = None) -> List[Any]:
    """The dataset's fragments in table order; only those in ``fragment_ids`` when given."""
    fragments = dataset.get_fragments()
    if fragment_ids is None:
        return fragments
    wanted = set(fragment_ids)
    return [f for f in fragments if f.fragment_id in wanted]


def count_at(stored: StoredIndex, where: Optional[str], version: Optional[int] = None) -> int:
    """The rows matching ``where`` at ``version`` (None: the latest); 0 before the first row."""
    dataset = pinned_table(stored, version)
    return 0 if dataset is None else stored.store.count(where, dataset=dataset)


def require_tier(stored: StoredIndex):
    """The index's rescoring tier (:class:`~eogp_index.store.codecs.TierCodec`); refused, saying
    how to get one, when it has none."""
    if stored.tier is None:
        raise ConfigError(
            f"precision 'rescore' scores every row from the index's rescoring tier, and {stored.path} has none "
            f"(it stores {stored.manifest.precision} codes only); refit with `eogp fit --rescore int8` and ingest "
            "again, or score with --precision 1bit",
            field="precision",
        )
    return stored.tier


def tier_scores(tier, batch, y: np.ndarray, normalize: str = "none") -> np.ndarray:
    """Exact scores ``(nq, b)`` float32 of a record batch's tier codes against ``y`` ``(nq, K)``:
    the tier decoded to float32 (:func:`~eogp_index.search.rescore.decoded_tier`, unit rows with
    ``normalize="unit"``) and multiplied in float32."""
    x = decoded_tier(tier, batch, normalize)  # (b, T) float32
    y = np.asarray(y, np.float32)
    if y.shape[1] != x.shape[1]:
        raise ConfigError(
            f"the queries have {y.shape[1]} coordinates and the rescoring tier {x.shape[1]}; score the tier "
            "with the queries' coordinates at the tier's width"
        )
    return (y @ x.T).astype(np.float32)


def select_documents(
    index,
    question: Union[Question, Sequence[Any]],
    options: SelectOptions = SelectOptions(),
    *,
    batch_bytes: int = STREAM_BATCH_BYTES,
) -> Selection:
    """The top documents for a target set: the question's queries (texts, chats, records), scored
    over the rows matching its ``where``, with its ``normalize``; ``options`` say how many and by
    which rule (:class:`SelectOptions`). A sequence of queries is a question with the defaults.

    Raises:
        InputError: no queries, or what :func:`~eogp_index.search.question.check_question` refuses.
    """
    work = selection_work(index, question, options)
    return finish_selection(work, *best_rows(index.stored, work, batch_bytes=batch_bytes))


@dataclass(frozen=True)
class SelectionWork:
    """What every part of a selection scans with: the checked question, the options, how many
    rows are kept (``keep``), the targets' coordinates ``y`` ``(1, K)`` for ``mean`` or
    ``(nq, K)`` for ``max``, and the table version counted and scanned."""

    question: Question
    options: SelectOptions
    keep: int
    y: np.ndarray
    version: Optional[int]

    @property
    def sign(self) -> float:
        """+1 keeps the largest scores, -1 the smallest."""
        return 1.0 if self.options.direction == "positive" else -1.0


def selection_work(index, question: Union[Question, Sequence[Any]], options: SelectOptions) -> SelectionWork:
    """Checks the question, counts the matching rows at the table's latest version (pinned) and
    measures the targets once: what :func:`best_rows` needs, on any process."""
    question = _question(question, "select")
    stored: StoredIndex = index.stored
    check_question(question, stored)  # before Lance counts or scans: it would drop what it cannot parse
    if options.precision == "rescore":
        require_tier(stored)  # before the queries are measured
    version = stored.store.version if stored.store.table is not None else None
    keep = options.count(count_at(stored, question.where, version))
    y = target_coordinates(index, question.queries, options.precision, question.checkpoint_weights)
    if options.score == "mean":
        y = y.astype(np.float64).mean(axis=0, keepdims=True).astype(np.float32)
    return SelectionWork(question, options, keep, y, version)


def best_rows(
    stored: StoredIndex,
    work: SelectionWork,
    *,
    batch_bytes: int = STREAM_BATCH_BYTES,
    fragment_ids: Optional[Sequence[int]] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """The ``work.keep`` best rows of ``fragment_ids`` (None: every fragment): row addresses
    ``(n,)`` uint64 and keys ``(n,)`` float32 (``sign * score``, larger is better), unordered.

    The best ``keep`` of every part's best ``keep`` are the best ``keep`` of all the rows
    (:func:`merge_best`), so shards' parts merge exactly.
    """
    best_addr = np.zeros(0, np.uint64)
    best_key = np.zeros(0, np.float32)
    if not work.keep:
        return best_addr, best_key
    sign, rule = work.sign, work.options.score
    batches = scored_batches(
        stored,
        work.y,
        where=work.question.where,
        batch_bytes=batch_bytes,
        normalize=work.question.normalize,
        precision=work.options.precision,
        fragment_ids=fragment_ids,
        version=work.version,
    )
    for batch, scores in batches:
        key = sign * (scores[0] if rule == "mean" else (scores.max(0) if sign > 0 else scores.min(0)))
        rowaddr = batch.column("_rowaddr").to_numpy().astype(np.uint64)
        best_addr, best_key = merge_best([(best_addr, best_key), (rowaddr, key.astype(np.float32))], work.keep)
    return best_addr, best_key


def merge_best(parts: Sequence[Tuple[np.ndarray, np.ndarray]], keep: int) -> Tuple[np.ndarray, np.ndarray]:
    """The ``keep`` best of several ``(rowaddr, key)`` parts (:func:`_best`'s order)."""
    rowaddr = np.concatenate([np.zeros(0, np.uint64), *(p[0] for p in parts)])
    key = np.concatenate([np.zeros(0, np.float32), *(p[1] for p in parts)])
    return _best(rowaddr, key, keep)


def finish_selection(work: SelectionWork, rowaddr: np.ndarray, key: np.ndarray) -> Selection:
    """The selection of the best rows' ``(rowaddr, key)``: best first, ties by row address."""
    order = np.lexsort((rowaddr, -key))
    return Selection(rowaddr[order], (work.sign * key[order]).astype(np.float32), work.options)


def target_coordinates(index, queries: Sequence[Any], precision: str, weights=None) -> np.ndarray:
    """The target queries' coordinates ``(nq, K)`` float32 for scoring at ``precision``: the
    encoder's projection (the one-bit code and the tier share their coordinates), an ensemble's
    checkpoints weighted (``weights``; None: the index's, :meth:`StoredIndex.weigh`)."""
    return index.stored.weigh(index.query_coordinates(list(queries)), weights)


def _question(question: Union[Question, Sequence[Any]], command: str) -> Question:
    """``question``, or a question of these queries with the defaults; refused without queries."""
    if not isinstance(question, Question):
        question = Question(queries=tuple(question))
    if not question.queries:
        raise InputError(f"{command} needs at least one target query", field="queries")
    return question


def _best(rowaddr: np.ndarray, key: np.ndarray, keep: int) -> Tuple[np.ndarray, np.ndarray]:
    """The ``keep`` largest keys, ties at the boundary broken by the lower row address, so that
    the selection does not depend on how the table was split into batches."""
    if key.size <= keep:
        return rowaddr, key
    threshold = -np.partition(-key, keep - 1)[keep - 1]
    above = np.flatnonzero(key > threshold)
    tied = np.flatnonzero(key == threshold)
    tied = tied[np.argsort(rowaddr[tied], kind="stable")[: keep - above.size]]
    chosen = np.concatenate([above, tied])
    return rowaddr[chosen], key[chosen]


# -- writing ---------------------------------------------------------------------------------------


def output_kind(path: Path) -> str:
    """``jsonl``, ``jsonl.gz`` or ``parquet``, from the output file's name."""
    name = index_path(path).name.lower()
    for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
        if name.endswith(suffix):
            return suffix[1:]
    raise ConfigError(f"--out {path}: name the output .jsonl, .jsonl.gz or .parquet")


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Any]:
    """A binary file that appears at ``path`` whole, or not at all.

    On Linux the file is written unnamed (``O_TMPFILE``) and linked in only when complete, so
    a process killed mid-write (even by SIGKILL) leaves nothing behind; elsewhere it is written
    to a hidden temporary name in the same folder, removed on any error, then renamed. An
    object-store URL (``s3://bucket/out.parquet``): written locally, then uploaded in one request.
    """
    target = index_path(path)
    if is_remote(target):
        with tempfile.TemporaryDirectory(prefix="eogp-out-") as folder:
            local = Path(folder) / target.name
            with open(local, "wb") as handle:
                yield handle
            upload(local, target)
        return
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"--out {path}: the folder {folder} does not exist")
    fd = None
    if hasattr(os, "O_TMPFILE"):
        with contextlib.suppress(OSError):  # file systems without O_TMPFILE support
            fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o644)
    if fd is not None:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
            staged = folder / f".{path.name}.{os.getpid()}.done"
            # linkat(AT_SYMLINK_FOLLOW) names the open file; a plain link() of the /proc path would not.
            proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(f"self/fd/{handle.fileno()}", staged, src_dir_fd=proc, follow_symlinks=True)
            finally:
                os.close(proc)
        os.replace(staged, path)
        return
    handle = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".partial", delete=False)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise


class _Writer:
    """Rows to a JSONL (optionally gzipped) or Parquet file object; JSONL lines may be given raw."""

    def __init__(self, handle, kind: str):
        self.kind = kind
        self.handle = gzip.GzipFile(fileobj=handle, mode="wb", mtime=0) if kind == "jsonl.gz" else handle
        self.parquet = None
        self.schema: Optional[pa.Schema] = None

    def line(self, raw: bytes) -> None:
        if self.kind == "parquet":  # raw bytes in a Parquet file would be read as no rows at all
            raise ValueError("a Parquet output takes records or tables, not JSON lines")
        self.handle.write(raw + b"\n")

    def records(self, rows: List[Dict[str, Any]]) -> None:
        if self.kind == "parquet":  # every field of every record a column (records of two kinds differ)
            names = list(dict.fromkeys(name for row in rows for name in row))
            self.table(pa.table({name: [row.get(name) for row in rows] for name in names}))
        else:
            for row in rows:
                self.line(json.dumps(row, ensure_ascii=False, default=str).encode("utf-8"))

    def table(self, table: pa.Table) -> None:
        if self.kind != "parquet":
            self.records(table.to_pylist())
            return
        import pyarrow.parquet as pq

        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.handle, table.schema)
            self.schema = table.schema
        elif table.schema != self.schema:
            schema = self.schema
            for name in schema.names:  # a field these records lack is null in them
                if name not in table.column_names:
                    table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
            try:
                if set(table.column_names) - set(schema.names):
                    raise KeyError(sorted(set(table.column_names) - set(schema.names)))
                table = table.select(schema.names).cast(schema)
            except (KeyError, ValueError, pa.ArrowInvalid) as exc:
                raise InputError(
                    f"the selected records' columns differ between shards ({table.schema.names} vs "
                    f"{schema.names}); write .jsonl instead of .parquet"
                ) from exc
        self.parquet.write_table(table)

    def close(self, empty_schema: Optional[pa.Schema] = None) -> None:
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            if self.parquet is None:
                self.parquet = pq.ParquetWriter(
                    self.handle, empty_schema or pa.schema([("id", pa.string()), ("score", pa.float32())])
                )
            self.parquet.close()
        elif self.kind == "jsonl.gz":
            self.handle.close()


def with_score(line: bytes, score: float) -> bytes:
    """A JSON object's line with ``"score": score`` added as its last field, bytes otherwise kept."""
    body = line.rstrip(b"\r\n").rstrip()
    if not body.endswith(b"}"):
        raise InputError("a selected line is not a JSON object")
    head = body[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b", "
    return head + sep + b'"score": ' + json.dumps(float(score)).encode() + b"}"


def write_selection(stored: StoredIndex, selection: Selection, out: Path) -> int:
    """Write the selected documents to ``out`` (.jsonl, .jsonl.gz or .parquet); returns how many.

    Records are written in corpus order (shard by shard, line by line), each read back from its
    shard with its content hash checked against the stored one (as ``explain`` does), or rebuilt
    from the stored text when the shard cannot be read; into a JSON Lines output, a JSON Lines
    shard's lines are copied byte for byte with ``"score"`` added last (into Parquet they are
    parsed, each record a row). With ``ids_only`` only ``id`` and ``score`` are
    written, best first.
    """
    kind = output_kind(out)
    columns = ["id", "shard", "position", "content_sha256", "content_kind"]
    if not selection.options.ids_only and not stored.manifest.has_content_hashes:
        raise InputError(
            f"{stored.path} records no content hashes (index format "
            f"{stored.manifest.format_version}), so records read back could not be checked; "
            "use --ids-only, or re-ingest into an index made by this version"
        )
    rows = stored.store.take_rows(selection.rowaddr.tolist(), ["id"] if selection.options.ids_only else columns)
    with atomic_output(out) as handle:
        writer = _Writer(handle, kind)
        if selection.options.ids_only:
            writer.table(pa.table({"id": rows.column("id"), "score": pa.array(selection.scores, pa.float32())}))
        else:
            listed = rows.append_column("_rowaddr", pa.array(selection.rowaddr, pa.uint64())).to_pylist()
            for shard, picked in _by_shard(listed, selection.scores):
                _write_shard(stored, writer, shard, picked)
        writer.close()
    return len(selection.rowaddr)


def _by_shard(rows: List[Dict[str, Any]], scores: np.ndarray) -> Iterator[Tuple[str, List[Dict[str, Any]]]]:
    groups: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for row, score in zip(rows, scores.tolist()):
        groups[row["shard"]].append({**row, "score": score})
    for shard in sorted(groups):
        yield shard, sorted(groups[shard], key=lambda r: r["position"])


def _write_shard(stored: StoredIndex, writer: _Writer, shard: str, picked: List[Dict[str, Any]]) -> None:
    from eogp_index.data.readers import detect_format

    try:
        uri, spec = stored.sources.shard(shard)
        fmt, compression = detect_format(uri)
        readable = Path(uri.split("::")[0]).exists()
    except InputError:
        readable, uri, spec, fmt, compression = False, None, None, None, None
    if not readable:
        # Stored text is read only here, for the shard that cannot be read, one shard at a time.
        has_text = "text" in stored.store.schema.names
        texts = (
            stored.store.take_rows([r["_rowaddr"] for r in picked], ["text"]).column("text").to_pylist()
            if has_text
            else [None] * len(picked)
        )
        picked = [{**row, "text": text} for row, text in zip(picked, texts)]
        if any(row["text"] is None for row in picked):
            missing = next(row for row in picked if row["text"] is None)
            raise InputError(
                f"example {missing['id']!r}: its shard {shard!r} cannot be read "
                f"({uri or 'not recorded in sources.json'}) and its text is not stored; restore the "
                "shard where it was ingested from, or use --ids-only"
            )
        spec = _stored_text_spec(stored, shard)
        writer.records(
            [
                _checked({**_record_from_text(r["text"], r["content_kind"], spec)}, r, spec, "its stored text")
                | {"score": r["score"]}
                for r in picked
            ]
        )
        return
    if fmt == "jsonl":
        records = []
        for row, line in zip(picked, _jsonl_lines(Path(uri), compression, [r["position"] for r in picked], shard)):
            record = _checked(json.loads(line), row, spec, uri)
            if writer.kind == "parquet":  # the records become rows; their lines cannot be copied
                records.append(record | {"score": row["score"]})
            else:
                writer.line(with_score(line, row["score"]))
        if records:
            writer.records(records)
    elif fmt == "parquet" and writer.kind == "parquet":
        for table, rows in _parquet_rows(Path(uri), picked):
            for row, record in zip(rows, table.to_pylist()):
                _checked(record, row, spec, uri)
            writer.table(table.append_column("score", pa.array([r["score"] for r in rows], pa.float64())))
    else:
        from eogp_index.data.readers import iter_raw_records

        wanted = {r["position"]: r for r in picked}
        out = []
        for raw in iter_raw_records(uri, shard=shard):
            row = wanted.get(raw.position)
            if row is not None and isinstance(raw.record, dict):
                out.append(_checked(raw.record, row, spec, uri) | {"score": row["score"]})
        _require_all(out, picked, shard, uri)
        writer.records(out)


def _stored_text_spec(stored: StoredIndex, shard: str):
    from eogp_index.data.records import RecordSpec

    recorded = stored.sources.data["shards"].get(shard, {}).get("record_spec", {})
    return RecordSpec(**recorded) if recorded else RecordSpec()


def _checked(record: Dict[str, Any], row: Dict[str, Any], spec, where: str) -> Dict[str, Any]:
    """``record`` if its content hashes to the stored one; else an :class:`InputError` naming it."""
    content = record_content(record, spec)
    if content is None or content_sha256(content) != row["content_sha256"]:
        raise InputError(
            f"example {row['id']!r}: the record at {location_of(row['shard'], row['position'])} in {where} has "
            "changed since it was ingested (its content hash differs), so it would not be the document that was "
            "scored. Restore the shard as it was, or ingest the new version into a new index"
        )
    return record


def _require_all(found: Sequence[Any], picked: Sequence[Dict[str, Any]], shard: str, uri: str) -> None:
    if len(found) != len(picked):
        raise InputError(
            f"shard {shard!r} at {uri} no longer holds all the selected records ({len(found)} of "
            f"{len(picked)} found); restore it as it was ingested"
        )


def _parquet_rows(path: Path, picked: List[Dict[str, Any]]) -> Iterator[Tuple[pa.Table, List[Dict[str, Any]]]]:
    """The selected rows of a Parquet shard with all its columns, one record batch at a time."""
    import pyarrow.parquet as pq

    start, i = 0, 0
    with pq.ParquetFile(path) as parquet:
        for batch in parquet.iter_batches(batch_size=8192):
            stop = start + batch.num_rows
            rows = []
            while i < len(picked) and picked[i]["position"] < stop:
                rows.append(picked[i])
                i += 1
            if rows:
                offsets = pa.array([r["position"] - start for r in rows], pa.int64())
                yield pa.Table.from_batches([batch.take(offsets)]), rows
            start = stop
    _require_all(picked[:i], picked, path.name, str(path))


def _jsonl_lines(path: Path, compression: Optional[str], positions: Sequence[int], shard: str) -> Iterator[bytes]:
    """The raw lines (without the line break) at ``positions`` (sorted, 0-based) of a JSONL shard."""
    from eogp_index.data.readers import _open_binary

    wanted = iter(positions)
    target = next(wanted, None)
    found = 0
    with _open_binary(path, compression) as handle:
        for position, line in enumerate(handle):
            if target is None:
                break
            if position == target:
                if position == 0 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                yield line.rstrip(b"\n").rstrip(b"\r")
                found += 1
                target = next(wanted, None)
    if target is not None:
        raise InputError(f"shard {shard!r} at {path} ends before line {target + 1}; restore it as it was ingested")


# -- score export ----------------------------------------------------------------------------------


def write_scores(
    index,
    question: Union[Question, Sequence[Any]],
    out: Path,
    *,
    where: Optional[str] = None,
    batch_bytes: int = STREAM_BATCH_BYTES,
    precision: str = SelectOptions.precision,
) -> int:
    """Every matching row's score for every query of ``question`` (its ``where`` and
    ``normalize``; a sequence of queries with ``where``), to Parquet: ``id``, ``query`` (the
    query's 0-based position), ``score`` and the stored metadata columns; returns the rows written.
    ``precision``: :attr:`SelectOptions.precision <eogp_index.config.SelectOptions>` (``rescore``:
    every row from the rescoring tier).

    Streamed: the table is scanned fragment by fragment in table order
    (:func:`scored_fragments`), and each record batch becomes ``n_queries`` row groups, one per
    query; ``eogp scores --ray`` writes the same batches in the same order, so the same file.
    """
    parquet_output(out)  # before the queries are measured
    work = scores_work(index, question, where=where, precision=precision)
    return write_score_batches(out, score_batches(index.stored, work, batch_bytes=batch_bytes))


@dataclass(frozen=True)
class ScoresWork:
    """What every part of a score export scans with: the checked question, the precision, the
    metadata columns written, the queries' coordinates ``y`` ``(nq, K)`` and the table version."""

    question: Question
    precision: str
    metadata: Tuple[str, ...]
    y: np.ndarray
    version: Optional[int]


def scores_work(
    index, question: Union[Question, Sequence[Any]], *, where: Optional[str] = None, precision: str = "1bit"
) -> ScoresWork:
    """Checks the question and measures the queries once, at the table's latest version (pinned)."""
    if not isinstance(question, Question):
        question = Question(queries=tuple(question), where=where)
    elif where is not None:
        raise ConfigError("give where in the question, not beside it", field="where")
    question = _question(question, "scores")
    stored: StoredIndex = index.stored
    check_question(question, stored)
    check_score_precision(precision)
    if precision == "rescore":
        require_tier(stored)  # before the queries are measured
    version = stored.store.version if stored.store.table is not None else None
    y = target_coordinates(index, question.queries, precision, question.checkpoint_weights)
    from eogp_index.store.table import CODE_COLUMNS

    metadata = [c for c in stored.store.metadata_columns() if c not in CODE_COLUMNS and c not in ("id", "text")]
    return ScoresWork(question, precision, tuple(metadata), y, version)


def score_fragments(
    stored: StoredIndex,
    work: ScoresWork,
    *,
    batch_bytes: int = STREAM_BATCH_BYTES,
    fragment_ids: Optional[Sequence[int]] = None,
) -> Iterator[Tuple[int, Iterator[Tuple[pa.RecordBatch, np.ndarray]]]]:
    """``(fragment id, its batches)`` in table order: each batch's ``id`` and metadata columns
    with its scores ``(nq, b)`` float32 (:func:`scored_fragments`)."""
    columns = ["id", *work.metadata]
    fragments = scored_fragments(
        stored,
        work.y,
        where=work.question.where,
        columns=columns,
        batch_bytes=batch_bytes,
        normalize=work.question.normalize,
        precision=work.precision,
        fragment_ids=fragment_ids,
        version=work.version,
    )
    for fragment_id, batches in fragments:
        yield fragment_id, ((batch.select(columns), scores) for batch, scores in batches)


def score_batches(stored: StoredIndex, work: ScoresWork, **kwargs) -> Iterator[Tuple[pa.RecordBatch, np.ndarray]]:
    """Every fragment's batches of :func:`score_fragments`, in table order."""
    for _, batches in score_fragments(stored, work, **kwargs):
        yield from batches


def write_score_batches(out: Path, batches: Iterator[Tuple[pa.RecordBatch, np.ndarray]]) -> int:
    """Writes ``(rows, scores (nq, b))`` batches to the Parquet file ``out``: per batch, one row
    group per query (``id``, ``query``, ``score``, the metadata columns); returns the rows written."""
    import pyarrow.parquet as pq

    parquet_output(out)
    written = 0
    with atomic_output(out) as handle:
        writer = None
        for rest, scores in batches:
            for q in range(scores.shape[0]):
                table = (
                    pa.Table.from_batches([rest])
                    .add_column(1, "query", pa.array(np.full(rest.num_rows, q, np.int32)))
                    .add_column(2, "score", pa.array(scores[q]))
                )
                if writer is None:
                    writer = pq.ParquetWriter(handle, table.schema)
                writer.write_table(table)
                written += table.num_rows
        if writer is None:
            schema = pa.schema([("id", pa.string()), ("query", pa.int32()), ("score", pa.float32())])
            writer = pq.ParquetWriter(handle, schema)
        writer.close()
    return written


def parquet_output(out: Path) -> None:
    """Refuses an output that is not a ``.parquet`` file (scores are written as Parquet)."""
    if output_kind(out) != "parquet":
        raise ConfigError(f"--out {out}: scores are written as Parquet; name the file .parquet", field="out")
