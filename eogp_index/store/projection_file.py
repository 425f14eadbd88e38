"""``projection.safetensors``: a fitted :class:`~eogp_index.fit.projection.Projection` on disk.

Everything shared across examples and queries is saved in one safetensors file (format 3: the
kept eigenvector columns in 16 bits for a half-precision model, ``P`` in FP16 by default as in
the paper's Appendix E; formats 1 and 2 are still read; the layout is specified in
``schemas/index.md``), identified in the index manifest by its SHA-256 (checked in full by
``eogp verify``) and by a cheap sampled fingerprint (checked on every open,
:func:`~eogp_index.store.files.file_fingerprint`).

A loaded projection reads the ``P`` matrices lazily from the memory-mapped file, or, for an index
in an object store, by range reads of the object, one module's ``P`` at a time (:class:`LazyPca`).
When they all fit a memory limit each is read once, on first use, and kept; otherwise every
module's ``P`` is read when it is applied and dropped after, so one module's ``P`` is held at a
time (the paper's "modules in turn").
"""

from __future__ import annotations

import functools
import json
import math
import threading
from pathlib import Path
from typing import Dict, List, Optional

import torch

from eogp_index.config import PCA_DTYPE_BYTES, ProjectionConfig, default_projection_memory
from eogp_index.data.location import RangeSafetensors, index_path, is_remote, open_random_access
from eogp_index.errors import IncompatibleIndexError, IndexNotFoundError
from eogp_index.fit.projection import PCA_TORCH_DTYPES, ModuleProjection, Projection
from eogp_index.store.files import TensorEntry, write_safetensors

#: 3: the kept eigenvector columns stored in float16 for a half-precision model
#: (``config.EIGENVECTOR_DTYPES``), recorded as ``eigenvector_dtype``.
#: 2: ``P`` stored at ``ProjectionConfig.pca_dtype`` (FP16 by default), recorded in the metadata;
#: eigenvectors float32. 1: everything float32, no ``pca_dtype``. All three are read.
PROJECTION_FORMAT_VERSION = 3
READABLE_PROJECTION_VERSIONS = (1, 2, 3)
_EIGENVECTOR_KEYS = ("gradient_eigenvectors", "activation_eigenvectors")
#: safetensors' names of the dtypes the eigenvector columns may be stored in.
_STORED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def save_projection(projection: Projection, path: Path) -> str:
    """Write ``projection`` as safetensors (format 3: the eigenvector columns in the dtype they are
    held in, ``P`` at ``config.pca_dtype``); return the file's SHA-256 (its identity).

    The file is written one tensor at a time (:func:`~eogp_index.store.files.write_safetensors`):
    each module's ``P`` is read (for a fit, from its memory-mapped file in ``fit/pca/``), written
    and released before the next, so saving holds one module's ``P`` at a time, not all of them.
    """
    pca_dtype = PCA_TORCH_DTYPES[projection.config.pca_dtype]
    eigenvector_dtype = str(projection.eigenvector_dtype).removeprefix("torch.")
    entries: List[TensorEntry] = []
    modules_meta = []
    for name, p in projection.modules.items():
        for key in ("activation_eigenvectors", "gradient_eigenvectors", "local_index", "whiten"):
            tensor = getattr(p, key)
            entries.append(
                TensorEntry(f"{name}/{key}", tensor.dtype, tuple(tensor.shape), functools.partial(getattr, p, key))
            )
        if p.has_pca:
            # read at write time (a loaded or fitted P is read from disk then, and dropped after)
            entries.append(TensorEntry(f"{name}/pca", pca_dtype, (p.m, p.width), functools.partial(getattr, p, "pca")))
        if p.srht_signs is not None:
            for key in ("srht_signs", "srht_rows"):
                tensor = getattr(p, key)
                entries.append(
                    TensorEntry(f"{name}/{key}", tensor.dtype, tuple(tensor.shape), functools.partial(getattr, p, key))
                )
        modules_meta.append(
            {
                "name": name,
                "shape": list(p.shape),
                "m": p.m,
                "k": p.k,
                "damping": p.damping,
                "second_stage": p.second_stage,
                # a rescoring tier wider than k (StorageConfig.rescore_k): P and the SRHT's rows
                # have tier_k columns, the first k of them the one-bit code's
                **({} if p.tier_k is None else {"tier_k": p.tier_k}),
            }
        )
    metadata = {
        "format": "eogp-projection",
        "format_version": str(PROJECTION_FORMAT_VERSION),
        "variant": projection.config.variant,
        "damping_ratio": repr(projection.damping_ratio),
        "pca_dtype": projection.config.pca_dtype,
        "eigenvector_dtype": eigenvector_dtype,
        "config": json.dumps(projection.config.__dict__),
        "modules": json.dumps(modules_meta),
    }
    return write_safetensors(index_path(path), entries, metadata)


