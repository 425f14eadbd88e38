"""``eogp plan INDEX``: :func:`~eogp_index.fit.plan.make_plan` for a fitted index, with the figures
the fit fixed read from its files instead of bounded, and its documents as long as it cuts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from eogp_index.config import ProjectionConfig
from eogp_index.data.location import index_path
from eogp_index.errors import ConfigError, IncompatibleIndexError
from eogp_index.fit.plan import ModelShape, Plan, make_plan, model_shape, with_nodes
from eogp_index.store.files import safetensors_header, tensor_bytes
from eogp_index.store.manifest import MANIFEST_FILE, Manifest

#: safetensors' dtype names of the eigenvector columns (16 bits for a half-precision model from
#: projection format 3, float32 before it).
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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
    **options: Any,
) -> Plan:
    """:func:`~eogp_index.fit.plan.make_plan` for a fitted index: its model, modules, ``(m_u, k_u)``,
    options and dtype from its manifest, and the kept eigenvector columns, exact, from its
    projection file's header: their bytes and the dtype they are stored and held in.

    The curvature examples are the index's, whatever ``curvature_examples`` says. The documents
    are as long as the index cuts them (its manifest's ``max_tokens``) unless ``max_tokens`` or
    ``document_tokens`` says otherwise. ``shape``: the loaded model's
    (:func:`~eogp_index.fit.plan.shape_of_model`) instead of the manifest's model name's;
    ``options``: :func:`~eogp_index.fit.plan.make_plan`'s.

    Raises:
        ConfigError: ``dtype`` names another dtype than the one the index was built in.
        IncompatibleIndexError: the file holds the eigenvector columns in several dtypes.
    """
    del curvature_examples
    index_dir = index_path(index_dir)
    manifest = Manifest.load(index_dir)
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
    header = safetensors_header(index_dir / info["file"])
    entries = {
        m.name: [header[f"{m.name}/{key}"] for key in ("gradient_eigenvectors", "activation_eigenvectors")]
        for m in modules
    }
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
        max_tokens=max_tokens or manifest.max_tokens,
        max_tokens_from="--max-tokens" if max_tokens else "the index's max_tokens",
        # a query of this index rescores by the factor its fit measured, unless one is given
        **{**options, "query_rescore": options.get("query_rescore") or manifest.rescore_factor},
    )
    manifest_bytes = (index_dir / MANIFEST_FILE).stat().st_size
    return with_nodes(
        plan, nodes, bandwidth_gbs=bandwidth_gbs, metadata_bytes=metadata_bytes, manifest_bytes=manifest_bytes
    )
