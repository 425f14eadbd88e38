"""Why a document ranks: its score split by module, and by token.

A stored row's score is a sum over modules, ``score(i) = Σ_u s_iu⟨y_u, b_iu⟩`` (1 bit) or
``Σ_u ⟨y_u, x_iu⟩`` (stored coordinates). :func:`module_terms` gives each term, computed on its
own from the row's stored code, so the terms of a hit sum to its ranked score up to float32
rounding.
"""

from __future__ import annotations

from typing import List

import numpy as np

from eogp_index.store.codecs import Encoded, SignLayout, decode


def module_terms(encoded: Encoded, y: np.ndarray, layout: SignLayout) -> np.ndarray:
    """Per-module terms ``(r, U)`` float32 of ``r`` stored rows against one query ``y`` ``(K,)``.

    Term ``u`` of row ``i`` is ``s_iu⟨y_u, b_iu⟩`` for 1-bit rows (``⟨y_u, x_iu⟩`` for stored
    coordinates), accumulated in float64.
    """
    stored = decode(encoded, layout).astype(np.float64)  # (r, K): s_u·b_u, or x
    y = np.asarray(y, np.float64).reshape(-1)
    products = stored * y[None, :]
    bounds = list(layout.coord_offsets) + [layout.num_coords]
    return np.stack([products[:, a:b].sum(axis=1) for a, b in zip(bounds[:-1], bounds[1:])], axis=1).astype(np.float32)


def module_dicts(terms: np.ndarray, names: List[str]) -> List[dict]:
    """``(r, U)`` terms → one ``{module name: term}`` dict per row (the JSON of ``by_module``)."""
    return [{name: float(v) for name, v in zip(names, row)} for row in terms]
