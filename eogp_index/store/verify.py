"""The complete identity check of an index (``eogp verify``): every byte hashed.

:meth:`AttributionIndex.open <eogp_index.client.AttributionIndex.open>` checks sampled
fingerprints of the model and the projection file, cheap at any size; this recomputes the full
SHA-256s recorded in the manifest, for when a change could hide between the sampled bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Union

from torch import nn

from eogp_index.errors import InputError
from eogp_index.gradients.model import load_indexed_model, model_fingerprint, model_sha256
from eogp_index.store.files import file_fingerprint, file_sha256
from eogp_index.store.stored_index import StoredIndex


def verify_index(
    path: Union[str, Path], *, model: Optional[nn.Module] = None, model_name: Optional[str] = None, device: str = "cpu"
) -> Dict[str, Any]:
    """The complete identity check of an index: every byte of its projection file and of its
    model's weights hashed (SHA-256) and compared with the manifest, and the sampled fingerprints
    that :meth:`AttributionIndex.open` checks recomputed.

    Args:
        model: the model as loaded (before eogp-index swaps GPT-2's ``Conv1D`` layers, e.g. not
            an opened index's ``.model``); default: loaded from ``model_name`` or the manifest.

    Returns:
        ``{"index", "ok", "projection": {...}, "model": {...}}``, each part with the manifest's and
        the computed ``sha256`` (and ``fingerprint``) and ``ok``.
    """
    stored = StoredIndex.open(path)
    manifest = stored.manifest
    projection_path = stored.path / manifest.projection["file"]
    if not projection_path.exists():
        raise InputError(f"{projection_path} is missing: the index has no projection (refit it with eogp fit)")
    projection = {
        "file": str(projection_path),
        "expected_sha256": manifest.projection["sha256"],
        "sha256": file_sha256(projection_path),
    }
    if manifest.projection.get("fingerprint"):
        projection.update(
            expected_fingerprint=manifest.projection["fingerprint"], fingerprint=file_fingerprint(projection_path)
        )
    if model is None:
        model, _ = load_indexed_model(manifest.model, model_name, device=device, dtype=manifest.model_dtype)
    weights = {
        "name": model_name or manifest.model["name"],
        "expected_sha256": manifest.model["weights_sha256"],
        "sha256": model_sha256(model),
    }
    if manifest.model.get("weights_fingerprint"):
        weights.update(expected_fingerprint=manifest.model["weights_fingerprint"], fingerprint=model_fingerprint(model))
    for part in (projection, weights):
        part["ok"] = all(part[key] == part[f"expected_{key}"] for key in ("sha256", "fingerprint") if key in part)
    return {
        "index": str(stored.path),
        "ok": projection["ok"] and weights["ok"],
        "projection": projection,
        "model": weights,
    }
