"""The one-bit code's recall of the rescoring tier's top rows, measured on the stored table.

The fit measures that recall among its held-out documents (:mod:`eogp_index.fit.recall`): each
ranks the other few dozen. A query ranks the whole table, and the rows that crowd the one-bit top
``N = F · k`` grow with it, so a factor chosen among a few dozen candidates can be too small for a
large table (docs/variants.md shows a case). This module measures the same curve on the table itself:

* **queries**: the fit's held-out documents, projected by the stored projection as a query is
  (at most :data:`~eogp_index.fit.recall.RECALL_QUERIES`), saved in the index at fit time
  (:data:`QUERIES_FILE`, :func:`save_queries`); a stored copy of a query's own document (same
  ``content_sha256``) is left out of its answers;
* **candidates**: every row of the table (above :attr:`TableRecallConfig.max_rows
  <eogp_index.config.TableRecallConfig.max_rows>`, a seeded sample of whole fragments), streamed
  once for all queries, each row scored exactly by its tier codes and by its one-bit code
  ``s_u ⟨y_u, b_u⟩`` (both in float64, summed over modules);
* **the curves**: per query and side (most positive, most negative), for the fit's factors with
  ``F · t`` below the rows read (:data:`~eogp_index.config.RECALL_FACTORS`, up to 100), the share
  of the tier's top ``t = min(20, rows // 20)`` found in the one-bit top ``F · t`` (the recall),
  and ``1 -`` the NDCG@``t`` of that top ordered by the tier against the tier's own top ``t``
  (the gap, :func:`~eogp_index.fit.ndcg.rescored_ndcg`); each the mean over both sides and the
  queries, with its standard error; **the factor**: the fit's choice
  (:func:`~eogp_index.fit.recall.default_factor`): the smallest ``F`` whose gap is at most
  :data:`~eogp_index.config.RESCORE_GAP_TARGET`, else the largest measured (``reached``
  false). The smallest ``F`` whose recall reaches :data:`~eogp_index.config.RECALL_TARGET` is
  recorded beside it.

Equal scores are ordered by scan position, so the result is exactly what a float64 sort of every
row's two scores gives. The record (:data:`RECORD_FILE`, ``schemas/table_recall.schema.json``) is
rewritten after each ingest (:meth:`Commits.finish <eogp_index.encode.commits.Commits.finish>`)
and by ``eogp optimize``; the default rescoring factor prefers it over the fit's
(:func:`default_rescore_factor`). A record of format version 1 (the factor chosen by the recall,
no gap) still reads, and its factor is used until the next measurement rewrites it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from eogp_index.config import (
    RECALL_FACTORS,
    RECALL_MAX_T,
    RECALL_T_SHARE,
    RECALL_TARGET,
    RESCORE_GAP_TARGET,
    TableRecallConfig,
)
from eogp_index.data.location import IndexPath, index_path, write_atomic
from eogp_index.errors import IncompatibleIndexError
from eogp_index.fit.ndcg import rescored_ndcg
from eogp_index.fit.recall import RecallCurve, default_factor, format_cells, format_choice, recall_factor

#: The record of the last measurement, in the index directory.
RECORD_FILE = "table_recall.json"
#: The held-out queries' coordinates ``(q, T)`` float32 and their documents' hashes.
QUERIES_FILE = "recall_queries.safetensors"
FORMAT = "eogp-table-recall"
FORMAT_VERSION = 2
#: The versions this module reads: 1 (the factor chosen by the recall) and 2 (by the gap).
READ_VERSIONS = (1, 2)
SCHEMA_FILE = "table_recall.schema.json"
#: Bytes of float64 row copies one batch may hold (its rows are capped to fit).
_BATCH_BYTES = 1 << 27


# -- files: every read and write of this module's two files goes through these two -------------
def _write_file(index_dir: IndexPath, name: str, data: bytes) -> None:
    """Write ``index_dir/name`` whole (:func:`~eogp_index.data.location.write_atomic`: renamed
    into place on a disk, one PUT in an object store), so that a reader never sees half a file."""
    write_atomic(index_path(index_dir) / name, data)


def _read_file(index_dir: IndexPath, name: str) -> Optional[bytes]:
    """``index_dir/name``'s bytes, or None when it does not exist."""
    try:
        return (index_path(index_dir) / name).read_bytes()
    except FileNotFoundError:
        return None


def _file_stamp(index_dir: IndexPath, name: str) -> Optional[Tuple[int, int, int]]:
    """``index_dir/name``'s ``(inode, size, mtime_ns)`` (inode 0 in an object store), or None when
    it does not exist: what a cached read of it is checked against (a rewrite replaces the file)."""
    try:
        st = (index_path(index_dir) / name).stat()
    except FileNotFoundError:
        return None
    return getattr(st, "st_ino", 0), st.st_size, st.st_mtime_ns


