"""Cost of explaining hits, side by side with what it is made of, in one run.

On an index (default: the demo's ``default-index``, built by ``make demo``), for each of a few
queries from ``examples/default/queries.jsonl``:

* the query's top ``--top`` hits (``top_influential``: one query gradient + the scan);
* ``explain_many`` of those hits (one batched pass over the documents and the query);
* a bare forward and backward pass over the same documents (``GradientCapture`` with a transform
  that only keeps the gradient's shape), and the same with the index's projection of whole
  documents (what ingest does);

and prints each time and the ratios ``explain / (bare pass)`` and ``explain / (projected pass)``.
The target: explaining a hit costs about one forward and backward pass of the document
plus the projection, not a pass over the store. Also printed: the stored text's bytes per row
(``--store-text``) next to the codes' bytes. Targets are printed, never asserted. ``--json PATH``
also writes the figures as one JSON object.

Usage: python benchmarks/explain.py [--index default-index] [--top 10] [--queries 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common

from eogp_index.client import AttributionIndex
from eogp_index.gradients.capture import GradientCapture, project_examples
from eogp_index.gradients.model import pad_token_id

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn) -> float:
    """Wall seconds of the fastest of three runs."""
    return common.best_of(fn, 3).seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", default=str(ROOT / "default-index"))
    parser.add_argument("--queries-file", default=str(ROOT / "examples/default/queries.jsonl"))
    parser.add_argument("--queries", type=int, default=3)
    parser.add_argument("--top", type=int, default=10)
    common.add_json_argument(parser)
    args = parser.parse_args()
    show = print if not common.prints_json(args) else (lambda *a, **k: None)
    figures = {"index": args.index, "top": args.top, "queries": []}
    if not Path(args.index, "manifest.json").exists():
        sys.exit(f"no index at {args.index}: run `make demo` first (or pass --index)")
    index = AttributionIndex.open(args.index)
    queries = [json.loads(line) for line in Path(args.queries_file).read_text().splitlines()[: args.queries]]
    names = index.manifest.module_names
    bare = GradientCapture(index.model, names, lambda name, a, g: g.sum(dim=1))
    projected = GradientCapture(index.model, names, index.projection.transform)
    pad = pad_token_id(index.tokenizer)
    show(
        f"index {args.index}: {index.info()['rows']} rows, {len(names)} modules, "
        f"{index.manifest.bytes_per_example} code bytes per row; top {args.top}; 2 threads, best of 3"
    )
    for query in queries:
        hits = index.top_influential(query, k=args.top, direction="positive").column("id").to_pylist()
        docs = [index.stored.document(i, index.tokenizer) for i in hits]
        tokens = sum(len(d.input_ids) for d in docs)
        t_query = best_of(lambda: index.top_influential(query, k=args.top, direction="positive"))
        t_explain = best_of(lambda: index.explain_many(query, hits))
        t_bare = best_of(
            lambda: project_examples(bare, docs, batch_size=len(docs), pad_token_id=pad, device=index.device)
        )
        t_proj = best_of(
            lambda: project_examples(projected, docs, batch_size=len(docs), pad_token_id=pad, device=index.device)
        )
        label = (query.get("text") or json.dumps(query))[:60].replace("\n", " ")
        figures["queries"].append(
            {
                "query": label,
                "documents": len(docs),
                "tokens": tokens,
                "query_seconds": t_query,
                "explain_seconds": t_explain,
                "bare_seconds": t_bare,
                "projected_seconds": t_proj,
                "explain_over_bare": t_explain / t_bare,
                "explain_over_projected": t_explain / t_proj,
            }
        )
        show(f"\nquery {label!r}: {len(docs)} documents, {tokens} tokens")
        show(f"  top-{args.top} query           {t_query * 1e3:8.1f} ms")
        show(f"  explain_many({len(docs)})        {t_explain * 1e3:8.1f} ms")
        show(f"  bare fwd+bwd of the docs   {t_bare * 1e3:8.1f} ms   explain / bare      = {t_explain / t_bare:5.2f}")
        show(f"  projected fwd+bwd (ingest) {t_proj * 1e3:8.1f} ms   explain / projected = {t_explain / t_proj:5.2f}")
    if "text" in (index.store.schema.names if index.store.schema is not None else []):
        texts = index.store.read(["text"]).column("text").to_pylist()
        sizes = [len(t.encode("utf-8")) for t in texts if t is not None]
        show(
            f"\nstored text: {sum(sizes) / max(1, len(sizes)):.0f} bytes per row on average (max {max(sizes)}), "
            f"{len(texts) - len(sizes)} rows over the cap; codes: {index.manifest.bytes_per_example} bytes per row"
        )
        figures["stored_text"] = {
            "mean_bytes": sum(sizes) / max(1, len(sizes)),
            "max_bytes": max(sizes),
            "rows_over_cap": len(texts) - len(sizes),
        }
    figures.update(rows=index.info()["rows"], modules=len(names), code_bytes=index.manifest.bytes_per_example)
    common.write_json(args.json, figures)


if __name__ == "__main__":
    main()
