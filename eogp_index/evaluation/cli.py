"""``eogp eval``: measure how much attribution quality each byte of storage buys.

A click group with three commands -- ``fidelity`` (agreement with uncompressed EK-FAC),
``lds`` (retraining ground truth) and ``all`` (both from one scoring pass) -- over
:mod:`eogp_index.evaluation.run`. Every command writes ``results.json``, ``results.md``,
PNG plots and ``details.json`` under ``--out``; ``--json`` also prints the numbers.
Paths default to the shipped tiny model and corpus (``examples/default``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Tuple

import click

from eogp_index.cli_options import field_option, option_group
from eogp_index.cliutil import fail_cleanly as _fail_cleanly
from eogp_index.errors import EOGPError
from eogp_index.evaluation.config import DataConfig, EnsembleConfig, FidelityConfig, FinetuneRecipe, LDSConfig

__all__ = ["eval_group"]

#: Plotting and statistics are an optional extra; checked before a run, so that a missing one
#: is a one-line message rather than a traceback halfway through.
_EXTRA_MODULES = ("matplotlib", "scipy")


_data_options = option_group(
    option_group(
        field_option(DataConfig, "model"),
        field_option(DataConfig, "train", multiple=True),
        field_option(DataConfig, "queries", multiple=True),
        field_option(DataConfig, "pca_data", multiple=True),
        *(field_option(DataConfig, name) for name in ("pca_sample", "limit_train", "limit_queries", "max_tokens")),
        into="data",
    ),
    click.option(
        "--out",
        "out",
        required=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Directory for results.json, results.md, the PNGs and the caches.",
    ),
    option_group(
        *(
            field_option(FidelityConfig, name)
            for name in (
                "budgets",
                "methods",
                "m",
                "batch_size",
                "seed",
                "rescore_factors",
                "rescore",
                "tier_k",
                "tier_k_max",
            )
        ),
        into="fidelity",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print all numbers as JSON."),
    click.option("--quiet", is_flag=True, help="No progress messages."),
)

_lds_options = option_group(
    field_option(LDSConfig, "base"),
    field_option(LDSConfig, "num_subsets", "--subsets"),
    field_option(LDSConfig, "n_bootstrap", "--bootstrap"),
    field_option(LDSConfig, "counterfactual"),
    *(field_option(LDSConfig, name) for name in ("cf_budget", "cf_removals", "cf_seeds", "cf_queries")),
    into="lds",
)
_ensemble_options = option_group(
    field_option(EnsembleConfig, "checkpoints", multiple=True),
    field_option(EnsembleConfig, "checkpoint_weights"),
    into="ensemble",
)
_recipe_options = option_group(
    field_option(FinetuneRecipe, "epochs"), field_option(FinetuneRecipe, "lr"), into="recipe"
)


def _configs(data: dict, fidelity: dict) -> Tuple[DataConfig, FidelityConfig]:
    missing = [name for name in _EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise EOGPError(f"eogp eval needs {' and '.join(missing)}: pip install 'eogp-index[eval]'")
    return DataConfig(**data), FidelityConfig(**fidelity)


def _lds_config(lds: dict, recipe: dict, cfg: FidelityConfig) -> LDSConfig:
    """The LDS settings; the counterfactual ranks only methods this run compares."""
    default_cf = LDSConfig.__dataclass_fields__["cf_methods"].default
    return LDSConfig(
        **lds,
        seed=cfg.seed,
        recipe=FinetuneRecipe(**recipe),
        cf_methods=tuple(m for m in default_cf if m in cfg.methods),
    )


def _finish(result, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, default=str))
        return
    click.echo(result.paths["markdown"].read_text(encoding="utf-8").split("\n## Setup", 1)[0].rstrip())
    click.echo("")
    for name, path in result.paths.items():
        click.echo(f"{name}: {path}")


def _logger(quiet: bool):
    return None if quiet else (lambda msg: click.echo(msg, err=True))


@click.group(name="eval")
def eval_group() -> None:
    """Measure attribution quality against storage: fidelity to EK-FAC, LDS, baselines, plots.

    Every method (EOGP, its FP16/SRHT variants, the EK-FAC top-k ablation, LoGra, GraSS,
    a Gaussian projection) is scored from one shared gradient pass at matched per-example
    budgets, against uncompressed EK-FAC from kronfluence on the same factors.

    \b
    Example:
        eogp eval fidelity --out runs/eval
        eogp eval all --out runs/eval --subsets 24
    """


@eval_group.command()
@_data_options
@_fail_cleanly
def fidelity(data, out, fidelity, as_json, quiet):
    """Agreement with uncompressed EK-FAC: NDCG@20 and Spearman per method and budget.

    Also the median Pearson correlation between 1-bit and FP16 scores at the same k
    (Table 2 of the paper), and for the 1-bit PCA methods the rescoring tier: each tier code
    (int8, int4, FP16) alone, the 1-bit top F x 20 rows of each side rescored by it for each
    --rescore-factors, the recall of the tier's top 20, and tiers of --tier-k times the 1-bit k.
    Writes results.json, results.md, ndcg_at_20.png, spearman.png, pearson_1bit_fp16.png,
    rescoring.png, tier_k.png and details.json under --out.

    \b
    Example:
        eogp eval fidelity --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval --budgets 64,256,1024,4096 --limit-queries 16
    """
    from eogp_index.evaluation.run import run_fidelity

    data, cfg = _configs(data, fidelity)
    _finish(run_fidelity(data, cfg, out, log=_logger(quiet)), as_json)


@eval_group.command()
@_data_options
@_lds_options
@_ensemble_options
@_recipe_options
@_fail_cleanly
def lds(data, out, fidelity, as_json, quiet, lds, ensemble, recipe):
    """Linear datamodeling score against retraining, and counterfactual removal.

    Retrains --base on --subsets random halves of the training documents (cached in
    --out/retraining.npz, so reruns and larger --subsets reuse what was trained) and
    correlates each method's predicted subset scores with the measured query losses.

    With --checkpoints, each other checkpoint is scored as --model is (its own EK-FAC and
    PCA on the same documents, cached in --out/checkpoints/<c>/), and the EOGP methods and
    uncompressed EK-FAC report the LDS of each checkpoint alone and of the weighted sum of
    their scores (--checkpoint-weights), against the same retraining of --base.

    \b
    Example:
        eogp eval lds --base examples/default/base --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval --subsets 24
        eogp eval lds --methods eogp --budgets 64,256 --no-counterfactual \\
            --checkpoints examples/default/base --out runs/eval-ensemble
    """
    from eogp_index.evaluation.run import run_lds

    data, cfg = _configs(data, fidelity)
    lds_cfg = _lds_config(lds, recipe, cfg)
    ens = EnsembleConfig(**ensemble)
    _finish(run_lds(data, cfg, lds_cfg, out, ensemble=ens, log=_logger(quiet)), as_json)


@eval_group.command(name="all")
@_data_options
@_lds_options
@_ensemble_options
@_recipe_options
@_fail_cleanly
def all_(data, out, fidelity, as_json, quiet, lds, ensemble, recipe):
    """Fidelity, LDS and counterfactual removal from one scoring pass, in one report.

    \b
    Example:
        eogp eval all --base examples/default/base --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval
    """
    from eogp_index.evaluation.run import run_all

    data, cfg = _configs(data, fidelity)
    lds_cfg = _lds_config(lds, recipe, cfg)
    _finish(run_all(data, cfg, lds_cfg, out, ensemble=EnsembleConfig(**ensemble), log=_logger(quiet)), as_json)
