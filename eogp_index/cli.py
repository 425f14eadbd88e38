"""``eogp``: the command line, a thin layer over the library.

Every command prints human-readable output, or JSON with ``--json``; user errors exit non-zero
with a one-line message saying what to fix.
"""

from __future__ import annotations

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

INDEX_DIR = click.Path(exists=True, file_okay=False, path_type=Path)

#: Which record fields hold what (``fit`` and ``ingest``); the command gets them as ``record``.
_record_options = option_group(
    *(field_option(RecordSpec, name) for name in ("text_field", "messages_field", "input_ids_field", "labels_field",
                                                  "id_field")),
    field_option(RecordSpec, "metadata_fields", "--metadata", multiple=True),
    into="record",
)
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
@click.option("--data", "data", multiple=True, required=True,
              help="Shard files or globs (JSONL[.gz/.zst], Parquet, datasets.save_to_disk dirs) to fit on.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Index directory to create.")
@option_group(
    field_option(ProjectionConfig, "variant"),
    field_option(ProjectionConfig, "k", "-k", "--k", help="Output coordinates per module (256 unless --budget-kb)."),
    field_option(ProjectionConfig, "budget_kb"),
    field_option(ProjectionConfig, "m", "--m"),
    field_option(ProjectionConfig, "num_fit_examples", "--pca-examples"),
    into="projection",
)
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
@click.option("--overwrite", is_flag=True, help="Replace an existing index at --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_record_options
@_fail_cleanly
def fit(model, data, out, projection, storage, curvature, modules, gradients, seed, table_uri, overwrite, as_json,
        record):
    """Fit EK-FAC curvature and the projection; create an empty index.

    MODEL is a HuggingFace hub name or a local model directory. The first
    max(--curvature-examples, --pca-examples) documents of --data are the fitting set:
    pass a dedicated shard to fit on a random sample.

    \b
    Example:
        eogp fit examples/default/model --data examples/default/corpus/train.jsonl.gz --out my-index -k 256
    """
    import itertools

    from eogp_index.data.readers import expand_shards
    from ingest.records import Example, iter_examples

    from eogp_index.client import AttributionIndex
    from eogp_index.gradients.model import load_model

    if projection["k"] is None and projection["budget_kb"] is None:
        projection["k"] = 256
    gradients = GradientConfig(**gradients)
    projection = ProjectionConfig(**projection, seed=seed)
    curvature = CurvatureConfig(**curvature, batch_size=gradients.batch_size, seed=seed)
    spec = RecordSpec(**record, max_tokens=gradients.max_tokens)
    loaded, tokenizer = load_model(model, device=gradients.resolved_device())
    wanted = max(curvature.num_examples, projection.num_fit_examples if projection.variant == "eogp" else 0)
    stream = (e for e in iter_examples(expand_shards(data), spec, tokenizer, on_error="skip") if isinstance(e, Example))
    examples = list(itertools.islice(stream, wanted))
    click.echo(f"fitting on {len(examples)} documents", err=True)
    index = AttributionIndex.create(out, loaded, tokenizer, examples, model_name=model,
                                    modules=list(modules) or None, curvature=curvature, projection=projection,
                                    storage=StorageConfig(**storage), gradients=gradients,
                                    table_uri=table_uri, mode="overwrite" if overwrite else "create")
    _emit(index.info(), as_json, _print_info)


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
@click.option("--shard-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Name shards by their path relative to this directory (needed when file names repeat); "
                   "keep it the same across runs.")
@distributed_option
@click.option("--commit-every", type=click.IntRange(min=1), default=None,
              help="Under torchrun: steps between commits (default 1); a crash loses at most this many steps.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_record_options
@_fail_cleanly
def ingest(index_dir, shards, on_error, rejects, batch_size, model_name, device, shard_root, distributed,
           commit_every, as_json, record):
    """Store corpus shards in an index. Safe to rerun: stored examples are skipped.

    Under torchrun (several workers, or --distributed) the shards are dealt out to the
    workers, each projects its share and rank 0 commits their rows together.

    \b
    Example:
        eogp ingest my-index 'data/shard-*.jsonl.zst' --metadata source --on-error skip
        torchrun --nproc_per_node 8 -m eogp_index.cli ingest my-index 'data/*.parquet' --commit-every 4
    """
    spec = RecordSpec(**record)  # max_tokens: the index's
    gradients = GradientConfig(batch_size=batch_size or GradientConfig().batch_size, device=device)
    options = dict(spec=spec, on_error=on_error, rejects_path=rejects, batch_size=batch_size,
                   progress=not as_json, shard_root=shard_root)
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
@_model_option
@field_option(GradientConfig, "device")
@distributed_option
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@_fail_cleanly
def query(index_dir, texts, queries_file, limit_queries, k, where, direction, candidates, stream, model_name, device,
          distributed, as_json):
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

    queries: List[Any] = list(texts)
    if queries_file is not None:
        from eogp_index.data.readers import iter_raw_records

        for raw in iter_raw_records(queries_file):
            if not isinstance(raw.record, dict):
                raise click.ClickException(f"{raw.record.location}: {raw.record.reason}")
            queries.append(raw.record)
    if limit_queries is not None:
        queries = queries[:limit_queries]
    if not queries:
        raise click.UsageError("give --text or --queries")
    sharded = under_torchrun(distributed)
    if sharded and (candidates is not None or stream):
        raise click.UsageError("--candidates and --stream choose single-process routes; drop them under torchrun")
    with process_group():
        gradients = GradientConfig(device=worker_device(device) if sharded else device)
        index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
        if index.store.count() == 0 and torchrun_rank() == 0:
            click.echo(f"{index_dir} has no rows yet: nothing has been ingested. "
                       f"Store documents first: eogp ingest {index_dir} SHARDS...", err=True)
        search = index.search(queries, many=True).limit(k).where(where).direction(direction)
        if candidates is not None:
            search = search.candidates(candidates)
        elif stream or sharded:
            search = search.route("sharded" if sharded else "stream")
        tables = search.to_list()  # one gradient pass for all the queries
    if torchrun_rank() == 0:
        _emit([{"query": q, "results": t.to_pylist()} for q, t in zip(queries, tables)], as_json, _print_results)


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
    _emit({"column": column, "kind": kind, "indices": [str(i.name) for i in store.table.list_indices()]},
          as_json, lambda d: click.echo(f"indexed {d['column']} ({d['kind']})"))


@cli.command("build-faiss")
@click.argument("index_dir", type=INDEX_DIR)
@click.option("--kind", type=click.Choice(["flat", "ivf", "hnsw"]), default="flat", show_default=True,
              help="FAISS binary index: exact Hamming (flat), inverted lists (ivf) or a graph (hnsw).")
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
    from eogp_index.search.candidates import CandidateIndex, FaissConfig, build
    from eogp_index.store.stored_index import StoredIndex

    index = StoredIndex.open(index_dir)  # the stored signs are all it needs: no model
    if extend_only:
        faiss_index = CandidateIndex.load(index_dir, name)
        added = faiss_index.extend(index, progress=not as_json)
    else:
        config = FaissConfig(kind=kind) if replicas is None else FaissConfig(kind=kind, replicas=replicas)
        faiss_index = build(index, name, config, progress=not as_json)
        added = faiss_index.ntotal
    _emit({"name": name, "kind": faiss_index.config.kind, "replicas": faiss_index.replicas,
           "rows": faiss_index.ntotal, "added": added}, as_json,
          lambda d: click.echo(f"FAISS index {d['name']!r}: {d['rows']} rows ({d['added']} added), "
                               f"{d['replicas']} replicas per sign bit"))


def _print_info(data: dict) -> None:
    modules = data["modules"]
    click.echo(f"index       {data['path']}")
    click.echo(f"model       {data['model']['name']}  (sha256 {data['model']['weights_sha256'][:12]}…)")
    click.echo(f"variant     {data['projection']['variant']}, precision {data['precision']}, "
               f"damping ratio {data['damping_ratio']}")
    click.echo(f"modules     {len(modules)}  (k = {sorted({m['k'] for m in modules})}, "
               f"m = {sorted({m['m'] for m in modules})})")
    click.echo(f"bytes/row   {data['bytes_per_example']}")
    click.echo(f"rows        {data['rows']}  (table version {data['table_version']})")


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


cli.add_command(eval_group)


def main(argv: Optional[List[str]] = None) -> None:
    cli.main(args=argv, prog_name="eogp")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
