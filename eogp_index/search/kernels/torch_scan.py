"""The torch path of the exact scan, :func:`scan_scores_torch` (e.g. on a GPU).

No numba here: chunks of rows are unpacked on the device and multiplied by the queries, so the
scores equal the float64 reference up to float32 matmul rounding (not the bits of the numba
table walk). torch is imported on first use, so the numba path never needs it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from eogp_index.errors import ConfigError, InputError
from eogp_index.search.kernels.checks import _as_layout, _check_codes, _check_queries, _check_scales, _geometry
from eogp_index.store.codecs import SignLayout


def scan_scores_torch(
    codes: Union[np.ndarray, "Any"],
    scales: Union[np.ndarray, "Any"],
    y: Union[np.ndarray, "Any"],
    layout: SignLayout,
    device: Union[str, "Any"] = "cpu",
    *,
    chunk_rows: Optional[int] = None,
):
    """Scores with torch, e.g. on CUDA: chunks of rows are unpacked on the device and multiplied.

    Per chunk the bits are unpacked with shifts into ``±s_iu`` (scale folded in), giving a
    ``(rows, K)`` float32 matrix that is multiplied by ``yᵀ``; only one chunk is expanded at a time.

    Args:
        codes: ``(n, nbytes)`` uint8 (numpy or torch). scales: ``(n, U)`` float16.
        y: ``(nq, K)`` float32. layout: module sizes. device: e.g. ``"cuda"`` or ``"cpu"``.
        chunk_rows: rows per chunk (default: ~256 MiB of float32 per chunk).

    Returns:
        ``(nq, n)`` float32 ``torch.Tensor`` on ``device``.
    """
    import torch

    layout = _as_layout(layout)
    dev = torch.device(device)
    # Codes and scales already held as torch tensors (on the device, e.g. a resident copy) stay
    # there: only their shapes and dtypes are checked. numpy ones are checked and copied per chunk.
    if isinstance(codes, torch.Tensor):
        _check_torch_block(codes, scales, layout)
        np_codes, np_scales = codes, scales
    else:
        np_codes = _check_codes(codes, layout)
        np_scales = _check_scales(scales, np_codes.shape[0], layout)
    np_y = _check_queries(y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else y, layout)
    g = _geometry(layout)
    n, K = np_codes.shape[0], layout.num_coords
    if chunk_rows is None:
        chunk_rows = max(1, (256 << 20) // (4 * K))
    chunk_rows = int(chunk_rows)
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")

    pad_index = torch.from_numpy(g.pad_index.copy()).to(dev)  # copies: the cached arrays are read-only
    module_of_coord = torch.from_numpy(g.module_of_coord.copy()).to(dev)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    yt = torch.as_tensor(np_y, device=dev).T.contiguous()  # (K, nq)
    out = torch.empty((np_y.shape[0], n), dtype=torch.float32, device=dev)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        c = torch.as_tensor(np_codes[r0:r1], device=dev)
        bits = ((c.unsqueeze(-1) >> shifts) & 1).reshape(r1 - r0, -1)[:, pad_index]  # (R, K) uint8
        s = torch.as_tensor(np_scales[r0:r1], device=dev).to(torch.float32)[:, module_of_coord]  # (R, K)
        signed = torch.where(bits.bool(), s, -s)
        out[:, r0:r1] = (signed @ yt).T
    return out


def _check_torch_block(codes, scales, layout: SignLayout) -> None:
    """The checks of :func:`_check_codes` and :func:`_check_scales` for torch tensors, without a copy."""
    import torch

    if codes.dtype != torch.uint8:
        raise InputError(f"codes must be uint8 packed sign bits, got dtype {codes.dtype}")
    if codes.ndim != 2 or codes.shape[1] != layout.nbytes:
        raise ConfigError(f"codes must have shape (n, {layout.nbytes}), got {tuple(codes.shape)}")
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (codes.shape[0], layout.num_modules):
        raise ConfigError(
            f"scales must be a torch tensor of shape ({codes.shape[0]}, {layout.num_modules}) beside torch codes, "
            f"got {type(scales).__name__} {tuple(getattr(scales, 'shape', ()))}"
        )
    if not scales.is_floating_point():
        raise InputError(f"scales must be float16 (or another float dtype), got {scales.dtype}")
