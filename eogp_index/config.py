"""Configuration of each pipeline stage, as small frozen dataclasses with the paper's defaults.

The stages run in one direction — fit curvature → fit projection → ingest → query — and each
takes only its own config. Values are validated in ``__post_init__`` so a bad value fails where
it is set, with a message that names the field.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Optional, Tuple

from eogp_index.errors import ConfigError

SecondStage = Literal["pca", "srht", "none"]
Precision = Literal["1bit", "fp16", "fp32"]
PRECISIONS = ("1bit", "fp16", "fp32")
PcaDtype = Literal["fp16", "fp32"]
#: The rescoring tier's code (schemas/store.md): the same coordinates as the one-bit code, stored
#: again at higher precision beside it and read only for the rows near the top of a scan.
Rescore = Literal["int8", "int4", "fp16", "none"]
RESCORE_CODES = ("int8", "int4", "fp16", "none")
#: How a mixture of experts' fused expert tensors are treated (eogp_index.gradients.experts).
Experts = Literal["fused", "dense"]
EXPERTS = ("fused", "dense")
PCA_DTYPES = ("fp16", "fp32")
#: Bytes per element of a stored PCA matrix, by ``ProjectionConfig.pca_dtype``.
PCA_DTYPE_BYTES = {"fp16": 2, "fp32": 4}
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Bytes per weight or activation element, by the model's dtype.
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The dtype the kept eigenvector columns are stored and held in, by the model's: 16 bits for a
#: half-precision model, as its activations and gradients are, but float16 for bfloat16 too. The
#: columns are unit vectors (entries within ±1, where float16 has 11 significant bits to
#: bfloat16's 8), and a column's rounding error leaks the large gradient components along the top
#: eigenvectors into every coordinate it touches: bfloat16 columns cost measurable fidelity,
#: float16 ones do not (docs/precision-and-memory.md).
EIGENVECTOR_DTYPES = {"float32": "float32", "bfloat16": "float16", "float16": "float16"}

#: Variant names used in the manifest and the CLI, mapped to the second stage they use.
VARIANTS = {"auto": "pca", "eogp": "pca", "eogp-rot": "pca", "eogp-r": "srht", "ekfac-topk": "none"}
Rotation = Literal["none", "hadamard"]
#: The rotation each variant applies inside a module's k-dim PCA subspace before the signs are
#: taken, folded into P at fit time (the stored codes keep EOGP's format and meaning). ``auto``
#: draws it for every module and keeps it where the held-out measurement chooses it.
ROTATIONS = {"auto": "hadamard", "eogp": "none", "eogp-rot": "hadamard", "eogp-r": "none", "ekfac-topk": "none"}


def default_variant(tier: Optional[str]) -> str:
    """The variant a fit uses when none is given: ``auto`` with a rescoring tier ``tier`` (each
    module's one-bit code chosen by its measured recall of the tier's top rows: the rotation helps
    that recall on some models and hurts it on others, docs/variants.md), the paper's ``eogp``
    without one."""
    return "eogp" if tier is None else "auto"


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
        metadata={
            "help": "λ_u = damping_ratio · tr(Λ_u)/d_u (kronfluence's heuristic damping when 0.1).",
            "min": 0.0,
            "min_open": True,
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the example sample and the sampled labels."})

    def __post_init__(self) -> None:
        _positive("CurvatureConfig.num_examples", self.num_examples, allow_none=False)
        _positive("CurvatureConfig.batch_size", self.batch_size, allow_none=False)
        _positive("CurvatureConfig.damping_ratio", self.damping_ratio, allow_none=False)


#: The default first-stage width: ``m_u = min(d_u, max(k_u, DEFAULT_M))``, whatever ``k``
#: (the paper fixes ``m_u`` independently of ``k``). Chosen from the measured fidelity-versus-m
#: curve (``benchmarks/m_curve.py``, docs/fitting.md "First-stage width").
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

    ``variant`` None (the default) resolves per tier (:meth:`resolved`): with a rescoring tier the
    one-bit code's job is recall of the tier's top rows, which the rotation raises on some models
    and lowers on others, so each module's code is chosen by that recall, measured (``auto``);
    without a tier the paper's EOGP.
    """

    variant: Optional[Literal["auto", "eogp", "eogp-rot", "eogp-r", "ekfac-topk"]] = field(
        default=None,
        metadata={
            "help": "eogp: PCA second stage (the paper's EOGP); auto: per module, eogp or eogp-rot, chosen on held-out "
            "fitting documents (with a rescoring tier: whichever 1-bit code finds more of the tier's top rows; "
            "without: whichever ranks them closer to their first-stage inner products; a tie within one standard "
            "error keeps eogp; see docs/variants.md); eogp-rot: PCA, then a randomized Hadamard rotation of "
            "the k coordinates before the signs; eogp-r: SRHT; ekfac-topk: top-k EK-FAC axes "
            "(ablation). Default: auto when the index has a rescoring tier (--rescore int8|int4|fp16, the "
            "default), eogp without one (--rescore none, or --precision fp16|fp32).",
        },
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
        metadata={
            "help": "Share of the PCA fitting set held out to measure how well each 1-bit code ranks them "
            "against their first-stage inner products (printed by the fit; variant auto chooses by "
            "it); P is fitted on the rest first, then on all. 0 measures nothing (auto then keeps "
            "eogp).",
            "min": 0.0,
        },
    )
    pca_dtype: PcaDtype = field(
        default="fp16",
        metadata={
            "help": "Precision of the stored PCA matrices P (m_u x k_u per module): fp16 as in the paper "
            "(half the disk and memory), or fp32. Applied in float32 either way."
        },
    )

    def __post_init__(self) -> None:
        if self.pca_dtype not in PCA_DTYPES:
            raise ConfigError(f"ProjectionConfig.pca_dtype must be one of {list(PCA_DTYPES)}, got {self.pca_dtype!r}")
        if self.variant is not None and self.variant not in VARIANTS:
            raise ConfigError(f"ProjectionConfig.variant must be one of {sorted(VARIANTS)}, got {self.variant!r}")
        if (self.k is None) == (self.budget_kb is None):
            raise ConfigError("ProjectionConfig: give exactly one of k (coordinates per module) or budget_kb")
        _positive("ProjectionConfig.k", self.k)
        _positive("ProjectionConfig.budget_kb", self.budget_kb)
        _positive("ProjectionConfig.m", self.m)
        _positive("ProjectionConfig.num_fit_examples", self.num_fit_examples, allow_none=False)
        if not 0 <= self.held_out_fraction <= 0.5:
            raise ConfigError(
                f"ProjectionConfig.held_out_fraction (--held-out-fraction) must lie in [0, 0.5], "
                f"got {self.held_out_fraction!r}"
            )

    def resolved(self, tier: Optional[str]) -> "ProjectionConfig":
        """This config with its variant decided: an explicit variant as it is; None (the default)
        as :func:`default_variant` of the index's rescoring tier ``tier`` (``StorageConfig.tier``)."""
        return self if self.variant is not None else replace(self, variant=default_variant(tier))

    @property
    def second_stage(self) -> SecondStage:
        # Every default resolves to a PCA variant, so the second stage is known before the tier is.
        return VARIANTS[self.variant or "eogp"]  # type: ignore[return-value]

    @property
    def rotation(self) -> Rotation:
        """The rotation folded into ``P`` (:data:`ROTATIONS`): ``"hadamard"`` for ``eogp-rot``.

        Raises:
            ConfigError: the variant is not decided yet (:meth:`resolved` first).
        """
        if self.variant is None:
            raise ConfigError(
                "ProjectionConfig.variant None depends on the rescoring tier: call .resolved(storage.tier) "
                "first, or give the variant"
            )
        return ROTATIONS[self.variant]  # type: ignore[return-value]

    def dims(self, d: int, num_modules: int, precision: Precision, rescore_k: Optional[int] = None) -> Tuple[int, int]:
        """``(m_u, k_u)`` for a module of ``d`` parameters among ``num_modules``.

        A budget is split evenly; a module too small for its share keeps ``k_u = d``
        (the rest of its share is not moved to other modules). ``rescore_k``: the rescoring
        tier's coordinates per module (``StorageConfig.rescore_k``), which the first stage must
        give too: the default ``m_u`` is at least it, and ``ekfac-topk`` keeps that many axes
        (its one-bit code the first ``k_u``).
        """
        k = self.k if self.k is not None else k_for_budget(self.budget_kb, num_modules, precision)
        k = min(k, d)
        wide = k if rescore_k is None else max(k, min(rescore_k, d))
        if self.second_stage == "none":
            return wide, k  # the ablation keeps the top EK-FAC axes themselves
        return first_stage_width(d, wide if self.m is None else k, self.m), k


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


