"""Rescoring: the one-bit top rows of each side scored again from the index's rescoring tier.

An index with a tier (format 3, schemas/store.md) stores the one-bit code's coordinates a second
time at higher precision (int8, int4 or fp16), in table columns the hot copy never loads (with
``--rescore-k``, more coordinates per module than the one-bit code keeps: the query's
coordinates are the tier's, and the scans take the first ``k_u`` of each module's). A
question with ``rescore = F`` (:class:`~eogp_index.search.question.Question`) has every route
return its exact one-bit top ``N = F · k`` rows per side (``C`` at most, on the candidates
route); :func:`rescored` reads those rows' tier codes by row address in one Lance take for all
the queries, scores them in float32 against the queries' unquantized coordinates, and keeps the
best ``k`` per side by that score, each hit keeping its one-bit score (``Hits.scores_1bit``). A
side keeps only rows whose rescored score has its sign.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from eogp_index.errors import ConfigError
from eogp_index.search.ranking import Hits, Side
from eogp_index.store.stored_index import StoredIndex


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
    table = stored.store.take_rows(np.asarray(rowaddr, np.uint64).tolist(), list(tier.columns))
    return decoded_tier(tier, table, normalize)


def decoded_tier(tier, batch, normalize: str = "none") -> np.ndarray:
    """A table's or record batch's tier codes decoded to ``(r, T)`` float32; ``normalize="unit"``:
    each row divided by its float64 norm (a zero row stays zero)."""
    x = tier.decode(tier.from_arrow(batch))
    if normalize == "unit":
        norms = np.sqrt(np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64)))
        x = (x / np.where(norms > 0, norms, 1.0)[:, None]).astype(np.float32)
    return x


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
        Per query, ``{side: Hits}`` whose ``scores`` are the tier's (float32) and ``scores_1bit``
        the one-bit scan's; best first, equal scores by ascending row address.
    """
    y = np.asarray(y, np.float32)
    width = stored.coordinates.num_coords
    if y.ndim != 2 or y.shape[1] != width:
        raise ConfigError(
            f"rescoring needs the queries' coordinates of the whole tier, (nq, {width}), got {y.shape}: pass "
            "the encoder's query coordinates, not the one-bit code's part of them"
        )
    parts = [hits.rowaddr for by_side in found for hits in by_side.values()]
    wanted = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
    if wanted.size == 0:
        none = Hits(np.zeros(0, np.uint64), np.zeros(0, np.float32), np.zeros(0, np.float32))
        return [{side: none for side in by_side} for by_side in found]
    x = tier_coordinates(stored, wanted, normalize)
    out = []
    for q, by_side in enumerate(found):
        sides = {}
        for side, hits in by_side.items():
            rows = x[np.searchsorted(wanted, hits.rowaddr)]
            scores = (rows @ y[q]).astype(np.float32)  # float32, as the one-bit kernels score
            order = np.lexsort((hits.rowaddr, -scores if side == "positive" else scores))[:k]
            best = Hits(hits.rowaddr[order], scores[order], scores_1bit=hits.scores[order])
            sides[side] = best.of_sign(side)
        out.append(sides)
    return out
