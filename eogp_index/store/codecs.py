"""Stage 3: one-bit storage of projected coordinates (Section 3.3).

Per example and module: the signs of the ``k_u`` coordinates, packed, and one FP16 scale
``s = ‖x‖₁ / k_u`` — the least-squares optimal scale for those signs (Appendix A.3).

Bit order (schemas/store.md): module ``u``'s bits start at a fresh byte; coordinate ``j`` is bit
``j % 8`` (least significant first, FAISS's convention) of byte ``offset_u + j // 8``; bit 1 is
``+1`` (coordinate ``>= 0``), bit 0 is ``-1``; padding bits are 0. Per example this is
``Σ_u (⌈k_u/8⌉ + 2)`` bytes.

``fp16``/``fp32`` precision stores the coordinates themselves, for comparisons.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from eogp_index.config import Precision
from eogp_index.errors import ConfigError, InputError


@dataclass(frozen=True)
class SignLayout:
    """Where each module's coordinates and bits sit in a row.

    Attributes:
        k: coordinates per module, in module order.
    """

    k: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            k = tuple(int(v) for v in self.k)
        except (TypeError, ValueError):
            raise ConfigError(f"SignLayout.k must be positive integers (coordinates per module), got {self.k!r}") from None
        if not k or min(k) < 1:
            raise ConfigError(f"SignLayout needs at least one module and every k_u >= 1, got k={k}")
        object.__setattr__(self, "k", k)  # hashable and canonical: kernels cache per layout

    @property
    def num_modules(self) -> int:
        return len(self.k)

    @property
    def num_coords(self) -> int:
        return int(sum(self.k))

    @functools.cached_property
    def module_bytes(self) -> tuple[int, ...]:
        return tuple(math.ceil(k / 8) for k in self.k)

    @property
    def nbytes(self) -> int:
        """Packed sign bytes per row, ``Σ_u ⌈k_u/8⌉``."""
        return int(sum(self.module_bytes))

    @functools.cached_property
    def byte_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.module_bytes[:-1]))

    @functools.cached_property
    def coord_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.k[:-1]))

    def bytes_per_example(self, precision: Precision = "1bit") -> int:
        """Per-example payload: ``Σ_u(⌈k_u/8⌉+2)`` for 1 bit, ``2Σk_u`` / ``4Σk_u`` otherwise."""
        if precision == "1bit":
            return self.nbytes + 2 * self.num_modules
        return self.num_coords * (2 if precision == "fp16" else 4)


def pack_signs(x: np.ndarray, layout: SignLayout) -> np.ndarray:
    """``(n, K)`` float coordinates → ``(n, nbytes)`` uint8 packed signs (bit 1 = ``x >= 0``)."""
    x = np.asarray(x)
    _check_width(x, layout.num_coords, "coordinates")
    _check_finite(x)
    parts = [
        np.packbits(x[:, off : off + k] >= 0, axis=1, bitorder="little")
        for off, k in zip(layout.coord_offsets, layout.k)
    ]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def unpack_signs(codes: np.ndarray, layout: SignLayout) -> np.ndarray:
    """``(n, nbytes)`` uint8 → ``(n, K)`` float32 of ±1 (padding bits dropped)."""
    _check_width(codes, layout.nbytes, "codes")
    parts = []
    for off, nb, k in zip(layout.byte_offsets, layout.module_bytes, layout.k):
        bits = np.unpackbits(codes[:, off : off + nb], axis=1, bitorder="little")[:, :k]
        parts.append(bits.astype(np.float32) * 2 - 1)
    return np.concatenate(parts, axis=1)


def scales_of(x: np.ndarray, layout: SignLayout) -> np.ndarray:
    """``(n, K)`` coordinates → ``(n, U)`` float16 scales ``‖x_u‖₁/k_u`` (computed in float32)."""
    x = np.asarray(x, dtype=np.float32)
    _check_width(x, layout.num_coords, "coordinates")
    _check_finite(x)
    scales = np.stack(
        [np.abs(x[:, off : off + k]).mean(axis=1) for off, k in zip(layout.coord_offsets, layout.k)], axis=1
    )
    if scales.size and scales.max() > float(np.finfo(np.float16).max):
        raise InputError(f"a scale ({scales.max():.4g}) exceeds the float16 range (65504); "
                         "the projected coordinates are unreasonably large (check the damping)")
    return scales.astype(np.float16)


@dataclass(frozen=True)
class Encoded:
    """A batch of stored representations.

    ``signs`` ``(n, nbytes)`` uint8 and ``scales`` ``(n, U)`` float16 in 1-bit mode;
    ``coords`` ``(n, K)`` float16/float32 otherwise.
    """

    signs: Optional[np.ndarray] = None
    scales: Optional[np.ndarray] = None
    coords: Optional[np.ndarray] = None


def encode(x: np.ndarray, layout: SignLayout, precision: Precision) -> Encoded:
    """Quantize ``(n, K)`` float32 coordinates for storage."""
    if precision == "1bit":
        return Encoded(signs=pack_signs(x, layout), scales=scales_of(x, layout))
    dtype = np.float16 if precision == "fp16" else np.float32
    _check_width(np.asarray(x), layout.num_coords, "coordinates")
    return Encoded(coords=np.asarray(x).astype(dtype))


def decode(encoded: Encoded, layout: SignLayout) -> np.ndarray:
    """The stored approximation ``s_u · b_u`` (or the stored coordinates), ``(n, K)`` float32."""
    if encoded.coords is not None:
        return encoded.coords.astype(np.float32)
    signs = unpack_signs(encoded.signs, layout)
    scale = np.repeat(encoded.scales.astype(np.float32), layout.k, axis=1)
    return signs * scale


def _check_finite(x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise InputError("coordinates contain NaN or inf: their signs are undefined "
                         "(check the model's loss and the projection upstream)")


def _check_width(array: np.ndarray, expected: int, what: str) -> None:
    if array.ndim != 2 or array.shape[1] != expected:
        raise ConfigError(f"{what} must have shape (n, {expected}) for this layout, got {array.shape}")


def concat_modules(coords: Sequence[np.ndarray]) -> np.ndarray:
    """Per-module ``(n, k_u)`` arrays → one ``(n, K)`` float32 array in module order."""
    return np.ascontiguousarray(np.concatenate([np.asarray(c, dtype=np.float32) for c in coords], axis=1))
