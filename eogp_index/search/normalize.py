"""Unit-normalized scores: each training code divided by its exact norm (cosine to the query).

Influence ranks documents with large gradients first, whatever the query: a few high-norm
outliers can head every list. ``normalize="unit"`` scores ``⟨y, x̂_i⟩ / ‖x̂_i‖`` instead, where
``x̂_i`` is what the index stored for row ``i``. For a 1-bit row ``x̂_iu = s_iu · b_iu`` with
``b ∈ {±1}^{k_u}``, so its norm is exact from the scales alone:

    ‖x̂_i‖² = Σ_u s_iu² · k_u

and dividing the score by it is dividing every scale of the row by it. The scan kernels then run
unchanged on the divided scales ``s_iu / ‖x̂_i‖`` (float32): their pre-scan bound
``Σ_u s_iu · err_u`` becomes ``Σ_u (s_iu / ‖x̂_i‖) · err_u``, the row's bound divided by its
norm, so the exact top-k stays exact for the normalized scores. Stored coordinates (fp16/fp32
indexes) are divided row by row likewise. A row whose code is zero has no direction: it
scores 0.

The divided codes of the hot copy are computed once per table version and kept with it.
"""

from __future__ import annotations

import numpy as np

from eogp_index.config import check_normalize
from eogp_index.store.codecs import Encoded, SignLayout

_HOT_KEY = "normalized:unit"


def row_norms(encoded: Encoded, layout: SignLayout) -> np.ndarray:
    """``(n,)`` float64 exact norms of the stored codes: ``sqrt(Σ_u s_iu² k_u)`` (1-bit) or ``‖x_i‖``."""
    if encoded.coords is not None:
        coords = encoded.coords.astype(np.float64)
        return np.sqrt(np.einsum("ij,ij->i", coords, coords))
    scales = encoded.scales.astype(np.float64)
    return np.sqrt((scales * scales) @ np.asarray(layout.k, np.float64))


def unit_normalized(encoded: Encoded, layout: SignLayout) -> Encoded:
    """``encoded`` with every row divided by its norm (:func:`row_norms`), in scanning dtypes:
    1-bit rows keep their signs and get scales ``s_iu / ‖x̂_i‖`` ``(n, U)`` float32."""
    norms = row_norms(encoded, layout)
    divisor = np.where(norms > 0, norms, 1.0)[:, None]  # a zero row stays zero
    if encoded.coords is not None:
        return Encoded(coords=(encoded.coords.astype(np.float64) / divisor).astype(np.float32))
    return Encoded(
        signs=encoded.signs,
        scales=np.ascontiguousarray((encoded.scales.astype(np.float64) / divisor).astype(np.float32)),
    )


def normalized_codes(encoded: Encoded, layout: SignLayout, normalize: str) -> Encoded:
    """The codes to score under ``normalize``: ``encoded`` itself for ``none``."""
    check_normalize(normalize)
    return encoded if normalize == "none" else unit_normalized(encoded, layout)


def hot_normalized(hot, layout: SignLayout, normalize: str) -> Encoded:
    """The hot copy's codes under ``normalize``; the divided ones are computed once per hot copy
    (``hot.cache``, which lives as long as its table version)."""
    check_normalize(normalize)
    if normalize == "none":
        return hot.encoded
    if _HOT_KEY not in hot.cache:
        hot.cache[_HOT_KEY] = unit_normalized(hot.encoded, layout)
    return hot.cache[_HOT_KEY]
