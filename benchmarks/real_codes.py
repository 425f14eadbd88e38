#!/usr/bin/env python
"""First passes on real gradient codes: a corpus of real documents through the shipped model.

``build`` makes the corpus and the index, outside the repository and the test suite, in a cache
folder (``--cache``, default ``real-codes/`` under ``$EOGP_BENCH_CACHE`` or ``~/.cache/eogp-bench``):

* **Corpus.** Two local text sources, deduplicated by text. First the docstrings of the
  installed Python packages (every ``.py`` file under the site-packages of the running
  interpreter, then its standard library; read with ``ast``, no import): each module's, class's
  and function's own docstring, cleaned with ``inspect.cleandoc``. Then the English manual pages
  under ``/usr/share/man/man[1-8]`` (the roff source with its requests and font escapes
  stripped, no ``man`` run). Each text is cut at blank lines into documents of ``--min-chars``
  to about ``--max-chars`` characters. A seeded hash of each text puts ``--held-out`` (5%) of the documents in
  ``queries.jsonl`` (never ingested) and the rest in shards of ``--shard-docs`` documents
  (``corpus/shard-NNNN.jsonl.gz``), the first ``--docs`` documents in all, in a seeded random
  order within each source (a smaller ``--docs`` is a uniform sample of the docstrings, and its
  shards a prefix of a larger one's).
* **Index.** ``eogp fit`` of ``examples/default/model`` as ``make demo`` fits it (on the shipped
  fine-tuning set, ``-k 256``, 128 tokens), then ``eogp ingest`` of the shards in order, one
  command per shard. Every step is skipped when its output is there and ingest skips stored
  rows, so the same command resumes a killed build and grows a smaller one to ``--docs``.

``measure`` projects the held-out documents (``--queries`` of them) with the index's model (from
``--model``, the shipped one by default: a cached index may name a checkout that is gone) and,
for each first-pass kind (``eogp build-candidates --kind``, built with its default configuration
or the one parameter given, as ``bench-<kind>`` in the index), each budget ``C``
(``--budgets``, multiples of ``k = 20``) and each side, reports the share of the exact one-bit
top-20 (the exact scan of every row) found in the candidate answer, and the time of one query
(both sides) side by side with the exact scan's (the median over the queries of each query's
best of ``--repeat``)::

    python benchmarks/real_codes.py build                    # 100k documents ingested; resumes
    python benchmarks/real_codes.py build --docs 20000       # fewer
    python benchmarks/real_codes.py measure                  # the table
    python benchmarks/real_codes.py measure --json out.json  # and the figures as JSON
    python benchmarks/real_codes.py rescoring                # the tier's top-k in the one-bit top F·k

``rescoring`` scores every row by the index's tier (a full scan, float32) and, per held-out query
and side, reports the share of the tier's top ``k`` found in the exact one-bit top ``F · k``.

``table-recall`` runs the measurement the index itself makes after each ingest
(``eogp_index.store.table_recall``) with two query sets: the fit's held-out documents
(``fit/fitting_set.json``'s ``pca_held_out``, at most 64, projected as queries: an index fitted
before ``recall_queries.safetensors`` was saved keeps no other record of them) and the corpus's
held-out queries (``rescoring``'s); ``--write`` records the first as the index's
``table_recall.json``::

    python benchmarks/real_codes.py table-recall --write
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import common

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "default" / "model"
FIT_DATA = REPO / "examples" / "default" / "corpus" / "train.jsonl.gz"
SEED = "eogp-real-codes-1"


def default_cache() -> Path:
    return Path(os.environ.get("EOGP_BENCH_CACHE", Path.home() / ".cache" / "eogp-bench")) / "real-codes"


# -- corpus ------------------------------------------------------------------------------------


def chunks(text: str, min_chars: int, max_chars: int) -> List[str]:
    """A docstring cut at blank lines into documents of ``min_chars`` characters or more,
    consecutive paragraphs joined until one more would pass ``max_chars`` (most of a document
    then fits the 128 tokens the model was fine-tuned on)."""
    out, current = [], ""
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if not paragraph:
            continue
        if current and len(current) >= min_chars and len(current) + len(paragraph) + 2 > max_chars:
            out.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if len(current) >= min_chars:
        out.append(current)
    return out


def _docstrings(path: Path, root: Path, min_chars: int, max_chars: int) -> Iterator[Tuple[str, str, str]]:
    """(qualname, kind, text) of a source file's module, class and function docstrings."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError, RecursionError):
        return
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    stack: List[Tuple[ast.AST, str, str]] = [(tree, module, "module")]
    while stack:
        node, name, kind = stack.pop()
        doc = ast.get_docstring(node, clean=False)
        if isinstance(doc, str):
            for part, text in enumerate(chunks(inspect.cleandoc(doc).strip(), min_chars, max_chars)):
                yield (f"{name}#{part}" if part else name), kind, text
        for child in getattr(node, "body", []):
            if isinstance(child, ast.ClassDef):
                stack.append((child, f"{name}.{child.name}", "class"))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, f"{name}.{child.name}", "function"))


