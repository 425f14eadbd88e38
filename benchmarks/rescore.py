#!/usr/bin/env python
"""Rescoring at 1M rows: the rescored query against the one-bit query, side by side, and the tier
bytes each query reads.

Targets: a query that rescores its one-bit top ``N = F · k`` rows per side from the
int8 tier takes at most 1.2 x the time of the one-bit query (``rescore=0``) on the same index,
in the same run; it reads at most ``N`` x the tier's bytes per row per side from the tier.

The index (built once, cached outside the repository under ``$EOGP_BENCH_CACHE/rescore-1m-k2048``
or ``~/.cache/eogp-bench/rescore-1m-k2048``; a killed build resumes where it stopped):

1. ``eogp fit`` of the shipped model ``examples/default/model`` with ``-k 2048`` per module (8
   modules: 2,064 bytes of one-bit code, 16,400 bytes of the default int8 tier per row) and
   ``--variant eogp-r`` (``--variant``; the demo's 512 documents span 512 PCA directions, and the
   synthetic rows time the same under any variant), and ``eogp ingest`` of the demo corpus (512
   real documents, projected by the model, with their text);
2. synthetic rows appended up to ``--rows`` (1,000,000) without the model (it would take hours),
   through the store layer's own writer (``store.table.build_rows`` and ``Store.add``, one Lance
   commit per ``--batch`` rows, compacted and ended as ingest does). The first
   :data:`DRAWN_ROWS` rows are drawn: Gaussian coordinates, per module scaled like a real row
   (its module scales ``‖x_u‖₁/k_u`` drawn from the ingested rows, times ``exp(0.25 · N(0,1))``)
   with the real rows' spread over coordinates, encoded by the index's own codecs (one-bit code
   and int8 tier), as ingest encodes projected gradients. The rest are variants of drawn rows
   (:func:`variants`: each module negated at random and its scale jittered again, done on the
   stored codes), since drawing and encoding each 16 KB row is most of a build's time. ids,
   shards, positions, content hashes and metadata are unique per row;
3. the table compacted as a default ingest leaves it (:func:`compact`: ``eogp optimize``, fragments
   of 262,144 rows). A query's tier rows lie in few fragments, as they would in a real index:
   each fragment a take touches adds to its cost (``docs/benchmarks.md``).

What is timed (in turns, round after round: the one-bit query, then each factor's; ``--repeat``
rounds for a single query, ``--batch-repeat`` for a batch, and each line its fastest round, with
the spread of the rounds' ratios; each line the search alone: the queries' coordinates are projected once beforehand, since the gradient pass is the
same with and without rescoring and only dilutes the ratio): a batch of ``--batch-queries``
queries (64) and a single query, on the hot route (``--routes``: the hot copy in memory; the
stream route reads the whole table per query), ``direction="both"``, ``k=20``: the one-bit query
and the rescored query at factors ``--factors`` (5, 10, 20, 50, 100). Queries
(``--query-sets``): coordinates drawn as the synthetic rows are (``drawn``: their top rows lie all
over the table), and real texts (``examples/default/queries.jsonl``, held out of the corpus)
projected by the model (``texts``). Each rescored line gives its ratio to the one-bit line of the
same batch, the rescoring step's share of it (:func:`eogp_index.search.rescore.rescored`, timed
inside the same run), the distinct tier rows taken per query, and the bytes Lance read from the
tier per query (``Store.take_reads``) against the bound ``N x bytes per row x 2 sides``. The
tier rows of a query's later rounds lie in the page cache from its first, and a larger factor's
rows include a smaller one's. Every line prints the load average beside its figures:
the machine may be shared. A cache written before the tier's columns were laid out full-zip
(``store.table.RANDOM_ACCESS``), or before its rows were records (index format 4), is refused::

    python benchmarks/rescore.py                    # build (once) and time
    python benchmarks/rescore.py --json out.json    # also the figures as JSON
    python benchmarks/rescore.py --rows 100000      # a smaller index (its own cache directory)
    python benchmarks/rescore.py --k-per-module 256 # the 272-byte one-bit code
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
from common import add_json_argument, best_of, prints_json, write_json

from eogp_index.store.maintenance import after_ingest, maybe_optimize, optimize
from eogp_index.store.stored_index import StoredIndex
from eogp_index.store.table import FULL_ZIP, RANDOM_ACCESS, RowInfo, build_rows

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "examples" / "default"
TARGET_RATIO = 1.2
ROWS = 1_000_000
#: Coordinates per module of the one-bit code: 8 modules x (2048 / 8 + 2) B, the 2 KB default code.
K_PER_MODULE = 2048
#: Synthetic rows drawn from :class:`RowModel`; the rest are variants of them (:func:`variants`).
DRAWN_ROWS = 70_000
#: Spread of a synthetic row's module scales around the real row they copy (log-normal).
SCALE_JITTER = 0.25


def cache_root(rows: int, k_per_module: int = K_PER_MODULE) -> Path:
    base = os.environ.get("EOGP_BENCH_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "eogp-bench"
    size = "1m" if rows == ROWS else str(rows)
    return root / f"rescore-{size}-k{k_per_module}"


def _eogp(*args: str) -> None:
    """Run the ``eogp`` command of this Python's environment (as ``make demo`` does)."""
    exe = Path(sys.executable).parent / "eogp"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "eogp_index.cli"]
    subprocess.run(command + list(args), check=True)


