"""``eogp``: the command line, a thin layer over the library.

Every command prints human-readable output, or JSON with ``--json``; user errors exit non-zero
with a one-line message saying what to fix.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, List, Optional, Tuple

import click

from eogp_index.cli_options import field_option, option_group
from eogp_index.cliutil import distributed_option, process_group, torchrun_rank, under_torchrun, worker_device
from eogp_index.cliutil import emit as _emit
from eogp_index.cliutil import fail_cleanly as _fail_cleanly
from eogp_index.config import (
    MAX_BLOCK_DOCUMENTS,
    CurvatureConfig,
    GradientConfig,
    IngestConfig,
    ProjectionConfig,
    SelectOptions,
    StorageConfig,
    TableRecallConfig,
)
from eogp_index.data.records import RecordSpec
from eogp_index.errors import EOGPError
from eogp_index.evaluation.cli import eval_group
from eogp_index.search.question import Question
from eogp_index.serve.config import ServeConfig
from eogp_index.store.sources import DEFAULT_TEXT_BYTES


class Location(click.ParamType):
    """A local path or an object-store URL (``s3://``, ``gs://``, ``az://``, ``file://``;
    :mod:`eogp_index.data.location`): a URL no layer reads is refused here, before anything runs
    or is created. A local path is checked as ``click.Path(**local)`` checks it."""

    name = "path or URL"

    def __init__(self, **local):
        self.local = click.Path(path_type=Path, **local)

    def convert(self, value, param, ctx):
        from eogp_index.data.location import index_path, is_remote
        from eogp_index.errors import ConfigError

        try:
            found = index_path(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return found if is_remote(found) else self.local.convert(str(found), param, ctx)


INDEX_DIR = Location(exists=True, file_okay=False)

#: Which record fields hold what (``fit`` and ``ingest``); the command gets them as ``record``.
_record_options = option_group(
    *(
        field_option(RecordSpec, name)
        for name in (
            "text_field",
            "messages_field",
            "input_ids_field",
            "labels_field",
            "prompt_field",
            "completion_field",
            "id_field",
        )
    ),
    field_option(RecordSpec, "metadata_fields", "--metadata", multiple=True),
    into="record",
)
#: The projection's options (``fit`` and ``plan``); the command gets them as ``projection``.
_projection_options = option_group(
    field_option(ProjectionConfig, "variant"),
    field_option(ProjectionConfig, "k", "-k", "--k", help="Output coordinates per module (256 unless --budget-kb)."),
    field_option(ProjectionConfig, "budget_kb"),
    field_option(ProjectionConfig, "m", "--m"),
    field_option(ProjectionConfig, "num_fit_examples", "--pca-examples"),
    field_option(ProjectionConfig, "held_out_fraction"),
    field_option(ProjectionConfig, "pca_dtype"),
    into="projection",
)
#: How much of the PCA matrices may stay in memory (``ingest``, ``query``, ``explain``, ``serve``).
_projection_memory_option = field_option(GradientConfig, "projection_memory_gb")
#: The model's precision (every command that loads it).
_dtype_option = field_option(GradientConfig, "dtype")
#: The memory budget and the batch's tokens (``fit``, ``ingest``, ``plan``).
_budget_options = (
    field_option(GradientConfig, "memory_budget_gb", "--memory-budget"),
    field_option(GradientConfig, "batch_tokens"),
)
#: The options of a question (``query``): one per field of :class:`Question`, with its help and default.
_question_options = option_group(
    field_option(Question, "k", "-k", "--k"),
    *(
        field_option(Question, name)
        for name in (
            "where",
            "direction",
            "candidates",
            "route",
            "first_pass",
            "rescore",
            "by_module",
            "aggregate",
            "normalize",
            "checkpoint_weights",
            "allow_partial",
        )
    ),
    field_option(Question, "group_by", metavar="COLUMN"),
    into="question",
)
#: The options of a target set's question (``select``, ``scores``): its filter and normalization.
_target_question_options = option_group(
    *(field_option(Question, name) for name in ("where", "normalize", "checkpoint_weights")), into="question"
)
_model_option = click.option(
    "--model",
    "model_name",
    default=None,
    help="Load the model from here instead of the path or name in the manifest (it must be the same model).",
)


@click.group()
@click.version_option(package_name="eogp-index")
def cli() -> None:
    """eogp-index: which training documents made the model do this?

    Build an index once (fit), store the corpus (ingest), then ask (query).

    \b
    Example:
        eogp fit examples/default/model --data 'examples/default/corpus/train.jsonl.gz' --out my-index --k 256
        eogp ingest my-index 'examples/default/corpus/train.jsonl.gz' --metadata module --metadata kind
        eogp query my-index --text "Return the sum of a and b." -k 5
    """


@cli.command()
@click.argument("models", metavar="MODEL [CHECKPOINT ...]", nargs=-1, required=True)
@click.option(
    "--checkpoint-weights",
    "checkpoint_weights",
    default="uniform",
    show_default=True,
    help="With several checkpoints: each one's weight in the score. uniform: 1/C each (the mean); or a JSON "
    'file: {"weights": [...]} or a list, one per checkpoint, or a trainer_state.json (each checkpoint weighted '
    "by the learning rate logged at its step, normalized to sum to 1; docs/ensembles.md).",
)
@click.option(
    "--adapter",
    "adapter",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="A LoRA adapter directory (saved by peft) to load onto MODEL; its LoRA matrices are attributed "
    "unless --module names base layers.",
)
@click.option(
    "--data",
    "data",
    multiple=True,
    help="Shard files or globs (JSONL[.gz/.zst], Parquet, datasets.save_to_disk dirs), or a dataset "
    "(owner/name, hf://datasets/owner/name, a local dataset directory; with --split) to fit on.",
)
@click.option(
    "--fit-data",
    "fit_data",
    multiple=True,
    help="Fit on these shards instead of --data: fitting data kept apart from what you ingest (e.g. a held-out split).",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=Location(file_okay=False),
    help="Index directory or object-store URL (s3://bucket/prefix) to create (or the interrupted fit to resume).",
)
@click.option("--split", default=None, help="The split to read of a dataset in --data / --fit-data (train, …).")
@click.option("--config", "dataset_config", default=None, help="The config of a dataset with several.")
@_projection_options
@option_group(
    field_option(StorageConfig, "precision"),
    field_option(StorageConfig, "rescore"),
    field_option(StorageConfig, "rescore_k"),
    into="storage",
)
@option_group(
    field_option(CurvatureConfig, "num_examples", "--curvature-examples"),
    field_option(CurvatureConfig, "damping_ratio"),
    into="curvature",
)
@click.option("--module", "modules", multiple=True, help="Module name or glob to attribute (repeatable).")
@option_group(
    *(
        field_option(GradientConfig, name)
        for name in ("max_tokens", "batch_size", "device", "dtype", "experts", "gradient_checkpointing")
    ),
    *_budget_options,
    into="gradients",
)
@field_option(ProjectionConfig, "seed", help="Seed of the fitting samples, the sampled labels and the SRHT.")
@click.option(
    "--table-uri", default=None, help="LanceDB URI for the table (e.g. s3://bucket/prefix); default: inside --out."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing index, or an interrupted fit, at --out.")
@distributed_option
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_record_options
@_fail_cleanly
def fit(
    models,
    checkpoint_weights,
    adapter,
    data,
    fit_data,
    out,
    split,
    dataset_config,
    projection,
    storage,
    curvature,
    modules,
    gradients,
    seed,
    table_uri,
    overwrite,
    distributed,
    as_json,
    record,
):
    """Fit EK-FAC curvature and the projection; create an empty index.

    MODEL is a HuggingFace hub name, a local model directory, or a LoRA
    adapter directory saved by peft (its base is loaded from its
    adapter_config.json; --adapter puts one on another base). Several
    checkpoints of one training run make an ensemble (docs/ensembles.md):
    each is fitted (its own curvature and projection) on the same fitting
    documents, every row stores each one's code, and a score is the
    weighted sum of theirs (--checkpoint-weights). They must share the
    architecture and tokenizer; anything else is refused. The fitting
    examples are a seeded random sample of all the records of --data (or
    --fit-data), read in one pass: --curvature-examples fit the EK-FAC factors
    and --pca-examples others fit the PCA. When there are too few for two
    disjoint sets, the sets overlap and a warning says so.

    The PCA pass caches each module's coordinates on disk (OUT/fit/, float16)
    and fits the modules one at a time, so memory does not grow with the
    number of modules. A fit that stopped (killed, out of time) resumes when
    the same command is run again: finished stages are reused and reported;
    --overwrite starts over. Under torchrun the PCA pass and the modules' PCA
    are split over the workers (curvature too on CUDA; elsewhere rank 0 fits it).

    \b
    Example:
        eogp fit examples/default/model --data examples/default/corpus/train.jsonl.gz --out my-index -k 256
        eogp fit examples/default/base examples/default/model --data examples/default/corpus/train.jsonl.gz --out ens
        torchrun --nproc_per_node 8 -m eogp_index.cli fit gpt2 --fit-data 'heldout/*.jsonl' --out wiki-index
    """
    import logging

    from eogp_index.client import AttributionIndex
    from eogp_index.data.readers import expand_shards
    from eogp_index.fit.fitting import checkpoint_weights_from
    from eogp_index.fit.sampling import sample_shards
    from eogp_index.gradients.model import load_model, model_and_adapter
    from eogp_index.store.stored_index import check_index_dir

    if bool(data) == bool(fit_data):
        raise click.UsageError("give the shards to fit on with --data, or with --fit-data (not both)")
    data, fit_data = (_dataset_splits(p, split, dataset_config) for p in (data, fit_data))
    if projection["k"] is None and projection["budget_kb"] is None:
        projection["k"] = 256
    sharded = under_torchrun(distributed)
    if sharded:
        gradients["device"] = worker_device(gradients["device"])
    gradients = GradientConfig(**gradients)
    projection = ProjectionConfig(**projection, seed=seed)
    storage = StorageConfig(**storage)
    if projection.k is not None:  # said before the model loads (a budget's k is checked once modules are known)
        storage.check_rescore_k(projection.k)
    curvature = CurvatureConfig(**curvature, batch_size=gradients.batch_size, seed=seed)
    spec = RecordSpec(**record, max_tokens=gradients.max_tokens)
    handler = logging.StreamHandler(sys.stderr)  # resume and per-rank messages
    handler.setFormatter(logging.Formatter(f"[rank {torchrun_rank()}] %(message)s" if sharded else "%(message)s"))
    fit_log = logging.getLogger("eogp_index.fit")
    fit_log.addHandler(handler)
    fit_log.setLevel(logging.INFO)
    try:
        # Said before the model loads: a missing shard, a stray file, an index already at --out.
        expand_shards(list(fit_data or data))
        check_index_dir(out, "overwrite" if overwrite else "create")
        weights = checkpoint_weights_from(checkpoint_weights, list(models))
        with _fit_process_group(gradients.resolved_device()) if sharded else contextlib.nullcontext():
            model, adapter = model_and_adapter(models[0], adapter)
            loaded, tokenizer = load_model(
                model, adapter=adapter, device=gradients.resolved_device(), dtype=gradients.dtype
            )
            others = _load_checkpoints(models[1:], tokenizer, model, gradients)
            wanted = curvature.num_examples + (projection.num_fit_examples if projection.second_stage == "pca" else 0)
            examples, seen = sample_shards(list(fit_data or data), spec, tokenizer, wanted, seed)
            if torchrun_rank() == 0:
                click.echo(f"fitting on {len(examples)} documents sampled from {seen} records", err=True)
            index = AttributionIndex.create(
                out,
                loaded,
                tokenizer,
                examples,
                model_name=model,
                adapter=adapter,
                modules=list(modules) or None,
                curvature=curvature,
                projection=projection,
                storage=storage,
                gradients=gradients,
                table_uri=table_uri,
                mode="overwrite" if overwrite else "create",
                checkpoints=others,
                checkpoint_weights=weights if others else None,
            )
    except EOGPError:
        if torchrun_rank() != 0:  # every worker fails alike: rank 0 alone says why
            raise click.exceptions.Exit(1)
        raise
    finally:
        fit_log.removeHandler(handler)
    if torchrun_rank() == 0:
        _emit(index.info(), as_json, _print_info)


def _load_checkpoints(names, tokenizer, first: str, gradients) -> list:
    """An ensemble's further checkpoints as ``(name, model)``, each tokenizer checked against the first's."""
    from eogp_index.fit.fitting import check_tokenizer
    from eogp_index.gradients.model import load_model

    others = []
    for name in names:
        other, other_tokenizer = load_model(name, device=gradients.resolved_device(), dtype=gradients.dtype)
        check_tokenizer(tokenizer, other_tokenizer, first_name=first, name=name)
        others.append((name, other))
    return others


@contextlib.contextmanager
def _fit_process_group(device: str):
    """The torchrun job's process group for ``eogp fit``: NCCL on CUDA (kronfluence then splits
    the curvature itself), else Gloo; a long timeout, since the other ranks wait while rank 0
    fits the curvature."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=24))
    try:
        yield
    finally:
        dist.destroy_process_group()


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.argument("shards", nargs=-1, required=True)
@click.option(
    "--on-error",
    type=click.Choice(["raise", "skip"]),
    default="raise",
    show_default=True,
    help="raise: stop at the first bad record; skip: list bad records in a rejects file.",
)
@click.option(
    "--rejects",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write rejected records (default: INDEX/rejects/<time>.jsonl).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Examples per batch, one commit each (under torchrun: per worker and step).",
)
@_model_option
@field_option(GradientConfig, "device")
@_dtype_option
@field_option(GradientConfig, "gradient_checkpointing")
@_projection_memory_option
@field_option(IngestConfig, "block_documents")
@option_group(*_budget_options, into="budget")
@click.option(
    "--shard-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Name shards by their path relative to this directory (needed when file names repeat); "
    "keep it the same across runs.",
)
@click.option(
    "--store-text",
    "store_text",
    is_flag=True,
    help="Keep each document's text (a chat or ids as JSON) in the table, so results show it and "
    "`eogp explain` needs no shard; costs about the documents' own size per row.",
)
@click.option(
    "--store-text-max-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_TEXT_BYTES,
    show_default=True,
    help="With --store-text: longer documents are not stored (explained from their shard instead).",
)
@field_option(RecordSpec, "long_documents")
@click.option("--split", default=None, help="The split to read of a dataset among SHARDS (train, …).")
@click.option("--config", "dataset_config", default=None, help="The config of a dataset with several.")
@distributed_option
@click.option(
    "--commit-every",
    type=click.IntRange(min=1),
    default=None,
    help="Under torchrun: steps between commits (default 1); a crash loses at most this many steps.",
)
@field_option(IngestConfig, "allow_deleted")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_record_options
@_fail_cleanly
def ingest(
    index_dir,
    shards,
    on_error,
    rejects,
    batch_size,
    model_name,
    device,
    dtype,
    gradient_checkpointing,
    projection_memory_gb,
    block_documents,
    budget,
    shard_root,
    store_text,
    store_text_max_bytes,
    long_documents,
    split,
    dataset_config,
    distributed,
    commit_every,
    allow_deleted,
    as_json,
    record,
):
    """Store corpus shards in an index. Safe to rerun: stored examples are skipped.

    Under torchrun (several workers, or --distributed) the shards are dealt out to the
    workers, each projects its share and rank 0 commits their rows together.

    \b
    Example:
        eogp ingest my-index 'data/shard-*.jsonl.zst' --metadata source --on-error skip --store-text
        torchrun --nproc_per_node 8 -m eogp_index.cli ingest my-index 'data/*.parquet' --commit-every 4
    """
    spec = RecordSpec(**record, long_documents=long_documents)  # max_tokens: the index's
    shards = _dataset_splits(shards, split, dataset_config)
    gradients = GradientConfig(
        batch_size=batch_size or GradientConfig().batch_size,
        device=device,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        projection_memory_gb=projection_memory_gb,
        **budget,
    )
    sharded = under_torchrun(distributed)
    if commit_every is not None and not sharded:
        raise click.UsageError("--commit-every applies to torchrun workers; run under torchrun or drop it")
    config = IngestConfig(
        spec=spec,
        on_error=on_error,
        rejects_path=rejects,
        batch_size=batch_size,
        block_documents=block_documents,
        progress=not as_json,
        shard_root=shard_root,
        store_text=store_text_max_bytes if store_text else None,
        commit_every=commit_every or 1,
        allow_deleted=allow_deleted,
    )
    from eogp_index.store.stored_index import StoredIndex
    from ingest.pipeline import check_before_loading

    def check() -> None:  # what needs no model, said before it loads
        check_before_loading(
            StoredIndex.open(index_dir),
            list(shards),
            spec,
            shard_root=shard_root,
            store_text=config.store_text,
            distributed=sharded,
        )

    if sharded:
        from ingest.distributed import run_distributed_ingest

        try:
            check()
            summary = run_distributed_ingest(
                index_dir, list(shards), config, gradients=gradients, model_path=model_name
            )
        except EOGPError:
            if torchrun_rank() != 0:  # every worker fails alike: rank 0 alone says why
                raise click.exceptions.Exit(1)
            raise
    else:
        from eogp_index.client import AttributionIndex
        from ingest.pipeline import run_ingest

        check()
        index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
        if not as_json:
            click.echo(_sizing_line(index.sizing), err=True)
        summary = run_ingest(index, list(shards), config)
    if torchrun_rank() == 0:
        _emit(summary.to_json(), as_json, lambda s: click.echo("\n".join(f"{k:>18}: {v}" for k, v in s.items())))