#: roff requests whose arguments are running text (the others are layout and are dropped).
TEXT_REQUESTS = {"B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "TP", "IP", "SS", "Nm", "Nd"}
#: roff requests that end a paragraph.
BREAKS = {"PP", "LP", "P", "SH", "SS", "TP", "IP", "Sh", "Pp", "sp", "br", "HP"}
ESCAPES = re.compile(r"\\(f[BIRP]|f\(..|s[-+]?\d|\(..|\*\(..|\*.|[&|^%:])")


def roff_text(source: str) -> str:
    """The running text of a manual page's roff source: paragraphs separated by blank lines."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".", "'")):
            request, _, rest = line[1:].strip().partition(" ")
            if request in BREAKS:
                lines.append("")
            if request in TEXT_REQUESTS and rest:
                lines.append(rest.replace('"', ""))
            continue
        lines.append(line)
    text = ESCAPES.sub("", "\n".join(lines)).replace("\\-", "-").replace("\\e", "\\")
    return re.sub(r"\n{3,}", "\n\n", text)


def _manpages(min_chars: int, max_chars: int) -> Iterator[Tuple[str, str, str]]:
    """(page#part, "manpage", text) of every English manual page's paragraphs."""
    for path in sorted(Path("/usr/share/man").glob("man[1-8]/*")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        text = roff_text(raw.decode("utf-8", "replace"))
        paragraphs = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())
        for part, chunk in enumerate(chunks(paragraphs, min_chars, max_chars)):
            yield f"{path.name.split('.')[0]}#{part}", "manpage", chunk


def collect(min_chars: int, max_chars: int) -> List[Dict[str, Any]]:
    """Every docstring document of site-packages and the standard library, then every manual page
    document, each source in a seeded random order, deduplicated by text."""
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])]
    seen, sources = set(), []

    def keep(found: Iterator[Tuple[str, str, str]]) -> List[Dict[str, Any]]:
        docs = []
        for qualname, kind, text in found:
            if text not in seen:
                seen.add(text)
                doc_id = hashlib.sha1(text.encode()).hexdigest()[:16]
                docs.append({"text": text, "qualname": qualname, "kind": kind, "n_chars": len(text), "id": doc_id})
        # In a seeded random order: the first documents (a smaller --docs, or the shards a partial
        # build ingested) are a uniform sample of the source, not its first packages alphabetically.
        return sorted(docs, key=lambda d: _draw(d["id"], "order"))

    def docstrings() -> Iterator[Tuple[str, str, str]]:
        for root in roots:
            for path in sorted(root.rglob("*.py")):
                if root.name != "site-packages" and "site-packages" in path.parts:
                    continue
                yield from _docstrings(path, root, min_chars, max_chars)

    sources = keep(docstrings()) + keep(_manpages(min_chars, max_chars))
    return sources


