"""One searcher per route: where the stored codes are read from and which kernel scores them.

Every searcher answers the same question — the exact top ``k`` rows per query and side among
the rows matching ``where`` — and returns :class:`~eogp_index.search.ranking.Hits`; ranking,
keeping each side to rows of its sign, and metadata are :mod:`eogp_index.search.ranking`'s job
(applied to every route's answer by the query builder). The routes:

========================  ================================================================
:class:`HotSearcher`      the in-memory hot copy, CPU kernels (the default; streams, and says
                          so, when the disk has no room to write the copy)
:class:`TorchSearcher`    the hot copy on a CUDA device, scored with torch
:class:`StreamSearcher`   the table streamed in record batches (larger than memory)
:class:`ShardedSearcher`  each torchrun worker streams its share of the fragments; merged
:class:`CandidateSearcher`  a first pass picks candidates, which are scored exactly
========================  ================================================================

:func:`exact_scores` is the only place that looks at what a codec stored: packed signs go to
the scaled-sign kernels, coordinates to a matrix product. The exact searchers take
``normalize``: with ``"unit"`` they score the codes divided by their norms
(:mod:`eogp_index.search.normalize`) with the same kernels. Every searcher takes the queries'
coordinates as the encoder gives them, ``(nq, T)`` (an index with a rescoring tier wider than its
one-bit code) or ``(nq, K)``, and scans with the one-bit code's part (``StoredIndex.one_bit``).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from eogp_index.config import check_normalize
from eogp_index.errors import NoSpaceError
from eogp_index.search.normalize import hot_normalized, normalized_codes
from eogp_index.search.ranking import Hits, Side
from eogp_index.store.codecs import Encoded, SignLayout
from eogp_index.store.filters import check_filter
from eogp_index.store.stored_index import StoredIndex

#: Record batches streamed from Lance are sized in bytes: wide codes make rows large.
STREAM_BATCH_BYTES = 64 << 20

#: ``{side: Hits}`` for each query row of ``y``.
Found = List[Dict[Side, Hits]]

log = logging.getLogger("eogp_index.search")


def exact_scores(
    encoded: Encoded,
    y: np.ndarray,
    layout: SignLayout,
    *,
    rows: Optional[np.ndarray] = None,
    device: str = "cpu",
    torch_kernels: Optional[bool] = None,
) -> np.ndarray:
    """Exact scores ``(nq, r)`` float32 of the rows ``rows`` (all if None) of a block of codes.

    1-bit rows score ``Σ_u s_iu⟨y_u, b_iu⟩``; stored coordinates score ``⟨y, x_i⟩``.

    Args:
        encoded: the block, in scanning dtypes (``codec.from_arrow`` / the hot copy).
        y: ``(nq, K)`` float32 projected queries. rows: ``(r,)`` int64 positions in the block.
        device: ``"cpu"`` (numba kernels, numpy) or a CUDA device (torch).
        torch_kernels: score with torch on ``device`` (None: on a CUDA device only).
    """
    y = np.asarray(y, np.float32)
    use_torch = device.startswith("cuda") if torch_kernels is None else torch_kernels
    if encoded.signs is not None:
        if use_torch:
            from eogp_index.search.scan import scan_scores_torch

            if not device.startswith("cuda"):
                block = encoded if rows is None else encoded.take(rows)
                return scan_scores_torch(block.signs, block.scales, y, layout, device).cpu().numpy()
            signs, scales = _resident(encoded.signs, device), _resident(encoded.scales, device)
            if rows is not None:
                import torch

                picked = torch.as_tensor(rows, device=device)
                signs, scales = signs[picked], scales[picked]
            return scan_scores_torch(signs, scales, y, layout, device).cpu().numpy()
        from eogp_index.search.scan import scan_scores

        return scan_scores(encoded.signs, encoded.scales, y, layout, rows=rows)
    coords = encoded.coords if rows is None else encoded.coords[rows]
    if use_torch:
        import torch

        return (torch.as_tensor(y, device=device) @ torch.as_tensor(coords, device=device).T).cpu().numpy()
    return (y @ coords.T).astype(np.float32)


#: ``{device: [(host array, its copy on the device)]}``: the hot copy's codes and scales kept on a
#: GPU between queries, so a query moves only its coordinates and scores. One entry per array
#: kind; a new table version (new arrays) replaces them.
_ON_DEVICE: Dict[str, List[tuple]] = {}


def _resident(array: np.ndarray, device: str):
    """``array`` as a torch tensor on ``device``, copied there once per array object."""
    import torch

    held = _ON_DEVICE.setdefault(device, [])
    for host, copy in held:
        if host is array:
            return copy
    copy = torch.as_tensor(np.ascontiguousarray(array), device=device)
    same_kind = [i for i, (host, _) in enumerate(held) if host.dtype == array.dtype and host.ndim == array.ndim]
    if same_kind:
        del held[same_kind[0]]
    held.append((array, copy))
    return copy


def warm_kernels(stored: StoredIndex) -> None:
    """Load the compiled scan kernels of ``stored``'s codec (one tiny scan, unfiltered and
    filtered), so that the first query does not pay numba's start-up. Safe on another thread;
    never raises (a failure only leaves the first query to pay)."""
    try:
        if stored.manifest.precision != "1bit":
            return  # coordinates are scored by a matrix product: nothing to load
        from eogp_index.search.scan import scan_top_k

        layout = stored.layout
        codes = np.zeros((64, layout.nbytes), np.uint8)
        scales = np.ones((64, layout.num_modules), np.float32)
        y = np.ones((1, layout.num_coords), np.float32)
        scan_top_k(codes, scales, y, layout, 1)
        scan_top_k(codes, scales, y, layout, 1, rows=np.arange(0, 64, 2))
    except Exception:  # noqa: BLE001 - a warm-up only
        pass


def _best_of_scores(rowaddr: np.ndarray, scores: np.ndarray, k: int, sides: Sequence[Side]) -> Found:
    return [{side: Hits.best(rowaddr, row, k, side) for side in sides} for row in scores]


class HotSearcher:
    """Exact scan of the hot copy (:mod:`eogp_index.store.hot`) on the CPU.

    1-bit codes go through the bounded top-k kernel (:func:`~eogp_index.search.scan.scan_top_k`),
    which rescores exactly only the rows that can still enter the top ``k``.
    """

    device = "cpu"
    #: score with torch on ``device`` (every matching row, then ranked) rather than numba's top-k scan
    torch_kernels = False

    def __init__(self, stored: StoredIndex, *, normalize: str = "none"):
        check_normalize(normalize)
        self.stored = stored
        self.normalize = normalize

    def _rows(self, hot, where: Optional[str]) -> Optional[np.ndarray]:
        """Hot-copy positions ``(r,)`` int64 of the rows matching ``where``, sorted (None: every
        row): evaluated on the hot columns and cached per table version (:mod:`eogp_index.store.filters`)."""
        return self.stored.matching_rows(where, hot)

    def scores(self, y: np.ndarray, where: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
        """Every matching row's exact score: rowaddr ``(r,)`` uint64 and ``(nq, r)`` float32."""
        y = self.stored.one_bit(y)
        hot = self.stored.hot_codes()
        rows = self._rows(hot, where)
        rowaddr = hot.rowaddr if rows is None else hot.rowaddr[rows]
        if rowaddr.size == 0:
            return rowaddr, np.zeros((y.shape[0], 0), np.float32)
        encoded = hot_normalized(hot, self.stored.layout, self.normalize)
        scores = exact_scores(
            encoded, y, self.stored.layout, rows=rows, device=self.device, torch_kernels=self.torch_kernels
        )
        return rowaddr, scores

    def top_k(self, y: np.ndarray, k: int, sides: Sequence[Side], where: Optional[str] = None) -> Found:
        y = self.stored.one_bit(y)
        try:
            hot = self.stored.hot_codes()
        except NoSpaceError as exc:  # no room to write the hot copy: the same answer, from the table
            log.warning("this query streams the table instead of its hot copy: %s", exc)
            return StreamSearcher(self.stored, normalize=self.normalize).top_k(y, k, sides, where)
        rows = self._rows(hot, where)
        if hot.num_rows == 0 or (rows is not None and rows.size == 0):
            return [{side: Hits.empty() for side in sides} for _ in range(y.shape[0])]
        if hot.codes is None or self.torch_kernels:
            rowaddr, scores = self.scores(y, where)
            return _best_of_scores(rowaddr, scores, k, sides)
        from eogp_index.search.scan import scan_top_k

        scales = hot_normalized(hot, self.stored.layout, self.normalize).scales
        top = scan_top_k(
            hot.codes,
            scales,
            y,
            self.stored.layout,
            k,
            rows=rows,
            largest="positive" in sides,
            smallest="negative" in sides,
        )
        picks = {
            "positive": (top.largest_indices, top.largest_scores),
            "negative": (top.smallest_indices, top.smallest_scores),
        }
        return [
            {side: Hits(hot.rowaddr[picks[side][0][q]], picks[side][1][q]) for side in sides} for q in range(y.shape[0])
        ]