def _sizing_line(sizing) -> str:
    """What AttributionIndex.open chose for the memory budget, in one line."""
    return (
        f"memory budget {sizing['budget'] / 1e9:.3g} GB ({sizing['budget_from']}): batches of "
        f"{sizing['documents']} documents of up to {sizing['document_tokens']} tokens (from {sizing['from']}), "
        f"P {'resident' if sizing['p_resident'] else 'read one module at a time'}; eogp plan INDEX prints the "
        "estimates"
    )


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--text", "texts", multiple=True, help="A query text (repeatable).")
@click.option(
    "--queries",
    "queries_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL file of queries: {text} / {messages} / {input_ids} / {prompt, completion} records, or "
    "preference queries {prompt, chosen, rejected}. A bad line is reported by its line number and "
    "the other queries are still answered (exit status 1).",
)
@click.option(
    "--limit-queries", type=click.IntRange(min=1), default=None, help="Use only the first N queries of --queries."
)
@_question_options
@click.option("--stream", is_flag=True, help="Shorthand for --route stream.")
@_model_option
@field_option(GradientConfig, "device")
@_dtype_option
@_projection_memory_option
@distributed_option
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@_fail_cleanly
def query(
    index_dir,
    texts,
    queries_file,
    limit_queries,
    question,
    stream,
    model_name,
    device,
    dtype,
    projection_memory_gb,
    distributed,
    as_json,
):
    """Show the stored examples that most influence each query.

    Positive scores: training on the example lowers the query's loss. Under torchrun
    (several workers, or --distributed) each worker scans a share of the table and
    rank 0 prints the merged, still exact, top k. A behaviour shown by several
    queries is one measurement with --aggregate; --group-by sums influence by a column.

    \b
    Example:
        eogp query my-index --text "Parse a CSV file." -k 5 --where "num_tokens > 50"
        eogp query my-index --queries behaviour.jsonl --aggregate mean --group-by source
        torchrun --nproc_per_node 4 -m eogp_index.cli query my-index --text "Parse a CSV file." --json
    """
    from eogp_index.client import AttributionIndex

    labels, queries = _queries(texts, queries_file, limit_queries)
    errors: List[str] = []
    sharded = under_torchrun(distributed)
    if stream:
        question["route"] = "stream" if question["route"] == "auto" else question["route"]
    if sharded and (question["candidates"] is not None or question["route"] not in ("auto", "sharded")):
        raise click.UsageError("--candidates and --route choose single-process routes; drop them under torchrun")
    if sharded:
        question["route"] = "sharded"
    asked = Question(**question)  # checked before the model loads
    with process_group():
        gradients = GradientConfig(
            device=worker_device(device) if sharded else device, dtype=dtype, projection_memory_gb=projection_memory_gb
        )
        index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
        if index.store.count() == 0 and torchrun_rank() == 0:
            click.echo(
                f"{index_dir} has no rows yet: nothing has been ingested. "
                f"Store documents first: eogp ingest {index_dir} SHARDS...",
                err=True,
            )
        asked.check(index.stored)  # a bad filter or column fails the command, before any query is projected
        queries, coordinates = _answerable(index, labels, queries, errors)
        tables = []
        if queries:
            # measured in one gradient pass for all the queries
            tables = index.search(asked.replace(queries=tuple(queries))).to_list(coordinates=coordinates)
    if torchrun_rank() == 0:
        shown = [{"aggregate": asked.aggregate, "queries": queries}] if asked.aggregate and queries else queries
        if asked.group_by:
            _emit(
                [{"query": q, "group_by": asked.group_by, "groups": t.to_pylist()} for q, t in zip(shown, tables)],
                as_json,
                _print_groups,
            )
        else:
            _emit([{"query": q, "results": t.to_pylist()} for q, t in zip(shown, tables)], as_json, _print_results)
        if errors:
            raise click.ClickException(
                f"{len(errors)} of {len(errors) + len(queries)} queries were not answered:\n" + "\n".join(errors)
            )
    elif errors:
        raise click.exceptions.Exit(1)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--text", "texts", multiple=True, help="The query text.")
