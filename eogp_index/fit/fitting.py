"""Fitting an index's projection, stages 1-3 in order: curvature, first stage, second stage.

:func:`fit_projection` is what ``eogp fit`` runs between loading the model and writing the index
directory:

1. EK-FAC curvature with kronfluence on a seeded sample of the fitting examples
   (:mod:`eogp_index.fit.curvature`; factors written under ``<out>/curvature``);
2. the first stage of every module from those factors, and the SRHTs (:mod:`eogp_index.fit.projection`);
3. for EOGP, the first-stage coordinates of a seeded sample of the examples, and the
   uncentered PCA of each module's coordinates.

Writing the manifest and the projection file is the store's job
(:meth:`~eogp_index.store.stored_index.StoredIndex.create`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import InputError
from eogp_index.fit.curvature import fit_curvature
from eogp_index.fit.projection import Projection, build_projection, fit_second_stage_pca
from eogp_index.gradients.capture import GradientCapture, project_examples
from eogp_index.gradients.model import find_attributed_modules, model_sha256, pad_token_id, replace_conv1d
from eogp_index.data.records import Example

CURVATURE_DIR = "curvature"


@dataclass(frozen=True)
class FittedProjection:
    """What a fit produced, and the facts about it the manifest records.

    Attributes:
        projection: the fitted per-module projections, in module order.
        weights_sha256: the model's fingerprint, taken before GPT-2's ``Conv1D`` layers are swapped.
        num_parameters: the model's parameter count.
        curvature_examples: examples the EK-FAC factors were fitted on.
        pca_examples: examples in the PCA fitting set (0 without a PCA stage).
    """

    projection: Projection
    weights_sha256: str
    num_parameters: int
    curvature_examples: int
    pca_examples: int


def fit_projection(
    model: nn.Module,
    tokenizer,
    examples: Sequence[Example],
    out_dir: Path,
    *,
    modules: Optional[Sequence[str]] = None,
    curvature: CurvatureConfig = CurvatureConfig(),
    projection: ProjectionConfig = ProjectionConfig(k=256),
    storage: StorageConfig = StorageConfig(),
    gradients: GradientConfig = GradientConfig(),
    progress: bool = True,
) -> FittedProjection:
    """Fit curvature and projection on ``examples``; the model is prepared for attribution in place.

    Args:
        examples: tokenized corpus examples; seeded samples of them fit the EK-FAC factors
            (``curvature.num_examples``) and the PCA (``projection.num_fit_examples``).
        out_dir: the index directory; kronfluence's factors go to ``out_dir/curvature``.
        modules: module names or globs to attribute (default: attention and MLP linears).
    """
    if not examples:
        raise InputError("no examples to fit the curvature and projection on; give --data shards with documents")
    weights_sha256 = model_sha256(model)  # before the Conv1D swap: the checkpoint's own bytes
    replace_conv1d(model)
    device = gradients.resolved_device()
    model.to(device).eval()
    names = find_attributed_modules(model, modules)
    pad_id = pad_token_id(tokenizer)
    factors = fit_curvature(model, [(ex.input_ids, ex.labels) for ex in examples], names, Path(out_dir) / CURVATURE_DIR,
                            config=curvature, pad_token_id=pad_id, device=device, progress=progress)
    fitted = build_projection(factors, projection, storage, damping_ratio=curvature.damping_ratio)
    num_fit = 0
    if projection.second_stage == "pca":
        generator = torch.Generator().manual_seed(projection.seed)
        order = torch.randperm(len(examples), generator=generator)[: projection.num_fit_examples].sort().values
        fit_set = [examples[i] for i in order.tolist()]
        num_fit = len(fit_set)
        capture = GradientCapture(model, names, fitted.first_stage_transform)
        first_stage = project_examples(capture, fit_set, batch_size=gradients.batch_size, pad_token_id=pad_id,
                                       device=device, progress=progress, desc="PCA fitting set")
        fit_second_stage_pca(fitted, {name: [z] for name, z in first_stage.items()})
    return FittedProjection(
        projection=fitted,
        weights_sha256=weights_sha256,
        num_parameters=sum(p.numel() for p in model.parameters()),
        curvature_examples=min(curvature.num_examples, len(examples)),
        pca_examples=num_fit,
    )
