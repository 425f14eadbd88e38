"""Clustered first pass: the stored codes regrouped into cells of alike rows, scanned exactly cell by cell.

A row's score is ``Σ_u s_iu⟨y_u, b_iu⟩``. Over a store of millions of rows the top of that sum
is decided above all by the scales: rows with large ``s_iu`` in the modules where the query is
large have the widest spread of scores, so they hold the extremes on both sides. A sign index
(FAISS Hamming) sees none of it. This first pass therefore groups rows by what decides the
spread, and keeps the exact kernel:

* **Cells.** Every row gets a *scale cell* ``p`` (k-means over ``log s_iu``, ``U`` dimensions,
  ``P = scale_cells`` centroids) and a *sign list* ``l`` (binary k-means over its signs,
  ``L = lists`` centroids; ``L = 1`` by default, one list). Its cell is ``c = l·P + p``. The
  index holds a copy of the codes (signs, FP16 scales, Lance row address) sorted by cell, so
  a cell is a contiguous run of rows; within a cell rows stay in row-address order.
* **Per-cell statistics.** ``smean[c, u]`` (mean scale), ``s2max[c, u]`` (largest squared
  scale) and, per list, ``m[l, j]`` the mean of the ±1 signs of coordinate ``j`` over the
  list (from the training sample). Within list ``l`` a row's ``⟨y_u, b_u⟩`` has mean
  ``A_lu = ⟨y_u, m_lu⟩`` and, treating the coordinates as independent, variance
  ``B_lu = Σ_j y_uj² (1 − m_luj²)``. A cell's optimistic estimate for a side ``σ = ±1`` is::

      ucb_c = σ·Σ_u smean_cu·A_lu + z·sqrt(Σ_u s2max_cu·B_lu)

  (``z`` standard deviations of the widest row in the cell: an upper estimate, not a bound).
* **Search, per query and side.** Cells are visited by decreasing ``ucb``. Round 1 scans
  the first cells up to ``first_fraction`` of the rows (at least ``64·k`` rows) with the exact
  bounded kernel (:func:`~eogp_index.search.scan.scan_top_k`), which gives the k-th best exact
  score ``T``; round 2 scans every further cell whose ``ucb >= T`` (a cell whose optimistic
  estimate cannot reach ``T`` is skipped: that is the early stop). Both rounds together scan
  at most ``C`` rows (``candidates(C)``). Every returned score is exact, computed from the same
  bytes as the table's; what the first pass can miss are rows of skipped cells.
* **Freshness.** Rows appended since the build (new Lance fragments) are kept in a *delta*
  (``<name>.delta.npz``) that every query scans in full; when it passes
  ``max(1%, 4096 rows)`` of the clustered rows, or when fragments were rewritten (compaction,
  deletions: row addresses change), the copy is rebuilt from the hot copy with the trained
  centroids (no retraining). A query never misses an ingested row and never returns a stale
  address.

Files in ``<index>/faiss/`` (schemas/index.md): ``<name>.json`` (format ``eogp-clustered``,
version, parameters, the fragments and table version covered, the projection and model hashes;
written last, it commits the others), ``<name>.codes.npy`` ``(n, nbytes)`` uint8,
``<name>.scales.npy`` ``(n, U)`` float16, ``<name>.rowaddr.npy`` ``(n,)`` uint64,
``<name>.cells.npz`` (``offsets`` ``(ncell+1,)`` int64, ``smean``/``s2max`` ``(ncell, U)``
float32, ``scale_centroids`` ``(P, U)`` float32 of log-scales, ``sign_centroids``
``(L, nbytes)`` uint8, ``mean_signs`` ``(L, K)`` float32) and ``<name>.delta.npz``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np

from eogp_index.errors import IncompatibleIndexError, InputError
from eogp_index.search.first_pass.base import (
    FirstPass,
    FirstPassConfig,
    SideAnswer,
    build_param,
    commit,
    fragment_keys,
    load_faiss,
    require_signs,
    search_param,
    temporary,
)
from eogp_index.store.codecs import SignLayout, unpack_signs

#: Rows per block when assigning rows to cells and writing the sorted copy.
_BLOCK_ROWS = 1 << 18
#: Rows scanned by round 1 at least, per requested row (small stores: every row at once).
_FIRST_ROWS_PER_K = 64
#: The kernel returns this many rows more than ``k``, so that equal scores at the k-th place
#: are ordered by row address (:class:`~eogp_index.search.ranking.Hits`), not by cell.
_EXTRA = 8
#: The delta is merged into the clustered copy once it holds more rows than this share of it.
_DELTA_SHARE = 0.01
_DELTA_MIN_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class ClusteredConfig(FirstPassConfig):
    """``clustered``: the codes regrouped into cells by scale profile, scanned exactly (module docstring)."""

    lists: int = build_param(1, "Sign lists L (binary k-means over the signs; 1 = none).", min=1)
    scale_cells: int = build_param(64, "Scale cells P (k-means over the per-module log-scales).", min=1)
    train_iters: int = build_param(10, "Sign-list k-means iterations (the scale k-means runs at least 20).", min=1)
    use_gpu: Literal["auto", "never"] = build_param(
        "auto",
        "auto: train the k-means on the GPU when FAISS is a GPU build and sees one; never: on the CPU.",
        choices=("auto", "never"),
    )
    z: float = search_param(
        4.0,
        "Standard deviations in a cell's optimistic estimate (larger = more cells scanned, higher recall).",
        min=0.0,
    )
    first_fraction: float = search_param(
        0.01, "Share of the rows scanned before the early stop applies (round 1).", min=0.0, min_open=True, max=1.0
    )


def _kmeans(x: np.ndarray, k: int, *, iters: int, seed: int, use_gpu: str):
    """FAISS k-means centroids ``(k, d)`` float32 of ``x`` ``(n, d)`` (on a GPU when one is lent)."""
    faiss = load_faiss()
    gpu = use_gpu == "auto" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    km = faiss.Kmeans(
        x.shape[1],
        int(k),
        niter=int(iters),
        seed=int(seed),
        gpu=bool(gpu),
        max_points_per_centroid=max(1, -(-x.shape[0] // int(k))),
    )
    km.train(np.ascontiguousarray(x, np.float32))
    return np.ascontiguousarray(km.centroids, np.float32)


def _log_scales(scales: np.ndarray) -> np.ndarray:
    # A zero scale (an all-zero module) would be -inf: floor it at the smallest FP16 normal.
    return np.log(np.maximum(np.asarray(scales, np.float32), np.float32(6.1e-5)))


class _Cells:
    """The trained partition: centroids and what each list's signs look like on average."""

    def __init__(self, scale_centroids: np.ndarray, sign_centroids: np.ndarray, mean_signs: np.ndarray):
        self.scale_centroids = np.ascontiguousarray(scale_centroids, np.float32)  # (P, U) log-scales
        self.sign_centroids = np.ascontiguousarray(sign_centroids, np.uint8)  # (L, nbytes)
        self.mean_signs = np.ascontiguousarray(mean_signs, np.float32)  # (L, K), in [-1, 1]
        faiss = load_faiss()
        self._scale_index = faiss.IndexFlatL2(self.scale_centroids.shape[1])
        self._scale_index.add(self.scale_centroids)
        self._sign_index = None
        if self.lists > 1:
            self._sign_index = faiss.IndexBinaryFlat(self.sign_centroids.shape[1] * 8)
            self._sign_index.add(self.sign_centroids)

    @property
    def scale_cells(self) -> int:
        return int(self.scale_centroids.shape[0])

    @property
    def lists(self) -> int:
        return int(self.sign_centroids.shape[0])

    @property
    def num_cells(self) -> int:
        return self.lists * self.scale_cells

    def assign(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Cell ``(n,)`` int64 of each row (signs ``(n, nbytes)`` uint8, scales ``(n, U)``)."""
        _, p = self._scale_index.search(_log_scales(scales), 1)
        cell = p[:, 0].astype(np.int64)
        if self._sign_index is not None:
            _, lst = self._sign_index.search(np.ascontiguousarray(codes, np.uint8), 1)
            cell += lst[:, 0].astype(np.int64) * self.scale_cells
        return cell

    @classmethod
    def train(cls, codes: np.ndarray, scales: np.ndarray, layout: SignLayout, config: ClusteredConfig) -> "_Cells":
        """Centroids from a sample of rows (signs ``(s, nbytes)``, scales ``(s, U)``)."""
        P = min(int(config.scale_cells), codes.shape[0])
        scale_centroids = _kmeans(
            _log_scales(scales), P, iters=max(20, config.train_iters), seed=1, use_gpu=config.use_gpu
        )
        L = min(int(config.lists), codes.shape[0])
        lst = np.zeros(codes.shape[0], np.int64)
        if L > 1:
            faiss = load_faiss()
            d = layout.nbytes * 8
            ivf = faiss.IndexBinaryIVF(faiss.IndexBinaryFlat(d), d, L)  # FAISS's binary k-means
            ivf.cp.niter = int(config.train_iters)
            ivf.cp.max_points_per_centroid = max(1, -(-codes.shape[0] // L))
            ivf.train(np.ascontiguousarray(codes, np.uint8))
            sign_centroids = faiss.vector_to_array(faiss.downcast_IndexBinary(ivf.quantizer).xb).reshape(L, -1)
            lst = ivf.quantizer.search(np.ascontiguousarray(codes, np.uint8), 1)[1][:, 0].astype(np.int64)
        else:
            sign_centroids = np.zeros((1, layout.nbytes), np.uint8)
        # Mean ±1 sign per list and coordinate, summed in blocks (the sample unpacked at once
        # would be 4 bytes per bit).
        sums = np.zeros((L, layout.num_coords), np.float64)
        for a in range(0, codes.shape[0], 8192):
            block = unpack_signs(codes[a : a + 8192], layout)  # (b, K) ±1 float32
            onehot = np.zeros((block.shape[0], L), np.float32)
            onehot[np.arange(block.shape[0]), lst[a : a + 8192]] = 1.0
            sums += onehot.T @ block
        mean_signs = sums / np.maximum(np.bincount(lst, minlength=L), 1)[:, None]
        return cls(scale_centroids, sign_centroids, mean_signs.astype(np.float32))


class ClusteredFirstPass(FirstPass, kind="clustered"):
    """The clustered copy of the stored codes and its cell statistics (module docstring).

    Build with :meth:`build`, reopen with :meth:`FirstPass.load`, keep current with
    :meth:`refresh`, query with :meth:`top_k`.
    """

    Config = ClusteredConfig
    FORMAT = "eogp-clustered"
    FORMAT_VERSION = 1
    FILES = {
        "meta": ".json",
        "codes": ".codes.npy",
        "scales": ".scales.npy",
        "rowaddr": ".rowaddr.npy",
        "cells": ".cells.npz",
        "delta": ".delta.npz",
    }

    def __init__(
        self,
        index_dir: Path,
        name: str,
        config: ClusteredConfig,
        meta: Dict[str, Any],
        cells: _Cells,
        *,
        codes: np.ndarray,
        scales: np.ndarray,
        rowaddr: np.ndarray,
        offsets: np.ndarray,
        smean: np.ndarray,
        s2max: np.ndarray,
        delta: Optional[Dict[str, np.ndarray]] = None,
    ):
        super().__init__(index_dir, name, config, meta)
        self.cells = cells
        self.codes, self.scales, self.rowaddr = codes, scales, rowaddr
        self.offsets = np.asarray(offsets, np.int64)
        self.counts = np.diff(self.offsets)
        self.smean, self.s2max = np.asarray(smean, np.float32), np.asarray(s2max, np.float32)
        self.list_of_cell = np.arange(cells.num_cells) // cells.scale_cells
        self.delta = delta or _empty_delta(codes.shape[1], scales.shape[1])
        self._masks: Dict[Tuple[str, int], Tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    @property
    def ntotal(self) -> int:
        """Rows covered: the clustered copy and the delta."""
        return int(self.rowaddr.shape[0] + self.delta["rowaddr"].shape[0])

    @property
    def build_params(self) -> Dict[str, Any]:
        return dict(self.meta["params"])

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(
        cls, stored, name: str = "default", config: Optional[ClusteredConfig] = None, *, progress: bool = False
    ) -> "ClusteredFirstPass":
        """Train the cells on a sample of the stored rows and write the clustered copy of every row
        of the hot copy (:meth:`StoredIndex.hot_codes`)."""
        config = config or cls.Config()
        cls.paths(stored.path, name)  # a bad name fails now, not after the build
        require_signs(stored)
        layout: SignLayout = stored.layout
        hot = stored.hot_codes()
        n = hot.num_rows
        if n == 0:
            raise InputError(f"{stored.path}: no rows stored yet; ingest examples before building a candidate index")
        sample_rows = min(n, max(1 << 16, 256 * max(int(config.scale_cells), int(config.lists))))
        sample = np.sort(np.random.default_rng(0).choice(n, size=sample_rows, replace=False))
        cells = _Cells.train(np.asarray(hot.codes[sample]), np.asarray(hot.scales[sample]), layout, config)
        meta = {**cls.provenance(stored, name), "params": {"lists": cells.lists, "scale_cells": cells.scale_cells}}
        fragments = fragment_keys(stored.store.dataset())
        built = cls._write(
            stored.path,
            name,
            config,
            meta,
            cells,
            hot.codes,
            hot.scales,
            hot.rowaddr,
            version=hot.version,
            fragments=fragments,
            progress=progress,
        )
        return built

    @classmethod
    def _write(
        cls,
        index_dir: Path,
        name: str,
        config: ClusteredConfig,
        meta: Dict[str, Any],
        cells: _Cells,
        codes,
        scales,
        rowaddr,
        *,
        version: int,
        fragments,
        progress: bool = False,
    ) -> "ClusteredFirstPass":
        """Assign every row to its cell, write the sorted copy and the statistics, commit the JSON."""
        n, U = scales.shape
        cell = np.empty(n, np.int64)
        blocks = range(0, n, _BLOCK_ROWS)
        if progress:
            from tqdm.auto import tqdm

            blocks = tqdm(blocks, desc="assign cells", unit="block")
        for a in blocks:
            cell[a : a + _BLOCK_ROWS] = cells.assign(codes[a : a + _BLOCK_ROWS], scales[a : a + _BLOCK_ROWS])
        order = np.argsort(cell, kind="stable")  # stable: row-address order within a cell
        counts = np.bincount(cell, minlength=cells.num_cells)
        offsets = np.zeros(cells.num_cells + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        p = cls.paths(index_dir, name)
        p["dir"].mkdir(parents=True, exist_ok=True)
        tmp = {key: temporary(p[key]) for key in ("codes", "scales", "rowaddr", "cells", "meta")}
        out_codes = np.lib.format.open_memmap(tmp["codes"], mode="w+", dtype=np.uint8, shape=(n, codes.shape[1]))
        out_scales = np.empty((n, U), np.float16)
        for a in range(0, n, _BLOCK_ROWS):
            rows = order[a : a + _BLOCK_ROWS]
            out_codes[a : a + rows.size] = codes[rows]
            s = np.asarray(scales[rows], np.float32)
            out_scales[a : a + rows.size] = s  # FP16 scales read back from FP16: exact
        out_codes.flush()
        del out_codes
        # Rows are grouped by cell now: per-cell sums and maxima are reductions over runs.
        smean = np.zeros((cells.num_cells, U), np.float64)
        s2max = np.zeros((cells.num_cells, U), np.float32)
        nonempty = np.flatnonzero(counts > 0)
        starts = offsets[nonempty]
        for u in range(U):
            s = out_scales[:, u].astype(np.float32)
            smean[nonempty, u] = np.add.reduceat(s.astype(np.float64), starts) / counts[nonempty]
            s2max[nonempty, u] = np.maximum.reduceat(s * s, starts)
        with open(tmp["scales"], "wb") as fh:  # (np.save on a name would append ".npy")
            np.save(fh, out_scales)
        with open(tmp["rowaddr"], "wb") as fh:
            np.save(fh, np.ascontiguousarray(np.asarray(rowaddr, np.uint64)[order]))
        with open(tmp["cells"], "wb") as fh:
            np.savez(
                fh,
                offsets=offsets,
                smean=smean.astype(np.float32),
                s2max=s2max,
                scale_centroids=cells.scale_centroids,
                sign_centroids=cells.sign_centroids,
                mean_signs=cells.mean_signs,
            )
        meta = dict(meta, rows=int(n), delta_rows=0, table_version=int(version), fragments=fragments)
        tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        if p["delta"].exists():
            p["delta"].unlink()
        commit([p[key] for key in ("codes", "scales", "rowaddr", "cells", "meta")])
        return cls.load(index_dir, name, config=config)

    @classmethod
    def from_codes(
        cls,
        codes: np.ndarray,
        scales: np.ndarray,
        layout: SignLayout,
        config: ClusteredConfig,
        index_dir: Union[str, Path],
        name: str = "in-memory",
    ) -> "ClusteredFirstPass":
        """A clustered copy of codes held in memory, built as :meth:`build` builds (benchmarks).

        Row ``i`` gets row address ``i``; the files go to ``<index_dir>/faiss/``. Not tied to a
        table: :meth:`top_k` needs only ``stored.layout`` (and no ``where``) then.
        """
        codes = np.ascontiguousarray(codes, np.uint8)
        n = codes.shape[0]
        sample = np.sort(
            np.random.default_rng(0).choice(n, size=min(n, max(1 << 16, 256 * int(config.scale_cells))), replace=False)
        )
        cells = _Cells.train(codes[sample], np.asarray(scales[sample]), layout, config)
        meta = {
            "format": cls.FORMAT,
            "format_version": cls.FORMAT_VERSION,
            "name": name,
            "kind": cls.kind,
            "params": {"lists": cells.lists, "scale_cells": cells.scale_cells},
            "nbytes": layout.nbytes,
            "k": list(layout.k),
            "table": None,
            "projection_sha256": None,
            "weights_sha256": None,
        }
        return cls._write(
            Path(index_dir),
            name,
            config,
            meta,
            cells,
            codes,
            scales,
            np.arange(n, dtype=np.uint64),
            version=-1,
            fragments=[],
        )

    @classmethod
    def _open(cls, index_dir: Path, name: str, meta: Dict[str, Any], config: ClusteredConfig) -> "ClusteredFirstPass":
        """The copy's codes, scales and row addresses memory-mapped; the cells' sizes from the files."""
        p = cls.paths(index_dir, name)
        try:
            codes = np.load(p["codes"], mmap_mode="r")
            scales = np.load(p["scales"], mmap_mode="r")
            rowaddr = np.load(p["rowaddr"], mmap_mode="r")
            with np.load(p["cells"]) as z:
                arrays = {key: z[key] for key in z.files}
            delta = None
            if p["delta"].exists():
                with np.load(p["delta"]) as z:
                    delta = {key: z[key] for key in z.files}
        except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
            raise IncompatibleIndexError(
                f"{p['dir']}: the files of {name!r} cannot be read ({exc}); rebuild it with "
                f"{cls.rebuild_hint(index_dir, name)}"
            ) from exc
        delta_rows = 0 if delta is None else delta["rowaddr"].shape[0]
        if (
            not (codes.shape[0] == scales.shape[0] == rowaddr.shape[0] == meta["rows"] == arrays["offsets"][-1])
            or codes.shape[1] != meta["nbytes"]
            or delta_rows != meta.get("delta_rows", 0)
        ):
            raise IncompatibleIndexError(
                f"{p['dir']}: the files of {name!r} disagree with {p['meta'].name} (rows {meta['rows']}, delta "
                f"{meta.get('delta_rows', 0)}; an interrupted write?); rebuild it with "
                f"{cls.rebuild_hint(index_dir, name)}"
            )
        cells = _Cells(arrays["scale_centroids"], arrays["sign_centroids"], arrays["mean_signs"])
        config = dataclasses.replace(config, lists=cells.lists, scale_cells=cells.scale_cells)
        return cls(
            index_dir,
            name,
            config,
            meta,
            cells,
            codes=codes,
            scales=scales,
            rowaddr=rowaddr,
            offsets=arrays["offsets"],
            smean=arrays["smean"],
            s2max=arrays["s2max"],
            delta=delta,
        )

    # -- keeping current ---------------------------------------------------------------------
    def refresh(self, stored, *, progress: bool = False) -> "ClusteredFirstPass":
        """This index brought to the table's current version; returns the index to use (``self``,
        or a rebuilt one).

        Only appended fragments: their rows join the delta (merged into the clustered copy past
        ``max(1%, 4096)`` rows). Rewritten or removed fragments (compaction, deletions): the copy is
        rebuilt from the hot copy with the trained centroids.
        """
        self.check_compatible(stored)
        if stored.store.version == self.table_version:
            return self
        hot = stored.hot_codes()
        current = fragment_keys(stored.store.dataset())
        recorded = {tuple(f) for f in self.meta["fragments"]}
        known = {tuple(f) for f in self.meta.get("delta_fragments", [])} | recorded
        if not known <= {tuple(f) for f in current}:
            return self._rebuild(stored, hot, current, progress=progress)
        new_ids = [f[0] for f in current if tuple(f) not in known]
        fragment_of = (hot.rowaddr >> np.uint64(32)).astype(np.int64)
        new = np.flatnonzero(np.isin(fragment_of, np.asarray(new_ids, np.int64)))
        delta = self.delta
        if new.size:
            delta = {
                "codes": np.concatenate([delta["codes"], np.asarray(hot.codes[new])]),
                "scales": np.concatenate([delta["scales"], np.asarray(hot.scales[new], np.float16)]),
                "rowaddr": np.concatenate([delta["rowaddr"], hot.rowaddr[new].astype(np.uint64)]),
            }
        if delta["rowaddr"].shape[0] > max(_DELTA_SHARE * self.rowaddr.shape[0], _DELTA_MIN_ROWS):
            return self._rebuild(stored, hot, current, progress=progress)
        p = self.paths(self.index_dir, self.name)
        with open(temporary(p["delta"]), "wb") as fh:
            np.savez(fh, **delta)
        meta = dict(
            self.meta,
            delta_rows=int(delta["rowaddr"].shape[0]),
            table_version=int(hot.version),
            delta_fragments=sorted(list(f) for f in known - recorded) + [f for f in current if f[0] in new_ids],
        )
        temporary(p["meta"]).write_text(json.dumps(meta, indent=2) + "\n")
        commit([p["delta"], p["meta"]])
        self.meta, self.delta = meta, delta
        self._masks.clear()
        return self

    def _rebuild(self, stored, hot, fragments, *, progress: bool) -> "ClusteredFirstPass":
        meta = {k: v for k, v in self.meta.items() if k not in ("delta_fragments",)}
        return self._write(
            self.index_dir,
            self.name,
            self.config,
            meta,
            self.cells,
            hot.codes,
            hot.scales,
            hot.rowaddr,
            version=hot.version,
            fragments=fragments,
            progress=progress,
        )

    # -- searching ---------------------------------------------------------------------------
    def cell_order(self, y: np.ndarray, layout: SignLayout, side: str) -> Tuple[np.ndarray, np.ndarray]:
        """Cells by decreasing optimistic estimate for one query ``y`` ``(K,)`` and side: ``(cells
        (c,) int64, ucb (c,) float64)``, empty cells left out."""
        y = np.asarray(y, np.float64).reshape(-1)
        starts = np.asarray(layout.coord_offsets)
        m = self.cells.mean_signs
        A = np.add.reduceat(m * y[None, :], starts, axis=1)  # (L, U): mean of <y_u, b_u> per list
        B = np.add.reduceat((1.0 - m.astype(np.float64) ** 2) * (y * y)[None, :], starts, axis=1)  # variance
        sign = 1.0 if side == "positive" else -1.0
        lst = self.list_of_cell
        mu = sign * np.einsum("cu,cu->c", self.smean, A[lst])
        sd = np.sqrt(np.maximum(np.einsum("cu,cu->c", self.s2max, B[lst]), 0.0))
        ucb = mu + float(self.config.z) * sd
        cells = np.flatnonzero(self.counts > 0)
        order = cells[np.argsort(-ucb[cells], kind="stable")]
        return order, ucb[order]

    def _rows_of(self, cells: np.ndarray) -> np.ndarray:
        """Copy positions ``(r,)`` int64 of the rows of ``cells``, ascending (cells sorted first)."""
        cells = np.sort(cells)
        lens = self.counts[cells]
        total = int(lens.sum())
        if total == 0:
            return np.zeros(0, np.int64)
        shift = np.repeat(self.offsets[cells] - (np.cumsum(lens) - lens), lens)
        return np.arange(total, dtype=np.int64) + shift

    def _mask(self, stored, where: Optional[str]) -> Tuple[Optional[np.ndarray], Optional[np.ndarray], np.ndarray]:
        """Which rows of the copy and of the delta match ``where`` (boolean masks, None: all) and
        the matching rows per cell ``(ncell,)``; cached per (filter, table version)."""
        if where is None:
            return None, None, self.counts
        key = (where, self.table_version)
        with self._lock:
            if key in self._masks:
                return self._masks[key]
        hot = stored.hot_codes()
        matching = np.sort(hot.rowaddr[stored.matching_rows(where, hot)].astype(np.uint64))
        masks = []
        for addr in (self.rowaddr, self.delta["rowaddr"]):
            addr = np.asarray(addr, np.uint64)
            pos = np.searchsorted(matching, addr)
            hit = pos < matching.size
            hit[hit] = matching[pos[hit]] == addr[hit]
            masks.append(hit)
        counts = np.zeros_like(self.counts)
        nonempty = np.flatnonzero(self.counts > 0)
        if nonempty.size:
            counts[nonempty] = np.add.reduceat(masks[0].astype(np.int64), self.offsets[nonempty])
        entry = (masks[0], masks[1], counts)
        with self._lock:
            if len(self._masks) >= 8:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = entry
        return entry

    def top_k(
        self, stored, y: np.ndarray, k: int, C: int, sides: Sequence[str], *, where: Optional[str] = None
    ) -> Dict[str, SideAnswer]:
        """One query's best rows per side: ``{side: (rowaddr (r,) uint64, exact scores (r,) float32,
        rows scanned)}`` with ``r <= k + 8``, best first (the ranking picks the top ``k``).

        Args:
            y: ``(1, K)`` or ``(K,)`` float32. k: rows wanted per side.
            C: at most this many rows of the clustered copy are scanned per side; when no more
                rows than that match (``where``), all of them are (exact). The delta is always
                scanned in full.
            where: SQL filter (evaluated by :meth:`StoredIndex.matching_rows`).
        """
        from eogp_index.search.scan import scan_top_k

        layout: SignLayout = stored.layout
        y = np.asarray(y, np.float32).reshape(1, -1)
        mask, delta_mask, counts = self._mask(stored, where)
        total = int(counts.sum())
        kk = int(k) + _EXTRA
        first = min(
            int(C),
            max(int(np.ceil(float(self.config.first_fraction) * self.rowaddr.shape[0])), _FIRST_ROWS_PER_K * int(k)),
        )
        out = {}
        for side in sides:
            largest = side == "positive"
            found: List[Tuple[np.ndarray, np.ndarray]] = []

            def scan(codes, scales, addr, rows):
                if rows is not None and rows.size == 0:
                    return
                top = scan_top_k(codes, scales, y, layout, kk, rows=rows, largest=largest, smallest=not largest)
                idx, val = (
                    (top.largest_indices, top.largest_scores)
                    if largest
                    else (top.smallest_indices, top.smallest_scores)
                )
                found.append((np.asarray(addr, np.uint64)[idx[0]], val[0]))

            def rows_of(cells):
                rows = self._rows_of(cells)
                return rows if mask is None else rows[mask[rows]]

            if self.delta["rowaddr"].size:
                scan(
                    self.delta["codes"],
                    self.delta["scales"],
                    self.delta["rowaddr"],
                    None if delta_mask is None else np.flatnonzero(delta_mask),
                )
            if total <= C:  # every (matching) row fits the budget: the exact scan
                scan(self.codes, self.scales, self.rowaddr, None if mask is None else np.flatnonzero(mask))
                best = _best(found, kk, largest)
                out[side] = (best[0], best[1], total)
                continue
            order, ucb = self.cell_order(y[0], layout, side)
            cum = np.cumsum(counts[order])
            j1 = min(
                order.size,
                int(np.searchsorted(cum, first)) + 1,
                max(1, int(np.searchsorted(cum, int(C), side="right"))),
            )
            rows = rows_of(order[:j1])[: int(C)]  # (a first cell larger than C: its first C rows)
            scanned = int(rows.size)
            scan(self.codes, self.scales, self.rowaddr, rows)
            best = _best(found, kk, largest)
            # Round 2: the cells whose optimistic estimate still reaches the k-th best exact score
            # (all of them while fewer than k rows were found), in that order, within the budget.
            threshold = (best[1][k - 1] if largest else -best[1][k - 1]) if best[1].size >= k else -np.inf
            rest = order[j1:][ucb[j1:] >= threshold]
            rest = rest[: int(np.searchsorted(np.cumsum(counts[rest]), int(C) - scanned, side="right"))]
            rows = rows_of(rest)
            if rows.size:
                scanned += int(rows.size)
                found = [best]
                scan(self.codes, self.scales, self.rowaddr, rows)
                best = _best(found, kk, largest)
            out[side] = (best[0], best[1], scanned)
        return out


def _best(found: List[Tuple[np.ndarray, np.ndarray]], kk: int, largest: bool) -> Tuple[np.ndarray, np.ndarray]:
    """The ``kk`` best of several (rowaddr, score) lists, best first, equal scores by row address."""
    if not found:
        return np.zeros(0, np.uint64), np.zeros(0, np.float32)
    addr = np.concatenate([f[0] for f in found]).astype(np.uint64)
    val = np.concatenate([f[1] for f in found]).astype(np.float32)
    order = np.lexsort((addr, -val if largest else val))[:kk]
    return addr[order], val[order]


def _empty_delta(nbytes: int, U: int) -> Dict[str, np.ndarray]:
    return {
        "codes": np.zeros((0, nbytes), np.uint8),
        "scales": np.zeros((0, U), np.float16),
        "rowaddr": np.zeros(0, np.uint64),
    }
