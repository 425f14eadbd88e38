"""Stage 1: EK-FAC curvature, fitted by kronfluence.

kronfluence fits the Kronecker factors, their eigendecompositions and the corrected
eigenvalues; this module runs it and reads the results back as :class:`ModuleCurvature`.

A trap this module exists to avoid: kronfluence stores ``lambda_matrix`` as a *sum* over the
``num_lambda_processed`` examples. The corrected eigenvalues are ``lambda_matrix /
num_lambda_processed``; the damping ``λ_u = 0.1·tr(Λ_u)/d_u`` must be computed from those
normalised values, exactly as kronfluence's own heuristic (``damping_factor=None``) does.
Mixing the two silently changes which directions are kept and how they are weighted.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

from eogp_index.config import CurvatureConfig
from eogp_index.errors import IndexNotFoundError
from eogp_index.fit.task import LanguageModelingTask
from eogp_index.gradients.loss import collate

ANALYSIS_NAME = "eogp"
FACTORS_NAME = "ekfac"


@dataclass(frozen=True)
class ModuleCurvature:
    """EK-FAC of one linear module.

    Attributes:
        activation_eigenvectors: ``Q_A``, ``(d_in', d_in')`` float32, columns are eigenvectors.
        gradient_eigenvectors: ``Q_S``, ``(d_out, d_out)`` float32.
        eigenvalues: corrected eigenvalues ``Λ`` (normalised per example), ``(d_out, d_in')``
            float32; entry ``[o, i]`` belongs to the direction ``Q_S[:, o] ⊗ Q_A[:, i]``.
    """

    activation_eigenvectors: torch.Tensor
    gradient_eigenvectors: torch.Tensor
    eigenvalues: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(d_out, d_in')`` of the module's gradient."""
        return tuple(self.eigenvalues.shape)  # type: ignore[return-value]

    @property
    def num_params(self) -> int:
        return self.eigenvalues.numel()

    def damping(self, ratio: float = 0.1) -> float:
        """``λ_u = ratio · tr(Λ_u)/d_u``: kronfluence's heuristic damping when ``ratio=0.1``."""
        return float(ratio * self.eigenvalues.double().mean())


class _ExampleDataset(Dataset):
    def __init__(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int):
        return self.examples[index]


def _unwrap_tracked_modules(model: nn.Module) -> None:
    """Undo kronfluence's ``prepare_model`` wrapping so the model is a plain model again."""
    from kronfluence.module.tracked_module import TrackedModule

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, TrackedModule):
                setattr(parent, child_name, child.original_module)


@contextlib.contextmanager
def kronfluence_device(device: str) -> Iterator[None]:
    """Make ``device`` the current CUDA device while kronfluence runs (a no-op off CUDA).

    Outside a multi-GPU torchrun job kronfluence puts the model on ``torch.device("cuda")``,
    i.e. the *current* CUDA device (``cuda:0`` unless set), whatever device the caller chose;
    with ``--device cuda:1`` the model then sat on ``cuda:0`` while batches went to ``cuda:1``.
    """
    target = torch.device(device)
    if target.type != "cuda" or target.index is None:
        yield
        return
    previous = torch.cuda.current_device()
    torch.cuda.set_device(target)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def fit_curvature(
    model: nn.Module,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    modules: List[str],
    output_dir: Path,
    *,
    config: CurvatureConfig = CurvatureConfig(),
    pad_token_id: int = 0,
    device: str = "cpu",
    progress: bool = True,
) -> Dict[str, ModuleCurvature]:
    """Fit EK-FAC with kronfluence on ``examples`` and return the per-module factors.

    Args:
        model: the model, with ``Conv1D`` already replaced; it is wrapped by kronfluence during
            the fit and unwrapped afterwards (its parameters' ``requires_grad`` are left False).
        examples: ``(input_ids, labels)`` pairs; a seeded sample of ``config.num_examples``
            is used. Labels are only used as a mask: the Fisher samples its own labels.
        modules: names of the attributed ``nn.Linear`` modules.
        output_dir: kronfluence writes its factors under ``output_dir/eogp/factors_ekfac``.
    """
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(examples), generator=generator)[: config.num_examples].sort().values
    sample = [examples[i] for i in order.tolist()]

    # Sampled labels are seeded per batch from the stage's seed (see LanguageModelingTask).
    task = LanguageModelingTask(modules=list(modules), seed=config.seed + 1)
    prepared = prepare_model(model, task)
    try:
        with kronfluence_device(device):
            analyzer = Analyzer(
            analysis_name=ANALYSIS_NAME,
            model=prepared,
            task=task,
                cpu=device == "cpu",
                disable_tqdm=not progress,
                output_dir=str(output_dir),
                log_level=logging.WARNING,
            )
            analyzer.fit_all_factors(
                factors_name=FACTORS_NAME,
                dataset=_ExampleDataset(sample),
                per_device_batch_size=config.batch_size,
                dataloader_kwargs=DataLoaderKwargs(collate_fn=lambda batch: collate(batch, pad_token_id)),
                factor_args=FactorArguments(strategy="ekfac"),
                overwrite_output_dir=True,
            )
    finally:
        _unwrap_tracked_modules(model)
        model.to(device)  # kronfluence moved it to its own device; the caller's batches go to ``device``
    return load_curvature(output_dir, modules)


def factors_dir(output_dir: Path) -> Path:
    return Path(output_dir) / ANALYSIS_NAME / f"factors_{FACTORS_NAME}"


def load_curvature(output_dir: Path, modules: List[str]) -> Dict[str, ModuleCurvature]:
    """Read kronfluence's EK-FAC factors back, with the eigenvalues normalised per example."""
    folder = factors_dir(output_dir)
    files = {}
    for name in ("activation_eigenvectors", "gradient_eigenvectors", "lambda_matrix", "num_lambda_processed"):
        path = folder / f"{name}.safetensors"
        if not path.exists():
            raise IndexNotFoundError(f"kronfluence factor file {path} is missing; fit the curvature first (eogp fit)")
        files[name] = load_file(str(path))
    curvature = {}
    for module in modules:
        if module not in files["lambda_matrix"]:
            raise IndexNotFoundError(
                f"module {module!r} has no EK-FAC factors in {folder}; refit the curvature for these modules"
            )
        lambda_sum = files["lambda_matrix"][module].double()
        count = files["num_lambda_processed"][module].double()
        curvature[module] = ModuleCurvature(
            activation_eigenvectors=files["activation_eigenvectors"][module].float().contiguous(),
            gradient_eigenvectors=files["gradient_eigenvectors"][module].float().contiguous(),
            eigenvalues=(lambda_sum / count).float().contiguous(),
        )
    return curvature