@click.option(
    "--query-file",
    "--queries",
    "queries_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL file of queries ({text} / {messages} / {input_ids} / {prompt, completion}); the first one is "
    "explained.",
)
@click.option("--id", "ids", multiple=True, help="Stored example id to explain (repeatable: one batched pass).")
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=None,
    help="Explain the query's N most positive hits instead of naming --id.",
)
@click.option("--color/--no-color", default=None, help="Shade tokens with colour (default: when a terminal).")
@_model_option
@field_option(GradientConfig, "device")
@_dtype_option
@_projection_memory_option
@click.option("--json", "as_json", is_flag=True, help="Print the explanations as JSON.")
@_fail_cleanly
def explain(index_dir, texts, queries_file, ids, top, color, model_name, device, dtype, projection_memory_gb, as_json):
    """Explain why documents rank for a query: by module and by token.

    Recomputes each document's per-token gradient contributions (one forward and
    backward pass) and projects them with the index's projection: the document's
    tokens sum to its unquantized projected score, the query's tokens to the score as
    ranked. Tokens are shaded green (helps) or red (hurts); --no-color marks them
    ⟨token⟩+++ / ⟨token⟩--.

    \b
    Example:
        eogp explain my-index --text "Parse a CSV file." --top 3
        eogp explain my-index --text "Parse a CSV file." --id train-08123 --json
    """
    from eogp_index.client import AttributionIndex
    from eogp_index.search.render import explanation_terminal

    labels, queries = _queries(texts, queries_file, 1)
    if queries[0] is None:
        raise click.ClickException(labels[0])
    if bool(ids) == (top is not None):
        raise click.UsageError("give --id ID (repeatable) or --top N")
    index = AttributionIndex.open(
        index_dir,
        model_name=model_name,
        gradients=GradientConfig(device=device, dtype=dtype, projection_memory_gb=projection_memory_gb),
    )
    if top is not None:  # the query's most positive hits
        asked = Question(queries=(queries[0],), k=top, direction="positive")
        ids = tuple(index.top_influential(asked).column("id").to_pylist())
    explanations = index.explain_many(queries[0], list(ids))
    use_color = sys.stdout.isatty() if color is None else color
    _emit(
        [e.to_json() for e in explanations],
        as_json,
        lambda _: click.echo("\n\n".join(explanation_terminal(e, color=use_color) for e in explanations)),
    )


def _dataset_splits(patterns, split: Optional[str], config: Optional[str]) -> tuple:
    """``patterns`` with ``--split`` / ``--config`` attached to the datasets among them."""
    if split is None and config is None:
        return tuple(patterns)
    from eogp_index.data.readers import dataset_source, with_split

    if patterns and not any(dataset_source(p) is not None for p in patterns):
        raise click.UsageError(
            "--split and --config pick a split of a dataset (owner/name, hf://datasets/owner/name "
            "or a local dataset directory); none of the shards given is one"
        )
    return tuple(with_split(p, split, config) if dataset_source(p) is not None else p for p in patterns)


