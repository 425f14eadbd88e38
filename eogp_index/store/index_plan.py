"""``eogp plan INDEX``: :func:`~eogp_index.fit.plan.make_plan` for a fitted index, with the figures
the fit fixed read from its files instead of bounded, and its documents as long as it cuts them.

A checkpoint ensemble's manifest lists its checkpoints (the optional field ``checkpoints``, one
entry per checkpoint); the plan counts that many models, projections and codes
(``Manifest.num_checkpoints``), and checkpoint ``j >= 1``'s kept eigenvector columns are read from
``checkpoints/<j>/`` under the projection file's name when it is there (else bounded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from eogp_index.config import ProjectionConfig
from eogp_index.data.location import index_path
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.fit.plan import ModelShape, Plan, make_plan, model_shape, with_nodes
from eogp_index.store.files import safetensors_header, tensor_bytes
from eogp_index.store.manifest import MANIFEST_FILE, Manifest
from eogp_index.store.stored_index import CHECKPOINTS_DIR

#: safetensors' dtype names of the eigenvector columns (16 bits for a half-precision model from
#: projection format 3, float32 before it).
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _eigenbases(index_dir: Path, file: str, modules: Any, checkpoints: int) -> Dict[str, list]:
    """Each module's two eigenvector-column headers, checkpoint ``j >= 1``'s as ``c<j>/<module>``
    (those whose file is absent are left out: the plan bounds them)."""
    entries: Dict[str, list] = {}
    for j in range(checkpoints):
        path = index_dir / file if j == 0 else index_dir / CHECKPOINTS_DIR / str(j) / file
        if j and not path.is_file():
            continue
        header = safetensors_header(path)
        prefix = f"c{j}/" if j else ""
        for m in modules:
            keys = ("gradient_eigenvectors", "activation_eigenvectors")
            entries[prefix + m.name] = [header[f"{m.name}/{key}"] for key in keys]
    return entries


def plan_of_index(
    index_dir: Path,
    *,
    dtype: Optional[str] = None,
    curvature_examples: Optional[int] = None,
    shape: Optional[ModelShape] = None,
    max_tokens: Optional[int] = None,
    nodes: Optional[int] = None,
    bandwidth_gbs: Optional[float] = None,
    metadata_bytes: Optional[int] = None,
    checkpoints: Optional[int] = None,
    **options: Any,
) -> Plan:
    """:func:`~eogp_index.fit.plan.make_plan` for a fitted index: its model, modules, ``(m_u, k_u)``,
    options and dtype from its manifest, and the kept eigenvector columns, exact, from its
    projection file's header: their bytes and the dtype they are stored and held in.

    The curvature examples are the index's, whatever ``curvature_examples`` says. The documents
    are as long as the index cuts them (its manifest's ``max_tokens``) unless ``max_tokens`` or
    ``document_tokens`` says otherwise. ``shape``: the loaded model's
    (:func:`~eogp_index.fit.plan.shape_of_model`) instead of the manifest's model name's;
    ``options``: :func:`~eogp_index.fit.plan.make_plan`'s. The checkpoints are the manifest's
    (``Manifest.num_checkpoints``); ``checkpoints``, if given, must be as many.

    Raises:
        ConfigError: ``dtype`` names another dtype than the one the index was built in, or
            ``checkpoints`` another count than the manifest's.
        IncompatibleIndexError: the file holds the eigenvector columns in several dtypes.
    """
    del curvature_examples
    index_dir = index_path(index_dir)
    manifest = Manifest.load(index_dir)
    count = manifest.num_checkpoints
    if checkpoints not in (None, count):
        raise ConfigError(
            f"{index_dir} was fitted on {count} checkpoint(s) (its manifest), not {checkpoints}; plan it "
            "without --checkpoints"
        )
    cluster = dict(nodes=nodes, bandwidth_gbs=bandwidth_gbs, metadata_bytes=metadata_bytes)
    return plan_of_manifest(
        index_dir, manifest, count, dtype=dtype, shape=shape, max_tokens=max_tokens, **cluster, **options
    )


def plan_of_manifest(
    index_dir: Path,
    manifest: Manifest,
    checkpoints: int,
    *,
    dtype: Optional[str] = None,
    shape: Optional[ModelShape] = None,
    max_tokens: Optional[int] = None,
    nodes: Optional[int] = None,
    bandwidth_gbs: Optional[float] = None,
    metadata_bytes: Optional[int] = None,
    **options: Any,
) -> Plan:
    """:func:`plan_of_index` of the index in ``index_dir`` whose manifest is ``manifest``, fitted
    on ``checkpoints`` checkpoints (checkpoint ``j >= 1``'s projection file in ``checkpoints/<j>/``)."""
    count = checkpoints
    built = manifest.model_dtype
    if dtype not in (None, "auto", built):
        raise ConfigError(
            f"{index_dir} was built with the model in {built} (manifest model.dtype); plan it with "
            f"--dtype {built} or auto"
        )
    modules = manifest.checkpoint_modules(0)  # an ensemble's first checkpoint (its model's names)
    shape = shape or model_shape(manifest.model["name"], [m.name for m in modules])
    info = manifest.projection
    projection = ProjectionConfig(
        variant=info["variant"],
        k=max(m.k for m in modules),
        m=max(m.m for m in modules),
        num_fit_examples=max(1, info["num_fit_examples"]),
        pca_dtype=manifest.pca_dtype,
    )
    entries = _eigenbases(index_dir, info["file"], modules, count)
    eigen = {name: sum(tensor_bytes(entry) for entry in pair) for name, pair in entries.items()}
    stored = {_DTYPES.get(entry["dtype"], entry["dtype"]) for pair in entries.values() for entry in pair}
    if len(stored) != 1 or not stored <= set(_DTYPES.values()):
        raise IncompatibleIndexError(
            f"{index_dir / info['file']} stores the eigenvector columns as {sorted(stored)}, "
            "not in one model dtype; the file is damaged. Refit the index."
        )
    plan = make_plan(
        shape,
        projection,
        precision=manifest.precision,
        dtype=built,
        eigenbasis_bytes=eigen,
        eigenbasis_dtype=stored.pop(),
        dims={m.name: (m.m, m.k) for m in modules},
        rescore=manifest.tier_code or "none",
        tier_k=dict(zip([m.name for m in modules], manifest.tier_k)),
        curvature_examples=manifest.curvature["num_examples"],
        checkpoints=count,
        max_tokens=max_tokens or manifest.max_tokens,
        max_tokens_from="--max-tokens" if max_tokens else "the index's max_tokens",
        # a query of this index rescores by the factor its fit measured, unless one is given
        **{**options, "query_rescore": options.get("query_rescore") or manifest.rescore_factor},
    )
    manifest_bytes = (index_dir / MANIFEST_FILE).stat().st_size
    return with_nodes(
        plan, nodes, bandwidth_gbs=bandwidth_gbs, metadata_bytes=metadata_bytes, manifest_bytes=manifest_bytes
    )
