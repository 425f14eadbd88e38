#!/usr/bin/env python
"""Peak memory of ``eogp select`` (streamed) next to a plain query's, at a large row count.

Builds a tiny index (a small GPT-2 made from a config, a word tokenizer, 64 documents), grows it
to ``--rows`` rows with :func:`benchmarks.filters.grow` (codes copied from the real rows with
bits flipped), then measures in fresh processes, one per measurement, the peak resident set
(``common.peak_rss_bytes``) of:

* **query**: ``top_influential(q, k=20)`` — the default route, which loads the hot copy;
* **select**: ``select_documents`` with ``--top 10%`` and ``--score mean``, ids and scores
  written with :func:`write_selection` (``ids_only``: the grown rows have no shard records);
* **select max**: the same with ``--score max`` over 8 target queries.

Each line gives the measurement's peak RSS, its ratio to the query's, and how much it grew past
the peak of opening the index (model loaded, before the operation). ``--json PATH`` also
writes the figures as one JSON object.

    python benchmarks/selection.py --rows 1000000
    python benchmarks/selection.py --rows 200000      # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_json_argument, peak_rss_bytes, prints_json, write_json

QUERIES = [" ".join(f"t{(q * 5 + j * 3) % 60 + 2}" for j in range(8)) for q in range(8)]


def build(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from eogp_index.cli import main

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(64)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0", eos_token="t0")
    model.save_pretrained(path / "model")
    tokenizer.save_pretrained(path / "model")
    docs = path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": " ".join(f"t{(i * 11 + j * j) % 63 + 1}" for j in range(12))}) + "\n" for i in range(64)
        )
    )
    for args in (
        [
            "fit",
            str(path / "model"),
            "--data",
            str(docs),
            "--out",
            str(path / "small"),
            "-k",
            "64",
            "--curvature-examples",
            "32",
            "--pca-examples",
            "32",
        ],
        ["ingest", str(path / "small"), str(docs)],
    ):
        try:
            main(args)
        except SystemExit as exc:
            if exc.code:
                raise


def measure(path: Path, what: str) -> None:
    """Runs in a fresh process; prints one JSON line."""
    import numpy as np  # noqa: F401  (loaded before the baseline, as by every measurement)

    from eogp_index.client import AttributionIndex
    from eogp_index.config import SelectOptions
    from eogp_index.search.select import select_documents, write_selection

    index = AttributionIndex.open(path / "grown", model_name=str(path / "model"))
    opened = peak_rss_bytes() / 2**20
    started = time.perf_counter()
    if what == "query":
        index.top_influential(QUERIES[0], k=20)
        picked = 20
    else:
        how = "max" if what == "select max" else "mean"
        selection = select_documents(index, QUERIES, SelectOptions(top="10%", score=how, ids_only=True))
        picked = write_selection(index.stored, selection, path / "subset.parquet")
    print(
        json.dumps(
            {
                "what": what,
                "rows": index.store.count(),
                "picked": picked,
                "seconds": time.perf_counter() - started,
                "opened_rss_mb": opened,
                "peak_rss_mb": peak_rss_bytes() / 2**20,
            }
        )
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--commit", type=int, default=65536, help="rows per commit while growing")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the index here (reused if present)")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--what", default="query", help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.measure is not None:
        measure(args.measure, args.what)
        return
    from filters import grow

    work = args.workdir or Path(tempfile.mkdtemp(prefix="eogp-bench-select-"))
    if not (work / "small").exists():
        build(work)
    grow(work / "small", work / "grown", args.rows, args.commit)
    results = []
    for what in ("query", "select", "select max"):
        done = subprocess.run(
            [sys.executable, __file__, "--measure", str(work), "--what", what],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = results[0]["peak_rss_mb"]
    write_json(args.json, [{**r, "over_query": r["peak_rss_mb"] / base} for r in results])
    if prints_json(args):
        return
    print(f"{results[0]['rows']:,} rows")
    for r in results:
        print(
            f"  {r['what']:<11} peak RSS {r['peak_rss_mb']:8.0f} MB  ({r['peak_rss_mb'] / base:4.2f} x query)  "
            f"+{r['peak_rss_mb'] - r['opened_rss_mb']:6.0f} MB over the opened index  "
            f"{r['picked']:>9,} picked  {r['seconds']:6.1f} s"
        )


if __name__ == "__main__":
    main()
