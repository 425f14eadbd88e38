"""Configuration of each pipeline stage, as small frozen dataclasses with the paper's defaults.

The stages run in one direction — fit curvature → fit projection → ingest → query — and each
takes only its own config. Values are validated in ``__post_init__`` so a bad value fails where
it is set, with a message that names the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

from eogp_index.errors import ConfigError

SecondStage = Literal["pca", "srht", "none"]
Precision = Literal["1bit", "fp16", "fp32"]
PRECISIONS = ("1bit", "fp16", "fp32")
PcaDtype = Literal["fp16", "fp32"]
PCA_DTYPES = ("fp16", "fp32")
#: Bytes per element of a stored PCA matrix, by ``ProjectionConfig.pca_dtype``.
PCA_DTYPE_BYTES = {"fp16": 2, "fp32": 4}
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")

#: Variant names used in the manifest and the CLI, mapped to the second stage they use.
VARIANTS = {"auto": "pca", "eogp": "pca", "eogp-rot": "pca", "eogp-r": "srht", "ekfac-topk": "none"}
Rotation = Literal["none", "hadamard"]
#: The rotation each variant applies inside a module's k-dim PCA subspace before the signs are
#: taken, folded into P at fit time (the stored codes keep EOGP's format and meaning). ``auto``
#: draws it for every module and keeps it where the held-out measurement chooses it.
ROTATIONS = {"auto": "hadamard", "eogp": "none", "eogp-rot": "hadamard", "eogp-r": "none", "ekfac-topk": "none"}
#: The default share of the PCA fitting set held out to measure each code's quantization fidelity.
HELD_OUT_FRACTION = 0.15


def _positive(name: str, value: Optional[float], *, allow_none: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{name} is required")
        return
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class CurvatureConfig:
    """EK-FAC fitting (done by kronfluence) on a sample of the corpus.

    Fisher statistics use labels sampled from the model's next-token distribution
    (``sample=True`` in kronfluence's task), as the paper's Appendix C.2 prescribes.
    """

    num_examples: int = field(
        default=1000, metadata={"help": "Corpus examples used to fit the EK-FAC factors.", "min": 1}
    )
    batch_size: int = field(default=8, metadata={"help": "Examples per batch while fitting.", "min": 1})
    damping_ratio: float = field(
        default=0.1,
        metadata={"help": "λ_u = damping_ratio · tr(Λ_u)/d_u (kronfluence's heuristic damping when 0.1).",
                  "min": 0.0, "min_open": True},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the example sample and the sampled labels."})

    def __post_init__(self) -> None:
        _positive("CurvatureConfig.num_examples", self.num_examples, allow_none=False)
        _positive("CurvatureConfig.batch_size", self.batch_size, allow_none=False)
        _positive("CurvatureConfig.damping_ratio", self.damping_ratio, allow_none=False)


#: The default first-stage width: ``m_u = min(d_u, max(k_u, DEFAULT_M))``, whatever ``k``
#: (the paper fixes ``m_u`` independently of ``k``). Chosen from the measured fidelity-versus-m
#: curve (``benchmarks/m_curve.py``, README "First-stage width").
DEFAULT_M = 16384
DEFAULT_M_HELP = f"min(d_u, max(k, {DEFAULT_M}))"


def first_stage_width(d: int, k: int, m: Optional[int] = None) -> int:
    """The first-stage width ``m_u`` of a module with ``d`` parameters and ``k`` output coordinates.

    Args:
        m: the width asked for (capped at ``d``); None: the default rule (:data:`DEFAULT_M`).

    Raises:
        ConfigError: an ``m`` below ``k`` (the second stage cannot output more axes than it is given).
    """
    k = min(k, d)
    if m is None:
        return min(d, max(k, DEFAULT_M))
    m = min(m, d)
    if m < k:
        raise ConfigError(f"ProjectionConfig: m={m} is smaller than k={k}; the first stage must keep m >= k axes")
    return m


@dataclass(frozen=True)
class ProjectionConfig:
    """The two-stage projection of Section 3.2 and its output size per module.

    Give either ``k`` (coordinates per module) or ``budget_kb`` (per-example storage in KiB,
    split evenly over the modules). ``m`` is the first-stage width, independent of ``k`` as in
    the paper; ``None`` keeps :func:`first_stage_width`'s default.
    """

    variant: Literal["auto", "eogp", "eogp-rot", "eogp-r", "ekfac-topk"] = field(
        default="eogp",
        metadata={"help": "eogp: PCA second stage (the paper's EOGP); auto: per module, eogp or eogp-rot, whichever "
                          "1-bit code ranks held-out fitting documents closer to their FP16 ranking (a tie within "
                          "one standard error keeps eogp; see docs/variants.md for how it fared); eogp-rot: PCA, then a randomized Hadamard rotation of "
                          "the k coordinates before the signs; eogp-r: SRHT; ekfac-topk: top-k EK-FAC axes "
                          "(ablation)."},
    )
    k: Optional[int] = field(default=None, metadata={"help": "Output coordinates per module.", "min": 1})
    budget_kb: Optional[float] = field(
        default=None,
        metadata={"help": "Per-example storage budget in KiB (instead of k).", "min": 0.0, "min_open": True},
    )
    m: Optional[int] = field(
        default=None,
        metadata={"help": f"First-stage width m_u per module, capped at d_u (default: {DEFAULT_M_HELP}).", "min": 1},
    )
    num_fit_examples: int = field(default=1000, metadata={"help": "Examples in the PCA fitting set.", "min": 1})
    seed: int = field(default=0, metadata={"help": "Seed of the PCA fitting sample and the SRHT."})
    held_out_fraction: float = field(
        default=HELD_OUT_FRACTION,
        metadata={"help": "Share of the PCA fitting set held out to measure each 1-bit code's fidelity to FP16 "
                          "(printed by the fit; variant auto chooses by it); P is fitted on the rest first, then on "
                          "all. 0 measures nothing (auto then keeps eogp).", "min": 0.0},
    )
    pca_dtype: PcaDtype = field(
        default="fp16",
        metadata={"help": "Precision of the stored PCA matrices P (m_u x k_u per module): fp16 as in the paper "
                          "(half the disk and memory), or fp32. Applied in float32 either way."},
    )

    def __post_init__(self) -> None:
        if self.pca_dtype not in PCA_DTYPES:
            raise ConfigError(f"ProjectionConfig.pca_dtype must be one of {list(PCA_DTYPES)}, got {self.pca_dtype!r}")
        if self.variant not in VARIANTS:
            raise ConfigError(f"ProjectionConfig.variant must be one of {sorted(VARIANTS)}, got {self.variant!r}")
        if (self.k is None) == (self.budget_kb is None):
            raise ConfigError("ProjectionConfig: give exactly one of k (coordinates per module) or budget_kb")
        _positive("ProjectionConfig.k", self.k)
        _positive("ProjectionConfig.budget_kb", self.budget_kb)
        _positive("ProjectionConfig.m", self.m)
        _positive("ProjectionConfig.num_fit_examples", self.num_fit_examples, allow_none=False)
        if not 0 <= self.held_out_fraction <= 0.5:
            raise ConfigError(f"ProjectionConfig.held_out_fraction (--held-out-fraction) must lie in [0, 0.5], "
                              f"got {self.held_out_fraction!r}")

    @property
    def second_stage(self) -> SecondStage:
        return VARIANTS[self.variant]  # type: ignore[return-value]

    @property
    def rotation(self) -> Rotation:
        """The rotation folded into ``P`` (:data:`ROTATIONS`): ``"hadamard"`` for ``eogp-rot``."""
        return ROTATIONS[self.variant]  # type: ignore[return-value]

    def dims(self, d: int, num_modules: int, precision: Precision) -> Tuple[int, int]:
        """``(m_u, k_u)`` for a module of ``d`` parameters among ``num_modules``.

        A budget is split evenly; a module too small for its share keeps ``k_u = d``
        (the rest of its share is not moved to other modules).
        """
        k = self.k if self.k is not None else k_for_budget(self.budget_kb, num_modules, precision)
        k = min(k, d)
        if self.second_stage == "none":
            return k, k  # the ablation keeps the top-k EK-FAC axes themselves
        return first_stage_width(d, k, self.m), k



#: Per-module storage of ``k`` coordinates, by precision: the one place these formulas live.
#: 1bit: ⌈k/8⌉ packed sign bytes + one FP16 scale; fp16/fp32: the coordinates themselves.
_SCALE_BYTES = 2
_COORD_BYTES = {"fp16": 2, "fp32": 4}


def bytes_per_module(k: int, precision: Precision) -> int:
    """Per-example bytes of one module: ⌈k/8⌉ + 2 in 1-bit mode (signs + FP16 scale), else 2k or 4k."""
    _check_precision(precision)
    if precision == "1bit":
        return math.ceil(k / 8) + _SCALE_BYTES
    return k * _COORD_BYTES[precision]


def k_for_bytes(module_bytes: int, precision: Precision) -> int:
    """The largest ``k`` with ``bytes_per_module(k, precision) <= module_bytes`` (may be < 1)."""
    _check_precision(precision)
    if precision == "1bit":
        return 8 * (module_bytes - _SCALE_BYTES)
    return module_bytes // _COORD_BYTES[precision]


def k_for_budget(budget_kb: float, num_modules: int, precision: Precision) -> int:
    """The largest uniform ``k`` whose per-example payload fits ``budget_kb`` KiB."""
    per_module = int(budget_kb * 1024) // num_modules
    k = k_for_bytes(per_module, precision)
    if k < 1:
        raise ConfigError(
            f"a budget of {budget_kb} KiB over {num_modules} modules leaves {per_module} bytes per module, "
            f"too few for one coordinate in {precision} mode; raise --budget-kb or attribute fewer modules"
        )
    return k


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")


@dataclass(frozen=True)
class StorageConfig:
    """How projected training coordinates are stored per example."""

    precision: Precision = field(
        default="1bit",
        metadata={"help": "1bit: packed signs + FP16 scale (EOGP); fp16/fp32: unquantized, for comparisons."},
    )

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"StorageConfig.precision must be '1bit', 'fp16' or 'fp32', got {self.precision!r}")


@dataclass(frozen=True)
class GradientConfig:
    """Per-example gradient computation (training examples and queries alike)."""

    batch_size: int = field(default=8, metadata={"help": "Examples per forward/backward pass.", "min": 1})
    max_tokens: Optional[int] = field(
        default=None, metadata={"help": "Truncate documents and queries to this many tokens.", "min": 1}
    )
    device: str = field(default="auto", metadata={"help": "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1'…"})
    projection_memory_gb: Optional[float] = field(
        default=None,
        metadata={"help": "GiB the PCA matrices P may hold in memory at once. Under it each module's P is read "
                          "once and kept; over it the modules' P are read one at a time in every batch and "
                          "dropped (slower, bounded). Default: $EOGP_PROJECTION_MEMORY_GB, else half the "
                          "available memory.", "min": 0.0, "min_open": True},
    )

    def __post_init__(self) -> None:
        _positive("GradientConfig.batch_size", self.batch_size, allow_none=False)
        _positive("GradientConfig.max_tokens", self.max_tokens)
        _positive("GradientConfig.projection_memory_gb", self.projection_memory_gb)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"GradientConfig.device must be 'auto', 'cpu', 'mps', 'cuda' or 'cuda:N' "
                              f"(--device), got {self.device!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
