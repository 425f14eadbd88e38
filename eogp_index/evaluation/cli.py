"""``eogp eval``: measure how much attribution quality each byte of storage buys.

A click group with three commands -- ``fidelity`` (agreement with uncompressed EK-FAC),
``lds`` (retraining ground truth) and ``all`` (both from one scoring pass) -- over
:mod:`eogp_index.evaluation.run`. Every command writes ``results.json``, ``results.md``,
PNG plots and ``details.json`` under ``--out``; ``--json`` also prints the numbers.
Paths default to the shipped tiny model and corpus (``examples/default``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import click

from eogp_index.cliutil import fail_cleanly as _fail_cleanly

__all__ = ["eval_group"]


def _ints(value: Optional[str], what: str) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    try:
        items = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError as exc:
        raise click.BadParameter(f"{what} must be comma-separated integers, got {value!r}") from exc
    if not items:
        raise click.BadParameter(f"{what} is empty")
    return items


def _names(value: Optional[str]) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    return tuple(v for v in value.replace(" ", "").split(",") if v)


def _default_root() -> Path:
    """``examples/default`` (as :func:`tinylm.default_root`, without importing torch at startup)."""
    here = Path(__file__).resolve().parents[2] / "examples" / "default"
    return here if here.is_dir() else Path.cwd() / "examples" / "default"


def _data_options(func: Callable) -> Callable:
    root = _default_root()
    options = [
        click.option("--model", default=str(root / "model"), show_default=True,
                     help="The attributed (fine-tuned) model directory."),
        click.option("--train", "train", multiple=True, default=(str(root / "corpus" / "train.jsonl.gz"),),
                     show_default=True, help="Training-document shards or globs (repeatable)."),
        click.option("--queries", "queries", multiple=True, default=(str(root / "queries.jsonl"),),
                     show_default=True, help="Query-document shards or globs (repeatable)."),
        click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
                     help="Directory for results.json, results.md, the PNGs and the caches."),
        click.option("--budgets", default=None,
                     help="Bytes per example, comma-separated (default 64,128,256,512,1024,2048,4096)."),
        click.option("--methods", default=None,
                     help="Methods, comma-separated (default: eogp,eogp-fp16,eogp-r,ekfac-topk,logra-random,"
                          "logra-pca,grass,gaussian; also logra-random-1bit,logra-pca-1bit,grass-1bit)."),
        click.option("--pca-data", "pca_data", multiple=True,
                     help="Fit EOGP's PCA on these shards instead of the training documents (repeatable)."),
        click.option("--limit-train", type=int, default=None, help="Use only the first N training documents."),
        click.option("--limit-queries", type=int, default=None, help="Use only the first N queries."),
        click.option("--max-tokens", type=int, default=128, show_default=True, help="Truncate documents."),
        click.option("--batch-size", type=int, default=8, show_default=True, help="Documents per gradient batch."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--json", "as_json", is_flag=True, help="Print all numbers as JSON."),
        click.option("--quiet", is_flag=True, help="No progress messages."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _lds_options(func: Callable) -> Callable:
    options = [
        click.option("--base", default=str(_default_root() / "base"), show_default=True,
                     help="The pretrained model every retraining starts from."),
        click.option("--subsets", type=int, default=24, show_default=True,
                     help="LDS subsets R (half of the documents each)."),
        click.option("--epochs", type=int, default=None, help="Fine-tuning epochs (default: the recipe's 3)."),
        click.option("--lr", type=float, default=None, help="Fine-tuning learning rate (default: the recipe's)."),
        click.option("--bootstrap", type=int, default=1000, show_default=True,
                     help="Bootstrap resamples of the LDS CI."),
        click.option("--counterfactual/--no-counterfactual", default=True, show_default=True,
                     help="Also retrain without each method's top-ranked documents."),
        click.option("--cf-budget", type=int, default=256, show_default=True,
                     help="Budget (bytes per example) of the compressed methods in the counterfactual."),
        click.option("--cf-removals", default="32,64", show_default=True,
                     help="Documents removed, comma-separated."),
        click.option("--cf-seeds", default="0,1", show_default=True, help="Retraining seeds, comma-separated."),
        click.option("--cf-queries", type=int, default=16, show_default=True,
                     help="Rank and measure on the first N queries."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _configs(model, train, queries, budgets, methods, pca_data, limit_train, limit_queries, max_tokens, batch_size,
             seed):
    from eogp_index.evaluation.run import DataConfig, FidelityConfig

    data = DataConfig(model=model, train=tuple(train), queries=tuple(queries), max_tokens=max_tokens,
                      limit_train=limit_train, limit_queries=limit_queries, pca_data=tuple(pca_data) or None)
    kwargs = dict(batch_size=batch_size, seed=seed)
    if budgets is not None:
        kwargs["budgets"] = _ints(budgets, "--budgets")
    if methods is not None:
        kwargs["methods"] = _names(methods)
    return data, FidelityConfig(**kwargs)


def _lds_config(base, subsets, epochs, lr, bootstrap, counterfactual, cf_budget, cf_removals, cf_seeds, cf_queries,
                seed, methods: Optional[Sequence[str]]):
    import dataclasses

    from eogp_index.evaluation.run import LDSConfig
    from eogp_index.evaluation.tinylm import FinetuneRecipe

    recipe = FinetuneRecipe()
    if epochs is not None:
        recipe = dataclasses.replace(recipe, epochs=epochs)
    if lr is not None:
        recipe = dataclasses.replace(recipe, lr=lr)
    default_cf = LDSConfig.__dataclass_fields__["cf_methods"].default
    cf_methods = tuple(m for m in default_cf if methods is None or m in methods)
    return LDSConfig(base=base, num_subsets=subsets, seed=seed, recipe=recipe, n_bootstrap=bootstrap,
                     counterfactual=counterfactual, cf_budget=cf_budget, cf_methods=cf_methods,
                     cf_removals=_ints(cf_removals, "--cf-removals"), cf_seeds=_ints(cf_seeds, "--cf-seeds"),
                     cf_queries=cf_queries)


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
def fidelity(model, train, queries, out, budgets, methods, pca_data, limit_train, limit_queries, max_tokens,
             batch_size, seed, as_json, quiet):
    """Agreement with uncompressed EK-FAC: NDCG@20 and Spearman per method and budget.

    Also the median Pearson correlation between 1-bit and FP16 scores at the same k
    (Table 2 of the paper). Writes results.json, results.md, ndcg_at_20.png, spearman.png,
    pearson_1bit_fp16.png and details.json under --out.

    \b
    Example:
        eogp eval fidelity --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval --budgets 64,256,1024,4096 --limit-queries 16
    """
    from eogp_index.evaluation.run import run_fidelity

    data, cfg = _configs(model, train, queries, budgets, methods, pca_data, limit_train, limit_queries, max_tokens,
                         batch_size, seed)
    _finish(run_fidelity(data, cfg, out, log=_logger(quiet)), as_json)


@eval_group.command()
@_data_options
@_lds_options
@_fail_cleanly
def lds(model, train, queries, out, budgets, methods, pca_data, limit_train, limit_queries, max_tokens, batch_size,
        seed, as_json, quiet, base, subsets, epochs, lr, bootstrap, counterfactual, cf_budget, cf_removals, cf_seeds,
        cf_queries):
    """Linear datamodeling score against retraining, and counterfactual removal.

    Retrains --base on --subsets random halves of the training documents (cached in
    --out/retraining.npz, so reruns and larger --subsets reuse what was trained) and
    correlates each method's predicted subset scores with the measured query losses.

    \b
    Example:
        eogp eval lds --base examples/default/base --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval --subsets 24
    """
    from eogp_index.evaluation.run import run_lds

    data, cfg = _configs(model, train, queries, budgets, methods, pca_data, limit_train, limit_queries, max_tokens,
                         batch_size, seed)
    lds_cfg = _lds_config(base, subsets, epochs, lr, bootstrap, counterfactual, cf_budget, cf_removals, cf_seeds,
                          cf_queries, seed, cfg.methods)
    _finish(run_lds(data, cfg, lds_cfg, out, log=_logger(quiet)), as_json)


@eval_group.command(name="all")
@_data_options
@_lds_options
@_fail_cleanly
def all_(model, train, queries, out, budgets, methods, pca_data, limit_train, limit_queries, max_tokens, batch_size,
         seed, as_json, quiet, base, subsets, epochs, lr, bootstrap, counterfactual, cf_budget, cf_removals, cf_seeds,
         cf_queries):
    """Fidelity, LDS and counterfactual removal from one scoring pass, in one report.

    \b
    Example:
        eogp eval all --base examples/default/base --model examples/default/model \\
            --train examples/default/corpus/train.jsonl.gz --queries examples/default/queries.jsonl \\
            --out runs/eval
    """
    from eogp_index.evaluation.run import run_all

    data, cfg = _configs(model, train, queries, budgets, methods, pca_data, limit_train, limit_queries, max_tokens,
                         batch_size, seed)
    lds_cfg = _lds_config(base, subsets, epochs, lr, bootstrap, counterfactual, cf_budget, cf_removals, cf_seeds,
                          cf_queries, seed, cfg.methods)
    _finish(run_all(data, cfg, lds_cfg, out, log=_logger(quiet)), as_json)
