"""The hot copy of the stored codes that the scan reads.

The LanceDB table stays the system of record, but decoding a wide ``list<uint8>`` column is far
slower than memory bandwidth, so repeated queries scan a copy of the ``signs`` and ``scales``
(or ``coords``) held in memory. The copy is cached on disk per Lance fragment
(``<index>/hot/frag-<id>-<physical rows>-<deletions>/``, ``.npy`` files) and keyed by row
address: it is tied to the table's fragments, so rows added by an ingest (new fragments) are
read and appended on the next query, and rewritten fragments (compaction, deletions) are re-read.
Lance answers filters (which row addresses); the hot copy is scanned.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np

from eogp_index.store.codecs import SignLayout
from eogp_index.store.table import Store, list_column_to_numpy

#: Record batches read from Lance are sized in bytes, not rows: a few thousand rows of wide codes
#: can already be tens of megabytes.
BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class HotCodes:
    """Codes of every stored row, in row-address order.

    Attributes:
        rowaddr: ``(n,)`` uint64 Lance row addresses (``fragment_id << 32 | offset``), sorted.
        codes: ``(n, nbytes)`` uint8 packed signs (1-bit), else ``None``.
        scales: ``(n, U)`` float32 (1-bit), else ``None``.
        coords: ``(n, K)`` float32 (fp16/fp32 precision), else ``None``.
        version: the table version the copy reflects.
    """

    rowaddr: np.ndarray
    codes: Optional[np.ndarray]
    scales: Optional[np.ndarray]
    coords: Optional[np.ndarray]
    version: int

    @property
    def num_rows(self) -> int:
        return int(self.rowaddr.shape[0])

    def positions(self, rowaddr: np.ndarray) -> np.ndarray:
        """Row addresses → positions in the hot arrays, ``(r,)`` int64."""
        rowaddr = np.asarray(rowaddr, dtype=np.uint64)
        pos = np.searchsorted(self.rowaddr, rowaddr)
        if pos.size and (pos.max() >= self.num_rows or not np.array_equal(self.rowaddr[pos], rowaddr)):
            raise RuntimeError("hot copy is out of date with the table; reopen the index")
        return pos.astype(np.int64)


def _fragment_key(fragment) -> str:
    deletions = fragment.num_deletions if hasattr(fragment, "num_deletions") else 0
    return f"frag-{fragment.fragment_id}-{fragment.physical_rows}-{deletions}"


def _read_fragment(dataset, fragment, columns: List[str], layout: SignLayout, precision: str) -> dict:
    rowaddr, codes, scales, coords = [], [], [], []
    scanner = dataset.scanner(columns=columns, fragments=[fragment], with_row_address=True,
                              batch_size_bytes=BATCH_BYTES, scan_in_order=True)
    for batch in scanner.to_batches():
        rowaddr.append(batch.column("_rowaddr").to_numpy().astype(np.uint64))
        if precision == "1bit":
            codes.append(list_column_to_numpy(batch.column("signs"), layout.nbytes, np.uint8))
            scales.append(list_column_to_numpy(batch.column("scales"), layout.num_modules, np.float32))
        else:
            coords.append(list_column_to_numpy(batch.column("coords"), layout.num_coords, np.float32))

    def stack(parts, width, dtype):
        return np.concatenate(parts) if parts else np.zeros((0, width), dtype)

    out = {"rowaddr": np.concatenate(rowaddr) if rowaddr else np.zeros(0, np.uint64)}
    if precision == "1bit":
        out["codes"] = stack(codes, layout.nbytes, np.uint8)
        out["scales"] = stack(scales, layout.num_modules, np.float32)
    else:
        out["coords"] = stack(coords, layout.num_coords, np.float32)
    return out


def load_hot(store: Store, layout: SignLayout, precision: str, cache_dir: Optional[Path]) -> HotCodes:
    """Build or refresh the hot copy of ``store`` for its latest version.

    Fragments already cached in ``cache_dir`` are memory-mapped, new ones are read from Lance
    (only the code columns) and cached, and caches of fragments no longer in the table are
    removed. ``cache_dir=None`` keeps everything in memory only.
    """
    names = ["rowaddr", "codes", "scales"] if precision == "1bit" else ["rowaddr", "coords"]
    if store.table is None:
        empty = {"rowaddr": np.zeros(0, np.uint64), "codes": None, "scales": None, "coords": None}
        return HotCodes(version=0, **empty)
    dataset = store.dataset()
    columns = ["signs", "scales"] if precision == "1bit" else ["coords"]
    fragments = sorted(dataset.get_fragments(), key=lambda f: f.fragment_id)
    parts = []
    live = set()
    for fragment in fragments:
        key = _fragment_key(fragment)
        live.add(key)
        folder = cache_dir / key if cache_dir is not None else None
        if folder is not None and all((folder / f"{n}.npy").exists() for n in names):
            parts.append({n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in names})
            continue
        part = _read_fragment(dataset, fragment, columns, layout, precision)
        if folder is not None:
            tmp = folder.with_name(folder.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            for n in names:
                np.save(tmp / f"{n}.npy", part[n])
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)  # a half-written cache is never picked up
        parts.append(part)
    if cache_dir is not None and cache_dir.exists():
        for stale in cache_dir.iterdir():
            if stale.name not in live:
                shutil.rmtree(stale, ignore_errors=True)
    joined = {n: np.concatenate([p[n] for p in parts]) for n in names}
    order = np.argsort(joined["rowaddr"], kind="stable")
    if not np.array_equal(order, np.arange(order.size)):
        joined = {n: v[order] for n, v in joined.items()}
    return HotCodes(
        rowaddr=np.ascontiguousarray(joined["rowaddr"]),
        codes=np.ascontiguousarray(joined["codes"]) if "codes" in joined else None,
        scales=np.ascontiguousarray(joined["scales"], dtype=np.float32) if "scales" in joined else None,
        coords=np.ascontiguousarray(joined["coords"]) if "coords" in joined else None,
        version=dataset.version,
    )
