"""``eogp``: the command line, a thin layer over the library.

Every command prints human-readable output, or JSON with ``--json``; user errors exit non-zero
with a one-line message saying what to fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import click

from eogp_index.cliutil import emit as _emit
from eogp_index.cliutil import fail_cleanly as _fail_cleanly


def _record_options(func: Callable) -> Callable:
    """Options naming the fields of corpus records (shared by ``fit`` and ``ingest``)."""
    options = [
        click.option("--text-field", default="text", show_default=True, help="Field holding plain text."),
        click.option("--messages-field", default="messages", show_default=True,
                     help="Field holding a chat (list of {role, content}); loss on assistant turns only."),
        click.option("--input-ids-field", default="input_ids", show_default=True, help="Field of pre-tokenized ids."),
        click.option("--labels-field", default="labels", show_default=True, help="Field of labels (-100 = ignored)."),
        click.option("--id-field", default=None, help="Field to use as the example id (default: a stable hash)."),
        click.option("--metadata", "metadata_fields", multiple=True,
                     help="Record field stored as a typed column, usable in --where (repeatable)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _spec(text_field, messages_field, input_ids_field, labels_field, id_field, metadata_fields, max_tokens):
    from eogp_index.gradients.records import RecordSpec

    return RecordSpec(text_field=text_field, messages_field=messages_field, input_ids_field=input_ids_field,
                      labels_field=labels_field, id_field=id_field, metadata_fields=tuple(metadata_fields),
                      max_tokens=max_tokens)


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
@click.option("--variant", type=click.Choice(["eogp", "eogp-r", "ekfac-topk"]), default="eogp", show_default=True,
              help="Second stage: PCA (eogp), SRHT (eogp-r), none (ekfac-topk ablation).")
@click.option("-k", "--k", "k", type=int, default=None, help="Coordinates per module.")
@click.option("--budget-kb", type=float, default=None, help="Per-example storage budget in KiB (instead of -k).")
@click.option("--m", "m", type=int, default=None, help="First-stage width per module (default min(d_u, 8k)).")
@click.option("--precision", type=click.Choice(["1bit", "fp16", "fp32"]), default="1bit", show_default=True)
@click.option("--curvature-examples", type=int, default=1000, show_default=True,
              help="Examples used to fit EK-FAC.")
@click.option("--pca-examples", type=int, default=1000, show_default=True, help="Examples in the PCA fitting set.")
@click.option("--damping-ratio", type=float, default=0.1, show_default=True, help="λ_u = ratio · tr(Λ_u)/d_u.")
@click.option("--module", "modules", multiple=True, help="Module name or glob to attribute (repeatable).")
@click.option("--max-tokens", type=int, default=None, help="Truncate documents and queries to this many tokens.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--table-uri", default=None,
              help="LanceDB URI for the table (e.g. s3://bucket/prefix); default: inside --out.")
@click.option("--overwrite", is_flag=True, help="Replace an existing index at --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_record_options
@_fail_cleanly
def fit(model, data, out, variant, k, budget_kb, m, precision, curvature_examples, pca_examples, damping_ratio,
        modules, max_tokens, batch_size, device, seed, table_uri, overwrite, as_json, text_field, messages_field,
        input_ids_field, labels_field, id_field, metadata_fields):
    """Fit EK-FAC curvature and the projection; create an empty index.

    MODEL is a HuggingFace hub name or a local model directory. The first
    max(--curvature-examples, --pca-examples) documents of --data are the fitting set:
    pass a dedicated shard to fit on a random sample.

    \b
    Example:
        eogp fit examples/default/model --data examples/default/corpus/train.jsonl.gz --out my-index -k 256
    """
    import itertools

    from ingest.records import Example, iter_examples
    from ingest.readers import expand_shards

    from eogp_index.client import AttributionIndex
    from eogp_index.gradients.model import load_model
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig

    if k is None and budget_kb is None:
        k = 256
    gradients = GradientConfig(batch_size=batch_size, max_tokens=max_tokens, device=device)
    projection = ProjectionConfig(variant=variant, k=k, budget_kb=budget_kb, m=m, num_fit_examples=pca_examples,
                                  seed=seed)
    curvature = CurvatureConfig(num_examples=curvature_examples, batch_size=batch_size, damping_ratio=damping_ratio,
                                seed=seed)
    loaded, tokenizer = load_model(model, device=gradients.resolved_device())
    spec = _spec(text_field, messages_field, input_ids_field, labels_field, id_field, metadata_fields, max_tokens)
    wanted = max(curvature_examples, pca_examples if variant == "eogp" else 0)
    stream = (e for e in iter_examples(expand_shards(data), spec, tokenizer, on_error="skip") if isinstance(e, Example))
    examples = list(itertools.islice(stream, wanted))
    click.echo(f"fitting on {len(examples)} documents", err=True)
    index = AttributionIndex.create(out, loaded, tokenizer, examples, model_name=model,
                                    modules=list(modules) or None, curvature=curvature, projection=projection,
                                    storage=StorageConfig(precision=precision), gradients=gradients,
                                    table_uri=table_uri, mode="overwrite" if overwrite else "create")
    _emit(index.info(), as_json, _print_info)


@cli.command()
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("shards", nargs=-1, required=True)
@click.option("--on-error", type=click.Choice(["raise", "skip"]), default="raise", show_default=True,
              help="raise: stop at the first bad record; skip: list bad records in a rejects file.")
@click.option("--rejects", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write rejected records (default: INDEX/rejects/<time>.jsonl).")
@click.option("--batch-size", type=int, default=None, help="Examples per batch (one commit each).")
@click.option("--model", "model_name", default=None,
              help="Load the model from here instead of the path or name in the manifest (it must be the same model).")
@click.option("--device", default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_record_options
@_fail_cleanly
def ingest(index_dir, shards, on_error, rejects, batch_size, model_name, device, as_json, text_field, messages_field,
           input_ids_field, labels_field, id_field, metadata_fields):
    """Store corpus shards in an index. Safe to rerun: stored examples are skipped.

    For several GPUs or nodes: torchrun --nproc_per_node N -m ingest.distributed --help

    \b
    Example:
        eogp ingest my-index 'data/shard-*.jsonl.zst' --metadata source --on-error skip
    """
    from ingest.pipeline import run_ingest

    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    gradients = GradientConfig(batch_size=batch_size or 8, device=device)
    index = AttributionIndex.open(index_dir, model_name=model_name, gradients=gradients)
    spec = _spec(text_field, messages_field, input_ids_field, labels_field, id_field, metadata_fields,
                 index.manifest.max_tokens)
    summary = run_ingest(index, list(shards), spec=spec, on_error=on_error, rejects_path=rejects,
                         batch_size=batch_size, progress=not as_json)
    _emit(summary.to_json(), as_json, lambda s: click.echo("\n".join(f"{k:>18}: {v}" for k, v in s.items())))


@cli.command()
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--text", "texts", multiple=True, help="A query text (repeatable).")
@click.option("--queries", "queries_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL file of queries: {text} / {messages} / {input_ids} records.")
@click.option("--limit-queries", type=int, default=None, help="Use only the first N queries of --queries.")
@click.option("-k", "k", type=int, default=10, show_default=True, help="How many examples per direction.")
@click.option("--where", default=None, help="SQL filter on stored columns, e.g. \"kind = 'function'\".")
@click.option("--direction", type=click.Choice(["positive", "negative", "both"]), default="both", show_default=True)
@click.option("--candidates", type=int, default=None,
              help="Rescore only this many FAISS candidates per direction (needs `eogp build-faiss`).")
@click.option("--stream", is_flag=True, help="Scan the table in batches instead of an in-memory copy.")
@click.option("--model", "model_name", default=None,
              help="Load the model from here instead of the path or name in the manifest (it must be the same model).")
@click.option("--device", default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@_fail_cleanly
def query(index_dir, texts, queries_file, limit_queries, k, where, direction, candidates, stream, model_name, device,
          as_json):
    """Show the stored examples that most influence each query.

    Positive scores: training on the example lowers the query's loss.

    \b
    Example:
        eogp query my-index --text "Parse a CSV file." -k 5 --where "num_tokens > 50"
    """
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    queries: List[Any] = list(texts)
    if queries_file is not None:
        from ingest.readers import iter_raw_records

        for raw in iter_raw_records(queries_file):
            if not isinstance(raw.record, dict):
                raise click.ClickException(f"{raw.record.location}: {raw.record.reason}")
            queries.append(raw.record)
    if limit_queries is not None:
        queries = queries[:limit_queries]
    if not queries:
        raise click.UsageError("give --text or --queries")
    index = AttributionIndex.open(index_dir, model_name=model_name, gradients=GradientConfig(device=device))
    results = []
    for q in queries:
        table = index.top_influential(q, k=k, where=where, direction=direction, candidates=candidates,
                                      stream=stream)
        results.append({"query": q, "results": table.to_pylist()})
    _emit(results, as_json, _print_results)


@cli.command()
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@_fail_cleanly
def info(index_dir, as_json):
    """Show an index's manifest, row count and bytes per example.

    \b
    Example:
        eogp info my-index --json
    """
    from eogp_index.store.manifest import Manifest
    from eogp_index.store.table import Store

    manifest = Manifest.load(index_dir)
    store = Store(manifest.store_uri(index_dir), manifest.table)
    data = manifest.to_json()
    data.update(rows=store.count(), table_version=store.version, path=str(index_dir))
    _emit(data, as_json, _print_info)


@cli.command("index-column")
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
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
    from eogp_index.store.manifest import Manifest
    from eogp_index.store.table import Store

    manifest = Manifest.load(index_dir)
    store = Store(manifest.store_uri(index_dir), manifest.table)
    store.create_scalar_index(column, kind)
    _emit({"column": column, "kind": kind, "indices": [str(i.name) for i in store.table.list_indices()]},
          as_json, lambda d: click.echo(f"indexed {d['column']} ({d['kind']})"))


@cli.command("build-faiss")
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
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
    from eogp_index.client import AttributionIndex

    index = AttributionIndex.open(index_dir)
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


def _register_subgroups() -> None:
    from eogp_index.evaluation.cli import eval_group

    cli.add_command(eval_group)


_register_subgroups()


def main(argv: Optional[List[str]] = None) -> None:
    cli.main(args=argv, prog_name="eogp")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