def _queries(texts, queries_file, limit: Optional[int]) -> Tuple[List[str], List[Any]]:
    """Queries from --text options and a --queries JSONL file, the first ``limit`` of them, and
    where each comes from (``--text 1``, ``queries.jsonl:3``). A line that is not a JSON object is
    a None query labelled ``location: reason`` (the good queries are still answered)."""
    labels = [f"--text {i + 1}" for i in range(len(texts))]
    queries: List[Any] = list(texts)
    if queries_file is not None:
        from eogp_index.data.readers import iter_raw_records
        from eogp_index.data.records import location_of

        for raw in iter_raw_records(queries_file):
            if limit is not None and len(queries) >= limit:
                break
            if isinstance(raw.record, dict):
                labels.append(location_of(raw.shard, raw.position))
                queries.append(raw.record)
            else:  # in file order among the queries: reported by _tokenized
                labels.append(f"{raw.record.location}: {raw.record.reason}")
                queries.append(None)
    labels, queries = labels[:limit], queries[:limit]
    if not queries:
        raise click.UsageError("give --text or --queries")
    return labels, queries


def _answerable(index, labels: List[str], queries: List[Any], errors: List[str]) -> Tuple[List[Any], Any]:
    """The queries that measure, and their coordinates ``(n, K)`` from one gradient pass
    (:meth:`AttributionIndex.measure`); each query that does not (or is not a JSON object: None) is
    added to ``errors`` as ``location: reason``, in order."""
    given = [query for query in queries if query is not None]
    measured = index.measure(given)
    good, position = [], 0
    for label, query in zip(labels, queries):
        if query is None:
            errors.append(label)
            continue
        if position in measured.errors:
            errors.append(f"{label}: {measured.errors[position].reason}")
        else:
            good.append(query)
        position += 1
    return good, measured.coordinates


_target_options = option_group(
    click.option("--text", "texts", multiple=True, help="A target query text (repeatable)."),
    click.option(
        "--queries",
        "queries_file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="JSONL file of target queries (as for `eogp query`).",
    ),
    _model_option,
    field_option(GradientConfig, "device"),
    _projection_memory_option,
)
_OUT_FILE = Location(dir_okay=False)
_ray_options = option_group(
    click.option(
        "--ray",
        "ray_address",
        is_flag=False,
        flag_value="",
        default=None,
        metavar="[ADDRESS]",
        help="Score on a Ray cluster: --ray alone starts a local Ray, --ray HOST:PORT joins the cluster "
        "`ray start --head` started (put it after INDEX). The file is the one one process writes.",
    ),
    click.option(
        "--shards",
        type=click.IntRange(min=1),
        default=None,
        help="With --ray: split the table's fragments into this many shards, one Ray task each "
        "(default: one per CPU of the cluster).",
    ),
)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@_target_options
@_target_question_options
@option_group(
    *(field_option(SelectOptions, name) for name in ("top", "score", "direction", "ids_only", "precision")),
    into="options",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=_OUT_FILE,
    help="The subset to write: .jsonl, .jsonl.gz or .parquet (written whole or not at all).",
)
@_ray_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_fail_cleanly
def select(
    index_dir,
    texts,
    queries_file,
    model_name,
    device,
    projection_memory_gb,
    question,
    options,
    out,
    ray_address,
    shards,
    as_json,
):
    """Write the documents most influential for a target set, with their scores.

    Every stored row (matching --where) is scored against the target queries
    (--score mean: the mean over them, exact in one scan; max: each document's
    best, LESS's rule); the top N, or top P% of the matching rows, are written
    with their original records and a "score" field, read back from their shards
    with the content hash checked (or from stored text), in corpus order. A JSONL
    shard's lines are copied byte for byte, "score" added last. --ids-only
    writes id and score only, best first. --normalize unit scores each
    document's code divided by its norm (cosine to the targets, as LESS
    selects), as `eogp query --normalize unit` does. --precision rescore
    scores every row exactly from the index's rescoring tier instead of the
    one-bit code. The table is streamed. --ray scores the table's fragments in
    shards on Ray tasks (docs/cluster.md), each keeping its best rows, merged
    into the selection one process makes.

    \b
    Example:
        eogp select my-index --queries target.jsonl --top 10% --out subset.jsonl.gz
        eogp select my-index --queries target.jsonl --top 1000 --precision rescore --out subset.jsonl
        eogp select my-index --queries target.jsonl --top 1000 --score max --normalize unit --out subset.parquet
        eogp select my-index --ray head:6379 --shards 16 --queries target.jsonl --top 1% --out subset.jsonl
    """
    from eogp_index.search.select import output_kind, select_documents, write_selection

    output_kind(out)  # a bad name fails before the model loads
    _check_shards(ray_address, shards)
    asked = Question(queries=tuple(_target_set(texts, queries_file)), **question)
    options = SelectOptions(**options)
    index = _open_for_queries(index_dir, model_name, device, projection_memory_gb)
    if ray_address is not None:
        from eogp_index.cluster.batch import select_on_ray

        selection = select_on_ray(index.encoder, asked, options, address=ray_address, shards=shards)
    else:
        selection = select_documents(index.encoder, asked, options)
    written = write_selection(index.stored, selection, out)
    scores = selection.scores.tolist()
    summary = {
        "out": str(out),
        "selected": written,
        "min_score": min(scores, default=None),
        "max_score": max(scores, default=None),
    }
    _emit(
        summary,
        as_json,
        lambda s: click.echo(
            f"wrote {s['selected']} documents to {s['out']}"
            + (f" (scores {s['min_score']:+.4e} … {s['max_score']:+.4e})" if s["selected"] else "")
        ),
    )


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@_target_options
@_target_question_options
@field_option(SelectOptions, "precision")
@click.option(
    "--out",
    "out",
    required=True,
    type=_OUT_FILE,
    help="Parquet file of (id, query, score, metadata...), written whole or not at all.",
)
@_ray_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_fail_cleanly
def scores(
    index_dir,
    texts,
    queries_file,
    model_name,
    device,
    projection_memory_gb,
    question,
    precision,
    out,
    ray_address,
    shards,
    as_json,
):
    """Export every document's score for every query to Parquet.

    One row per (document, query): id, query (the query's 0-based position),
    score and the stored metadata columns, streamed from the table fragment by
    fragment in table order; ready for DuckDB or pandas. --precision rescore
    scores every row exactly from the index's rescoring tier instead of the
    one-bit code. --ray scores the fragments in shards on Ray tasks
    (docs/cluster.md) and writes the same file, in the same order.

    \b
    Example:
        eogp scores my-index --queries probes.jsonl --out scores.parquet
        eogp scores my-index --queries probes.jsonl --precision rescore --out exact.parquet
        eogp scores my-index --ray head:6379 --shards 16 --queries probes.jsonl --out scores.parquet
        duckdb -c "SELECT source, avg(score) FROM 'scores.parquet' GROUP BY source"
    """
    from eogp_index.search.select import output_kind, write_scores

    output_kind(out)
    _check_shards(ray_address, shards)
    asked = Question(queries=tuple(_target_set(texts, queries_file)), **question)
    index = _open_for_queries(index_dir, model_name, device, projection_memory_gb)
    if ray_address is not None:
        from eogp_index.cluster.batch import scores_on_ray

        written = scores_on_ray(index.encoder, asked, out, precision=precision, address=ray_address, shards=shards)
    else:
        written = write_scores(index.encoder, asked, out, precision=precision)
    _emit({"out": str(out), "rows": written}, as_json, lambda s: click.echo(f"wrote {s['rows']} scores to {s['out']}"))


def _check_shards(ray_address, shards) -> None:
    """Refuses --shards without --ray, and joins Ray (a bad address fails before the model loads)."""
    if shards is not None and ray_address is None:
        raise click.UsageError("--shards splits the work over Ray tasks; give --ray too")
    if ray_address is not None:
        from eogp_index.cluster.runtime import connect

        connect(ray_address)


