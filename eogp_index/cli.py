"""``eogp``: the command line, a thin layer over the library.

Every command prints human-readable output, or JSON with ``--json``; user errors exit non-zero
with a one-line message saying what to fix.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, List, Optional

import click

from eogp_index.cli_options import field_option, option_group
from eogp_index.cliutil import distributed_option, process_group, torchrun_rank, under_torchrun, worker_device
from eogp_index.cliutil import emit as _emit
from eogp_index.cliutil import fail_cleanly as _fail_cleanly
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.errors import EOGPError
from eogp_index.evaluation.cli import eval_group
from eogp_index.data.records import RecordSpec
from eogp_index.store.sources import DEFAULT_TEXT_BYTES
from eogp_index.serve.config import ServeConfig

INDEX_DIR = click.Path(exists=True, file_okay=False, path_type=Path)

#: Which record fields hold what (``fit`` and ``ingest``); the command gets them as ``record``.
_record_options = option_group(
    *(field_option(RecordSpec, name) for name in ("text_field", "messages_field", "input_ids_field", "labels_field",
                                                  "id_field")),
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
_model_option = click.option(
    "--model", "model_name", default=None,
    help="Load the model from here instead of the path or name in the manifest (it must be the same model).")


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
@click.argument("model")
@click.option("--data", "data", multiple=True,
              help="Shard files or globs (JSONL[.gz/.zst], Parquet, datasets.save_to_disk dirs) to fit on.")
@click.option("--fit-data", "fit_data", multiple=True,
              help="Fit on these shards instead of --data: fitting data kept apart from what you ingest "
                   "(e.g. a held-out split).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Index directory to create (or the interrupted fit to resume).")
@_projection_options
@option_group(field_option(StorageConfig, "precision"), into="storage")
@option_group(
    field_option(CurvatureConfig, "num_examples", "--curvature-examples"),
    field_option(CurvatureConfig, "damping_ratio"),
    into="curvature",
)
@click.option("--module", "modules", multiple=True, help="Module name or glob to attribute (repeatable).")
@option_group(*(field_option(GradientConfig, name) for name in ("max_tokens", "batch_size", "device")),
              into="gradients")
@field_option(ProjectionConfig, "seed", help="Seed of the fitting samples, the sampled labels and the SRHT.")
@click.option("--table-uri", default=None,
              help="LanceDB URI for the table (e.g. s3://bucket/prefix); default: inside --out.")
@click.option("--overwrite", is_flag=True, help="Replace an existing index, or an interrupted fit, at --out.")
@distributed_option
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_record_options
@_fail_cleanly
def fit(model, data, fit_data, out, projection, storage, curvature, modules, gradients, seed, table_uri, overwrite,
        distributed, as_json, record):
    """Fit EK-FAC curvature and the projection; create an empty index.

    MODEL is a HuggingFace hub name or a local model directory. The fitting
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
        torchrun --nproc_per_node 8 -m eogp_index.cli fit gpt2 --fit-data 'heldout/*.jsonl' --out wiki-index
    """
    import logging

    from eogp_index.client import AttributionIndex
    from eogp_index.fit.sampling import sample_shards
    from eogp_index.gradients.model import load_model

    if bool(data) == bool(fit_data):
        raise click.UsageError("give the shards to fit on with --data, or with --fit-data (not both)")
    if projection["k"] is None and projection["budget_kb"] is None:
        projection["k"] = 256
    sharded = under_torchrun(distributed)
    if sharded:
        gradients["device"] = worker_device(gradients["device"])
    gradients = GradientConfig(**gradients)
    projection = ProjectionConfig(**projection, seed=seed)
    curvature = CurvatureConfig(**curvature, batch_size=gradients.batch_size, seed=seed)
    spec = RecordSpec(**record, max_tokens=gradients.max_tokens)
    handler = logging.StreamHandler(sys.stderr)  # resume and per-rank messages
    handler.setFormatter(logging.Formatter(f"[rank {torchrun_rank()}] %(message)s" if sharded else "%(message)s"))
    fit_log = logging.getLogger("eogp_index.fit")
    fit_log.addHandler(handler)
    fit_log.setLevel(logging.INFO)
    try:
        with _fit_process_group(gradients.resolved_device()) if sharded else contextlib.nullcontext():
            loaded, tokenizer = load_model(model, device=gradients.resolved_device())
            wanted = curvature.num_examples + (projection.num_fit_examples if projection.second_stage == "pca" else 0)
            examples, seen = sample_shards(list(fit_data or data), spec, tokenizer, wanted, seed)
            if torchrun_rank() == 0:
                click.echo(f"fitting on {len(examples)} documents sampled from {seen} records", err=True)
            index = AttributionIndex.create(out, loaded, tokenizer, examples, model_name=model,
                                            modules=list(modules) or None, curvature=curvature,
                                            projection=projection, storage=StorageConfig(**storage),
                                            gradients=gradients, table_uri=table_uri,
                                            mode="overwrite" if overwrite else "create")
    except EOGPError:
        if torchrun_rank() != 0:  # every worker fails alike: rank 0 alone says why
            raise click.exceptions.Exit(1)
        raise
    finally:
        fit_log.removeHandler(handler)
    if torchrun_rank() == 0:
        _emit(index.info(), as_json, _print_info)


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
@click.option("--on-error", type=click.Choice(["raise", "skip"]), default="raise", show_default=True,
              help="raise: stop at the first bad record; skip: list bad records in a rejects file.")
@click.option("--rejects", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write rejected records (default: INDEX/rejects/<time>.jsonl).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Examples per batch, one commit each (under torchrun: per worker and step).")
@_model_option
@field_option(GradientConfig, "device")
@_projection_memory_option
@click.option("--shard-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Name shards by their path relative to this directory (needed when file names repeat); "
                   "keep it the same across runs.")
@click.option("--store-text", "store_text", is_flag=True,
              help="Keep each document's text (a chat or ids as JSON) in the table, so results show it and "
                   "`eogp explain` needs no shard; costs about the documents' own size per row.")
@click.option("--store-text-max-bytes", type=click.IntRange(min=1), default=DEFAULT_TEXT_BYTES, show_default=True,
              help="With --store-text: longer documents are not stored (explained from their shard instead).")
@distributed_option
@click.option("--commit-every", type=click.IntRange(min=1), default=None,
              help="Under torchrun: steps between commits (default 1); a crash loses at most this many steps.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_record_options
@_fail_cleanly
def ingest(index_dir, shards, on_error, rejects, batch_size, model_name, device, projection_memory_gb, shard_root,
           store_text, store_text_max_bytes, distributed, commit_every, as_json, record):
    """Store corpus shards in an index. Safe to rerun: stored examples are skipped.

    Under torchrun (several workers, or --distributed) the shards are dealt out to the
    workers, each projects its share and rank 0 commits their rows together.

    \b
    Example:
        eogp ingest my-index 'data/shard-*.jsonl.zst' --metadata source --on-error skip --store-text
        torchrun --nproc_per_node 8 -m eogp_index.cli ingest my-index 'data/*.parquet' --commit-every 4
    """
    spec = RecordSpec(**record)  # max_tokens: the index's
    gradients = GradientConfig(batch_size=batch_size or GradientConfig().batch_size, device=device,
                               projection_memory_gb=projection_memory_gb)
    options = dict(spec=spec, on_error=on_error, rejects_path=rejects, batch_size=batch_size,
                   progress=not as_json, shard_root=shard_root,
                   store_text=store_text_max_bytes if store_text else None)
    if under_torchrun(distributed):
        from ingest.distributed import run_distributed_ingest

        try:
            summary = run_distributed_ingest(index_dir, list(shards), commit_every=commit_every or 1,
                                             gradients=gradients, model_path=model_name, **options)
        except EOGPError:
            if torchrun_rank() != 0:  # every worker fails alike: rank 0 alone says why
                raise click.exceptions.Exit(1)
            raise
    else:
        if commit_every is not None:
            raise click.UsageError("--commit-every applies to torchrun workers; run under torchrun or drop it")
        from ingest.pipeline import run_ingest

        from eogp_index.client import AttributionIndex

        index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
        summary = run_ingest(index, list(shards), **options)
    if torchrun_rank() == 0:
        _emit(summary.to_json(), as_json, lambda s: click.echo("\n".join(f"{k:>18}: {v}" for k, v in s.items())))


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--text", "texts", multiple=True, help="A query text (repeatable).")
@click.option("--queries", "queries_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL file of queries: {text} / {messages} / {input_ids} records.")
@click.option("--limit-queries", type=click.IntRange(min=1), default=None,
              help="Use only the first N queries of --queries.")
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True,
              help="How many examples per direction.")
@click.option("--where", default=None, help="SQL filter on stored columns, e.g. \"kind = 'function'\".")
@click.option("--direction", type=click.Choice(["positive", "negative", "both"]), default="both", show_default=True)
@click.option("--candidates", type=click.IntRange(min=1), default=None,
              help="Rescore only this many FAISS candidates per direction (needs `eogp build-faiss`).")
@click.option("--stream", is_flag=True, help="Scan the table in batches instead of an in-memory copy.")
@click.option("--by-module", is_flag=True,
              help="Split each hit's score into its per-module terms (they sum to the score).")
@_model_option
@field_option(GradientConfig, "device")
@_projection_memory_option
@distributed_option
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@_fail_cleanly
def query(index_dir, texts, queries_file, limit_queries, k, where, direction, candidates, stream, by_module,
          model_name, device, projection_memory_gb, distributed, as_json):
    """Show the stored examples that most influence each query.

    Positive scores: training on the example lowers the query's loss. Under torchrun
    (several workers, or --distributed) each worker scans a share of the table and
    rank 0 prints the merged, still exact, top k.

    \b
    Example:
        eogp query my-index --text "Parse a CSV file." -k 5 --where "num_tokens > 50"
        torchrun --nproc_per_node 4 -m eogp_index.cli query my-index --text "Parse a CSV file." --json
    """
    from eogp_index.client import AttributionIndex

    queries = _queries(texts, queries_file, limit_queries)
    sharded = under_torchrun(distributed)
    if sharded and (candidates is not None or stream):
        raise click.UsageError("--candidates and --stream choose single-process routes; drop them under torchrun")
    with process_group():
        gradients = GradientConfig(device=worker_device(device) if sharded else device,
                                   projection_memory_gb=projection_memory_gb)
        index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
        if index.store.count() == 0 and torchrun_rank() == 0:
            click.echo(f"{index_dir} has no rows yet: nothing has been ingested. "
                       f"Store documents first: eogp ingest {index_dir} SHARDS...", err=True)
        search = index.search(queries, many=True).limit(k).where(where).direction(direction).by_module(by_module)
        if candidates is not None:
            search = search.candidates(candidates)
        elif stream or sharded:
            search = search.route("sharded" if sharded else "stream")
        tables = search.to_list()  # one gradient pass for all the queries
    if torchrun_rank() == 0:
        _emit([{"query": q, "results": t.to_pylist()} for q, t in zip(queries, tables)], as_json, _print_results)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--text", "texts", multiple=True, help="The query text.")
@click.option("--query-file", "--queries", "queries_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL file of queries ({text} / {messages} / {input_ids}); the first one is explained.")
@click.option("--id", "ids", multiple=True, help="Stored example id to explain (repeatable: one batched pass).")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help="Explain the query's N most positive hits instead of naming --id.")
@click.option("--color/--no-color", default=None, help="Shade tokens with colour (default: when a terminal).")
@_model_option
@field_option(GradientConfig, "device")
@_projection_memory_option
@click.option("--json", "as_json", is_flag=True, help="Print the explanations as JSON.")
@_fail_cleanly
def explain(index_dir, texts, queries_file, ids, top, color, model_name, device, projection_memory_gb, as_json):
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

    queries = _queries(texts, queries_file, 1)
    if bool(ids) == (top is not None):
        raise click.UsageError("give --id ID (repeatable) or --top N")
    index = AttributionIndex.open(index_dir, model_name=model_name,
                                  gradients=GradientConfig(device=device, projection_memory_gb=projection_memory_gb))
    if top is not None:
        ids = tuple(index.top_influential(queries[0], k=top).column("id").to_pylist())
    explanations = index.explain_many(queries[0], list(ids))
    use_color = sys.stdout.isatty() if color is None else color
    _emit([e.to_json() for e in explanations], as_json,
          lambda _: click.echo("\n\n".join(explanation_terminal(e, color=use_color) for e in explanations)))


def _queries(texts, queries_file, limit: Optional[int]) -> List[Any]:
    """Queries from --text options and a --queries JSONL file, the first ``limit`` of them."""
    queries: List[Any] = list(texts)
    if queries_file is not None:
        from eogp_index.data.readers import iter_raw_records

        for raw in iter_raw_records(queries_file):
            if not isinstance(raw.record, dict):
                raise click.ClickException(f"{raw.record.location}: {raw.record.reason}")
            queries.append(raw.record)
    if limit is not None:
        queries = queries[:limit]
    if not queries:
        raise click.UsageError("give --text or --queries")
    return queries


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_fail_cleanly
def info(index_dir, as_json):
    """Show an index's manifest, row count and bytes per example.

    \b
    Example:
        eogp info my-index --json
    """
    from eogp_index.store.stored_index import StoredIndex

    _emit(StoredIndex.open(index_dir).info(), as_json, _print_info)


@cli.command("index-column")
@click.argument("index_dir", type=INDEX_DIR)
@click.argument("column")
@click.option("--kind", type=click.Choice(["BTREE", "BITMAP"]), default="BTREE", show_default=True,
              help="BTREE for ranges and many distinct values, BITMAP for few distinct values.")
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
    _emit({"column": column, "kind": kind, "indices": store.index_names()},
          as_json, lambda d: click.echo(f"indexed {d['column']} ({d['kind']})"))


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
        raise click.BadParameter(f"{value!r} is not a duration; give e.g. 0, 90s, 30m, 1h, 7d or none",
                                 param_hint="--retention") from None
    if seconds < 0:
        raise click.BadParameter("a retention cannot be negative", param_hint="--retention")
    return timedelta(seconds=seconds)


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--retention", default="1h", show_default=True,
              help="Remove table versions older than this (0: all but the latest; none: keep every version).")
@click.option("--target-rows", type=click.IntRange(min=1), default=None,
              help="Rows per fragment after compaction (default 262144).")
@click.option("--no-hot", is_flag=True, help="Leave the hot copy as it is (the next query brings it up to date).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def optimize(index_dir, retention, target_rows, no_hot, as_json):
    """Compact the table, refresh scalar indexes, drop old versions, rebuild the hot copy.

    Each ingest commit adds a fragment and a table version; many small ones
    slow every commit and query. Ingest runs this by itself once 256 small
    fragments pile up, and at its end; run it after writing the table another
    way, or to drop old versions sooner. Safe while others read or ingest.

    \b
    Example:
        eogp optimize my-index
        eogp optimize my-index --retention 0 --json
    """
    from eogp_index.store.maintenance import DEFAULT_TARGET_ROWS
    from eogp_index.store.maintenance import optimize as optimize_index
    from eogp_index.store.stored_index import StoredIndex

    report = optimize_index(StoredIndex.open(index_dir), retention=_retention(retention), rebuild_hot=not no_hot,
                            target_rows=target_rows or DEFAULT_TARGET_ROWS)
    _emit(report.to_json(), as_json, lambda _: click.echo(report.describe()))


@cli.command("build-faiss")
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--kind", type=click.Choice(["flat", "ivf", "hnsw", "clustered"]), default="flat", show_default=True,
              help="FAISS binary index: exact Hamming (flat), inverted lists (ivf) or a graph (hnsw); or "
                   "clustered: the codes grouped by scale profile, scanned exactly cell by cell (the one "
                   "that pays at millions of rows; --candidates is then its budget of rows).")
@click.option("--name", default="default", show_default=True, help="Name of the FAISS index in the index directory.")
@click.option("--replicas", type=click.IntRange(1, 16), default=None,
              help="Copies of each sign bit in FAISS, so that queries weight coordinates by |y| "
                   "(1 = plain Hamming; FAISS memory and search time grow with it). Build only; "
                   "default 1; 4 raises recall at a given --candidates.")
@click.option("--extend", "extend_only", is_flag=True, help="Only add rows ingested since the last build.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_fail_cleanly
def build_faiss(index_dir, kind, name, replicas, extend_only, as_json):
    """Build (or extend) a FAISS binary index over the stored signs for `query --candidates`.

    Uses the GPU binary flat index when a GPU FAISS build and a GPU are present.

    \b
    Example:
        eogp build-faiss my-index --kind hnsw
        eogp query my-index --text "Parse a CSV file." --candidates 2000
    """
    from eogp_index.search.candidates import FaissConfig, build, load
    from eogp_index.store.stored_index import StoredIndex

    index = StoredIndex.open(index_dir)  # the stored signs are all it needs: no model
    if extend_only:
        faiss_index = load(index_dir, name)
        added = faiss_index.extend(index, progress=not as_json)
    else:
        config = FaissConfig(kind=kind) if replicas is None else FaissConfig(kind=kind, replicas=replicas)
        faiss_index = build(index, name, config, progress=not as_json)
        added = faiss_index.ntotal
    _emit({"name": name, "kind": faiss_index.config.kind, "replicas": faiss_index.replicas,
           "rows": faiss_index.ntotal, "added": added}, as_json,
          lambda d: click.echo(f"FAISS index {d['name']!r}: {d['rows']} rows ({d['added']} added), "
                               f"{d['replicas']} replicas per sign bit"))


@cli.command()
@click.argument("index_dir", type=INDEX_DIR)
@option_group(field_option(ServeConfig, "host"), field_option(ServeConfig, "port"),
              field_option(ServeConfig, "token", envvar="EOGP_SERVE_TOKEN"), into="serving")
@field_option(GradientConfig, "device")
@_projection_memory_option
@_model_option
@option_group(*(field_option(ServeConfig, name) for name in ("batch_window_ms", "max_batch", "queue_size", "timeout_s",
                                                              "max_k", "max_query_tokens", "max_request_bytes")),
              into="limits")
@_fail_cleanly
def serve(index_dir, serving, device, projection_memory_gb, model_name, limits):
    """Serve influence queries over HTTP, with a web page, to many users at once.

    Loads the model and the hot copy once. Queries that arrive together share one
    gradient pass; each keeps its own filter, k and direction. The page is at /, the
    API under /v1/ (schema: /openapi.json). The token may also come from
    $EOGP_SERVE_TOKEN. Needs the serve extra: pip install 'eogp-index[serve]'.

    \b
    Example:
        eogp serve my-index --port 8000
        curl -s localhost:8000/v1/query -d '{"text": "Parse a CSV file.", "k": 5}'
    """
    try:
        import uvicorn  # noqa: F401  (the serve extra; say how to get it before loading the model)
        import fastapi  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"eogp serve needs the serve extra ({exc.name} is not installed): "
                                   "pip install 'eogp-index[serve]'") from exc
    from eogp_index.serve.app import create_app, open_index
    from eogp_index.serve.middleware import configure_logging

    config = ServeConfig(**serving, **limits)
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.token is None:
        click.echo(f"warning: serving on {config.host} without --token: anyone who can reach it can query",
                   err=True)
    configure_logging()
    index = open_index(index_dir, device=device, batch_size=config.max_batch, model_name=model_name,
                       projection_memory_gb=projection_memory_gb)
    app = create_app(index, config)
    click.echo(f"serving {index_dir} on http://{config.host}:{config.port}/ (Ctrl-C stops)", err=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)


@cli.command()
@click.argument("model")
@_projection_options
@option_group(field_option(StorageConfig, "precision"), into="storage")
@field_option(CurvatureConfig, "num_examples", "--curvature-examples")
@option_group(*(field_option(GradientConfig, name) for name in ("max_tokens", "batch_size")), into="gradients")
@click.option("--module", "modules", multiple=True, help="Module name or glob to attribute (repeatable).")
@click.option("--documents", type=click.IntRange(min=0), default=1_000_000, show_default=True,
              help="Documents in the store, for its size.")
@click.option("--all-modules", is_flag=True, help="One line per module (default: modules alike in every block, grouped).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_fail_cleanly
def plan(model, projection, storage, num_examples, gradients, modules, documents, all_modules, as_json):
    """Print the storage accounting of an index before fitting it: nothing runs.

    MODEL is a hub name, a local model directory or a config.json; only its
    config is read (the model is built on PyTorch's meta device, without
    weights). Takes eogp fit's options and gives, per attributed module, d_u,
    m_u and k_u; the bytes per example; the shared bytes (eigenbases, P); the
    fit's cache on disk; estimates of the peak memory of fit, ingest and query
    (each says what it counts); and the store's size for --documents.

    \b
    Example:
        eogp plan examples/default/model -k 256 --documents 1000000
        eogp plan allenai/OLMo-2-0425-1B --budget-kb 28 --pca-examples 10000 --max-tokens 512 --json
    """
    from eogp_index.fit.plan import format_plan, make_plan, model_shape

    if projection["k"] is None and projection["budget_kb"] is None:
        projection["k"] = 256
    config = ProjectionConfig(**projection)
    gradients = GradientConfig(**gradients)
    shape = model_shape(model, list(modules) or None)
    result = make_plan(shape, config, precision=StorageConfig(**storage).precision, curvature_examples=num_examples,
                       batch_size=gradients.batch_size, max_tokens=gradients.max_tokens, documents=documents)
    _emit(result, as_json, lambda data: click.echo(format_plan(data, all_modules=all_modules)))


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
        raise click.ClickException(f"{' and '.join(wrong)} of {index_dir} differ from the manifest: queries would be "
                                   "wrong. Restore the files the index was built with, or rebuild it (eogp fit).")


def _print_verify(report: dict) -> None:
    for part in ("projection", "model"):
        entry = report[part]
        what = entry.get("file") or entry.get("name")
        click.echo(f"{part:<11} {'ok' if entry['ok'] else 'DIFFERS'}  {what}")
        click.echo(f"            sha256 {entry['sha256']}" + ("" if entry["sha256"] == entry["expected_sha256"] else
                                                          f" (manifest: {entry['expected_sha256']})"))


def _print_info(data: dict) -> None:
    modules = data["modules"]
    click.echo(f"index       {data['path']}")
    click.echo(f"model       {data['model']['name']}  (sha256 {data['model']['weights_sha256'][:12]}…)")
    click.echo(f"variant     {data['projection']['variant']}, precision {data['precision']}, "
               f"damping ratio {data['damping_ratio']}")
    click.echo(f"modules     {len(modules)}  (k = {sorted({m['k'] for m in modules})}, "
               f"m = {sorted({m['m'] for m in modules})})")
    fidelity = data["projection"].get("fidelity")
    if fidelity:
        click.echo(f"1-bit code  per module, held-out NDCG@{fidelity['ndcg_at']} / Spearman against FP16 "
                   "(EOGP | EOGP-rot):")
        for name, c in fidelity["modules"].items():
            cells = " | ".join(_fidelity_cell(c.get(code), fidelity["ndcg_at"]) for code in ("eogp", "eogp-rot"))
            stored = c["code"] if data["projection"]["variant"] == "auto" else data["projection"]["variant"]
            click.echo(f"            {name:<28} {stored:<8} {cells}  ({c['held_out']} held out; measured best: "
                       f"{c['code']})")
    click.echo(f"bytes/row   {data['bytes_per_example']}")
    click.echo(f"rows        {data['rows']}  (table version {data['table_version']})")


def _fidelity_cell(entry: Optional[dict], ndcg_at: int) -> str:
    if not entry or entry.get(f"ndcg@{ndcg_at}") is None:
        return "n/a"
    spearman = entry.get("spearman")
    return f"{entry[f'ndcg@{ndcg_at}']:.3f} / " + ("n/a" if spearman is None else f"{spearman:.3f}")


def _print_results(results: list) -> None:
    from eogp_index.store.table import RESERVED_COLUMNS

    for item in results:
        q = item["query"]
        text = q if isinstance(q, str) else q.get("text") if isinstance(q, dict) else None
        text = text if text is not None else json.dumps(q)
        click.echo(f"\nquery: {' '.join(text.split())[:100]}")
        for row in item["results"]:
            # The user's own metadata says what a document is; bookkeeping columns come after.
            user = [k for k in row if k not in RESERVED_COLUMNS and k not in ("rank", "score", "direction")]
            shown = user[:4] + [k for k in ("shard", "position") if k in row][: max(0, 2 - len(user[:4]))]
            preview = ", ".join(f"{k}={row[k]}" for k in shown)
            side = f"{row['direction'][:3]} " if "direction" in row else ""
            click.echo(f"  {side}#{row['rank']:<3} {row['score']:+.4e}  {row['id']}  {preview}")
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