def fit_and_ingest(index: Path, k_per_module: int, variant: str) -> None:
    """Step 1: ``make demo``'s fit and ingest; skipped when done (``fitted``/``ingested`` marks)."""
    corpus = DEFAULT / "corpus" / "train.jsonl.gz"
    if not (index.parent / "fitted").exists():
        _eogp(
            "fit", str(DEFAULT / "model"), "--data", str(corpus), "--out", str(index), "-k", str(k_per_module),
            "--variant", variant, "--curvature-examples", "256", "--pca-examples", "512", "--max-tokens", "128", "--overwrite",
        )  # fmt: skip
        (index.parent / "fitted").touch()
    if not (index.parent / "ingested").exists():
        _eogp(
            "ingest", str(index), str(corpus), "--id-field", "id", "--metadata", "module", "--metadata", "kind",
            "--metadata", "qualname", "--metadata", "n_chars", "--store-text",
        )  # fmt: skip
        (index.parent / "ingested").touch()


class RowModel:
    """Realistically shaped coordinates ``(n, K)``, learnt from the real rows' tier codes."""

    def __init__(self, stored: StoredIndex):
        tier, layout = stored.tier, stored.layout
        x = tier.decode(tier.from_arrow(stored.store.read(list(tier.columns), "shard != 'synthetic'")))
        self.layout = layout
        self.scales = np.stack(
            [np.abs(x[:, o : o + k]).mean(axis=1) for o, k in zip(layout.coord_offsets, layout.k)], axis=1
        )  # (n_real, U)
        self.scales = self.scales[(self.scales > 0).all(axis=1)]
        shape = np.empty(layout.num_coords, np.float32)
        for u, (o, k) in enumerate(zip(layout.coord_offsets, layout.k)):
            spread = (x[:, o : o + k] / np.maximum(self.scales_of(x, u), 1e-30)[:, None]).std(axis=0)
            # E|σ z| = σ √(2/π): divided so that a row's mean |x_u| is about its drawn scale.
            shape[o : o + k] = spread / (spread.mean() * np.sqrt(2 / np.pi))
        self.shape = shape

    def scales_of(self, x: np.ndarray, u: int) -> np.ndarray:
        o, k = self.layout.coord_offsets[u], self.layout.k[u]
        return np.abs(x[:, o : o + k]).mean(axis=1)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        picks = self.scales[rng.integers(0, len(self.scales), n)]
        picks = picks * np.exp(SCALE_JITTER * rng.standard_normal(picks.shape))
        per_coord = np.repeat(picks.astype(np.float32), self.layout.k, axis=1)
        return rng.standard_normal((n, self.layout.num_coords), dtype=np.float32) * self.shape * per_coord