def _target_set(texts, queries_file) -> List[Any]:
    """Every query of a target set; a line that is not a JSON object is refused by its line number
    (a set missing some of its queries would select other documents without a word)."""
    labels, queries = _queries(texts, queries_file, None)
    bad = [label for label, query in zip(labels, queries) if query is None]
    if bad:
        raise click.UsageError("the target set has lines that are not queries:\n" + "\n".join(bad))
    return queries


def _open_for_queries(index_dir, model_name, device, projection_memory_gb):
    from eogp_index.client import AttributionIndex

    return AttributionIndex.open(
        index_dir,
        model_name=model_name,
        gradients=GradientConfig(device=device, projection_memory_gb=projection_memory_gb),
    )


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_fail_cleanly
def info(index_dir, as_json):
    """Show an index's manifest, row count, both tiers' bytes per row and on disk, and the bytes a query reads.

    \b
    Example:
        eogp info my-index --json
    """
    from eogp_index.store.stored_index import StoredIndex

    _emit(StoredIndex.open(index_dir).info(hits=Question.k, rescore=Question.rescore), as_json, _print_info)


@cli.command("index-column")
@click.argument("index_dir", type=INDEX_DIR)
@click.argument("column")
@click.option(
    "--kind",
    type=click.Choice(["BTREE", "BITMAP"]),
    default="BTREE",
    show_default=True,
    help="BTREE for ranges and many distinct values, BITMAP for few distinct values.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_fail_cleanly
def index_column(index_dir, column, kind, as_json):
    """Create a scalar index on a stored column so --where filters on it are fast.

    \b
    Example:
        eogp index-column my-index kind --kind BITMAP
        eogp index-column my-index num_tokens
    """
    from eogp_index.store.stored_index import StoredIndex

    store = StoredIndex.open(index_dir).store
    store.create_scalar_index(column, kind)
    _emit(
        {"column": column, "kind": kind, "indices": store.index_names()},
        as_json,
        lambda d: click.echo(f"indexed {d['column']} ({d['kind']})"),
    )


_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _retention(value: str):
    """``--retention``: ``none``, or a number of seconds with an optional unit (``30m``, ``1h``, ``7d``)."""
    from datetime import timedelta

    text = value.strip().lower()
    if text == "none":
        return None
    unit = text[-1] if text and text[-1] in _DURATION else "s"
    number = text[:-1] if text and text[-1] in _DURATION else text
    try:
        seconds = float(number) * _DURATION[unit]
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a duration; give e.g. 0, 90s, 30m, 1h, 7d or none", param_hint="--retention"
        ) from None
    if seconds < 0:
        raise click.BadParameter("a retention cannot be negative", param_hint="--retention")
    return timedelta(seconds=seconds)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option(
    "--retention",
    default="1h",
    show_default=True,
    help="Remove table versions older than this (0: all but the latest; none: keep every version).",
)
@click.option(
    "--target-rows",
    type=click.IntRange(min=1),
    default=None,
    help="Rows per fragment after compaction (default 262144).",
)
@click.option("--no-hot", is_flag=True, help="Leave the hot copy as it is (the next query brings it up to date).")
@option_group(
    field_option(TableRecallConfig, "max_rows", "--recall-max-rows"),
    field_option(TableRecallConfig, "seed", "--recall-seed"),
    into="recall",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def optimize(index_dir, retention, target_rows, no_hot, recall, as_json):
    """Compact the table, refresh scalar indexes, drop old versions, rebuild the hot copy.

    Each ingest commit adds a fragment and a table version; many small ones
    slow every commit and query. Ingest runs this by itself once 256 small
    fragments pile up, and at its end; run it after writing the table another
    way, or to drop old versions sooner. Safe while others read or ingest.

    With a rescoring tier it then measures, as each ingest does at its end, the
    one-bit code's recall of the tier's top rows on the table (the fit's
    held-out documents as queries) and records it in table_recall.json: the
    default rescoring factor (eogp info prints it).

    \b
    Example:
        eogp optimize my-index
        eogp optimize my-index --retention 0 --json
    """
    from eogp_index.store.maintenance import DEFAULT_TARGET_ROWS
    from eogp_index.store.maintenance import optimize as optimize_index
    from eogp_index.store.stored_index import StoredIndex
    from eogp_index.store.table_recall import format_table_recall, record_table_recall

    stored = StoredIndex.open(index_dir)
    report = optimize_index(
        stored,
        retention=_retention(retention),
        rebuild_hot=not no_hot,
        target_rows=target_rows or DEFAULT_TARGET_ROWS,
    )
    measured = record_table_recall(stored, config=TableRecallConfig(**recall))
    table_recall = None if measured is None else measured.to_json()

    def describe(_) -> None:
        click.echo(report.describe())
        if table_recall is not None:
            click.echo(f"rescoring {format_table_recall(table_recall)}")

    _emit({**report.to_json(), "table_recall": table_recall}, as_json, describe)


@cli.command("add-checkpoint")
@click.argument("index_dir", type=INDEX_DIR)
@click.argument("checkpoint")
@click.option(
    "--weight",
    type=float,
    default=None,
    help="The new checkpoint's weight in the score; the others keep theirs (an index of one checkpoint: 1). "
    "Default: every checkpoint 1/C, the mean.",
)
@field_option(GradientConfig, "device")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def add_checkpoint(index_dir, checkpoint, weight, device, as_json):
    """Add one more checkpoint of the training run to an index.

    CHECKPOINT (a model directory or hub name, with the index's architecture
    and tokenizer) is fitted on the documents the index was fitted on
    (fit/fitting_set.json, read back from the stored rows), then its codes are
    computed for every stored row and added as new columns: the other
    checkpoints' columns are not rewritten. The manifest is updated last; a
    run that stopped is completed by running it again (docs/ensembles.md).

    \b
    Example:
        eogp add-checkpoint my-index runs/checkpoint-2000
    """
    import logging

    from eogp_index.encode.checkpoints import add_checkpoint as add

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    fit_log = logging.getLogger("eogp_index.fit")
    fit_log.addHandler(handler)
    fit_log.setLevel(logging.INFO)
    try:
        report = add(index_dir, checkpoint, weight=weight, device=device, progress=not as_json)
    finally:
        fit_log.removeHandler(handler)
    _emit(
        report.to_json(),
        as_json,
        lambda r: click.echo(
            f"checkpoint {r['checkpoint']} ({r['name']}) added to {r['index']}: codes of {r['rows']} rows; "
            f"weights {r['weights']}"
        ),
    )


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--where", default=None, help="Delete the rows matching this SQL filter over the stored columns.")
@click.option(
    "--ids",
    "ids_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='Delete these ids: a file of one id per line, or JSON Lines of {"id": ...} objects.',
)
@click.option("--reason", default=None, help="Why (licence, privacy, ...), recorded with each id; never the text.")
@click.option(
    "--purge",
    is_flag=True,
    help="Also erase the rows from every file: compaction, old table versions (all), the hot copy, "
    "first passes, caches. Alone: erase every row deleted so far.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def delete(index_dir, where, ids_file, reason, purge, as_json):
    """Take documents down: delete rows from every answer, record them, optionally erase them.

    Each deleted id is recorded in INDEX/deletions.jsonl with its content hash,
    the time and --reason (never the text); a later `eogp ingest` of the same
    record is skipped unless --allow-deleted. Deleted rows leave every query,
    explanation, selection and first pass at once (a running server at its
    next query). Without --purge they stay in the table's data files until a
    purge. Interrupted, the next `eogp delete INDEX` completes it first. What a
    takedown does not undo: docs/takedowns.md.

    \b
    Example:
        eogp delete my-index --ids takedown.txt --reason "licence withdrawn" --purge
        eogp delete my-index --where "source = 'forum-dump'" --reason privacy
    """
    from eogp_index.search.takedown import delete as delete_documents
    from eogp_index.search.takedown import read_ids_file
    from eogp_index.store.stored_index import StoredIndex

    if where is not None and ids_file is not None:
        raise click.UsageError("give --where or --ids, not both")
    ids = read_ids_file(ids_file) if ids_file is not None else None
    report = delete_documents(StoredIndex.open(index_dir), where=where, ids=ids, reason=reason, purge=purge)
    _emit(report.to_json(), as_json, lambda _: click.echo(report.describe()))


class FirstPassKind(click.ParamType):
    """A registered first-pass kind. The registry (with numpy) loads only when the option is used
    or its help is shown, so that `eogp --help` stays light."""

    name = "kind"

    @staticmethod
    def kinds() -> Tuple[str, ...]:
        from eogp_index.search.first_pass import kinds

        return kinds()

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self.kinds()) + "]"

    def convert(self, value, param, ctx) -> str:
        from eogp_index.search.first_pass import RETIRED_KINDS

        if value in RETIRED_KINDS:
            why = RETIRED_KINDS[value]
            self.fail(f"the {value!r} first pass is retired: {why}; choose from {', '.join(self.kinds())}", param, ctx)
        if value not in self.kinds():
            self.fail(f"{value!r} is not a first-pass kind; choose from {', '.join(self.kinds())}", param, ctx)
        return value


@cli.command("build-candidates")
@click.argument("index_dir", type=INDEX_DIR)
@click.option(
    "--kind",
    type=FirstPassKind(),
    default="flat",
    show_default=True,
    help="Which first pass: flat has FAISS scan a RaBitQ code of every row (the decoded one-bit code, "
    "scales included) by inner product and rescores the best --candidates exactly.",
)
@click.option("--name", default="default", show_default=True, help="Name of the first pass in the index directory.")
@click.option("--extend", "extend_only", is_flag=True, help="Only add rows ingested since the last build.")
@click.option(
    "--recall-candidates",
    type=click.IntRange(20),
    default=100,
    show_default=True,
    help="The budget C the recall of the exact top-20 is measured at after the build (5 x 20 by default).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_fail_cleanly
def build_candidates(index_dir, kind, name, extend_only, recall_candidates, as_json):
    """Build (or extend) a first pass over the stored signs for `query --candidates`.

    A first pass picks candidates per query side; only those are scored
    exactly. The kinds ivf, hnsw and clustered are retired: rebuild their
    files with --kind flat. `eogp build-faiss` is the same command.

    After the build it measures its recall: the share of the exact top-20
    (both sides) found among --recall-candidates candidates, with a sample of stored rows'
    own codes as queries; it records it with the first pass, prints it, and
    warns when it is below 0.95.

    \b
    Example:
        eogp build-candidates my-index
        eogp query my-index --text "Parse a CSV file." --candidates 100
    """
    from eogp_index.search import first_pass
    from eogp_index.search.first_pass.recall import RECALL_TARGET
    from eogp_index.store.stored_index import StoredIndex

    index = StoredIndex.open(index_dir)  # the stored signs are all it needs: no model
    if extend_only:
        built = first_pass.load(index_dir, name)
        before = built.ntotal
        built = built.refresh(index, progress=not as_json)
        added = built.ntotal - before
    else:
        built = first_pass.build(index, name, first_pass.make_config(kind), progress=not as_json)
        added = built.ntotal
    params = built.build_params
    recall = built.record_recall(index, C=recall_candidates)
    _emit(
        {"name": name, "kind": built.kind, "rows": built.ntotal, "added": added, **params, "recall": recall.to_json()},
        as_json,
        lambda d: click.echo(
            f"first pass {d['name']!r} ({d['kind']}): {d['rows']} rows ({d['added']} added); "
            + ", ".join(f"{key} {value}" for key, value in params.items())
            + f"\nrecall of the exact top-{recall.k} at {recall.candidates} candidates: {recall.recall:.3f} "
            f"(positive {recall.positive:.3f}, negative {recall.negative:.3f}; {recall.queries} {recall.queries_from} "
            "as queries)"
        ),
    )
    if recall.below_target:
        click.echo(
            f"warning: first pass {name!r} ({built.kind}) finds {recall.recall:.3f} of the exact top-{recall.k} at "
            f"{recall.candidates} candidates, below {RECALL_TARGET}: query it with more --candidates "
            "(docs/querying.md#first-passes)",
            err=True,
        )


cli.add_command(
    click.Command(
        "build-faiss",
        callback=build_candidates.callback,
        params=build_candidates.params,
        hidden=True,
        help="The former name of `eogp build-candidates`, kept as an alias: the same options and result.\n\n"
        "\b\nExample:\n    eogp build-faiss my-index --kind flat",
    )
)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@option_group(
    field_option(ServeConfig, "host"),
    field_option(ServeConfig, "port"),
    field_option(ServeConfig, "token", envvar="EOGP_SERVE_TOKEN"),
    field_option(ServeConfig, "write_token", envvar="EOGP_WRITE_TOKEN"),
    into="serving",
)
@field_option(GradientConfig, "device")
@_dtype_option
@_projection_memory_option
@_model_option
@option_group(
    *(
        field_option(ServeConfig, name)
        for name in (
            "batch_window_ms",
            "max_batch",
            "queue_size",
            "timeout_s",
            "max_k",
            "max_query_tokens",
            "max_request_bytes",
            "max_queries",
        )
    ),
    field_option(ServeConfig, "shard_timeout_s", "--shard-timeout"),
    into="limits",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    metavar="[ADDRESS]",
    help="Serve the index in shards held by Ray actors: join the Ray cluster at ADDRESS (auto, host:port, "
    "ray://host:port), or start a local Ray when no address follows. Needs the cluster extra.",
)
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray: how many shard actors hold the table's fragments (default: the cluster's nodes).",
)
@_fail_cleanly
def serve(index_dir, serving, device, dtype, projection_memory_gb, model_name, limits, ray_address, shards):
    """Serve influence queries over HTTP, with a web page, to many users at once.

    Loads the model and the hot copy once. Queries that arrive together share one
    gradient pass; each keeps its own filter, k and direction. The page is at /, the
    API under /v1/ (schema: /openapi.json). The token may also come from
    $EOGP_SERVE_TOKEN, the write token (DELETE /v1/examples: takedowns) from
    $EOGP_WRITE_TOKEN. Needs the serve extra: pip install 'eogp-index[serve]'.

    With --ray, N Ray actors each hold some of the table's fragments in memory on
    their node and scan them; this process projects the queries and merges the
    shards' answers into one process's answer. New table versions are taken up
    without a restart; /healthz lists the shards.

    \b
    Example:
        eogp serve my-index --port 8000
        curl -s localhost:8000/v1/query -H 'Content-Type: application/json' -d '{"text": "Parse a CSV file.", "k": 5}'
        eogp serve my-index --ray auto --shards 4
    """
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401  (the serve extra; say how to get it before loading the model)
    except ImportError as exc:
        raise click.ClickException(
            f"eogp serve needs the serve extra ({exc.name} is not installed): pip install 'eogp-index[serve]'"
        ) from exc
    from eogp_index.serve.app import create_app, open_index
    from eogp_index.serve.middleware import configure_logging

    config = ServeConfig(**serving, **limits)
    if shards is not None and ray_address is None:  # said before the model loads
        raise click.UsageError("--shards goes with --ray: add --ray (a local Ray) or --ray ADDRESS")
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.token is None:
        click.echo(f"warning: serving on {config.host} without --token: anyone who can reach it can query", err=True)
    configure_logging()
    index = open_index(
        index_dir,
        device=device,
        batch_size=config.max_batch,
        model_name=model_name,
        projection_memory_gb=projection_memory_gb,
        dtype=dtype,
    )
    pool = None
    if ray_address is not None:
        pool = _shard_pool(index_dir, ray_address, shards, config.shard_timeout_s)
    app = create_app(index, config, pool)
    click.echo(f"serving {index_dir} on http://{config.host}:{config.port}/ (Ctrl-C stops)", err=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)