# -- the queries ---------------------------------------------------------------------------------
def save_queries(index_dir: Path, coordinates: np.ndarray, hashes: Sequence[str]) -> None:
    """Store the held-out queries: ``coordinates`` ``(q, T)`` (the index's coordinates per module,
    all of the tier's) and their documents' ``content_sha256`` ``(q,)``."""
    from safetensors.numpy import save

    coordinates = np.ascontiguousarray(coordinates, np.float32)
    metadata = {"format": "eogp-recall-queries", "format_version": "1", "content_sha256": json.dumps(list(hashes))}
    _write_file(index_dir, QUERIES_FILE, save({"coordinates": coordinates}, metadata=metadata))


def load_queries(index_dir: Path) -> Optional[Tuple[np.ndarray, Tuple[str, ...]]]:
    """The held-out queries saved at fit time, ``((q, T) float32, hashes)``, or None without them
    (an index fitted without a tier, without held-out documents, or before they were saved)."""
    from safetensors.numpy import load

    data = _read_file(index_dir, QUERIES_FILE)
    if data is None:
        return None
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])  # safetensors: length, JSON header
    hashes = json.loads((header.get("__metadata__") or {}).get("content_sha256", "[]"))
    return load(data)["coordinates"], tuple(hashes)


def drop_queries(index_dir: Path, hashes: Iterable[str]) -> int:
    """Remove the held-out queries whose document's ``content_sha256`` is in ``hashes`` (a
    takedown's purge: the file holds those documents' coordinates); how many were removed."""
    found = load_queries(index_dir)
    if found is None:
        return 0
    coordinates, saved = found
    gone = set(hashes)
    keep = [i for i, h in enumerate(saved) if h not in gone]
    if len(keep) == len(saved):
        return 0
    save_queries(index_dir, coordinates[keep], [saved[i] for i in keep])
    return len(saved) - len(keep)


# -- the record ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TableRecall:
    """One measurement on the stored table (the JSON of :data:`RECORD_FILE`).

    Attributes:
        table_version, rows: the table's version and rows when measured.
        rows_measured: rows read (``rows``, or a sample of whole fragments above ``max_rows``).
        sample: None (every row read), else ``{"fragments", "of_fragments", "seed"}``.
        queries, queries_from: the queries measured and where they came from.
        excluded: stored copies of a query's own document left out of its answers.
        tier: the tier's code. t: the tier's top ``t`` per side.
        target: the recall reported; recall_factor: the smallest factor reaching it, or None.
        factors, recall, recall_se: the curve: per factor, the mean recall and its standard error.
        gap, gap_se: per factor, the mean NDCG@``t`` gap of the rescored top and its standard error.
        gap_target: the gap the default factor must keep within.
        factor, reached: the default factor and whether its gap is within ``gap_target``.
        seconds: the measurement's wall time.
    """

    table_version: int
    rows: int
    rows_measured: int
    sample: Optional[Dict[str, int]]
    queries: int
    queries_from: str
    excluded: int
    tier: str
    t: int
    target: float
    factors: Tuple[int, ...]
    recall: Tuple[float, ...]
    recall_se: Tuple[float, ...]
    factor: Optional[int]
    reached: bool
    seconds: float
    gap: Tuple[float, ...] = ()
    gap_se: Tuple[float, ...] = ()
    gap_target: float = RESCORE_GAP_TARGET
    recall_factor: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["factors"] = list(self.factors)
        for name in ("recall", "recall_se", "gap", "gap_se"):
            data[name] = [_plain(v) for v in getattr(self, name)]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "criterion": "ndcg_gap", **data}


