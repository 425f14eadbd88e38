"""What ``eogp eval`` runs, as frozen dataclasses that import no torch.

The command line builds its options from these fields (:mod:`eogp_index.cli_options`), so
``eogp --help`` and ``eogp eval --help`` stay fast; :mod:`eogp_index.evaluation.run` and
:mod:`eogp_index.evaluation.tinylm` re-export them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Tuple

from eogp_index.errors import ConfigError
from eogp_index.evaluation.methods import (  # noqa: F401  (re-exported: the registry's tables)
    DEFAULT_METHODS,
    K_FROM_PRECISION,
    METHODS,
    PCA_FAMILIES,
    check_methods,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_METHODS",
    "K_FROM_PRECISION",
    "METHODS",
    "PCA_FAMILIES",
    "TIER_CODES",
    "DataConfig",
    "EnsembleConfig",
    "FidelityConfig",
    "FinetuneRecipe",
    "LDSConfig",
    "PretrainRecipe",
    "default_root",
]

#: The rescoring tier's codes the fidelity evaluation compares (eogp_index.store.codecs.TierCodec).
TIER_CODES: Tuple[str, ...] = ("int8", "int4", "fp16")

#: Per-example budgets in bytes (summed over modules): 64 B .. 4 KB.
DEFAULT_BUDGETS: Tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)


def default_root() -> Path:
    """``examples/default`` of the source tree this module lives in, else of the working directory."""
    here = Path(__file__).resolve().parents[2] / "examples" / "default"
    if here.is_dir():
        return here
    return Path.cwd() / "examples" / "default"


def _shipped(path: str, help: str, *, many: bool = False) -> Any:
    """A field defaulting to ``examples/default/<path>`` of the source tree (shown so in --help,
    whichever machine the source tree is on)."""
    factory = (lambda: (str(default_root() / path),)) if many else (lambda: str(default_root() / path))
    return field(default_factory=factory, metadata={"help": help, "show_default": f"examples/default/{path}"})


def _check_ranges(config: Any) -> None:
    """Enforce each field's ``min`` metadata (also the command line's range, see cli_options)."""
    for f in fields(config):
        value, low = getattr(config, f.name), f.metadata.get("min")
        if low is None or value is None:
            continue
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, bool) or not isinstance(item, (int, float)) or item < low:
                what = f"values must each be at least {low}" if isinstance(value, tuple) else f"must be at least {low}"
                raise ConfigError(f"{type(config).__name__}.{f.name} {what}, got {value!r}")


# --------------------------------------------------------------------------- training recipes


@dataclass(frozen=True)
class FinetuneRecipe:
    """How the default model is fine-tuned from its base (and retrained by LDS).

    AdamW (``betas=(0.9, 0.999)``, ``eps=1e-8``) with a learning rate decaying linearly
    from ``lr`` to 0 over all steps, gradient-norm clipping at ``max_grad_norm`` (0 turns it
    off), documents reshuffled every epoch by a generator seeded with ``seed``, batches of
    ``batch_size`` documents (the last one may be smaller), no dropout.
    """

    epochs: int = field(default=3, metadata={"help": "Fine-tuning epochs of every retraining.", "min": 1})
    lr: float = field(
        default=1e-3,
        metadata={"help": "Peak fine-tuning learning rate (linear decay to 0).", "min": 0.0, "min_open": True},
    )
    weight_decay: float = field(default=0.01, metadata={"min": 0.0})
    batch_size: int = field(default=8, metadata={"min": 1})
    max_tokens: int = field(default=128, metadata={"min": 1})
    seed: int = 0
    max_grad_norm: float = field(default=1.0, metadata={"min": 0.0})

    def __post_init__(self) -> None:
        _check_ranges(self)
        if not self.lr > 0:
            raise ConfigError(f"FinetuneRecipe.lr must be > 0, got {self.lr!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PretrainRecipe:
    """How the default base model is pretrained from scratch.

    Documents are concatenated (each followed by eos) and cut into ``block_size``-token
    blocks; ``steps`` AdamW steps on random batches of ``batch_size`` blocks, linear warmup
    over ``warmup_steps`` then cosine decay to ``lr / 10``.
    """

    steps: int = 1200
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    batch_size: int = 16
    block_size: int = 128
    seed: int = 0
    max_grad_norm: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- evaluation runs


@dataclass(frozen=True)
class DataConfig:
    """What is evaluated: the attributed model and the documents.

    model: the fine-tuned model directory (its tokenizer alongside). train, queries: shard
    paths or globs (JSONL[.gz/.zst], Parquet, ``save_to_disk`` directories). max_tokens:
    truncation, as in fine-tuning. limit_train / limit_queries: keep only the first N.
    pca_data: documents to fit EOGP's PCA on instead of the training documents (the paper
    fits on the candidates for GPT-2; a held-out set shows what in-sample fitting adds).
    pca_sample: fit on a seeded random sample of this many of the ``pca_data`` documents.
    """

    model: str = _shipped("model", "The attributed (fine-tuned) model directory.")
    train: Tuple[str, ...] = _shipped(
        "corpus/train.jsonl.gz", "Training-document shards or globs (repeatable).", many=True
    )
    queries: Tuple[str, ...] = _shipped("queries.jsonl", "Query-document shards or globs (repeatable).", many=True)
    max_tokens: int = field(default=128, metadata={"help": "Truncate documents to this many tokens.", "min": 2})
    limit_train: Optional[int] = field(
        default=None, metadata={"help": "Use only the first N training documents.", "min": 1}
    )
    limit_queries: Optional[int] = field(default=None, metadata={"help": "Use only the first N queries.", "min": 1})
    pca_data: Optional[Tuple[str, ...]] = field(
        default=None,
        metadata={"help": "Fit EOGP's PCA on these shards instead of the training documents (repeatable)."},
    )
    pca_sample: Optional[int] = field(
        default=None,
        metadata={
            "help": "Fit the PCA on a random sample of N of the --pca-data documents (seeded by --seed).",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class FidelityConfig:
    """The methods, budgets and metric settings of the fidelity evaluation (Appendix C.3, D.2).

    budgets: nominal bytes per example (all modules). m: the first-stage width of EOGP and
    EOGP-R, capped at ``d_u`` (None: the index's default, :func:`eogp_index.config.first_stage_width`).
    damping_ratio: ``λ_u = 0.1 tr(Λ_u)/d_u`` for EK-FAC and the post-projection curvatures.
    gaussian_seeds: draws averaged for the Gaussian control. ndcg_k: NDCG cut-off.
    tier_codes, rescore_factors, rescore, tier_k, tier_k_max: the rescoring tier of the 1-bit
    PCA methods (:mod:`eogp_index.evaluation.rescoring`): its codes, the factors ``F`` (the
    1-bit top ``F · ndcg_k`` rows of each side rescored), the factor of the main table, the
    tier's ``k`` as multiples of the 1-bit ``k``, and the largest tier ``k`` per module.
    """

    budgets: Tuple[int, ...] = field(
        default=DEFAULT_BUDGETS, metadata={"help": "Bytes per example (all modules), comma-separated.", "min": 1}
    )
    methods: Tuple[str, ...] = field(
        default=DEFAULT_METHODS,
        metadata={"help": "Methods, comma-separated, from: " + ",".join(METHODS) + "."},
    )
    damping_ratio: float = 0.1
    m: Optional[int] = field(
        default=None,
        metadata={
            "help": "First-stage width m_u of EOGP and EOGP-R per module, capped at d_u (default: the "
            "index's, see eogp fit --m); a budget whose k_u exceeds it is skipped.",
            "min": 1,
        },
    )
    gaussian_seeds: int = field(default=3, metadata={"min": 1})
    seed: int = field(default=0, metadata={"help": "Seed of the projections, samples and retrainings."})
    batch_size: int = field(default=8, metadata={"help": "Documents per gradient batch.", "min": 1})
    ndcg_k: int = field(default=20, metadata={"min": 1})
    modules: Optional[Tuple[str, ...]] = None
    tier_codes: Tuple[str, ...] = TIER_CODES
    rescore_factors: Tuple[int, ...] = field(
        default=(1, 2, 3, 5, 10, 20),
        metadata={
            "help": "Rescoring factors F, comma-separated: the 1-bit top F x 20 rows of each side are "
            "rescored by the tier (1-bit PCA methods).",
            "min": 1,
        },
    )
    rescore: int = field(
        default=5,
        metadata={"help": "The rescoring factor the report's main table and the tier's k curve use.", "min": 1},
    )
    tier_k: Tuple[int, ...] = field(
        default=(1, 2, 4),
        metadata={
            "help": "The tier's k as multiples of the 1-bit k, comma-separated (the PCA fitted to the "
            "larger k, the 1-bit code the signs of its first k).",
            "min": 1,
        },
    )
    tier_k_max: int = field(
        default=4096,
        metadata={
            "help": "Largest tier k per module; a larger multiple is skipped (completing a PCA "
            "costs m x k^2 per module).",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        check_methods(self.methods, "FidelityConfig.methods (--methods)")
        if not self.methods or not self.budgets:
            raise ConfigError("FidelityConfig: give at least one method and one budget")
        _check_ranges(self)
        unknown = [code for code in self.tier_codes if code not in TIER_CODES]
        if unknown:
            raise ConfigError(
                f"FidelityConfig.tier_codes: unknown tier code(s) {unknown}; choose from {', '.join(TIER_CODES)}"
            )
        if not self.rescore_factors or not self.tier_k or 1 not in self.tier_k:
            raise ConfigError(
                "FidelityConfig: give at least one rescoring factor (--rescore-factors) and tier multiples "
                f"(--tier-k) that include 1 (the tier of the 1-bit code's own k), got {self.tier_k!r}"
            )
        if not self.damping_ratio > 0:
            raise ConfigError(f"FidelityConfig.damping_ratio must be positive, got {self.damping_ratio}")


@dataclass(frozen=True)
class LDSConfig:
    """Retraining evaluation (Appendix D.1), sized for 2 CPU cores.

    base: the pretrained model each retraining starts from. num_subsets: ``R`` half-subsets
    (the paper uses 100; 24 keeps the default run in minutes). recipe: the fine-tuning recipe
    (the one the attributed model was made with). counterfactual: remove each of
    ``cf_methods`` at ``cf_budget`` bytes (plus uncompressed EK-FAC, plus random documents)
    top-``N`` documents for ``N`` in ``cf_removals``, ranked on the first ``cf_queries``
    queries, and retrain with each of ``cf_seeds``.
    """

    base: str = _shipped("base", "The pretrained model every retraining starts from.")
    num_subsets: int = field(
        default=24, metadata={"help": "LDS subsets R (a random half of the documents each).", "min": 2}
    )
    fraction: float = 0.5
    seed: int = 0
    recipe: FinetuneRecipe = FinetuneRecipe()
    n_bootstrap: int = field(
        default=1000, metadata={"help": "Bootstrap resamples of the LDS confidence interval.", "min": 0}
    )
    counterfactual: bool = field(
        default=True, metadata={"help": "Also retrain without each method's top-ranked documents."}
    )
    cf_budget: int = field(
        default=256,
        metadata={"help": "Budget (bytes per example) of the compressed methods in the counterfactual.", "min": 1},
    )
    cf_methods: Tuple[str, ...] = ("eogp", "logra-pca", "grass")
    cf_removals: Tuple[int, ...] = field(
        default=(32, 64), metadata={"help": "Documents removed, comma-separated.", "min": 1}
    )
    cf_seeds: Tuple[int, ...] = field(default=(0, 1), metadata={"help": "Retraining seeds, comma-separated."})
    cf_queries: int = field(default=16, metadata={"help": "Rank and measure on the first N queries.", "min": 1})

    def __post_init__(self) -> None:
        _check_ranges(self)
        if not 0 < self.fraction < 1:
            raise ConfigError(f"LDSConfig.fraction must lie in (0, 1), got {self.fraction}")
        check_methods(self.cf_methods, "LDSConfig.cf_methods")
        if self.counterfactual and not (self.cf_removals and self.cf_seeds):
            raise ConfigError(
                "LDSConfig: the counterfactual needs at least one removal count and one seed "
                "(--cf-removals, --cf-seeds), or counterfactual=False (--no-counterfactual)"
            )


@dataclass(frozen=True)
class EnsembleConfig:
    """Checkpoints ensembled with the attributed model (``eogp eval lds --checkpoints``).

    checkpoints: model directories besides ``DataConfig.model`` (which is checkpoint 0), each
    scored as the model is: its own EK-FAC and PCA, fitted on the same documents. They share the
    model's architecture and tokenizer. checkpoint_weights: ``"uniform"`` (``1/C`` each: the
    mean, as TRAK takes it) or a JSON file, one weight per checkpoint with the model first (a
    list, ``{"weights": [...]}``, or a Hugging Face ``trainer_state.json``: the learning rate at
    each checkpoint's step), as ``eogp fit`` reads them.
    """

    checkpoints: Tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "Another checkpoint to ensemble with --model (repeatable): LDS of each alone and of "
            "their weighted sum, for the EOGP methods."
        },
    )
    checkpoint_weights: str = field(
        default="uniform",
        metadata={
            "help": 'uniform (the mean) or a JSON file: a list or {"weights": [...]}, --model first, or a '
            "trainer_state.json (each checkpoint's learning rate at its step)."
        },
    )

    def __post_init__(self) -> None:
        if not self.checkpoint_weights:
            raise ConfigError("EnsembleConfig.checkpoint_weights: give uniform or a JSON file of weights")