class TorchSearcher(HotSearcher):
    """The hot copy scored on a CUDA device with torch (every matching row, then ranked); on
    ``"cpu"`` the same torch kernels run there (what tests without a GPU check)."""

    torch_kernels = True

    def __init__(self, stored: StoredIndex, device: str, *, normalize: str = "none"):
        super().__init__(stored, normalize=normalize)
        self.device = device


class StreamSearcher:
    """Streams the code columns of the table (or of some fragments) in record batches.

    Only ``_rowaddr`` and the codec's columns are read, ``batch_bytes`` at a time, so a store
    larger than memory can be scanned; each batch's top ``k`` is merged into a running top ``k``.
    """

    def __init__(self, stored: StoredIndex, *, batch_bytes: int = STREAM_BATCH_BYTES, normalize: str = "none"):
        check_normalize(normalize)
        self.stored = stored
        self.batch_bytes = batch_bytes
        self.normalize = normalize

    def fragment_ids(self) -> List[int]:
        if self.stored.store.table is None:
            return []
        return sorted(f.fragment_id for f in self.stored.store.dataset().get_fragments())

    def top_k(
        self,
        y: np.ndarray,
        k: int,
        sides: Sequence[Side],
        where: Optional[str] = None,
        *,
        fragment_ids: Optional[Sequence[int]] = None,
    ) -> Found:
        y = self.stored.one_bit(y)
        best: Found = [{side: Hits.empty() for side in sides} for _ in range(y.shape[0])]
        store, codec = self.stored.store, self.stored.codec
        if where is not None:  # Lance alone would drop what it cannot parse (store/filters.py)
            check_filter(where, store.schema, store)
        if store.table is None:
            return best
        dataset = store.dataset()
        fragments = dataset.get_fragments()
        if fragment_ids is not None:
            wanted = set(fragment_ids)
            fragments = [f for f in fragments if f.fragment_id in wanted]
        if not fragments:
            return best
        scanner = dataset.scanner(
            columns=list(codec.columns),
            filter=where,
            fragments=fragments,
            with_row_address=True,
            batch_size_bytes=self.batch_bytes,
        )
        for batch in store.batches(scanner, where):
            if batch.num_rows == 0:
                continue
            rowaddr = batch.column("_rowaddr").to_numpy().astype(np.uint64)
            encoded = normalized_codes(codec.from_arrow(batch), self.stored.layout, self.normalize)
            scores = exact_scores(encoded, y, self.stored.layout)
            for q, found in enumerate(best):
                for side in sides:
                    found[side] = Hits.merge([found[side], Hits.best(rowaddr, scores[q], k, side)], k, side)
        return best


