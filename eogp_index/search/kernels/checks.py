"""Input checks and layout geometry for the scan kernels (pure numpy, no numba).

:func:`_as_layout` accepts any object with per-module sizes ``.k``; :func:`_geometry` derives
(and caches per layout) the offset arrays every kernel indexes with; the ``_check_*`` functions
turn user input into the exact dtypes, shapes and contiguity the kernels are compiled for, with
error messages that say what was expected. Kept apart from the kernels so that the drivers
(numba and torch) validate input the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from eogp_index.errors import ConfigError, InputError
from eogp_index.store.codecs import SignLayout


def _as_layout(layout: Any) -> SignLayout:
    """Accept a :class:`SignLayout` or any object with a ``k`` sequence of module sizes."""
    if isinstance(layout, SignLayout):
        return layout
    k = getattr(layout, "k", None)
    if k is None:
        raise ConfigError(f"expected a SignLayout (an object with per-module sizes .k), got {type(layout).__name__}")
    return SignLayout(tuple(k))


@dataclass(frozen=True)
class _Geometry:
    """Index arrays derived from a layout (cached per layout)."""

    boff: np.ndarray  # (U+1,) uint64 byte offsets of the modules, plus nbytes
    pad_index: np.ndarray  # (K,) int64: column j of a query → bit position 8*off_u + (j - cum_k_u)
    module_of_coord: np.ndarray  # (K,) int64
    word_start: np.ndarray  # (U+1,) int64 first 64-bit word of each module in a padded row
    word_start_u64: np.ndarray  # the same as uint64, for the kernels
    reads_past_row: bool  # a module's 8-byte loads can pass the end of the row (see kernels.bounded)


@functools.lru_cache(maxsize=64)
def _geometry(layout: SignLayout) -> _Geometry:
    """The offset arrays of ``layout`` (read-only; cached, so every call with a layout shares them)."""
    k = np.asarray(layout.k, dtype=np.int64)
    mb = (k + 7) // 8
    boff = np.concatenate([[0], np.cumsum(mb)]).astype(np.uint64)
    coff = np.concatenate([[0], np.cumsum(k)[:-1]])
    module_of_coord = np.repeat(np.arange(len(k), dtype=np.int64), k)
    pad_index = 8 * boff[:-1].astype(np.int64)[module_of_coord] + (np.arange(int(k.sum())) - coff[module_of_coord])
    mw = (mb + 7) // 8
    word_start = np.concatenate([[0], np.cumsum(mw)]).astype(np.int64)
    past = bool(np.any(boff[:-1].astype(np.int64) + 8 * mw > int(mb.sum())))
    ws64 = word_start.astype(np.uint64)
    for a in (boff, pad_index, module_of_coord, word_start, ws64):
        a.setflags(write=False)
    return _Geometry(boff, pad_index, module_of_coord, word_start, ws64, past)


def _check_codes(codes: Any, layout: SignLayout) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise InputError(f"codes must be uint8 packed sign bits, got dtype {codes.dtype}")
    if codes.ndim != 2 or codes.shape[1] != layout.nbytes:
        raise ConfigError(
            f"codes must have shape (n, {layout.nbytes}) (layout.nbytes = Σ_u ⌈k_u/8⌉ for k={_short(layout.k)}), "
            f"got {codes.shape}; check that the store and the layout belong together"
        )
    return np.ascontiguousarray(codes)


def _check_scales(scales: Any, n: int, layout: SignLayout) -> np.ndarray:
    scales = np.asarray(scales)
    if scales.ndim != 2 or scales.shape != (n, layout.num_modules):
        raise ConfigError(
            f"scales must have shape (n, U) = ({n}, {layout.num_modules}) to match codes and the layout, "
            f"got {scales.shape}"
        )
    if scales.dtype == np.float16:
        return np.ascontiguousarray(scales)
    if not np.issubdtype(scales.dtype, np.floating):
        raise InputError(f"scales must be float16 (or another float dtype), got {scales.dtype}")
    return np.ascontiguousarray(scales, dtype=np.float32)


def _check_queries(y: Any, layout: SignLayout) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 1:
        y = y[None, :]
    if y.ndim != 2 or y.shape[1] != layout.num_coords:
        raise ConfigError(
            f"queries y must have shape (nq, K) with K = Σ_u k_u = {layout.num_coords}, got {np.shape(y)}"
        )
    if not np.issubdtype(y.dtype, np.floating) and not np.issubdtype(y.dtype, np.integer):
        raise InputError(f"queries y must be float32, got dtype {y.dtype}")
    y = np.ascontiguousarray(y, dtype=np.float32)
    if not np.isfinite(y).all():
        bad = np.argwhere(~np.isfinite(y))[0]
        raise InputError(f"queries y contain NaN/inf (first at query {bad[0]}, column {bad[1]}); scores would be NaN")
    return y


def _check_rows(rows: Any, n: int) -> Optional[np.ndarray]:
    if rows is None:
        return None
    rows = np.asarray(rows)
    if rows.ndim != 1 or not (np.issubdtype(rows.dtype, np.integer) or rows.size == 0):
        raise InputError(f"rows must be a 1-D array of integer row indices, got shape {rows.shape} dtype {rows.dtype}")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        bad = rows[(rows < 0) | (rows >= n)][0]
        raise InputError(f"rows contains index {bad}, outside the store's 0..{n - 1}")
    return rows


def _short(k: tuple[int, ...]) -> str:
    return str(k) if len(k) <= 6 else f"({k[0]}, {k[1]}, …, {k[-1]}) [{len(k)} modules]"


def _prepare(codes: Any, scales: Any, y: Any, layout: Any):
    """Checked ``(codes, scales, y, layout)`` of a scan (see the ``_check_*`` functions)."""
    layout = _as_layout(layout)
    codes = _check_codes(codes, layout)
    scales = _check_scales(scales, codes.shape[0], layout)
    y = _check_queries(y, layout)
    return codes, scales, y, layout
