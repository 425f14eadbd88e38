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
from typing import Iterator, List, Mapping, Sequence

import torch
from safetensors import safe_open
from torch import nn
from torch.utils.data import Dataset

from eogp_index.config import CurvatureConfig
from eogp_index.errors import IndexNotFoundError
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
    module_partitions: int = 1,
) -> "CurvatureFiles":
    """Fit EK-FAC with kronfluence on ``examples`` and return the per-module factors.

    Args:
        model: the model, with ``Conv1D`` already replaced; it is wrapped by kronfluence during
            the fit and unwrapped afterwards (its parameters' ``requires_grad`` are left False).
        examples: ``(input_ids, labels)`` pairs; a seeded sample of ``config.num_examples``
            is used. Labels are only used as a mask: the Fisher samples its own labels.
        modules: names of the attributed ``nn.Linear`` modules.
        output_dir: kronfluence writes its factors under ``output_dir/eogp/factors_ekfac``.
        module_partitions: kronfluence fits the covariances, then Λ, of this many contiguous
            groups of modules one group at a time (one pass over the sample each), so that only
            one group's factors are on the device at once
            (:func:`eogp_index.fit.plan.curvature_partitions` picks it from the memory budget).

    Whatever the model's dtype, kronfluence is told to accumulate the covariances, per-example
    gradients and Λ in float32 from the model's activations and output gradients, to
    eigendecompose in float64, and to run without autocast: its defaults today, set here so that
    a bf16 or fp16 model does not change them.
    """
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    from eogp_index.fit.task import LanguageModelingTask  # imports kronfluence: only a fit needs it

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
                factor_args=FactorArguments(
                    strategy="ekfac",
                    amp_dtype=None,
                    activation_covariance_dtype=torch.float32,
                    gradient_covariance_dtype=torch.float32,
                    eigendecomposition_dtype=torch.float64,
                    per_sample_gradient_dtype=torch.float32,
                    lambda_dtype=torch.float32,
                    covariance_module_partitions=min(module_partitions, len(modules)),
                    lambda_module_partitions=min(module_partitions, len(modules)),
                ),
                overwrite_output_dir=True,
            )
    finally:
        _unwrap_tracked_modules(model)
        model.to(device)  # kronfluence moved it to its own device; the caller's batches go to ``device``
    return load_curvature(output_dir, modules)


def factors_dir(output_dir: Path) -> Path:
    return Path(output_dir) / ANALYSIS_NAME / f"factors_{FACTORS_NAME}"


def load_curvature(output_dir: Path, modules: List[str]) -> "CurvatureFiles":
    """kronfluence's EK-FAC factors, read one module at a time, eigenvalues normalised per example.

    Raises:
        IndexNotFoundError: a factor file, or a module in it, is missing.
    """
    return CurvatureFiles(factors_dir(output_dir), modules)


class CurvatureFiles(Mapping[str, ModuleCurvature]):
    """``{module: ModuleCurvature}`` over kronfluence's factor files: each module's tensors are
    read from them when it is looked up, so every module's factors (1.4 TB in float32 at
    OLMo-2-32B) never sit in memory at once."""

    _FILES = ("activation_eigenvectors", "gradient_eigenvectors", "lambda_matrix", "num_lambda_processed")

    def __init__(self, folder: Path, modules: List[str]):
        self.folder = Path(folder)
        self.modules = list(modules)
        for name in self._FILES:
            path = self.folder / f"{name}.safetensors"
            if not path.exists():
                raise IndexNotFoundError(
                    f"kronfluence factor file {path} is missing; fit the curvature first (eogp fit)"
                )
        with safe_open(str(self.folder / "lambda_matrix.safetensors"), framework="pt") as handle:
            present = set(handle.keys())
        for module in self.modules:
            if module not in present:
                raise IndexNotFoundError(
                    f"module {module!r} has no EK-FAC factors in {self.folder}; refit the curvature for these modules"
                )

    def __getitem__(self, module: str) -> ModuleCurvature:
        if module not in self.modules:
            raise KeyError(module)
        tensors = {}
        for name in self._FILES:
            with safe_open(str(self.folder / f"{name}.safetensors"), framework="pt") as handle:
                tensors[name] = handle.get_tensor(module)
        return ModuleCurvature(
            activation_eigenvectors=tensors["activation_eigenvectors"].float().contiguous(),
            gradient_eigenvectors=tensors["gradient_eigenvectors"].float().contiguous(),
            eigenvalues=(tensors["lambda_matrix"].double() / tensors["num_lambda_processed"].double())
            .float()
            .contiguous(),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)
