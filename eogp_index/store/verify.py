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
    that :meth:`AttributionIndex.open` checks recomputed; an ensemble's further checkpoints too.

    Args:
        model: the model as loaded (before eogp-index swaps GPT-2's ``Conv1D`` layers, e.g. not
            an opened index's ``.model``); default: loaded from ``model_name`` or the manifest.

    Returns:
        ``{"index", "ok", "projection": {...}, "model": {...}}``, each part with the manifest's and
        the computed ``sha256`` (and ``fingerprint``) and ``ok``; an ensemble adds
        ``"checkpoints": [{"projection", "model"}, ...]`` for checkpoints 1, 2, ...
    """
    stored = StoredIndex.open(path)
    manifest = stored.manifest
    if model is None:
        model, _ = load_indexed_model(manifest.model, model_name, device=device, dtype=manifest.model_dtype)
    report = {
        "index": str(stored.path),
        "projection": _file_part(stored.path, manifest.projection),
        "model": _model_part(model, model_name or manifest.model["name"], manifest.model),
    }
    parts = [report["projection"], report["model"]]
    if manifest.checkpoints is not None:
        report["checkpoints"] = []
        for entry in manifest.checkpoints[1:]:
            loaded, _ = load_indexed_model({"name": entry["name"]}, None, device=device, dtype=manifest.model_dtype)
            pair = {
                "projection": _file_part(stored.path, entry["projection"]),
                "model": _model_part(loaded, entry["name"], entry),
            }
            report["checkpoints"].append(pair)
            parts += pair.values()
    report["ok"] = all(part["ok"] for part in parts)
    return report


def _file_part(index_dir: Path, recorded: Dict[str, Any]) -> Dict[str, Any]:
    """A projection file's check against its manifest entry (``file``, ``sha256``, ``fingerprint``)."""
    projection_path = index_dir / recorded["file"]
    if not projection_path.exists():
        raise InputError(f"{projection_path} is missing: the index has no projection (refit it with eogp fit)")
    part = {"file": str(projection_path), "expected_sha256": recorded["sha256"], "sha256": file_sha256(projection_path)}
    if recorded.get("fingerprint"):
        part.update(expected_fingerprint=recorded["fingerprint"], fingerprint=file_fingerprint(projection_path))
    return _judged(part)


def _model_part(model: nn.Module, name: str, recorded: Dict[str, Any]) -> Dict[str, Any]:
    """A model's check against its manifest entry (``weights_sha256``, ``weights_fingerprint``)."""
    part = {"name": name, "expected_sha256": recorded["weights_sha256"], "sha256": model_sha256(model)}
    if recorded.get("weights_fingerprint"):
        part.update(expected_fingerprint=recorded["weights_fingerprint"], fingerprint=model_fingerprint(model))
    return _judged(part)


def _judged(part: Dict[str, Any]) -> Dict[str, Any]:
    part["ok"] = all(part[key] == part[f"expected_{key}"] for key in ("sha256", "fingerprint") if key in part)
    return part