def variants(stored: StoredIndex, base: np.ndarray, rng: np.random.Generator, n: int) -> Dict[str, np.ndarray]:
    """``n`` rows made from drawn ones (row addresses ``base``: the first :data:`DRAWN_ROWS`
    synthetic rows): each module's coordinates negated at random and scaled by
    ``exp(0.25 · N(0,1))``, done on the stored codes (the module's sign bits inverted, its int8
    tier codes negated, both scales multiplied): the table's columns that encoding those
    coordinates writes."""
    layout = stored.layout
    wanted, inverse = np.unique(base[rng.integers(0, base.size, n)], return_inverse=True)
    table = stored.store.take_rows(wanted, [*stored.codec.columns, *stored.tier.columns])
    codes, tier = stored.codec.from_arrow(table), stored.tier.from_arrow(table)
    flip = rng.random((n, layout.num_modules)) < 0.5
    jitter = np.exp(SCALE_JITTER * rng.standard_normal((n, layout.num_modules))).astype(np.float32)
    signs, tier_codes = codes.signs[inverse], tier["tier"][inverse]
    for u, (b0, nb, c0, k) in enumerate(zip(layout.byte_offsets, layout.module_bytes, layout.coord_offsets, layout.k)):
        rows = np.flatnonzero(flip[:, u])
        signs[rows, b0 : b0 + nb] ^= np.uint8(0xFF)
        tier_codes[rows, c0 : c0 + k] *= -1
    one_bit = {"signs": signs, "scales": (codes.scales[inverse].astype(np.float32) * jitter).astype(np.float16)}
    tier_scales = (tier["tier_scales"][inverse].astype(np.float32) * jitter).astype(np.float16)
    return {**one_bit, **stored.tier.split({"tier": tier_codes, "tier_scales": tier_scales})}