def _plain(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


def _schema() -> Dict[str, Any]:
    """The record's JSON Schema: the source tree's ``schemas/`` when the package runs from one,
    else the installed copy (as the manifest's)."""
    local = Path(__file__).resolve().parents[2] / "schemas" / SCHEMA_FILE
    text = (
        local.read_text()
        if local.is_file()
        else resources.files("eogp_index.schemas").joinpath(SCHEMA_FILE).read_text()
    )
    return json.loads(text)


def _validate(data: Dict[str, Any], source: Path) -> None:
    import jsonschema

    try:
        jsonschema.validate(data, _schema())
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise IncompatibleIndexError(
            f"{source}: field {where}: {exc.message}; delete the file and run `eogp optimize` on the index to "
            "measure again"
        ) from exc


def write_record(index_dir: Path, recall: TableRecall) -> None:
    data = recall.to_json()
    _validate(data, index_path(index_dir) / RECORD_FILE)
    _write_file(index_dir, RECORD_FILE, (json.dumps(data, indent=2) + "\n").encode())


def read_record(index_dir: Path) -> Optional[Dict[str, Any]]:
    """The last measurement's record (validated), or None when the index has none.

    Raises:
        IncompatibleIndexError: a record of another format version, or one that does not
            validate; the message says how to measure again.
    """
    data = _read_file(index_dir, RECORD_FILE)
    if data is None:
        return None
    source = index_path(index_dir) / RECORD_FILE
    try:
        record = json.loads(data)
    except json.JSONDecodeError as exc:
        raise IncompatibleIndexError(f"{source}: not valid JSON ({exc}); delete it and run `eogp optimize`") from exc
    if not isinstance(record, dict) or record.get("format_version") not in READ_VERSIONS:
        found = record.get("format_version") if isinstance(record, dict) else None
        raise IncompatibleIndexError(
            f"{source}: format version {found!r}, but this eogp-index reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}; delete the file and run `eogp optimize` on the index to measure again"
        )
    _validate(record, source)
    return record


#: The last record read per index directory, with the file's stamp: a query reads the factor
#: from here, at the cost of one stat, instead of parsing and validating the file each time.
_RECORDS: Dict[str, Tuple[Optional[Tuple[int, int, int]], Optional[Dict[str, Any]]]] = {}


def current_record(index_dir: Path) -> Optional[Dict[str, Any]]:
    """:func:`read_record`, read again only when the file changed (its stamp)."""
    key = str(index_path(index_dir).resolve())
    stamp = _file_stamp(index_dir, RECORD_FILE)
    cached = _RECORDS.get(key)
    if cached is None or cached[0] != stamp:
        cached = (stamp, read_record(index_dir) if stamp is not None else None)
        _RECORDS[key] = cached
    return cached[1]


def default_rescore_factor(stored) -> Optional[int]:
    """The rescoring factor a query without ``rescore`` uses on ``stored`` (a
    :class:`~eogp_index.store.stored_index.StoredIndex` with a tier): the table's measured factor
    (:data:`RECORD_FILE`) when there is one, else the fit's (``Manifest.rescore_factor``), else
    None. The table's wins: it is measured among the rows a query ranks, the fit's among a few
    dozen held-out documents."""
    record = current_record(stored.path)
    if record is not None and record.get("factor") is not None:
        return int(record["factor"])
    return stored.manifest.rescore_factor


# -- the measurement -----------------------------------------------------------------------------
def _fragments_to_read(fragments: List, max_rows: int, seed: int) -> Tuple[Optional[List], Optional[Dict[str, int]]]:
    """Every fragment (None: the whole table) when they hold at most ``max_rows`` rows; else a
    seeded sample of whole fragments, drawn until it holds ``max_rows`` rows, in table order."""
    counts = [f.count_rows() for f in fragments]
    if sum(counts) <= max_rows:
        return None, None
    order = np.random.default_rng(seed).permutation(len(fragments))
    chosen, total = [], 0
    for i in order:
        if total >= max_rows:
            break
        chosen.append(int(i))
        total += counts[i]
    chosen.sort()
    return [fragments[i] for i in chosen], {"fragments": len(chosen), "of_fragments": len(fragments), "seed": seed}


class _Tops:
    """Each query's running top ``depth`` rows of one score and side, by score, equal scores by
    scan position (``positions`` ``(q, ≤depth)`` int64 and ``scores`` float64, best first), and
    with ``aux`` another score of the same rows (``(q, ≤depth)`` float64, signed as ``scores``)."""

    def __init__(self, queries: int, depth: int, sign: float):
        self.depth, self.sign = depth, sign
        self.positions = np.zeros((queries, 0), np.int64)
        self.scores = np.zeros((queries, 0), np.float64)
        self.aux = np.zeros((queries, 0), np.float64)

    def add(self, start: int, scores: np.ndarray, aux: Optional[np.ndarray] = None) -> None:
        """Merge a batch's ``(q, n)`` scores (and ``aux``) of the rows at scan positions
        ``start ..``; a NaN (a row left out of that query's answers) never ranks."""
        n = scores.shape[1]
        aux = scores if aux is None else aux
        # The kept rows in position order, then the batch's (later positions): a stable sort by
        # score then orders equal scores by position.
        by_position = np.argsort(self.positions, axis=1, kind="stable")
        positions = np.concatenate(
            [
                np.take_along_axis(self.positions, by_position, axis=1),
                np.broadcast_to(start + np.arange(n), scores.shape),
            ],
            axis=1,
        )
        values = np.concatenate([np.take_along_axis(self.scores, by_position, axis=1), self.sign * scores], axis=1)
        others = np.concatenate([np.take_along_axis(self.aux, by_position, axis=1), self.sign * aux], axis=1)
        keys = np.where(np.isnan(values), np.inf, -values)  # best (largest signed score) first
        best = np.argsort(keys, axis=1, kind="stable")[:, : self.depth]
        self.positions = np.take_along_axis(positions, best, axis=1)
        self.scores = np.take_along_axis(values, best, axis=1)
        self.aux = np.take_along_axis(others, best, axis=1)


def _scan(stored, chosen, y: np.ndarray, hashes: Sequence[str], t: int, depth: int, batch_rows: int):
    """Stream the rows once: each query's tier top ``t`` and one-bit top ``depth`` per side
    (:class:`_Tops`), and the stored copies of the queries' documents left out."""
    tier = stored.tier
    columns = list(stored.codec.columns) + list(tier.columns)
    names = stored.store.schema.names
    wanted = {h: [q for q, other in enumerate(hashes) if other == h] for h in hashes if h}
    by_hash = bool(wanted) and "content_sha256" in names
    if by_hash:
        columns.append("content_sha256")
    y_tier = np.asarray(y, np.float64)  # (q, T)
    y_bit = np.asarray(stored.one_bit(y_tier), np.float64)  # (q, K)
    q = y_tier.shape[0]
    tops = {
        (kind, side): _Tops(q, t if kind == "tier" else depth, sign)
        for kind in ("tier", "one_bit")
        for side, sign in (("positive", 1.0), ("negative", -1.0))
    }
    # Bounded memory whatever the tier's width: the float64 copies of a batch's tier and codes.
    batch_rows = max(1, min(batch_rows, _BATCH_BYTES // (8 * (y_tier.shape[1] + y_bit.shape[1]))))
    scanner = stored.store.dataset().scanner(columns=columns, fragments=chosen, batch_size=batch_rows)
    start = excluded = 0
    for batch in stored.store.batches(scanner):
        n = batch.num_rows
        if not n:
            continue
        x_tier = tier.decode(tier.from_arrow(batch)).astype(np.float64)  # (n, T)
        x_bit = stored.codec.decode(stored.codec.from_arrow(batch)).astype(np.float64)  # (n, K)
        scores = {"tier": y_tier @ x_tier.T, "one_bit": y_bit @ x_bit.T}  # (q, n) each
        if by_hash:
            for row, value in enumerate(batch.column("content_sha256").to_pylist()):
                for query in wanted.get(value, ()):
                    scores["tier"][query, row] = scores["one_bit"][query, row] = np.nan
                    excluded += 1
        for (kind, _), top in tops.items():  # the one-bit tops keep their rows' tier scores
            top.add(start, scores[kind], scores["tier"] if kind == "one_bit" else None)
        start += n
    return tops, excluded


def _curve(tops, t: int, factors: Sequence[int], queries: int) -> RecallCurve:
    """Per factor, the means over queries (of the means over both sides) of the share of the
    tier's top ``t`` found in the one-bit top ``F · t`` and of the NDCG@``t`` gap of that top
    rescored by the tier (:func:`~eogp_index.fit.ndcg.rescored_ndcg`), with standard errors."""
    recalls, gaps = [], []
    for side in ("positive", "negative"):
        best = tops[("tier", side)].positions  # (q, t)
        kept = tops[("one_bit", side)]  # (q, depth), best first; aux: their signed tier scores
        found = kept.positions
        place = np.full(best.shape, found.shape[1], np.int64)  # where the one-bit scan puts each
        hits = best[:, :, None] == found[:, None, :]  # (q, t, depth)
        any_hit = hits.any(axis=2)
        place[any_hit] = hits.argmax(axis=2)[any_hit]
        recalls.append(np.stack([(place < f * t).mean(axis=1) for f in factors], axis=1))
        relevant = hits.any(axis=1)  # (q, depth): each kept row in the tier's top t
        gaps.append(1.0 - rescored_ndcg(kept.aux, relevant, t, factors))
    per_query = {"recall": (recalls[0] + recalls[1]) / 2, "gap": (gaps[0] + gaps[1]) / 2}  # (q, len(factors))
    stats = {}
    for name, values in per_query.items():
        means = values.mean(axis=0)
        ses = values.std(axis=0, ddof=1) / math.sqrt(queries) if queries > 1 else np.full(len(factors), np.nan)
        stats[name] = tuple(float(v) for v in means), tuple(float(v) for v in ses)
    return RecallCurve(t, queries, tuple(factors), *stats["recall"], *stats["gap"])


def measure_table_recall(
    stored,
    queries: Optional[np.ndarray] = None,
    hashes: Sequence[str] = (),
    *,
    config: TableRecallConfig = TableRecallConfig(),
    queries_from: str = "fit held-out documents",
) -> Optional[TableRecall]:
    """Measure the one-bit code's recall of the tier's top rows on ``stored``'s table.

    Args:
        stored: a :class:`~eogp_index.store.stored_index.StoredIndex`.
        queries: ``(q, T)`` query coordinates (all of the tier's, ``stored.coordinates``);
            default: the held-out queries saved at fit time (:func:`load_queries`).
        hashes: ``(q,)`` the queries' documents' ``content_sha256`` (a stored copy is left out).

    Returns:
        The measurement, or None when there is nothing to measure: no tier, no queries, fewer
        than ``config.min_rows`` rows.
    """
    started = time.perf_counter()
    if stored.tier is None or stored.manifest.precision != "1bit":
        return None
    if queries is None:
        saved = load_queries(stored.path)
        if saved is None:
            return None
        queries, hashes = saved
    queries = np.asarray(queries, np.float64)
    if queries.ndim != 2 or queries.shape[0] < 1 or queries.shape[1] != stored.coordinates.num_coords:
        raise IncompatibleIndexError(
            f"the recall's queries are {queries.shape}, but {stored.path}'s coordinates are "
            f"(q, {stored.coordinates.num_coords}): {QUERIES_FILE} belongs to another fit. Delete it, or refit"
        )
    dataset = stored.store.table
    rows = 0 if dataset is None else dataset.count_rows()
    if rows < config.min_rows:
        return None
    version = dataset.version
    chosen, sample = _fragments_to_read(list(dataset.get_fragments()), config.max_rows, config.seed)
    measured = rows if chosen is None else sum(f.count_rows() for f in chosen)
    t = max(1, min(RECALL_MAX_T, measured // RECALL_T_SHARE))
    factors = tuple(f for f in RECALL_FACTORS if f * t < measured)
    if not factors:
        return None
    tops, excluded = _scan(stored, chosen, queries, hashes, t, max(factors) * t, config.batch_rows)
    curve = _curve(tops, t, factors, int(queries.shape[0]))
    factor, reached = default_factor(curve)  # the fit's choice, on the table's curves
    return TableRecall(
        table_version=int(version),
        rows=int(rows),
        rows_measured=int(measured),
        sample=sample,
        queries=int(queries.shape[0]),
        queries_from=queries_from,
        excluded=int(excluded),
        tier=stored.tier.code,
        t=t,
        target=RECALL_TARGET,
        factors=factors,
        recall=curve.recall,
        recall_se=curve.recall_se,
        factor=factor,
        reached=reached,
        seconds=round(time.perf_counter() - started, 3),
        gap=curve.gap,
        gap_se=curve.gap_se,
        gap_target=RESCORE_GAP_TARGET,
        recall_factor=recall_factor(curve),
    )


def record_table_recall(stored, *, config: TableRecallConfig = TableRecallConfig()) -> Optional[TableRecall]:
    """Measure ``stored``'s table with the fit's held-out queries and write the record
    (:data:`RECORD_FILE`); None (and the record left as it is) when there is nothing to measure."""
    recall = measure_table_recall(stored, config=config)
    if recall is not None:
        write_record(stored.path, recall)
    return recall


def format_table_recall(record: Dict[str, Any], table_version: Optional[int] = None) -> str:
    """One line of the table's recall record (:meth:`TableRecall.to_json`; a version 1 record
    has no gap), as ``eogp info`` prints it; ``table_version``: the table's version now (a record
    of an older one says so)."""
    t = record["t"]
    sample = record.get("sample")
    read = f"{record['rows_measured']} rows" + (
        f" (a seeded sample of {sample['fragments']} of {sample['of_fragments']} fragments)" if sample else ""
    )
    stale = ""
    if table_version is not None and table_version != record["table_version"]:
        stale = f"; measured at table version {record['table_version']}, the table is at {table_version} now"
    return (
        f"on the table (version {record['table_version']}, {record['rows']} rows; {read} read): recall of the "
        f"{record['tier']} tier's top-{t} per side in the one-bit top F x {t}, and the NDCG@{t} gap of that top "
        f"rescored ({record['queries']} held-out queries): {format_cells(record)}; {format_choice(record)}{stale}"
    )