def _draw(doc_id: str, what: str) -> float:
    """A seeded uniform draw in [0, 1) for a document."""
    digest = hashlib.sha256(f"{SEED}:{what}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def held_out(doc_id: str, share: float) -> bool:
    return _draw(doc_id, "held-out") < share


def write_corpus(cache: Path, args) -> List[Path]:
    """The shards (the first ``--docs`` documents, less the held-out ones) and queries.jsonl."""
    corpus = cache / "corpus"
    done = corpus / "corpus.json"
    if done.exists():
        found = json.loads(done.read_text()).get("settings", {})
        if found == _settings(args):
            return sorted(corpus.glob("shard-*.jsonl.gz"))
        other = {key: (found.get(key), value) for key, value in _settings(args).items() if key != "docs"}
        if any(a != b for a, b in other.values()) and (cache / "index").exists():
            raise SystemExit(
                f"{cache} holds an index of another corpus ({other}: cached, asked); "
                "give another --cache, or the cached corpus's settings"
            )
    corpus.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = collect(args.min_chars, args.max_chars)[: args.docs]
    train = [d for d in docs if not held_out(d["id"], args.held_out)]
    queries = [d for d in docs if held_out(d["id"], args.held_out)]
    for old in corpus.glob("shard-*.jsonl.gz"):
        old.unlink()
    shards = []
    for i in range(0, len(train), args.shard_docs):
        path = corpus / f"shard-{i // args.shard_docs:04d}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for doc in train[i : i + args.shard_docs]:
                f.write(json.dumps(doc) + "\n")
        shards.append(path)
    with open(corpus / "queries.jsonl", "w", encoding="utf-8") as f:
        for doc in queries:
            f.write(json.dumps(doc) + "\n")
    summary = {"settings": _settings(args), "documents": len(docs), "ingested": len(train), "held_out": len(queries)}
    done.write_text(json.dumps(summary, indent=1))
    print(f"corpus: {summary} in {time.perf_counter() - t0:.0f} s", flush=True)
    return shards


def _settings(args) -> Dict[str, Any]:
    return {
        "docs": args.docs,
        "min_chars": args.min_chars,
        "max_chars": args.max_chars,
        "held_out": args.held_out,
        "shard_docs": args.shard_docs,
        "sources": "docstrings+manpages",
    }


def _eogp(*argv: str) -> None:
    command = [sys.executable, "-m", "eogp_index.cli", *argv]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def build(args) -> None:
    cache = Path(args.cache)
    shards = write_corpus(cache, args)
    index = cache / "index"
    if not (index / "manifest.json").exists():
        _eogp(
            "fit", str(MODEL), "--data", str(FIT_DATA), "--out", str(index), "-k", "256",
            "--curvature-examples", "256", "--pca-examples", "512", "--max-tokens", "128", "--overwrite",
        )  # fmt: skip
    for shard in shards:
        t0 = time.perf_counter()
        _eogp(
            "ingest", str(index), str(shard), "--id-field", "id", "--metadata", "kind", "--metadata", "qualname",
            "--batch-size", str(args.batch_size),
        )  # fmt: skip
        print(f"{shard.name}: {time.perf_counter() - t0:.0f} s", flush=True)


# -- measuring ---------------------------------------------------------------------------------


def _queries(cache: Path, n: int) -> List[str]:
    with open(cache / "corpus" / "queries.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line, _ in zip(f, range(n))]


def measure(args) -> Dict[str, Any]:
    import numpy as np

    from eogp_index import AttributionIndex
    from eogp_index.search import first_pass
    from eogp_index.search.first_pass.recall import measure_recall
    from eogp_index.search.scan import scan_top_k

    cache = Path(args.cache)
    index = AttributionIndex.open(str(cache / "index"), model_name=args.model)
    stored = index.stored
    hot = stored.hot_codes()
    texts = _queries(cache, args.queries)
    t0 = time.perf_counter()
    y = np.ascontiguousarray(index.query_coordinates(texts), np.float32)
    print(f"{hot.num_rows} rows; {len(y)} held-out queries projected in {time.perf_counter() - t0:.0f} s", flush=True)
    k, sides = args.k, ["positive", "negative"]

    def per_query(fn) -> float:
        """Median over the queries of each query's best time, in ms."""
        return 1e3 * float(
            np.median([common.best_of(lambda: fn(y[q : q + 1]), args.repeat).seconds for q in range(len(y))])
        )

    exact_ms = per_query(lambda yq: scan_top_k(hot.codes, hot.scales, yq, stored.layout, k))
    lines = []
    for spec in args.kinds:
        kind, _, param = spec.partition(":")
        options = {param.split("=")[0]: int(param.split("=")[1])} if param else {}  # e.g. flat:query_bits=4
        name = f"bench-{kind}" + (f"-{param.replace('=', '')}" if param else "")
        t0 = time.perf_counter()
        built = first_pass.build(stored, name, first_pass.make_config(kind, **options), progress=False)
        build_s = time.perf_counter() - t0
        for mult in args.budgets:
            C = mult * k
            recall = measure_recall(built, stored, y, k=k, C=C)
            ms = per_query(lambda yq: built.top_k(stored, yq, k, C, sides))
            lines.append(
                {
                    "kind": spec,
                    "C": C,
                    "C_over_k": mult,
                    "recall": recall.recall,
                    "recall_positive": recall.positive,
                    "recall_negative": recall.negative,
                    "ms_per_query": ms,
                    "exact_ms_per_query": exact_ms,
                    "speedup": exact_ms / ms,
                    "build_s": build_s,
                }
            )
            print(render_line(lines[-1]), flush=True)
    return {"rows": hot.num_rows, "queries": len(y), "k": k, "load": os.getloadavg()[0], "lines": lines}


def rescoring(args) -> Dict[str, Any]:
    """The recall that rescoring needs, on the real rows: for each held-out query and side, the
    share of the tier's own top ``k`` (a full scan of the tier, in float32) found among the exact
    one-bit top ``F · k``; rescoring those rows by the tier then returns exactly the tier's top
    ``k`` when the share is 1."""
    import numpy as np

    from eogp_index import AttributionIndex
    from eogp_index.search.rescore import tier_coordinates
    from eogp_index.search.scan import scan_top_k

    index = AttributionIndex.open(str(Path(args.cache) / "index"), model_name=args.model)
    stored = index.stored
    if stored.tier is None:
        raise SystemExit(f"{args.cache}/index has no rescoring tier: rebuild it (build fits one by default)")
    hot = stored.hot_codes()
    y = np.ascontiguousarray(index.query_coordinates(_queries(Path(args.cache), args.queries)), np.float32)
    x = tier_coordinates(stored, hot.rowaddr)  # (n, T) float32, the hot copy's row order
    tier = x @ y.T  # (n, nq)
    k, factors = args.k, [f for f in args.factors if f * args.k <= hot.num_rows]
    found = scan_top_k(hot.codes, hot.scales, stored.one_bit(y), stored.layout, max(factors) * k)
    shares = {f: [] for f in factors}
    for q in range(len(y)):
        order = np.lexsort((np.arange(hot.num_rows), -tier[:, q]))
        for best, one_bit in ((order[:k], found.largest_indices[q]), (order[::-1][:k], found.smallest_indices[q])):
            for f in factors:
                shares[f].append(np.isin(best, one_bit[: f * k]).mean())
    curve = [
        {"F": f, "N": f * k, "recall": float(np.mean(v)), "se": float(np.std(v) / np.sqrt(len(v)))}
        for f, v in shares.items()
    ]
    return {"rows": hot.num_rows, "queries": len(y), "k": k, "tier": stored.tier.code, "curve": curve}


def _fit_held_out_texts(index_dir: Path, n: int) -> List[str]:
    """The texts of the fit's first ``n`` held-out documents (by position in the fitting shard)."""
    fitting = json.loads((index_dir / "fit" / "fitting_set.json").read_text())
    positions = [row[2] for row in fitting["pca_held_out"][:n]]
    wanted, texts = set(positions), {}
    with gzip.open(FIT_DATA, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i in wanted:
                texts[i] = json.loads(line)["text"]
    return [texts[p] for p in positions]


def table_recall(args) -> Dict[str, Any]:
    """The index's own table measurement (``eogp_index.store.table_recall``) for both query sets."""
    import numpy as np

    from eogp_index import AttributionIndex
    from eogp_index.store.table_recall import measure_table_recall, write_record

    index_dir = Path(args.cache) / "index"
    index = AttributionIndex.open(str(index_dir), model_name=args.model)
    sets = {
        "fit held-out documents": _fit_held_out_texts(index_dir, args.queries),
        "corpus held-out queries": _queries(Path(args.cache), args.queries),
    }
    records = {}
    for name, texts in sets.items():
        y = np.ascontiguousarray(index.query_coordinates(texts), np.float32)
        records[name] = measure_table_recall(index.stored, y, (), queries_from=name)
    if args.write:
        write_record(index_dir, records["fit held-out documents"])
    return {name: record.to_json() for name, record in records.items()}


def render_line(line: Dict[str, Any]) -> str:
    return (
        f"{line['kind']:>16}  C={line['C']:>5} ({line['C_over_k']:>3}×k)  recall@20 {line['recall']:.3f} "
        f"(+ {line['recall_positive']:.3f}, − {line['recall_negative']:.3f})  "
        f"{line['ms_per_query']:.2f} ms/query, exact scan {line['exact_ms_per_query']:.2f} ms: {line['speedup']:.1f}×"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="make the corpus and the index (resumable)")
    b.add_argument("--docs", type=int, default=106_000, help="documents in all, held-out ones included")
    b.add_argument("--min-chars", type=int, default=120)
    b.add_argument("--max-chars", type=int, default=400, help="longer docstrings are cut at blank lines")
    b.add_argument("--held-out", type=float, default=0.05, help="share of the documents kept out as queries")
    b.add_argument("--shard-docs", type=int, default=5000)
    b.add_argument(
        "--batch-size", type=int, default=64, help="ingest's gradient batch (a small model's cost is per batch)"
    )
    m = sub.add_parser("measure", help="recall and time of every first-pass kind")
    m.add_argument("--queries", type=int, default=64)
    m.add_argument("-k", type=int, default=20)
    m.add_argument("--budgets", type=lambda s: [int(v) for v in s.split(",")], default=[5, 10, 25])
    m.add_argument(
        "--kinds",
        type=lambda s: s.split(","),
        default=["flat", "flat:query_bits=4"],
        help="first-pass kinds at their defaults, or with one integer parameter (kind:name=value)",
    )
    m.add_argument("--model", default=str(MODEL), help="the index's model (its weights must hash as the manifest's)")
    m.add_argument("--repeat", type=int, default=3)
    common.add_json_argument(m)
    r = sub.add_parser("rescoring", help="recall of the tier's top-k in the one-bit top F x k")
    r.add_argument("--queries", type=int, default=64)
    r.add_argument("-k", type=int, default=20)
    r.add_argument("--factors", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 3, 5, 10, 20])
    r.add_argument("--model", default=str(MODEL), help="the index's model (its weights must hash as the manifest's)")
    common.add_json_argument(r)
    t = sub.add_parser("table-recall", help="the index's recall measurement on its table, both query sets")
    t.add_argument("--queries", type=int, default=64)
    t.add_argument("--model", default=str(MODEL), help="the index's model (its weights must hash as the manifest's)")
    t.add_argument("--write", action="store_true", help="record the fit held-out measurement in the index")
    common.add_json_argument(t)
    for p in (b, m, r, t):
        p.add_argument("--cache", default=str(default_cache()), help="where the corpus and the index are kept")
    args = parser.parse_args(argv)
    if args.command == "table-recall":
        from eogp_index.store.table_recall import format_table_recall

        figures = table_recall(args)
        common.write_json(args.json, figures)
        if not common.prints_json(args):
            for name, record in figures.items():
                print(f"{name}: {format_table_recall(record)}")
        return 0
    if args.command == "build":
        build(args)
        return 0
    if args.command == "rescoring":
        figures = rescoring(args)
        common.write_json(args.json, figures)
        if not common.prints_json(args):
            print(f"{figures['rows']} rows, {figures['queries']} held-out queries, {figures['tier']} tier, "
                  f"share of its top {figures['k']} per side in the one-bit top F x {figures['k']}:")  # fmt: skip
            for point in figures["curve"]:
                print(f"  F = {point['F']:>2} (N = {point['N']:>3}): {point['recall']:.3f} ± {point['se']:.3f}")
        return 0
    figures = measure(args)
    common.write_json(args.json, figures)
    if not common.prints_json(args):
        print(f"{figures['rows']} rows, {figures['queries']} held-out queries, k = {figures['k']}, "
              f"load {figures['load']:.1f}")  # fmt: skip
        for line in figures["lines"]:
            print(render_line(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