def _shard_pool(index_dir, ray_address: Optional[str], shards: Optional[int], timeout_s: float):
    """The shard actors of ``eogp serve --ray``: ``--ray`` alone (``local``) starts a local Ray."""
    from eogp_index.cluster.runtime import connect
    from eogp_index.cluster.shards import ShardPool

    address = None if ray_address == "local" else ray_address
    ray = connect(address)
    count = shards or max(1, len([n for n in ray.nodes() if n.get("Alive")]))
    click.echo(f"starting {count} shard actors on Ray", err=True)
    return ShardPool(str(index_dir), count, address=address, timeout_s=timeout_s)


@cli.command()
@click.argument("model")
@_projection_options
@option_group(
    field_option(StorageConfig, "precision"),
    field_option(StorageConfig, "rescore"),
    field_option(StorageConfig, "rescore_k"),
    into="storage",
)
@field_option(CurvatureConfig, "num_examples", "--curvature-examples")
@option_group(
    *(field_option(GradientConfig, name) for name in ("max_tokens", "batch_size", "dtype", "experts")),
    *_budget_options,
    into="gradients",
)
@click.option(
    "--document-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="The documents' length in tokens, for the batch (default: --max-tokens, else the model's context).",
)
@click.option(
    "--device",
    "device_kind",
    type=click.Choice(["cuda", "cpu"]),
    default="cuda",
    show_default=True,
    help="Where the budget is: on cpu, kronfluence's host memory counts in it too.",
)
@click.option("--module", "modules", multiple=True, help="Module name or glob to attribute (repeatable).")
@click.option(
    "--documents",
    type=click.IntRange(min=0),
    default=1_000_000,
    show_default=True,
    help="Documents in the store, for its size.",
)
@field_option(
    IngestConfig,
    "block_documents",
    help="Documents per ingest block when P does not stay in memory (default: as an ingest sizes it, from "
    f"the memory the budget leaves, at most {MAX_BLOCK_DOCUMENTS:,}).",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Plan the store over this many shard nodes (eogp serve --ray --shards): per node its codes, "
    "memory and scan time, and the object-store bytes (docs/cluster.md).",
)
@click.option(
    "--bandwidth-gbs",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="With --nodes: the GB/s a node scans its in-memory codes at, for the scan time (default: 20, "
    "a stated figure for one server's streaming reads from memory).",
)
@click.option(
    "--metadata-bytes",
    type=click.IntRange(min=0),
    default=None,
    help="With --nodes: the table's bytes per row besides the codes (ids, bookkeeping and your metadata "
    "columns, uncompressed), for the object-store bytes (default: 141, the bookkeeping columns alone).",
)
@click.option(
    "--checkpoints",
    type=click.IntRange(min=1),
    default=None,
    help="Checkpoints ensembled (eogp fit CKPT_A CKPT_B ...): C models, projections and codes "
    "(default 1; an INDEX's are its manifest's).",
)
@click.option(
    "--all-modules", is_flag=True, help="One line per module (default: modules alike in every block, grouped)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_fail_cleanly
def plan(
    model,
    projection,
    storage,
    num_examples,
    gradients,
    document_tokens,
    device_kind,
    modules,
    documents,
    block_documents,
    nodes,
    bandwidth_gbs,
    metadata_bytes,
    checkpoints,
    all_modules,
    as_json,
):
    """Plan an index before fitting it, or read a fitted one's: nothing runs.

    MODEL is a hub name, a local model directory, a LoRA adapter directory or
    a config.json; only its config is read (the model is built on PyTorch's
    meta device, without weights). Takes eogp fit's options and gives, per
    attributed module, d_u, m_u and k_u; the bytes per example; the shared
    bytes (eigenbases, P); the fit's cache on disk; the batch (documents x
    tokens) and kronfluence's module partitions eogp fit and ingest would use;
    the peak memory of each phase against --memory-budget, saying which one
    does not fit and what would make it fit; the disk each phase needs; the P
    read per ingested document (resident, per batch, per block) against the
    block cache's disk; the store's size for --documents; and the coverage:
    the attributed share of the model's parameters by kind, and what is left
    out and why. Before a fit the kept eigenvector columns are an upper bound
    (marked <=); given an INDEX directory instead of MODEL, the plan reads its
    manifest and projection file and they are exact, and its documents are as
    long as the index cuts them (its max_tokens, unless --max-tokens or
    --document-tokens is given). --nodes K plans the store over K shard nodes
    (eogp serve --ray --shards K): per node the rows and codes it holds, the
    memory it needs and one scan's time at --bandwidth-gbs, the ingress's
    memory, and the bytes in object storage. --checkpoints C plans an ensemble
    of C checkpoints: C models, projections and codes per example.

    \b
    Example:
        eogp plan examples/default/model -k 256 --documents 1000000
        eogp plan olmo-2-1b/config.json -k 2048 --m 262144 --max-tokens 512 --documents 1000000000 --nodes 16
        eogp plan olmo-2-1b/config.json -k 2048 --m 262144 --dtype bfloat16 --max-tokens 512 --memory-budget 80
        eogp plan my-index --memory-budget 24
    """
    from eogp_index.fit.plan import format_p_reads, format_plan, make_plan, model_shape, with_nodes
    from eogp_index.store.index_plan import plan_of_index

    gradients = GradientConfig(**gradients)
    budget = None if gradients.memory_budget_gb is None else int(gradients.memory_budget_gb * 1e9)
    options = dict(
        curvature_examples=num_examples,
        batch_size=gradients.batch_size,
        max_tokens=gradients.max_tokens,
        documents=documents,
        dtype=gradients.dtype,
        memory_budget=budget,
        batch_tokens=gradients.batch_tokens,
        document_tokens=document_tokens,
        device=device_kind,
        block_documents=block_documents,
        query_hits=Question.k,
        query_rescore=Question.rescore,
    )
    cluster = dict(nodes=nodes, bandwidth_gbs=bandwidth_gbs, metadata_bytes=metadata_bytes)
    if (Path(model) / "manifest.json").is_file():
        result = plan_of_index(Path(model), checkpoints=checkpoints, **options, **cluster)
    else:
        if projection["k"] is None and projection["budget_kb"] is None:
            projection["k"] = 256
        shape = model_shape(model, list(modules) or None, experts=gradients.experts)
        storage = StorageConfig(**storage)
        result = make_plan(
            shape,
            ProjectionConfig(**projection),
            precision=storage.precision,
            rescore=storage.rescore,
            rescore_k=storage.rescore_k,
            checkpoints=checkpoints or 1,
            **options,
        )
        result = with_nodes(result, **cluster)
    reads = result.p_reads(block_documents)
    _emit(
        {**result.to_json(), "p_reads": reads.to_json()},
        as_json,
        lambda _: click.echo(format_plan(result, all_modules=all_modules) + "\n" + format_p_reads(reads)),
    )


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@_model_option
@field_option(GradientConfig, "device")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def verify(index_dir, model_name, device, as_json):
    """Check an index's model and projection in full: every byte hashed.

    Opening an index checks cheap sampled fingerprints of the model's weights
    and of the projection file; this computes the full SHA-256 of both (the
    model is loaded) and compares them with the manifest. Exits non-zero when
    either differs.

    \b
    Example:
        eogp verify my-index
        eogp verify my-index --model /models/moved-here --json
    """
    from eogp_index.store.verify import verify_index

    report = verify_index(index_dir, model_name=model_name, device=GradientConfig(device=device).resolved_device())
    _emit(report, as_json, _print_verify)
    if not report["ok"]:
        wrong = [part for part in ("projection", "model") if not report[part]["ok"]]
        raise click.ClickException(
            f"{' and '.join(wrong)} of {index_dir} differ from the manifest: queries would be "
            "wrong. Restore the files the index was built with, or rebuild it (eogp fit)."
        )


def _print_verify(report: dict) -> None:
    further = [(f"c{j}/{part}", pair[part]) for j, pair in enumerate(report.get("checkpoints", []), 1) for part in pair]
    for part, entry in [("projection", report["projection"]), ("model", report["model"]), *further]:
        what = entry.get("file") or entry.get("name")
        click.echo(f"{part:<11} {'ok' if entry['ok'] else 'DIFFERS'}  {what}")
        click.echo(
            f"            sha256 {entry['sha256']}"
            + ("" if entry["sha256"] == entry["expected_sha256"] else f" (manifest: {entry['expected_sha256']})")
        )


def _print_info(data: dict) -> None:
    modules = data["modules"]
    click.echo(f"index       {data['path']}")
    click.echo(f"model       {data['model']['name']}  (sha256 {data['model']['weights_sha256'][:12]}…)")
    for j, entry in enumerate(data.get("checkpoints") or []):  # an ensemble: each checkpoint and its weight
        click.echo(
            f"checkpoint  {j}: {entry['name']}  weight {entry['weight']:g}  (sha256 {entry['weights_sha256'][:12]}…)"
        )
    click.echo(
        f"variant     {data['projection']['variant']}, precision {data['precision']}, "
        f"damping ratio {data['damping_ratio']}"
    )
    click.echo(
        f"modules     {len(modules)}  (k = {sorted({m['k'] for m in modules})}, "
        f"m = {sorted({m['m'] for m in modules})})"
    )
    fidelity = data["projection"].get("fidelity")
    if fidelity:
        click.echo(
            f"1-bit code  per module, held-out NDCG@{fidelity['ndcg_at']} / Spearman against the first-stage "
            "inner products (EOGP | EOGP-rot | FP16 at k):"
        )
        for name, c in fidelity["modules"].items():
            cells = " | ".join(
                _fidelity_cell(c.get(code), fidelity["ndcg_at"]) for code in ("eogp", "eogp-rot", "fp16")
            )
            stored = c["code"] if data["projection"]["variant"] == "auto" else data["projection"]["variant"]
            click.echo(
                f"            {name:<28} {stored:<8} {cells}  ({c['held_out']} held out; measured best: {c['code']})"
            )
            if c.get("recall"):
                click.echo(f"            {'':<28} {_recall_cell(c['recall'])}")
        if fidelity.get("recall"):
            from eogp_index.fit.recall import format_recall

            click.echo(f"rescoring   at fit time, {format_recall(fidelity['recall'])}")
    _print_table_recall(data)
    from eogp_index.fit.plan import TierSize, format_tier_size

    click.echo(f"rows        {data['rows']}  (table version {data['table_version']})")
    for line in _deletion_lines(data.get("deletions")):
        click.echo(line)
    for line in format_tier_size(TierSize(**data["bytes"]), label_width=12):
        click.echo(line)


def _print_table_recall(data: dict) -> None:
    """``eogp info``'s line of the recall measured on the table (after each ingest and by
    ``eogp optimize``), which the default rescoring factor prefers over the fit's."""
    if data.get("tier") is None:
        return
    from eogp_index.store.table_recall import format_table_recall

    record = data.get("table_recall")
    if record is None:
        click.echo(
            "rescoring   on the table: not measured (measured after an ingest of at least 100 rows, or by "
            "eogp optimize, on an index fitted with held-out documents); queries use the fit's factor"
        )
        return
    click.echo(f"rescoring   {format_table_recall(record, data['table_version'])}")
    if not record["reached"]:
        criterion = (
            f"keeps the rescored top within NDCG gap {record['gap_target']} of the tier's"
            if record.get("criterion") == "ndcg_gap"
            else f"reaches recall {record['target']}"
        )
        click.echo(
            f"warning     no factor measured on the table {criterion}: queries default to the "
            f"largest, {record['factor']}; give --rescore higher for a faithful top",
            err=True,
        )


def _deletion_lines(found: Optional[dict]) -> List[str]:
    """``eogp info``'s takedown lines: ids deleted, rows awaiting a purge, deleted ids that fitted."""
    if not found or not (found["ids"] or found["awaiting_purge"] or found["pending"]):
        return []
    lines = [
        f"deleted     {found['ids']} ids in {found['requests']} takedown{'' if found['requests'] == 1 else 's'} "
        f"(deletions.jsonl); "
        f"{found['awaiting_purge']} deleted rows still on disk until `eogp delete --purge`"
    ]
    fitted = found["in_fitting_set"]
    if fitted:
        sets = ", ".join(f"{len(ids)} in the {name} set" for name, ids in fitted.items())
        lines.append(
            f"            deleted ids fitted this index ({sets}): the curvature and projection still include "
            "them (docs/takedowns.md)"
        )
    elif found["fitting_set_recorded"]:
        lines.append("            no deleted id was in the fitting set (fit/fitting_set.json)")
    else:
        lines.append("            the fit left no record of its documents: any deleted one may have fitted it")
    if found["pending"]:
        lines.append(
            f"            takedown {found['pending']['request']} was interrupted after {found['pending']['steps']}: "
            "run `eogp delete INDEX` to complete it"
        )
    return lines


def _query_line(q: Any) -> str:
    """One line naming a query (or an aggregated set of them) in human output."""
    if isinstance(q, dict) and "aggregate" in q and "queries" in q:
        return f"{q['aggregate']} of {len(q['queries'])} queries: " + _query_line(q["queries"][0])[:60] + " …"
    text = q if isinstance(q, str) else q.get("text") if isinstance(q, dict) else None
    text = text if text is not None else json.dumps(q)
    return " ".join(text.split())[:100]


def _print_groups(results: list, head: int = 20, tail: int = 5) -> None:
    """The groups of each roll-up; past ``head + tail`` groups, both ends of the ranking."""
    for item in results:
        column, groups = item["group_by"], item["groups"]
        click.echo(f"\nquery: {_query_line(item['query'])}")
        click.echo(
            f"  {column[:24]:<24} {'rows':>7} {'sum':>11} {'mean':>11} {'max':>11} {'top+':>5} {'top-':>5} "
            f"{'share+':>7} {'share-':>7}"
        )
        hidden = max(0, len(groups) - head - tail)
        for g in groups[:head] + [None] + groups[-tail:] if hidden else groups:
            if g is None:
                click.echo(f"  … {hidden} more groups (--json lists them all)")
                continue
            click.echo(
                f"  {str(g[column])[:24]:<24} {g['rows']:>7} {g['sum']:>+11.4e} {g['mean']:>+11.4e} "
                f"{g['max']:>+11.4e} {g['top_positive']:>5} {g['top_negative']:>5} "
                f"{g['share_positive']:>7.1%} {g['share_negative']:>7.1%}"
            )


def _recall_cell(entry: dict) -> str:
    """A module's recall of its tier's top rows by each 1-bit code (the mean over the factors)."""
    means = []
    for code in ("eogp", "eogp-rot"):
        values = [v for v in entry[code]["recall"] if v is not None]
        means.append(f"{code} {sum(values) / len(values):.3f}" if values else f"{code} n/a")
    t = entry["eogp"]["t"]
    return f"recall of the tier's top-{t} (mean over F): " + ", ".join(means)


def _fidelity_cell(entry: Optional[dict], ndcg_at: int) -> str:
    if not entry or entry.get(f"ndcg@{ndcg_at}") is None:
        return "n/a"
    spearman = entry.get("spearman")
    return f"{entry[f'ndcg@{ndcg_at}']:.3f} / " + ("n/a" if spearman is None else f"{spearman:.3f}")


def _print_results(results: list) -> None:
    from eogp_index.store.table import RESERVED_COLUMNS

    for item in results:
        click.echo(f"\nquery: {_query_line(item['query'])}")
        for row in item["results"]:
            # The user's own metadata says what a document is; bookkeeping columns come after.
            answer = ("rank", "score", "score_1bit", "direction", "modules")
            user = [k for k in row if k not in RESERVED_COLUMNS and k not in answer]
            shown = user[:4] + [k for k in ("shard", "position") if k in row][: max(0, 2 - len(user[:4]))]
            preview = ", ".join(f"{k}={row[k]}" for k in shown)
            side = f"{row['direction'][:3]} " if "direction" in row else ""
            # A rescored hit: the tier's score, as ranked, then the one-bit scan's.
            one_bit = f" (1-bit {row['score_1bit']:+.4e})" if row.get("score_1bit") is not None else ""
            click.echo(f"  {side}#{row['rank']:<3} {row['score']:+.4e}{one_bit}  {row['id']}  {preview}")
            if row.get("text"):
                click.echo(f"        {' '.join(row['text'].split())[:96]}")
            if row.get("modules"):
                terms = sorted(row["modules"].items(), key=lambda kv: -abs(kv[1]))[:4]
                click.echo("        by module: " + ", ".join(f"{name} {value:+.2e}" for name, value in terms))


cli.add_command(eval_group)


def main(argv: Optional[List[str]] = None) -> None:
    cli.main(args=argv, prog_name="eogp")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