def load_projection(path: Path, *, memory_limit: Optional[int] = None) -> Projection:
    """Read a projection file (format 1, 2 or 3); the ``P`` matrices are read lazily, the rest at once.

    The eigenvector columns are held as stored: in 16 bits for a half-precision model from
    format 3, float32 from the formats before it (so an older index projects exactly as it did).

    Args:
        memory_limit: bytes the ``P`` matrices may hold at once (default
            :func:`~eogp_index.config.default_projection_memory`). Under it each is read once, on
            first use, and kept; over it each is read whenever its module is projected, then dropped.

    Raises:
        IndexNotFoundError: no file at ``path``.
        IncompatibleIndexError: not a projection file, a format version this code does not read,
            or tensors stored at another dtype than the file says.
    """
    from safetensors import safe_open

    path = index_path(path)
    if not path.exists():
        raise IndexNotFoundError(f"projection file {path} is missing; the index was not fitted (eogp fit)")
    # The handle stays open for the projection's lifetime: P is read from it later. A file
    # replaced on disk meanwhile (a refit) leaves this open file, the one checked, in place. An
    # object is read by ranges: the header, each module's small tensors, and each P when applied.
    if is_remote(path):
        handle = RangeSafetensors(open_random_access(path), str(path))
    else:
        handle = safe_open(str(path), framework="pt")
    metadata = handle.metadata() or {}
    if metadata.get("format") != "eogp-projection":
        raise IncompatibleIndexError(f"{path} is not an eogp projection file")
    version = int(metadata.get("format_version", "0"))
    if version not in READABLE_PROJECTION_VERSIONS:
        raise IncompatibleIndexError(
            f"{path} has projection format version {version}; this eogp-index reads versions "
            f"{list(READABLE_PROJECTION_VERSIONS)}. Refit the index with this version (eogp fit --overwrite), "
            "or install the eogp-index that wrote it."
        )
    config_fields = json.loads(metadata["config"])
    # Format 1 stored P in float32 and had no pca_dtype: it is fp32, whatever today's default.
    config_fields.setdefault("pca_dtype", metadata.get("pca_dtype", "fp32"))
    # Files written before m was independent of k record the old rule's m_factor; the widths
    # themselves are in the per-module metadata, so the factor carries nothing.
    config_fields.pop("m_factor", None)
    config = ProjectionConfig(**config_fields)
    keys = set(handle.keys())
    pca_keys = {}
    for meta in json.loads(metadata["modules"]):
        key = f"{meta['name']}/pca"
        if key in keys:
            stored = str(handle.get_slice(key).get_dtype())
            if stored != {"fp16": "F16", "fp32": "F32"}[config.pca_dtype]:
                raise IncompatibleIndexError(
                    f"{path}: {key} is stored as {stored} but the file says pca_dtype "
                    f"{config.pca_dtype!r}; the file is damaged. Refit the index."
                )
            pca_keys[key] = math.prod(handle.get_slice(key).get_shape()) * PCA_DTYPE_BYTES[config.pca_dtype]
        _check_eigenvector_dtype(path, handle, meta["name"], metadata.get("eigenvector_dtype", "float32"))
    lazy = LazyPca(handle, pca_keys, default_projection_memory() if memory_limit is None else memory_limit)
    modules = {}
    for meta in json.loads(metadata["modules"]):
        name = meta["name"]
        optional = {
            key: handle.get_tensor(f"{name}/{key}") if f"{name}/{key}" in keys else None
            for key in ("srht_signs", "srht_rows")
        }
        modules[name] = ModuleProjection(
            shape=tuple(meta["shape"]),
            activation_eigenvectors=handle.get_tensor(f"{name}/activation_eigenvectors"),
            gradient_eigenvectors=handle.get_tensor(f"{name}/gradient_eigenvectors"),
            local_index=handle.get_tensor(f"{name}/local_index"),
            whiten=handle.get_tensor(f"{name}/whiten"),
            damping=float(meta["damping"]),
            second_stage=meta["second_stage"],
            k=int(meta["k"]),
            tier_k=None if meta.get("tier_k") is None else int(meta["tier_k"]),
            pca_loader=functools.partial(lazy.get, f"{name}/pca") if f"{name}/pca" in keys else None,
            **optional,
        )
    return Projection(modules, config=config, damping_ratio=float(metadata["damping_ratio"]), lazy=lazy)


def _check_eigenvector_dtype(path: Path, handle, name: str, expected: str) -> None:
    """Refuse a module whose eigenvector columns are stored in another dtype than the file says
    (``expected``: its ``eigenvector_dtype``; float32 before format 3, which had none)."""
    if expected not in _STORED_DTYPES:
        raise IncompatibleIndexError(
            f"{path}: eigenvector_dtype {expected!r} is not one of {sorted(_STORED_DTYPES)}; "
            "the file is damaged. Refit the index."
        )
    for key in _EIGENVECTOR_KEYS:
        stored = str(handle.get_slice(f"{name}/{key}").get_dtype())
        if stored != _STORED_DTYPES[expected]:
            raise IncompatibleIndexError(
                f"{path}: {name}/{key} is stored as {stored} but the file says "
                f"eigenvector_dtype {expected!r}; the file is damaged. Refit the index."
            )


class LazyPca:
    """The ``P`` matrices of a projection file, read on demand from its open, memory-mapped handle.

    ``resident``: all of them fit ``limit`` bytes, so each is kept after its first read; else
    each read is handed out and dropped by the caller (one module's ``P`` alive at a time).
    """

    def __init__(self, handle, sizes: Dict[str, int], limit: int):
        self._handle = handle
        self.total_bytes = sum(sizes.values())
        self.limit = int(limit)
        self.resident = self.total_bytes <= self.limit
        self._kept: Dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # a server's worker thread and the main thread may both project
        #: Bytes of ``P`` read from the file so far (what the plan's "P read per document" counts).
        self.bytes_read = 0

    def get(self, key: str) -> torch.Tensor:
        with self._lock:
            tensor = self._kept.get(key)
            if tensor is None:
                tensor = self._handle.get_tensor(key)
                self.bytes_read += tensor.numel() * tensor.element_size()
                if self.resident:
                    self._kept[key] = tensor
            return tensor
