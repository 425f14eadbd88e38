"""Stage 4: one-bit storage of projected coordinates (Section 3.3), one codec per precision.

Per example and module: the signs of the ``k_u`` coordinates, packed, and one FP16 scale
``s = ‖x‖₁ / k_u`` — the least-squares optimal scale for those signs (Appendix A.3).

Bit order (schemas/store.md): module ``u``'s bits start at a fresh byte; coordinate ``j`` is bit
``j % 8`` (least significant first, FAISS's convention) of byte ``offset_u + j // 8``; bit 1 is
``+1`` (coordinate ``>= 0``), bit 0 is ``-1``; padding bits are 0. Per example this is
``Σ_u (⌈k_u/8⌉ + 2)`` bytes.

``fp16``/``fp32`` precision stores the coordinates themselves, for comparisons.

A :class:`Codec` is everything a precision decides: which table columns a row has, its bytes,
how coordinates are encoded, and how stored columns are read back for scanning
(:func:`codec_for` picks one from the manifest's ``precision``). Nothing else in eogp-index
branches on the precision.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from eogp_index.config import TIER_LEVELS, Precision, bytes_per_module, quantize_tier_block, tier_bytes_per_module
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
            raise ConfigError(
                f"SignLayout.k must be positive integers (coordinates per module), got {self.k!r}"
            ) from None
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
        return sum(bytes_per_module(k, precision) for k in self.k)


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
        raise InputError(
            f"a scale ({scales.max():.4g}) exceeds the float16 range (65504); "
            "the projected coordinates are unreasonably large (check the damping)"
        )
    return scales.astype(np.float16)


@dataclass(frozen=True)
class Encoded:
    """A batch of stored representations, named as their table columns.

    ``signs`` ``(n, nbytes)`` uint8 and ``scales`` ``(n, U)`` float16 (float32 once read back for
    scanning) in 1-bit mode; ``coords`` ``(n, K)`` float16/float32 otherwise. A rescoring tier's
    columns are :class:`TierCodec`'s (:meth:`TierCodec.split`).
    """

    signs: Optional[np.ndarray] = None
    scales: Optional[np.ndarray] = None
    coords: Optional[np.ndarray] = None

    def columns(self) -> Dict[str, np.ndarray]:
        """``{column name: (n, w) array}`` of the columns this batch has, in schema order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def num_rows(self) -> int:
        return int(next(iter(self.columns().values())).shape[0])

    def take(self, rows: np.ndarray) -> "Encoded":
        """The rows ``rows`` ``(r,)`` int64 of every column."""
        return Encoded(**{name: values[rows] for name, values in self.columns().items()})


def checkpoint_column(name: str, part: int) -> str:
    """The table column of code column ``name`` for checkpoint ``part`` of an ensemble
    (schemas/store.md): checkpoint 0's is ``name`` itself, checkpoint ``j``'s ``name_c<j>``, so
    that adding a checkpoint adds columns without rewriting the others."""
    return name if part == 0 else f"{name}_c{part}"


def _part_sums(per_module: Sequence[int], parts: Tuple[int, ...]) -> Tuple[int, ...]:
    """Per-module widths summed over each checkpoint's consecutive modules."""
    out, start = [], 0
    for count in parts:
        out.append(int(sum(per_module[start : start + count])))
        start += count
    return tuple(out)