#: The largest code of each integer rescoring tier (its codes lie in ``[-q, q]``).
TIER_LEVELS = {"int8": 127, "int4": 7}


def quantize_tier_block(block, q: int):
    """One module's coordinates ``(n, k)`` float32 as an integer tier stores them: the row scales
    ``max|x| / q`` rounded to FP16 ``(n,)``, and the codes ``round(x / s)`` clipped to ``[-q, q]``
    ``(n, k)`` int8 (a zero, or underflowed, scale means a zero row: its codes are 0). The one
    rule the index's tier (``store.codecs.TierCodec``) and the fit's recall measurement share."""
    import numpy as np

    block = np.asarray(block, np.float32)
    n, k = block.shape
    scale = (np.abs(block).max(axis=1) / q).astype(np.float16) if k else np.zeros(n, np.float16)
    wide = scale.astype(np.float32)[:, None]
    codes = np.clip(np.rint(np.divide(block, wide, out=np.zeros_like(block), where=wide > 0)), -q, q)
    return codes.astype(np.int8), scale


def tier_bytes_per_module(k: int, code: str) -> int:
    """Per-example bytes of one module's rescoring tier: ``k`` (int8) or ``⌈k/2⌉`` (int4) plus an
    FP16 scale, or ``2k`` (fp16)."""
    if code == "int8":
        return k + _SCALE_BYTES
    if code == "int4":
        return math.ceil(k / 2) + _SCALE_BYTES
    if code == "fp16":
        return 2 * k
    raise ConfigError(f"a rescoring tier's code is int8, int4 or fp16, got {code!r}")


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

    rescore: Rescore = field(
        default="int8",
        metadata={
            "help": "The rescoring tier stored beside the 1-bit code (1bit precision only): int8/int4 of the same "
            "coordinates with a scale per module, or fp16; queries rescore their one-bit top rows with it. "
            "none: no tier."
        },
    )

    rescore_k: Optional[int] = field(
        default=None,
        metadata={
            "help": "The rescoring tier's coordinates per module (default: the one-bit code's k). Larger: the PCA "
            "is fitted to this many directions, the one-bit code keeps the first k of them (rotated for "
            "eogp-rot) and the tier all of them; at least k, capped at m_u like k. A query reads the "
            "tier only for its rescored rows.",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"StorageConfig.precision must be '1bit', 'fp16' or 'fp32', got {self.precision!r}")
        if self.rescore not in RESCORE_CODES:
            raise ConfigError(
                f"StorageConfig.rescore must be one of {list(RESCORE_CODES)}, got {self.rescore!r} "
                "(none: no rescoring tier)"
            )
        if self.rescore_k is None:
            return
        if isinstance(self.rescore_k, bool) or not isinstance(self.rescore_k, int) or self.rescore_k < 1:
            raise ConfigError(
                f"StorageConfig.rescore_k (--rescore-k) must be a positive integer, got {self.rescore_k!r}"
            )
        if self.tier is None:
            why = "--rescore none" if self.rescore == "none" else f"--precision {self.precision}"
            raise ConfigError(
                f"--rescore-k sets the rescoring tier's coordinates, but {why} stores no tier; drop --rescore-k, "
                "or fit with --precision 1bit and --rescore int8|int4|fp16"
            )

    def tier_k(self, k: int, m: int) -> int:
        """The tier's coordinates of a module whose one-bit code keeps ``k`` of its ``m`` first-stage
        coordinates: ``rescore_k`` capped at ``m`` (``k`` without it).

        Raises:
            ConfigError: a ``rescore_k`` below ``k`` (the tier holds the one-bit code's coordinates
                and more).
        """
        self.check_rescore_k(k)
        return k if self.rescore_k is None else min(self.rescore_k, m)

    def check_rescore_k(self, k: int) -> None:
        """Refuse a ``rescore_k`` below the one-bit code's ``k`` (the tier holds the one-bit
        code's coordinates and more)."""
        if self.rescore_k is not None and self.rescore_k < k:
            raise ConfigError(
                f"--rescore-k {self.rescore_k} is below the one-bit code's k={k}: the tier holds the one-bit "
                f"code's coordinates and more. Give --rescore-k {k} or more, or lower -k / --budget-kb"
            )

    @property
    def tier(self) -> Optional[str]:
        """The tier's code the index gets, or None: a tier only rescores a one-bit scan, so an
        fp16/fp32 index (its codes are the coordinates already) has none."""
        return self.rescore if self.precision == "1bit" and self.rescore != "none" else None


#: The rescoring factors the one-bit code's recall of the tier's top rows is measured at (at fit
#: time, eogp_index.fit.recall, and on the stored table, eogp_index.store.table_recall); each only
#: where the candidates allow it (``F · t`` below them). Past 20 for the codes whose top rows lie
#: deep in the one-bit ranking (a large table, a tier wider than the one-bit code).
RECALL_FACTORS = (1, 2, 3, 5, 10, 20, 50, 100)
#: The NDCG the rescored top may lose against the tier's own full scan, which chooses the default
#: rescoring factor: the smallest ``F`` whose mean ``1 - NDCG@t`` of the rescored top ``t`` against
#: the tier's top ``t`` is at most this (a reader should not tell the rescored top from the tier's).
RESCORE_GAP_TARGET = 0.005
#: The largest default rescoring factor. Past it the tier rows a query reads by row address cost
#: more than a fifth of the one-bit scan (docs/benchmarks.md, "Rescoring at 1M rows"): larger
#: factors are measured and printed, and a query asks for one with ``rescore``.
RESCORE_MAX_DEFAULT = 20
#: The recall reported beside the gap (the smallest factor reaching it is recorded, not used): a
#: missed row of the tier's top is a wrong row at the top of the answer, so nearly all must be
#: kept (one in fifty missed). The gap weighs a miss by its place, as the NDCG does.
RECALL_TARGET = 0.98
#: The largest top ``t`` measured (the top a reader reads: the evaluation's NDCG@20).
RECALL_MAX_T = 20
#: ``t`` is about this share of the candidates: ``t = min(20, candidates // 20)``, so that the
#: largest factor, 20, still selects.
RECALL_T_SHARE = 20


@dataclass(frozen=True)
class TableRecallConfig:
    """The one-bit code's recall of the rescoring tier's top rows, measured on the stored table
    after each ingest and by ``eogp optimize`` (:mod:`eogp_index.store.table_recall`): the queries
    are the fit's held-out documents, the candidates the table's rows."""

    min_rows: int = field(
        default=100,
        metadata={
            "help": "Below this many rows the table is not measured: its top 5% (t = rows // 20) would be a handful "
            "of rows, no more telling than the fit's held-out measurement, which the default factor keeps.",
            "min": 1,
        },
    )
    max_rows: int = field(
        default=2_000_000,
        metadata={
            "help": "At most this many rows are read: a larger table is measured on a seeded sample of its "
            "fragments holding about this many (the record says so). Bounds the measurement's reads (the "
            "codes and the tier of every row read) and time.",
            "min": 1,
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the fragment sample of a table over max_rows."})
    batch_rows: int = field(
        default=8192, metadata={"help": "Rows scored at once (memory: batch_rows x the tier's width).", "min": 1}
    )

    def __post_init__(self) -> None:
        for name in ("min_rows", "max_rows", "batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"TableRecallConfig.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class GradientConfig:
    """Per-example gradient computation (training examples and queries alike)."""

    batch_size: int = field(default=8, metadata={"help": "Examples per forward/backward pass.", "min": 1})
    max_tokens: Optional[int] = field(
        default=None, metadata={"help": "Truncate documents and queries to this many tokens.", "min": 1}
    )
    device: str = field(default="auto", metadata={"help": "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1'…"})
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute each transformer block in the backward pass instead of keeping its "
            "activations: far less memory for long documents, about one more forward pass of "
            "time, the same coordinates."
        },
    )
    projection_memory_gb: Optional[float] = field(
        default=None,
        metadata={
            "help": "GiB the PCA matrices P may hold in memory at once. Under it each module's P is read "
            "once and kept; over it the modules' P are read one at a time in every batch and "
            "dropped (slower, bounded). Default: $EOGP_PROJECTION_MEMORY_GB, else half the "
            "available memory.",
            "min": 0.0,
            "min_open": True,
        },
    )
    experts: Experts = field(
        default="fused",
        metadata={
            "help": "Mixtures of experts kept as fused 3-D tensors: 'fused' leaves them out (they have no "
            "per-example inputs); 'dense' rebuilds each expert as nn.Linear layers run on every token "
            "with the unrouted ones zeroed, the same function, so they are attributed (E/top_k times "
            "the experts' compute). Fit and plan only: an index reloads it from its manifest."
        },
    )
    dtype: ModelDtype = field(
        default="auto",
        metadata={
            "help": "The model's precision: auto is the checkpoint's own (what from_pretrained(dtype='auto') "
            "gives); bfloat16/float16 halve the weights and activations. Curvature, the first stage "
            "and P are computed in float32 whatever it is. An index is queried in the dtype it was "
            "built in (auto: the manifest's)."
        },
    )
    memory_budget_gb: Optional[float] = field(
        default=None,
        metadata={
            "help": "GB of device memory a run may use: batch sizes and kronfluence's module partitions are "
            "chosen to fit it. Default: the device's memory (a GPU's total; on the CPU the "
            "available memory).",
            "min": 0.0,
            "min_open": True,
        },
    )
    batch_tokens: Optional[int] = field(
        default=None,
        metadata={
            "help": "Tokens per forward/backward pass (documents x padded length); a batch holds at most "
            "--batch-size documents. Default: the most that fit --memory-budget (eogp plan prints it).",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"GradientConfig.dtype must be one of {list(MODEL_DTYPES)} (--dtype), got {self.dtype!r}")
        _positive("GradientConfig.memory_budget_gb", self.memory_budget_gb)
        _positive("GradientConfig.batch_tokens", self.batch_tokens)
        _positive("GradientConfig.batch_size", self.batch_size, allow_none=False)
        _positive("GradientConfig.max_tokens", self.max_tokens)
        _positive("GradientConfig.projection_memory_gb", self.projection_memory_gb)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"GradientConfig.device must be 'auto', 'cpu', 'mps', 'cuda' or 'cuda:N' "
                f"(--device), got {self.device!r}"
            )
        if self.experts not in EXPERTS:
            raise ConfigError(
                f"GradientConfig.experts must be one of {list(EXPERTS)} (--experts), got {self.experts!r}"
            )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


#: The most documents in a default ingest block (``IngestConfig.block_documents``): about the
#: paper's (Appendix E: "batches of approximately 11,000 documents, over which matrix-loading
#: costs are amortized"). A kill redoes at most a block.
MAX_BLOCK_DOCUMENTS = 11_000
#: Rows per commit of a shard ingest when ``IngestConfig.batch_size`` is not given (rounded up to
#: whole gradient batches). Bigger commits mean fewer Lance fragments; smaller ones lose less work
#: to a crash.
DEFAULT_COMMIT_ROWS = 256
#: Small fragments (fewer than ``target_rows`` rows) that make ingest compact the table.
DEFAULT_FRAGMENT_THRESHOLD = 256
OnError = Literal["raise", "skip"]
ON_ERRORS = ("raise", "skip")


@dataclass(frozen=True)
class IngestConfig:
    """How documents go into an index: one config for ``eogp ingest``,
    :func:`ingest.pipeline.run_ingest`, :func:`ingest.distributed.run_distributed_ingest` (torchrun)
    and :meth:`eogp_index.client.AttributionIndex.ingest`. Each entry point also takes these fields
    as keyword arguments, which replace the config's (``run_ingest(index, shards, batch_size=64)``).

    The options about reading shards (``spec``, ``on_error="skip"``, ``rejects_path``,
    ``shard_root``) do not apply to :meth:`AttributionIndex.ingest`, which takes tokenized examples,
    and ``commit_every`` applies under torchrun only: an entry point refuses what it cannot honour.
    """

    spec: Any = field(
        default=None,
        metadata={
            "help": "A RecordSpec (eogp_index.data.records): the record fields holding content, id and "
            "metadata, and what becomes of long documents. None: RecordSpec(), with the index's "
            "max_tokens."
        },
    )
    batch_size: Optional[int] = field(
        default=None,
        metadata={
            "help": f"Rows per commit (under torchrun: per worker and step), rounded up to whole gradient "
            f"batches. Default: {DEFAULT_COMMIT_ROWS} for shards, one gradient batch for "
            "AttributionIndex.ingest. A kill loses at most the commit in flight.",
            "min": 1,
        },
    )
    block_documents: Optional[int] = field(
        default=None,
        metadata={
            "help": "When P does not stay in memory: documents per ingest block. Their first-stage "
            "coordinates are cached on disk, then each module's P is read once for the whole block "
            f"(one commit per block). Default: sized from the free disk and memory, at most "
            f"{MAX_BLOCK_DOCUMENTS:,}; the gradient batch size reads P in every batch.",
            "min": 1,
        },
    )
    on_error: OnError = field(
        default="raise",
        metadata={"help": "raise: stop at the first bad record; skip: list bad records in a rejects file."},
    )
    rejects_path: Optional[Path] = field(
        default=None,
        metadata={"help": "Where on_error='skip' lists rejected records (default: INDEX/rejects/<time>-<pid>.jsonl)."},
    )
    shard_root: Optional[Path] = field(
        default=None,
        metadata={
            "help": "Name shards by their path relative to this directory (needed when file names repeat); "
            "keep it the same across runs."
        },
    )
    store_text: Optional[int] = field(
        default=None,
        metadata={
            "help": "Keep each document's text in the table, up to this many UTF-8 bytes (a longer one is "
            "read back from its shard when explained); None keeps none. Every ingest into one index "
            "uses the same setting.",
            "min": 1,
        },
    )
    optimize_threshold: Optional[int] = field(
        default=DEFAULT_FRAGMENT_THRESHOLD,
        metadata={
            "help": "Compact the table between commits past this many small fragments, and leave it ready "
            "to query at the end (None: neither; eogp optimize later).",
            "min": 0,
        },
    )
    commit_every: int = field(
        default=1,
        metadata={"help": "Under torchrun: steps between commits; a crash loses at most this many steps.", "min": 1},
    )
    progress: bool = field(default=True, metadata={"help": "Show a progress bar (documents, doc/s, tok/s)."})
    allow_deleted: bool = field(
        default=False,
        metadata={
            "help": "Store records that a takedown deleted (same id or content hash in the index's "
            "deletions.jsonl); by default they are skipped and counted as deleted."
        },
    )

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERRORS:
            raise ConfigError(f"on_error must be 'raise' or 'skip' (--on-error), got {self.on_error!r}")
        for name in ("batch_size", "block_documents", "store_text"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                flag = "--store-text-max-bytes" if name == "store_text" else "--" + name.replace("_", "-")
                raise ConfigError(f"IngestConfig.{name} ({flag}) must be a positive int or None, got {value!r}")
        commit_every = self.commit_every
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError(f"commit_every (--commit-every) must be a positive int, got {commit_every!r}")
        threshold = self.optimize_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
            raise ConfigError(f"IngestConfig.optimize_threshold must be a non-negative int or None, got {threshold!r}")
        if self.rejects_path is not None:
            object.__setattr__(self, "rejects_path", Path(self.rejects_path))

    def with_options(self, **options: Any) -> "IngestConfig":
        """This config with the fields named in ``options`` replaced: an entry point's keyword
        arguments. Raises :class:`ConfigError` for a name that is not a field."""
        names = [f.name for f in fields(self)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"unknown ingest options {unknown}: IngestConfig's fields are {names}")
        return replace(self, **options) if options else self

    def refuse(self, names: Tuple[str, ...], why: str) -> None:
        """Raise :class:`ConfigError` if any field of ``names`` differs from its default: an entry
        point that cannot honour it says so (``why``: what to do instead)."""
        default = IngestConfig()
        given = [name for name in names if getattr(self, name) != getattr(default, name)]
        if given:
            raise ConfigError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply here: {why}")

    def commit_rows(self, gradient_batch_size: int, default: int = DEFAULT_COMMIT_ROWS) -> int:
        """Rows per commit outside block ingest: ``batch_size`` (else ``default``) as whole
        gradient batches; one smaller batch when it is below a gradient batch."""
        rows = self.batch_size if self.batch_size is not None else default
        if rows <= gradient_batch_size:
            return rows
        return -(-rows // gradient_batch_size) * gradient_batch_size


# -- memory policy: how much a run may hold, where no option says -----------------------------

#: Environment variable giving the default memory limit of the P matrices, in GiB.
PROJECTION_MEMORY_ENV = "EOGP_PROJECTION_MEMORY_GB"


def available_memory() -> int:
    """Bytes of memory available to new allocations now (psutil, else /proc/meminfo, else 8 GiB)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        pass
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 8 << 30  # pragma: no cover


def default_projection_memory() -> int:
    """The default memory limit of a loaded projection's ``P`` matrices, in bytes:
    ``$EOGP_PROJECTION_MEMORY_GB`` GiB when set, else half the memory available now (the rest is
    left to the model, its activations and the hot copy of the codes)."""
    value = os.environ.get(PROJECTION_MEMORY_ENV)
    if value:
        try:
            gib = float(value)
        except ValueError as exc:
            raise ConfigError(f"${PROJECTION_MEMORY_ENV}={value!r} is not a number of GiB") from exc
        if gib <= 0:
            raise ConfigError(f"${PROJECTION_MEMORY_ENV} must be positive, got {value!r}")
        return int(gib * (1 << 30))
    return available_memory() // 2


Aggregate = Literal["mean", "sum"]
AGGREGATES = ("mean", "sum")
Normalize = Literal["none", "unit"]
NORMALIZATIONS = ("none", "unit")
#: Which stored code scores every row of ``eogp scores`` and ``eogp select``.
ScorePrecision = Literal["1bit", "rescore"]
SCORE_PRECISIONS = ("1bit", "rescore")


_TOP = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%?)\s*$")


@dataclass(frozen=True)
class SelectOptions:
    """How a selection is made from a target set's scores; the queries, ``where`` and ``normalize``
    are the :class:`~eogp_index.search.question.Question`'s.

    top: ``"N"`` documents, or ``"P%"`` of the rows matching ``where`` (rounded down, as LESS
        does; at least one when any row matches); an int N is taken as ``"N"``.
    score: ``mean`` or ``max`` over the target queries. direction: ``positive`` keeps the
        documents whose training most lowers the targets' loss, ``negative`` the most harmful
        (a selection keeps one side, so ``both`` is not one of them).
    ids_only: write only ``id`` and ``score``, without reading the records back.
    precision: ``1bit`` scores every row from the code the queries scan (the one-bit code, or
        the stored coordinates); ``rescore`` scores every row exactly, in float32, from the
        index's rescoring tier (``eogp fit --rescore``), streamed batch by batch from the table.
    """

    top: str = field(default="10%", metadata={"help": "How many documents: a count N or a share P% of the rows."})
    score: Literal["mean", "max"] = field(
        default="mean", metadata={"help": "A document's score over the target queries: their mean, or LESS's max."}
    )
    direction: Literal["positive", "negative"] = field(
        default="positive", metadata={"help": "Keep the most helpful (positive) or most harmful (negative)."}
    )
    ids_only: bool = field(default=False, metadata={"help": "Write only id and score, not the records."})
    precision: ScorePrecision = field(
        default="1bit",
        metadata={
            "help": "Score every row from the scanned code (1bit), or exactly from the index's rescoring tier "
            "(rescore: needs an index fitted with --rescore int8, int4 or fp16)."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.top, int) and not isinstance(self.top, bool):
            object.__setattr__(self, "top", str(self.top))
        self.parse_top()
        if self.score not in ("mean", "max"):
            raise ConfigError(f"score must be 'mean' or 'max', got {self.score!r}", field="score")
        if self.direction not in ("positive", "negative"):
            raise ConfigError(
                f"direction must be 'positive' or 'negative' (a selection keeps one side), got {self.direction!r}",
                field="direction",
            )
        check_score_precision(self.precision)

    def parse_top(self) -> Tuple[float, bool]:
        """``(value, is_percent)`` of :attr:`top`."""
        match = _TOP.match(str(self.top))
        value = float(match.group(1)) if match else 0.0
        percent = bool(match and match.group(2))
        if not match or value <= 0 or (percent and value > 100) or (not percent and value != int(value)):
            raise ConfigError(
                f"--top takes a positive count N (e.g. 1000) or a share P% with 0 < P <= 100 "
                f"(e.g. 10%), got {self.top!r}",
                field="top",
            )
        return value, percent

    def count(self, rows: int) -> int:
        """How many documents of ``rows`` candidates are selected."""
        value, percent = self.parse_top()
        if not percent:
            return min(int(value), rows)
        return min(rows, max(1 if rows else 0, math.floor(rows * value / 100)))


def check_score_precision(precision: str) -> None:
    """Refuse a scoring precision other than ``1bit`` or ``rescore``."""
    if precision not in SCORE_PRECISIONS:
        raise ConfigError(
            f"precision must be one of {list(SCORE_PRECISIONS)}, got {precision!r} (1bit: the scanned code; "
            "rescore: the index's rescoring tier)",
            field="precision",
        )


def check_normalize(normalize: str) -> None:
    """Refuse a normalization other than ``none`` or ``unit``."""
    if normalize not in NORMALIZATIONS:
        raise ConfigError(
            f"normalize must be one of {list(NORMALIZATIONS)}, got {normalize!r} "
            "(none: the paper's influence; unit: each training code divided by its norm)"
        )