class ShardedSearcher(StreamSearcher):
    """Under torchrun: worker ``r`` of ``W`` streams fragments ``r, r + W, ...``; every worker
    receives every worker's top ``k`` and merges them, so all ranks return the same answer.

    Without torchrun's environment (no ``RANK``) it is a one-worker :class:`StreamSearcher`.
    The process group (Gloo: only top-k lists travel) is started here if the caller has not.
    """

    def top_k(
        self,
        y: np.ndarray,
        k: int,
        sides: Sequence[Side],
        where: Optional[str] = None,
        *,
        fragment_ids: Optional[Sequence[int]] = None,
    ) -> Found:
        if "RANK" not in os.environ:
            return super().top_k(y, k, sides, where)
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local = super().top_k(y, k, sides, where, fragment_ids=self.fragment_ids()[rank::world])
        gathered: List[Found] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        return [
            {side: Hits.merge([g[q][side] for g in gathered], k, side) for side in sides} for q in range(y.shape[0])
        ]


class CandidateSearcher:
    """A first pass (``eogp build-candidates``) picks candidates per side, which are scored exactly.

    Exact over what the first pass scores (∩ filter); recall against the full scan depends on
    ``C`` and the kind (``benchmarks/candidates.py`` measures it).
    """

    def __init__(self, stored: StoredIndex, candidates: int, *, faiss_name: str = "default"):
        self.stored = stored
        self.candidates = int(candidates)
        self.faiss_name = faiss_name

    def top_k(self, y: np.ndarray, k: int, sides: Sequence[Side], where: Optional[str] = None) -> Found:
        from eogp_index.search.first_pass import candidate_top_k

        y = self.stored.one_bit(y)
        found: Found = []
        for q in range(y.shape[0]):
            scored = candidate_top_k(
                self.stored, y[q : q + 1], k, self.candidates, sides, where=where, name=self.faiss_name
            )
            found.append({side: Hits.best(rowaddr, scores, k, side) for side, (rowaddr, scores, _) in scored.items()})
        return found