class _Parts:
    """The code columns of an ensemble's checkpoints (``parts``: modules per checkpoint, in the
    combined layout's order). Every module starts at a fresh byte, so a checkpoint's columns are
    a contiguous slice of the combined row: the table holds one column per checkpoint
    (:func:`checkpoint_column`) and everything read back is the combined layout."""

    parts: Tuple[int, ...]

    def _init_parts(self, parts: Optional[Sequence[int]], num_modules: int) -> None:
        parts = (num_modules,) if parts is None else tuple(int(p) for p in parts)
        if sum(parts) != num_modules or min(parts) < 1:
            raise ConfigError(f"checkpoint parts {list(parts)} must split the {num_modules} modules")
        self.parts = parts

    def module_widths_of(self, name: str) -> Sequence[int]:
        """Elements of the combined column ``name`` per module."""
        raise NotImplementedError

    def _column_parts(self, name: str) -> Tuple[int, ...]:
        return _part_sums(self.module_widths_of(name), self.parts)

    @property
    def columns(self) -> Tuple[str, ...]:
        """The table columns of the codes, in schema order (checkpoint 0's, then checkpoint 1's, ...)."""
        return tuple(checkpoint_column(name, j) for j in range(len(self.parts)) for name in self.logical_columns)

    def split(self, columns: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Combined ``{column: (n, w)}`` arrays → the table's columns (:attr:`columns`)."""
        if len(self.parts) == 1:
            return dict(columns)
        out = {}
        for j in range(len(self.parts)):
            for name in self.logical_columns:
                widths = self._column_parts(name)
                start = sum(widths[:j])
                out[checkpoint_column(name, j)] = np.ascontiguousarray(columns[name][:, start : start + widths[j]])
        return out

    def read_column(self, batch, name: str, dtype) -> np.ndarray:
        """Combined column ``name`` of an Arrow table or batch, its checkpoints' columns joined."""
        widths = self._column_parts(name)
        arrays = [
            list_column_to_numpy(batch.column(checkpoint_column(name, j)), width, dtype)
            for j, width in enumerate(widths)
        ]
        return arrays[0] if len(arrays) == 1 else np.ascontiguousarray(np.concatenate(arrays, axis=1))


class Codec(_Parts):
    """How one precision stores a row: its columns, bytes, encoding and read-back.

    Subclasses set ``precision`` and ``logical_columns`` and implement :meth:`encode`,
    :meth:`widths` and :meth:`module_widths_of`. ``parts``: an ensemble's modules per
    checkpoint (:class:`_Parts`); None: one checkpoint.
    """

    precision: ClassVar[str]
    #: the code columns of a row (combined over an ensemble's checkpoints), in schema order
    logical_columns: ClassVar[Tuple[str, ...]]

    def __init__(self, layout: SignLayout, parts: Optional[Sequence[int]] = None):
        self.layout = layout
        self._init_parts(parts, layout.num_modules)

    @property
    def bytes_per_example(self) -> int:
        return self.layout.bytes_per_example(self.precision)  # type: ignore[arg-type]

    def encode(self, x: np.ndarray) -> Encoded:
        """Quantize ``(n, K)`` float32 coordinates for storage."""
        raise NotImplementedError

    def decode(self, encoded: Encoded) -> np.ndarray:
        """The stored approximation ``s_u · b_u`` (or the stored coordinates), ``(n, K)`` float32."""
        return decode(encoded, self.layout)

    def widths(self) -> Dict[str, Tuple[int, type]]:
        """``{column: (width, numpy dtype read back for scanning)}``."""
        raise NotImplementedError

    def from_arrow(self, batch) -> Encoded:
        """Code columns of an Arrow table or record batch → :class:`Encoded` in scanning dtypes."""
        return Encoded(**{name: self.read_column(batch, name, dtype) for name, (_, dtype) in self.widths().items()})

    def empty(self) -> Encoded:
        return Encoded(**{name: np.zeros((0, width), dtype) for name, (width, dtype) in self.widths().items()})


class OneBitCodec(Codec):
    """EOGP's storage: packed signs plus one FP16 scale ``‖x_u‖₁/k_u`` per module."""

    precision = "1bit"
    logical_columns = ("signs", "scales")

    def module_widths_of(self, name: str) -> Sequence[int]:
        return self.layout.module_bytes if name == "signs" else (1,) * self.layout.num_modules

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded(signs=pack_signs(x, self.layout), scales=scales_of(x, self.layout))

    def widths(self) -> Dict[str, Tuple[int, type]]:
        # Scales are widened to float32 once, when read back: the kernels read them per row.
        return {"signs": (self.layout.nbytes, np.uint8), "scales": (self.layout.num_modules, np.float32)}


class FloatCodec(Codec):
    """Unquantized coordinates (fp16 or fp32), for comparisons with the one-bit code."""

    logical_columns = ("coords",)

    def __init__(self, layout: SignLayout, precision: Precision, parts: Optional[Sequence[int]] = None):
        super().__init__(layout, parts)
        self.precision = precision  # type: ignore[misc]
        self.dtype = np.float16 if precision == "fp16" else np.float32

    def encode(self, x: np.ndarray) -> Encoded:
        _check_width(np.asarray(x), self.layout.num_coords, "coordinates")
        return Encoded(coords=np.asarray(x).astype(self.dtype))

    def widths(self) -> Dict[str, Tuple[int, type]]:
        return {"coords": (self.layout.num_coords, np.float32)}

    def module_widths_of(self, name: str) -> Sequence[int]:
        return self.layout.k


#: The largest code of each integer tier: symmetric, so that zero is exact and ``-q`` is a code.


def prefix_columns(x: np.ndarray, layout: SignLayout, prefix: SignLayout) -> np.ndarray:
    """The first ``prefix.k[u]`` of each module's ``layout.k[u]`` columns of ``x``.

    Args:
        x: ``(n, layout.num_coords)`` or already ``(n, prefix.num_coords)`` (returned as it is).
        layout: the wider layout (a rescoring tier's, ``StorageConfig.rescore_k``); prefix: the
            one-bit code's, ``prefix.k[u] <= layout.k[u]``.

    Returns:
        ``(n, prefix.num_coords)``, ``x`` itself when the layouts are equal.
    """
    x = np.asarray(x)
    if layout.k == prefix.k or (x.ndim == 2 and x.shape[1] == prefix.num_coords):
        return x
    _check_width(x, layout.num_coords, "coordinates")
    return np.ascontiguousarray(
        np.concatenate([x[:, off : off + k] for off, k in zip(layout.coord_offsets, prefix.k)], axis=1)
    )


class TierCodec(_Parts):
    """The rescoring tier: the ``(n, T)`` coordinates of ``layout`` (the one-bit code's, or
    more per module with ``--rescore-k``: the one-bit code then keeps the first ``k_u`` of each
    module's ``t_u``) at ``code``'s precision (schemas/store.md).

    int8/int4: per module ``u`` the scale ``s_u = max|x_u| / q`` (``q`` = 127 or 7) rounded to
    FP16, and the codes ``round(x / s_u)`` clipped to ``[-q, q]``; the tier decodes to
    ``codes · s_u``. int4 packs two codes a byte, each as ``code + 8`` (coordinate ``j`` of module
    ``u`` in byte ``offset_u + j // 2``, the low nibble for even ``j``; every module starts at a
    fresh byte). fp16: the coordinates rounded to float16, no scale.

    ``record`` (index format 4, schemas/store.md): an int8 or int4 tier's row is one record in the
    table's ``tier`` column, ``fixed_size_list<uint8>``: the codes' bytes, then the module scales'
    FP16 bytes (little-endian), so that rescoring reads each row with one read of its own bytes.
    Without it (format 3) the scales are a column of their own, ``tier_scales``. Either way the
    codec's arrays (:meth:`encode`, :meth:`decode`, :meth:`from_arrow`) are ``tier`` ``(n, w)``
    and ``tier_scales`` ``(n, U)``; :meth:`split` lays them out as the table's columns.
    """

    def __init__(self, code: str, layout: SignLayout, parts: Optional[Sequence[int]] = None, *, record: bool = True):
        if code not in ("int8", "int4", "fp16"):
            raise ConfigError(f"a rescoring tier's code is int8, int4 or fp16, got {code!r}")
        self.code = code
        self.layout = layout
        self.record = bool(record) and code != "fp16"
        self._init_parts(parts, layout.num_modules)

    @property
    def logical_columns(self) -> Tuple[str, ...]:
        """The codec's arrays; the table's columns are :attr:`columns`."""
        return ("tier",) if self.code == "fp16" else ("tier", "tier_scales")

    @property
    def columns(self) -> Tuple[str, ...]:
        if not self.record:
            return super().columns
        return tuple(checkpoint_column("tier", j) for j in range(len(self.parts)))

    def _record_parts(self) -> List[Tuple[int, int, int, int]]:
        """Per checkpoint: its first code byte, code bytes, first module and modules."""
        out, byte, module = [], 0, 0
        for width, count in zip(self._column_parts("tier"), self.parts):
            out.append((byte, width, module, count))
            byte, module = byte + width, module + count
        return out

    def split(self, columns: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """The codec's arrays ``{tier, tier_scales}`` → the table's columns (:attr:`columns`): a
        column per checkpoint; with ``record``, each row's code bytes and FP16 scale bytes joined."""
        if not self.record:
            return super().split(columns)
        codes = np.asarray(columns["tier"])
        scales = np.asarray(columns["tier_scales"]).astype("<f2")
        return {
            checkpoint_column("tier", j): np.ascontiguousarray(
                np.concatenate(
                    [codes[:, b0 : b0 + width].view(np.uint8), scales[:, m0 : m0 + count].view(np.uint8)], axis=1
                )
            )
            for j, (b0, width, m0, count) in enumerate(self._record_parts())
        }

    def module_widths_of(self, name: str) -> Sequence[int]:
        return self.module_widths if name == "tier" else (1,) * self.layout.num_modules

    @functools.cached_property
    def module_widths(self) -> Tuple[int, ...]:
        """Elements of the ``tier`` column per module."""
        return tuple(math.ceil(k / 2) if self.code == "int4" else k for k in self.layout.k)

    @property
    def width(self) -> int:
        return int(sum(self.module_widths))

    @property
    def bytes_per_example(self) -> int:
        return sum(tier_bytes_per_module(k, self.code) for k in self.layout.k)

    def encode(self, x: np.ndarray) -> Dict[str, np.ndarray]:
        """``(n, K)`` float32 coordinates → ``{column: (n, w) array}``."""
        x = np.asarray(x, np.float32)
        _check_width(x, self.layout.num_coords, "coordinates")
        _check_finite(x)
        if self.code == "fp16":
            return {"tier": x.astype(np.float16)}
        q = TIER_LEVELS[self.code]
        parts, scales = [], []
        for off, k in zip(self.layout.coord_offsets, self.layout.k):
            codes, scale = quantize_tier_block(x[:, off : off + k], q)
            if self.code == "int4":
                nibbles = (codes + 8).astype(np.uint8)
                if k % 2:
                    nibbles = np.concatenate([nibbles, np.full((len(x), 1), 8, np.uint8)], axis=1)
                codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
            parts.append(codes)
            scales.append(scale)
        return {"tier": np.ascontiguousarray(np.concatenate(parts, axis=1)), "tier_scales": np.stack(scales, axis=1)}

    def decode(self, columns: Dict[str, np.ndarray]) -> np.ndarray:
        """``{column: (n, w) array}`` (as stored, or read back by :meth:`from_arrow`) → the tier's
        coordinates ``(n, K)`` float32."""
        codes = np.asarray(columns["tier"])
        if self.code == "fp16":
            return codes.astype(np.float32)
        scales = np.asarray(columns["tier_scales"]).astype(np.float32)
        out = np.empty((codes.shape[0], self.layout.num_coords), np.float32)
        start = 0
        for u, (off, k, w) in enumerate(zip(self.layout.coord_offsets, self.layout.k, self.module_widths)):
            block = codes[:, start : start + w]
            start += w
            if self.code == "int4":
                packed = block.astype(np.uint8)
                block = np.empty((len(packed), 2 * w), np.int8)
                block[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
                block[:, 1::2] = (packed >> 4).astype(np.int8) - 8
                block = block[:, :k]
            out[:, off : off + k] = block.astype(np.float32) * scales[:, u : u + 1]
        return out

    def from_arrow(self, table) -> Dict[str, np.ndarray]:
        """The tier's columns of an Arrow table → the codec's arrays: ``tier`` ``(n, w)`` (int8,
        packed int4 as uint8, or float16) and ``tier_scales`` ``(n, U)`` float16 (int8, int4)."""
        dtype = {"int8": np.int8, "int4": np.uint8, "fp16": np.float16}[self.code]
        if not self.record:
            out = {"tier": self.read_column(table, "tier", dtype)}
            if self.code != "fp16":
                out["tier_scales"] = self.read_column(table, "tier_scales", np.float16)
            return out
        codes, scales = [], []
        for j, (_, width, _, count) in enumerate(self._record_parts()):
            rows = self._records(table, j, width, count)
            codes.append(rows[:, :width].view(dtype))
            scales.append(rows[:, width:].view("<f2"))
        if len(codes) == 1:
            return {"tier": np.ascontiguousarray(codes[0]), "tier_scales": np.ascontiguousarray(scales[0])}
        return {"tier": np.concatenate(codes, axis=1), "tier_scales": np.concatenate(scales, axis=1)}

    def _records(self, table, j: int, width: int, count: int) -> np.ndarray:
        """Checkpoint ``j``'s records ``(n, width + 2·count)`` uint8 of an Arrow table."""
        return list_column_to_numpy(table.column(checkpoint_column("tier", j)), width + 2 * count, np.uint8)

    def kernel_arrays(self, table) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tier columns of an Arrow table as the rescoring kernels read them: codes ``(n, c)``
        (int8 as stored, int4 and fp16 decoded to float32), scales ``(n, U)`` float32 (ones for a
        decoded tier) and module ``u``'s first and last code column ``offsets[u]:offsets[u + 1]``
        ``(U + 1,)`` int64. One checkpoint's int8 records are read in place: ``c`` is the record's
        width, whose last ``2U`` columns (the scales' bytes) no module covers."""
        if self.code != "int8":
            x = self.decode(self.from_arrow(table))
            return x, np.ones((x.shape[0], 1), np.float32), np.array([0, x.shape[1]], np.int64)
        offsets = np.append(np.asarray(self.layout.coord_offsets, np.int64), self.layout.num_coords)
        if self.record and len(self.parts) == 1:
            rows = self._records(table, 0, self.width, self.layout.num_modules)
            return rows.view(np.int8), rows[:, self.width :].view("<f2").astype(np.float32), offsets
        columns = self.from_arrow(table)
        return columns["tier"], columns["tier_scales"].astype(np.float32), offsets


def tier_for(
    code: Optional[str], layout: SignLayout, parts: Optional[Sequence[int]] = None, *, record: bool = True
) -> Optional[TierCodec]:
    """The tier codec of a manifest's ``tier.code`` (None, or ``none``: the index has no tier);
    ``record``: the format-4 layout (:class:`TierCodec`), False for a format-3 index."""
    return None if code in (None, "none") else TierCodec(code, layout, parts, record=record)


def codec_for(precision: Precision, layout: SignLayout, parts: Optional[Sequence[int]] = None) -> Codec:
    """The codec of a manifest's ``precision``; ``parts``: an ensemble's modules per checkpoint."""
    if precision == "1bit":
        return OneBitCodec(layout, parts)
    if precision in ("fp16", "fp32"):
        return FloatCodec(layout, precision, parts)
    raise ConfigError(f"precision must be '1bit', 'fp16' or 'fp32', got {precision!r}")


def encode(x: np.ndarray, layout: SignLayout, precision: Precision) -> Encoded:
    """Quantize ``(n, K)`` float32 coordinates for storage (the codec of ``precision``)."""
    return codec_for(precision, layout).encode(x)


def decode(encoded: Encoded, layout: SignLayout) -> np.ndarray:
    """The stored approximation ``s_u · b_u`` (or the stored coordinates), ``(n, K)`` float32."""
    if encoded.coords is not None:
        return encoded.coords.astype(np.float32)
    signs = unpack_signs(encoded.signs, layout)
    scale = np.repeat(encoded.scales.astype(np.float32), layout.k, axis=1)
    return signs * scale


def _check_finite(x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise InputError(
            "coordinates contain NaN or inf: their signs are undefined "
            "(check the model's loss and the projection upstream)"
        )


def _check_width(array: np.ndarray, expected: int, what: str) -> None:
    if array.ndim != 2 or array.shape[1] != expected:
        raise ConfigError(f"{what} must have shape (n, {expected}) for this layout, got {array.shape}")


def concat_modules(coords: Sequence[np.ndarray]) -> np.ndarray:
    """Per-module ``(n, k_u)`` arrays → one ``(n, K)`` float32 array in module order."""
    return np.ascontiguousarray(np.concatenate([np.asarray(c, dtype=np.float32) for c in coords], axis=1))


# -- Arrow <-> numpy -------------------------------------------------------------------------


def fixed_size_list(values: np.ndarray) -> pa.FixedSizeListArray:
    """``(n, w)`` array → ``fixed_size_list<dtype>[w]`` without copying row by row."""
    values = np.ascontiguousarray(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def list_column_to_numpy(column: pa.ChunkedArray | pa.Array, width: int, dtype) -> np.ndarray:
    """A ``fixed_size_list`` column → ``(n, width)`` numpy array (one copy at most)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    flat = column.flatten() if column.offset else column.values
    return flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, width)
