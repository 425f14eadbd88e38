"""Rescoring: the one-bit top rows of each side scored again from the index's rescoring tier.

An index with a tier (format 3, schemas/store.md) stores the one-bit code's coordinates a second
time at higher precision (int8, int4 or fp16), in table columns the hot copy never loads (with
``--rescore-k``, more coordinates per module than the one-bit code keeps: the query's
coordinates are the tier's, and the scans take the first ``k_u`` of each module's). A
question with ``rescore = F`` (:class:`~eogp_index.search.question.Question`) has every route
return its exact one-bit top ``N = F · k`` rows per side (``C`` at most, on the candidates
route); :func:`rescored` reads those rows' tier codes by row address and scores them against the
queries' unquantized coordinates, and keeps the best ``k`` per side by that score, each hit
keeping its one-bit score (``Hits.scores_1bit``). A side keeps only rows whose rescored score
has its sign.

The reads and the arithmetic are what the rows need, once (:func:`tier_scores`): the row
addresses of every query and side of a batch are de-duplicated and sorted, so a row that several
queries (or both sides of one) rescore is read once; the tier's columns only are taken, in takes
of about :data:`TAKE_BYTES`, the next take running while the current one is scored; and each
(row, query) pair is scored straight from the stored codes by one compiled kernel: per module,
the scale times the sum of the int8 codes times the query's coordinates, in float64 (each product
exact), rounded once to float32 (int4 and fp16 tiers decoded to float32 first, scale 1).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from eogp_index.errors import ConfigError
from eogp_index.search.ranking import Hits, Side
from eogp_index.store.stored_index import StoredIndex
from eogp_index.store.table import TAKE_BLOCK_SIZE

#: Tier bytes per Lance take: bounds the memory of a batch's rescoring (two takes in flight), and
#: is large enough that a take's fixed cost does not show.
TAKE_BYTES = 32 << 20


def rescored_count(rescore: int, k: int, candidates: Optional[int]) -> int:
    """The one-bit rows kept per side for rescoring: ``rescore · k``, at most ``candidates``."""
    n = int(rescore) * int(k)
    return n if candidates is None else min(n, int(candidates))


def tier_coordinates(stored: StoredIndex, rowaddr: np.ndarray, normalize: str = "none") -> np.ndarray:
    """The tier's coordinates ``(r, T)`` float32 (``T = Σ_u t_u``, ``stored.coordinates``:
    ``K`` unless the tier is wider than the one-bit code) of the rows at Lance row addresses ``rowaddr``
    ``(r,)`` (in that order), read from the table; ``normalize="unit"``: each divided by its norm.
    """
    tier = stored.tier
    table = stored.store.take_rows(np.asarray(rowaddr, np.uint64), list(tier.columns))
    return decoded_tier(tier, table, normalize)


def decoded_tier(tier, batch, normalize: str = "none") -> np.ndarray:
    """A table's or record batch's tier codes decoded to ``(r, T)`` float32; ``normalize="unit"``:
    each row divided by its float64 norm (a zero row stays zero)."""
    x = tier.decode(tier.from_arrow(batch))
    if normalize == "unit":
        norms = np.sqrt(np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64)))
        x = (x / np.where(norms > 0, norms, 1.0)[:, None]).astype(np.float32)
    return x


def _lanes(rowaddr: np.ndarray, spacing: int) -> np.ndarray:
    """A lane ``(r,)`` int64 for each of the sorted distinct row addresses ``rowaddr``: two rows of
    one lane are next to each other or at least ``spacing`` rows apart (rows of other fragments
    are far apart: the fragment is the address's high word).

    Rows next to each other form a run; a run starting within ``spacing`` rows of the previous
    one joins its cluster, and a cluster's runs take lanes ``0, 1, ..., spacing - 1`` in turn, so
    that runs of one lane have ``spacing - 1`` runs and ``spacing`` gaps between them."""
    lane = np.zeros(rowaddr.size, np.int64)
    if rowaddr.size < 2:
        return lane
    d = np.diff(rowaddr.astype(np.int64))
    new_run = d != 1
    run_of_row = np.concatenate([[0], np.cumsum(new_run)])
    starts_near = np.concatenate([[False], (d <= spacing)[new_run]])  # per run
    cluster = np.cumsum(~starts_near) - 1  # per run
    first = np.flatnonzero(~starts_near)  # each cluster's first run
    run_lane = (np.arange(starts_near.size) - first[cluster]) % spacing
    return run_lane[run_of_row]


def _take(stored: StoredIndex, rowaddr: np.ndarray, columns: List[str]) -> pa.Table:
    """The tier columns of the sorted distinct rows ``rowaddr``, in that order, read so that Lance
    reads only their bytes. On a local disk Lance merges two reads of a take less than
    ``TAKE_BLOCK_SIZE`` bytes apart into one read, gap included: each column is taken alone (one
    column's last rows lie next to another's first rows in a file), and rows a few rows apart
    of a narrow column in separate takes (:func:`_lanes`)."""
    store = stored.store
    if not store.local:
        return store.take_rows(rowaddr, columns)
    out = {}
    for name in columns:
        kind = store.schema.field(name).type  # fixed_size_list: an ensemble's columns differ in width
        width = kind.list_size * kind.value_type.bit_width // 8
        lanes = _lanes(rowaddr, TAKE_BLOCK_SIZE // max(1, width) + 2)
        if not lanes.any():
            out[name] = store.take_rows(rowaddr, [name]).column(name)
            continue
        order = np.argsort(lanes, kind="stable")
        parts = [store.take_rows(rowaddr[lanes == lane], [name]).column(name) for lane in np.unique(lanes)]
        out[name] = pa.chunked_array([c for part in parts for c in part.chunks]).take(pa.array(np.argsort(order)))
    return pa.table(out)


def _takes(stored: StoredIndex, wanted: np.ndarray) -> Iterator[Tuple[int, object]]:
    """``(start, table)`` per take of the sorted row addresses ``wanted``, about
    :data:`TAKE_BYTES` of tier each; the next take runs on a thread while the caller scores."""
    tier = stored.tier
    columns = list(tier.columns)
    step = max(1, TAKE_BYTES // max(1, tier.bytes_per_example))
    starts = list(range(0, wanted.size, step))
    if len(starts) == 1:
        yield 0, _take(stored, wanted, columns)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(_take, stored, wanted[:step], columns)
        for i, start in enumerate(starts):
            table = pending.result()
            if i + 1 < len(starts):
                nxt = starts[i + 1]
                pending = pool.submit(_take, stored, wanted[nxt : nxt + step], columns)
            yield start, table


def tier_scores(
    stored: StoredIndex, rowaddr: np.ndarray, query: np.ndarray, y: np.ndarray, normalize: str = "none"
) -> np.ndarray:
    """The tier's scores ``(P,)`` float32 of the pairs ``(rowaddr[p], y[query[p]])``.

    Each distinct row is read once, in the order of its address; the scores are the tier's
    coordinates (codes times their module's scale) times ``y``, summed in float64
    (``normalize="unit"``: divided by the row's float64 norm; a zero row scores zero), rounded to
    float32.

    Args:
        rowaddr: ``(P,)`` uint64 Lance row addresses, any order, repeats allowed.
        query: ``(P,)`` int64 rows of ``y``. y: ``(nq, T)`` float32, the tier's width.
    """
    from eogp_index.search.kernels.rescore import pair_scores, row_norms  # numba, loaded when first used

    rowaddr = np.asarray(rowaddr, np.uint64)
    out = np.zeros(rowaddr.size, np.float32)
    if rowaddr.size == 0:
        return out
    wanted, row = np.unique(rowaddr, return_inverse=True)
    order = np.argsort(row, kind="stable")  # the pairs by row: a row's queries follow each other
    row_sorted = row[order].astype(np.int64)
    query_sorted = np.asarray(query, np.int64)[order]
    bounds = np.searchsorted(row_sorted, np.arange(wanted.size + 1))
    y = np.ascontiguousarray(y, np.float32)
    scores = np.empty(order.size, np.float64)
    for start, table in _takes(stored, wanted):
        codes, scales, offsets = stored.tier.kernel_arrays(table)
        lo, hi = bounds[start], bounds[start + codes.shape[0]]
        local = row_sorted[lo:hi] - start
        part = np.empty(hi - lo, np.float64)
        pair_scores(codes, scales, offsets, y, local, query_sorted[lo:hi], part)
        if normalize == "unit":
            norms = np.empty(codes.shape[0], np.float64)
            row_norms(codes, scales, offsets, norms)
            part = np.where(norms[local] > 0, part / np.where(norms[local] > 0, norms[local], 1.0), 0.0)
        scores[lo:hi] = part
    out[order] = scores.astype(np.float32)
    return out


def rescored(
    stored: StoredIndex, found: Sequence[Dict[Side, Hits]], y: np.ndarray, k: int, normalize: str = "none"
) -> List[Dict[Side, Hits]]:
    """Each query's sides rescored from the tier and cut to ``k``, of their sign.

    Args:
        stored: an index with a tier (``stored.tier``).
        found: per query, ``{side: Hits}``: the one-bit top rows of each side.
        y: ``(nq, T)`` float32, the queries' unquantized coordinates (all of the tier's,
            ``stored.coordinates``), in ``found``'s order.
        k: hits kept per side.

    Raises:
        ConfigError: ``y`` of another width than the tier's (the one-bit code's prefix of a
            wider tier's coordinates cannot score it).

    Returns:
        Per query, ``{side: Hits}`` whose ``scores`` are the tier's (float32, :func:`tier_scores`)
        and ``scores_1bit`` the one-bit scan's; best first, equal scores by ascending row address.
    """
    y = np.asarray(y, np.float32)
    width = stored.coordinates.num_coords
    if y.ndim != 2 or y.shape[1] != width:
        raise ConfigError(
            f"rescoring needs the queries' coordinates of the whole tier, (nq, {width}), got {y.shape}: pass "
            "the encoder's query coordinates, not the one-bit code's part of them"
        )
    blocks = [(q, side, hits) for q, by_side in enumerate(found) for side, hits in by_side.items()]
    sizes = [hits.rowaddr.size for _, _, hits in blocks]
    rowaddr = np.concatenate([hits.rowaddr for _, _, hits in blocks]) if blocks else np.zeros(0, np.uint64)
    query = np.repeat(np.array([q for q, _, _ in blocks], np.int64), sizes)
    scores = tier_scores(stored, rowaddr, query, y, normalize)
    out: List[Dict[Side, Hits]] = [{} for _ in found]
    start = 0
    for (q, side, hits), size in zip(blocks, sizes):
        s = scores[start : start + size]
        start += size
        order = np.lexsort((hits.rowaddr, -s if side == "positive" else s))[:k]
        best = Hits(hits.rowaddr[order], s[order], scores_1bit=hits.scores[order])
        out[q][side] = best.of_sign(side)
    return out