def append_synthetic(index: Path, rows: int, batch: int, progress: bool) -> None:
    """Step 2: synthetic rows up to ``rows`` in all, one commit per ``batch``; resumable (a commit
    is whole or absent, and batch ``b`` always holds the same rows)."""
    from tqdm import tqdm

    stored = StoredIndex.open(index)
    store = stored.store
    real = store.count("shard != 'synthetic'")
    have = store.count() - real
    if real + have >= rows and (index.parent / "synthetic").exists():
        return
    model = RowModel(stored)
    target = rows - real
    # Variants need an int8 tier and whole bytes of signs per module (bits inverted a byte at a time).
    varied = stored.tier.code == "int8" and all(k % 8 == 0 for k in stored.layout.k)
    base = None
    optimized = False
    bar = tqdm(total=target, initial=have, unit="row", desc="synthetic rows", disable=not progress)
    while have < target:
        if have % batch:
            raise SystemExit(f"{index}: {have} synthetic rows is not a whole number of {batch}-row batches")
        n = min(batch, target - have)
        rng = np.random.default_rng([20261128, have // batch])
        if have < DRAWN_ROWS or not varied:
            x = model.draw(n, rng)
            encoded = {**stored.codec.encode(x).columns(), **stored.tier.split(stored.tier.encode(x))}
        else:
            if base is None:
                found = store.read(
                    ["position"], f"shard = 'synthetic' AND position < {DRAWN_ROWS}", with_row_address=True
                )
                order = np.argsort(found.column("position").to_numpy())
                base = found.column("_rowaddr").to_numpy().astype(np.uint64)[order]
            encoded = variants(stored, base, rng, n)
        ids = [f"synthetic-{have + i:07d}" for i in range(n)]
        info = RowInfo(
            ids=ids,
            shards=["synthetic"] * n,
            positions=list(range(have, have + n)),
            num_tokens=[128] * n,
            num_loss_tokens=[127] * n,
            truncated=[True] * n,
            metadata=[{"module": "synthetic", "kind": "synthetic", "qualname": i, "n_chars": 512} for i in ids],
            content_sha256=[hashlib.sha256(i.encode()).hexdigest() for i in ids]
            if stored.manifest.has_content_hashes
            else None,
            content_kind=["text"] * n if stored.manifest.has_content_hashes else None,
            text=[None] * n,
        )
        store.add(build_rows(info, encoded, schema=store.schema))
        optimized |= maybe_optimize(stored) is not None  # as ingest compacts along the way
        have += n
        bar.update(n)
    bar.close()
    after_ingest(stored, optimized=optimized)  # compaction and the hot copy, as ingest ends
    (index.parent / "synthetic").touch()


def check_layout(index: Path) -> None:
    """A cache written before the tier's columns were laid out full-zip (``store.table.RANDOM_ACCESS``),
    or before an int8 tier's codes and scales were one record per row (format 4), would time an
    older layout: it is refused."""
    stored = StoredIndex.open(index)
    if not stored.manifest.tier_records:
        raise SystemExit(
            f"{index}: index format {stored.manifest.format_version}, before the tier's records (4); remove {index.parent} and rerun"
        )
    want = {k.encode(): v.encode() for k, v in FULL_ZIP.items()}
    for name in (n for n in RANDOM_ACCESS if n in stored.store.schema.names):
        if not (stored.store.schema.field(name).metadata or {}).items() >= want.items():
            raise SystemExit(f"{index}: written before the tier's full-zip layout; remove {index.parent} and rerun")


def build(args) -> Path:
    root = cache_root(args.rows, args.k_per_module)
    index = root / "index"
    root.mkdir(parents=True, exist_ok=True)
    fit_and_ingest(index, args.k_per_module, args.variant)
    append_synthetic(index, args.rows, args.batch, not prints_json(args))
    compact(index)
    check_layout(index)
    return index


def compact(index: Path) -> None:
    """Step 3: the table compacted as a default ingest leaves it (``eogp optimize``: fragments of
    ``DEFAULT_TARGET_ROWS`` rows; a default ingest's 256-row commits are compacted so as they pile
    up), old versions removed at once; skipped when done (``compacted`` mark)."""
    if (index.parent / "compacted").exists():
        return
    optimize(StoredIndex.open(index), retention=timedelta(0))
    (index.parent / "compacted").touch()


class Counter:
    """Times :func:`~eogp_index.search.rescore.rescored` inside the queries (the query module's
    name for it, wrapped on this instance's watch) and counts the distinct tier rows taken."""

    def __init__(self, stored: StoredIndex):
        import eogp_index.search.query as query_module

        self.store, self.module = stored.store, query_module
        self.rescored, self.take = query_module.rescored, self.store.take_rows
        self.rows = 0
        self.step_seconds = 0.0
        query_module.rescored = self._rescored
        self.store.take_rows = self._take  # the instance's attribute: the class is untouched

    def _rescored(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.rescored(*args, **kwargs)
        finally:
            self.step_seconds += time.perf_counter() - t0

    def _take(self, rowaddr, columns):
        if "tier" in columns:  # each distinct row is in one take of the tier column
            self.rows += len(rowaddr)
        return self.take(rowaddr, columns)

    def reset(self) -> None:
        self.rows, self.step_seconds = 0, 0.0
        self.store.take_reads()


def time_queries(index_path: Path, args) -> Dict[str, Any]:
    import json

    from eogp_index.client import AttributionIndex

    index = AttributionIndex.open(index_path)
    stored = index.stored
    texts = [json.loads(line)["text"] for line in (DEFAULT / "queries.jsonl").open(encoding="utf-8")]
    texts = (texts * (1 + args.batch_queries // len(texts)))[: args.batch_queries]
    query_sets = {}
    for name in args.query_sets:
        if name == "texts":
            query_sets[name] = index.query_coordinates(texts)
        else:  # coordinates drawn like the synthetic rows: their top rows lie all over the table
            query_sets[name] = RowModel(stored).draw(len(texts), np.random.default_rng(7))
    tier_bytes = stored.tier.bytes_per_example
    counter = Counter(stored)
    res: Dict[str, Any] = {
        "rows": stored.count(),
        "tier_code": stored.tier.code,
        "tier_bytes_per_row": tier_bytes,
        "one_bit_bytes_per_row": stored.codec.bytes_per_example,
        "k": args.k,
        "factors": list(args.factors),
        "queries": len(texts),
        "cores": os.cpu_count(),
        "lines": [],
    }
    lines = Lines(echo=not prints_json(args))
    lines.append(
        f"index {index_path}: {res['rows']} rows, one-bit {res['one_bit_bytes_per_row']} B/row, "
        f"{res['tier_code']} tier {res['tier_bytes_per_row']} B/row; k={args.k} per side, both sides; "
        f"{os.cpu_count()} cores; target: rescored <= {TARGET_RATIO} x one-bit, tier bytes <= N x B/row x sides"
    )

    def run(route: str, rows: np.ndarray, factor: int):
        builder = index.search(list(texts[: len(rows)]), many=True).limit(args.k).direction("both").rescore(factor)
        if route != "hot":
            builder = builder.route(route)
        return builder.to_list(coordinates=rows)

    # As a server after its first queries: the rescoring kernel compiled (one rescored query of
    # coordinates not timed), and every fragment's file metadata in Lance's cache (one tier row
    # of each fragment taken).
    index.search(texts[:1], many=True).limit(args.k).rescore(1).to_list(
        coordinates=RowModel(stored).draw(1, np.random.default_rng(1))
    )
    firsts = stored.store.read(["position"], with_row_address=True).column("_rowaddr").to_numpy().astype(np.uint64)
    firsts = np.unique(firsts >> np.uint64(32)) << np.uint64(32)
    stored.store.take_rows(firsts, list(stored.tier.columns))
    for route in args.routes:
        if route == "hot":
            stored.hot_codes()  # loaded before timing, as a server holds it
        for name, y in query_sets.items():
            for label, rows in (("single", y[:1]), ("batch", y)):
                repeat = args.repeat if label == "single" else args.batch_repeat
                res["lines"] += _time_line(run, route, name, label, rows, counter, tier_bytes, repeat, args, lines)
    res["text"] = list(lines)
    return res


class Lines(list):
    """The printed lines, each printed as soon as it is measured (``echo``)."""

    def __init__(self, echo: bool):
        super().__init__()
        self.echo = echo

    def append(self, line: str) -> None:
        super().append(line)
        if self.echo:
            print(line, flush=True)


def _time_line(run, route, name, label, rows, counter, tier_bytes, repeat, args, lines) -> List[Dict[str, Any]]:
    """The one-bit query and each rescored one of a route, query set and batch, side by side.

    The lines are timed in turns, ``repeat`` rounds of the one-bit query then each factor's, and
    each keeps its fastest round: a slow spell of a shared machine falls on every line alike
    rather than on the lines that ran in it."""
    sides = 2  # direction "both"
    load = os.getloadavg()[0]
    run(route, rows[:1], 0)  # the kernels compiled and loaded before timing
    timed: Dict[int, List[tuple]] = {factor: [] for factor in (0, *args.factors)}
    for _ in range(max(1, int(repeat))):
        for factor in timed:
            counter.reset()
            best = best_of(lambda: run(route, rows, factor), 1)
            _, read = counter.store.take_reads()
            timed[factor].append((best.seconds, best.cpu_seconds, counter.step_seconds, counter.rows, read))
    base_seconds, base_cpu, *_ = min(timed[0])
    head = f"{route:6} {name:5} {label:6} ({len(rows):2} q)"
    out = [{"route": route, "query_set": name, "queries": label, "nq": len(rows), "factor": 0, "seconds": base_seconds,
            "cpu_seconds": base_cpu, "load_average": load, "rounds": len(timed[0])}]  # fmt: skip
    lines.append(f"{head}  one-bit     {base_seconds * 1e3:8.1f} ms (cpu {base_cpu * 1e3:8.1f} ms, load {load:5.2f})")
    for factor in args.factors:
        seconds, cpu, step, taken, read = min(timed[factor])  # the fastest round, its step, rows and bytes
        per_query_rows = taken / len(rows)
        bound = factor * args.k * tier_bytes * sides
        ratio = seconds / base_seconds
        # the rounds' ratios to the one-bit round before them: how far one round can stray
        rounds = sorted(t[0] / b[0] for t, b in zip(timed[factor], timed[0]))
        per_query_read = read / len(rows)
        item = {
            "route": route,
            "query_set": name,
            "queries": label,
            "nq": len(rows),
            "factor": factor,
            "seconds": seconds,
            "cpu_seconds": cpu,
            "rescoring_step_seconds": step,
            "one_bit_seconds": base_seconds,
            "ratio": ratio,
            "round_ratios": rounds,
            "time_target_met": ratio <= TARGET_RATIO,
            "tier_rows_per_query": per_query_rows,
            "tier_bytes_read_per_query": per_query_read,
            "tier_bytes_bound": bound,
            "bytes_target_met": per_query_read <= bound,
            "load_average": os.getloadavg()[0],
        }
        out.append(item)
        lines.append(
            f"{head}  rescored {factor:3d}x {seconds * 1e3:7.1f} ms (cpu {cpu * 1e3:8.1f} ms, load "
            f"{item['load_average']:5.2f})  {ratio:.3f} x [{'ok' if ratio <= TARGET_RATIO else 'MISSED'}] "
            f"(rounds {rounds[0]:.2f}-{rounds[-1]:.2f})  step {step * 1e3:7.1f} ms; tier {per_query_rows:5.0f} rows, "
            f"read {per_query_read / 1e6:7.3f} MB/q <= {bound / 1e6:7.3f} MB [{'ok' if per_query_read <= bound else 'MISSED'}]"
        )
    return out


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of the index (default 1,000,000)")
    parser.add_argument("--batch", type=int, default=10_000, help="synthetic rows per commit")
    parser.add_argument(
        "--k-per-module", type=int, default=K_PER_MODULE, help="one-bit coordinates per module (2048: the 2 KB code)"
    )
    parser.add_argument("--factors", type=lambda s: [int(f) for f in s.split(",")], default=[5, 10, 20, 50, 100])
    parser.add_argument("-k", type=int, default=20, help="hits per side")
    parser.add_argument("--batch-queries", type=int, default=64, help="queries of the batch lines")
    parser.add_argument("--routes", type=lambda s: s.split(","), default=["hot"], help="hot, stream (comma-separated)")
    parser.add_argument(
        "--query-sets", type=lambda s: s.split(","), default=["drawn", "texts"], help="drawn, texts (comma-separated)"
    )
    parser.add_argument(
        "--variant",
        default="eogp-r",
        help="the fit's --variant (eogp-r: no PCA; 512 documents span 512 of the 2048 PCA directions per module, "
        "and the synthetic rows time the same under any variant)",
    )
    parser.add_argument(
        "--repeat", type=int, default=7, help="rounds of the single-query lines (each line its fastest)"
    )
    parser.add_argument("--batch-repeat", type=int, default=2, help="rounds of the batch lines (each line its fastest)")
    parser.add_argument("--build-only", action="store_true", help="build (or finish) the index and stop")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    index = build(args)
    built = time.perf_counter() - t0
    if args.build_only:
        return {"index": str(index), "build_seconds": built}
    res = time_queries(index, args)
    res["index"] = str(index)
    res["load_average_end"] = os.getloadavg()
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
