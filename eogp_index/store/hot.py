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
from typing import Dict, Optional

import numpy as np

from eogp_index.errors import EOGPError
from eogp_index.store.codecs import Codec, Encoded
from eogp_index.store.table import Store

#: Record batches read from Lance are sized in bytes, not rows: a few thousand rows of wide codes
#: can already be tens of megabytes.
BATCH_BYTES = 64 << 20


class StaleHotCopyError(EOGPError):
    """Row addresses from the table are not in the hot copy: the table changed underneath it."""


@dataclass(frozen=True)
class HotCodes:
    """Codes of every stored row, in row-address order.

    Attributes:
        rowaddr: ``(n,)`` uint64 Lance row addresses (``fragment_id << 32 | offset``), sorted.
        encoded: the code columns (:class:`~eogp_index.store.codecs.Encoded`, scanning dtypes):
            ``signs`` ``(n, nbytes)`` uint8 and ``scales`` ``(n, U)`` float32 (1-bit), or
            ``coords`` ``(n, K)`` float32.
        version: the table version the copy reflects.
    """

    rowaddr: np.ndarray
    encoded: Encoded
    version: int

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
            raise StaleHotCopyError("the in-memory copy of the codes is older than the table (another process "
                                    "changed it during this query); run the query again")
        return pos.astype(np.int64)


def _fragment_key(fragment) -> str:
    deletions = fragment.num_deletions if hasattr(fragment, "num_deletions") else 0
    return f"frag-{fragment.fragment_id}-{fragment.physical_rows}-{deletions}"


def _read_fragment(dataset, fragment, codec: Codec) -> Dict[str, np.ndarray]:
    """``{"rowaddr": (n,), <code column>: (n, w), ...}`` of one fragment, in row order."""
    scanner = dataset.scanner(columns=list(codec.columns), fragments=[fragment], with_row_address=True,
                              batch_size_bytes=BATCH_BYTES, scan_in_order=True)
    rowaddr, parts = [], []
    for batch in scanner.to_batches():
        rowaddr.append(batch.column("_rowaddr").to_numpy().astype(np.uint64))
        parts.append(codec.from_arrow(batch).columns())
    out = {"rowaddr": np.concatenate(rowaddr) if rowaddr else np.zeros(0, np.uint64)}
    for name, empty in codec.empty().columns().items():
        out[name] = np.concatenate([p[name] for p in parts]) if parts else empty
    return out


def load_hot(store: Store, codec: Codec, cache_dir: Optional[Path]) -> HotCodes:
    """Build or refresh the hot copy of ``store`` for its latest version.

    Fragments already cached in ``cache_dir`` are memory-mapped, new ones are read from Lance
    (only the code columns) and cached, and caches of fragments no longer in the table are
    removed. ``cache_dir=None`` keeps everything in memory only.
    """
    names = ["rowaddr", *codec.columns]
    if store.table is None:
        return HotCodes(rowaddr=np.zeros(0, np.uint64), encoded=codec.empty(), version=0)
    dataset = store.dataset()
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
        part = _read_fragment(dataset, fragment, codec)
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
    if not parts:
        return HotCodes(rowaddr=np.zeros(0, np.uint64), encoded=codec.empty(), version=dataset.version)
    joined = {n: np.concatenate([p[n] for p in parts]) for n in names}
    order = np.argsort(joined["rowaddr"], kind="stable")
    if not np.array_equal(order, np.arange(order.size)):
        joined = {n: v[order] for n, v in joined.items()}
    rowaddr = np.ascontiguousarray(joined.pop("rowaddr"))
    encoded = Encoded(**{n: np.ascontiguousarray(v) for n, v in joined.items()})
    return HotCodes(rowaddr=rowaddr, encoded=encoded, version=dataset.version)
