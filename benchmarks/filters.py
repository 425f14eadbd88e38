#!/usr/bin/env python
"""Filtered searches, opening and the first query, and a batch of 64, through AttributionIndex.

Grows a copy of an index (default: the demo's, ``make demo``) to ``--rows`` rows written through
:meth:`Store.add <eogp_index.store.table.Store.add>` in ``--commit``-row commits, as ``eogp ingest``
commits, then runs ``eogp optimize`` on it, and measures in fresh processes:

* **open**: ``AttributionIndex.open`` with the model already loaded (what opening costs beyond
  loading the model), and the model's own load;
* **first query**: ``top_influential`` right after an ``open`` that loaded the model itself
  (which warms the scan kernels on the side meanwhile), and right after an ``open`` given a
  loaded model (nothing overlaps);
* **search**, as the targets define it — everything after the query's projected gradient exists
  (filter, scan, top-k, the hits' metadata): ``search(q).where(w).limit(20).to_list(coordinates=y)``,
  unfiltered, and with filters selecting ~0.1%, ~1% and ~25% of the rows, each both *unseen*
  (a filter string the process has not run: the constant changes every time) and *repeated*;
  each the best of ``--repeat``, interleaved with unfiltered searches, and given as a ratio to
  the unfiltered search next to the target ``f + 0.1``. CPU time (all threads) is given too: on a
  shared machine it moves far less than wall time;
* **a batch of 64** queries' search against one query's, next to the arithmetic floor of the
  batch pre-scan (64 queries x every code bit as int8 x 1-bit products, 64 per AVX512-VNNI
  instruction, one instruction per cycle and core).

How the rows are made: row ``i`` copies the codes of source row ``i mod n`` with every sign bit
flipped with probability 0.2 and each scale multiplied by ``exp(0.3·N(0,1))``; its metadata are
the source row's, with ``n_chars`` uniform in 0..9,999 (``n_chars < 10`` selects 0.1%, ``< 100``
1%), ``module`` one of four values (``module = 'json'`` 25%), ``qualname`` one of 100,000 and
``position = i``. The timings do not depend on what the codes mean; the recall of FAISS
candidates does, and ``benchmarks/candidates.py`` measures that on real codes. ``--json PATH``
also writes the figures as one JSON object.

    python benchmarks/filters.py --index default-index                  # 1M rows
    python benchmarks/filters.py --index default-index --rows 200000    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_json_argument, peak_rss_bytes, write_json

REPO = Path(__file__).resolve().parents[1]

QUERY = "Return the number of items in the queue."
# (name, unseen filter template over a counter j, repeated filter): the unseen ones select the
# same rows with a string the process has not run (a constant conjunct, which costs no column).
FILTERS = [
    ("0.1% (int)", "n_chars < 10 AND {j} = {j}", "n_chars < 10"),
    ("1% (int)", "n_chars < 100 AND {j} = {j}", "n_chars < 100"),
    ("1% (LIKE)", "qualname LIKE 'q1{d}%' AND {j} = {j}", "qualname LIKE 'q17%'"),
    ("25% (int)", "n_chars < 2500 AND {j} = {j}", "n_chars < 2500"),
    ("25% (string)", "module = 'json' AND {j} = {j}", "module = 'json'"),
]


def grow(source: Path, out: Path, rows: int, commit: int) -> None:
    import numpy as np
    import pyarrow as pa

    from eogp_index.store.stored_index import StoredIndex
    from eogp_index.store.table import fixed_size_list

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("manifest.json", "projection.safetensors", "sources.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    src, dst = StoredIndex.open(source), StoredIndex.open(out)
    base = src.store.read(src.store.metadata_columns() + list(src.codec.columns))
    signs = np.stack(base.column("signs").to_numpy(zero_copy_only=False))
    scales = np.stack(base.column("scales").to_numpy(zero_copy_only=False)).astype(np.float32)
    n0, rng, modules = base.num_rows, np.random.default_rng(0), np.array(["json", "re", "os", "http"])
    names = list(base.column_names)
    valid = _valid_bits(src.layout)
    started = time.perf_counter()
    for start in range(0, rows, commit):
        n = min(commit, rows - start)
        i = np.arange(start, start + n)
        src_i = i % n0
        flips = np.packbits(rng.random((n, signs.shape[1] * 8)) < 0.2, axis=1, bitorder="little")
        cols = {name: base.column(name).take(pa.array(src_i)) for name in names if name not in ("signs", "scales")}
        cols["signs"] = fixed_size_list(signs[src_i] ^ (flips & valid))
        cols["scales"] = fixed_size_list(
            (scales[src_i] * np.exp(0.3 * rng.standard_normal((n, scales.shape[1])))).astype(np.float16)
        )
        cols["id"] = pa.array([f"row-{j}" for j in i])
        cols["position"] = pa.array(i, pa.int64())
        if "n_chars" in cols:
            cols["n_chars"] = pa.array(rng.integers(0, 10000, n), pa.int64())
        if "module" in cols:
            cols["module"] = pa.array(modules[rng.integers(0, 4, n)])
        if "qualname" in cols:
            cols["qualname"] = pa.array([f"q{j % 100000}" for j in i])
        dst.store.add(pa.table(cols).select(names))
    fragments = dst.store.fragment_count()
    print(
        f"grew {out} to {rows:,} rows in {fragments:,} commits of {commit} rows: {time.perf_counter() - started:.0f} s",
        flush=True,
    )


def _valid_bits(layout):
    """A row's mask of real sign bits (padding bits stay 0)."""
    import numpy as np

    from eogp_index.store.codecs import pack_signs

    return pack_signs(np.ones((1, layout.num_coords), np.float32), layout)[0]


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t):
    return (time.perf_counter() - t[0]) * 1e3, (time.process_time() - t[1]) * 1e3


def measure(path: Path, repeat: int, torch_threads: int, what: str) -> None:
    """Runs in a fresh process; prints one JSON line."""
    t = _clock()
    import torch

    from eogp_index.client import AttributionIndex
    from eogp_index.gradients.model import load_model
    from eogp_index.store.manifest import Manifest

    torch.set_num_threads(torch_threads)
    imported = _since(t)[0]
    out = {"import_ms": imported}
    if what == "open":
        t = _clock()
        model, tokenizer = load_model(Manifest.load(path).model["name"])
        out["model_load_ms"] = _since(t)[0]
        t = _clock()
        index = AttributionIndex.open(path, model=model, tokenizer=tokenizer)
        out["open_ms"] = _since(t)[0]
        t = _clock()  # nothing overlaps the kernels' and the copy's first load here
        index.top_influential(QUERY, k=20)
        out["first_query_model_given_ms"] = _since(t)[0]
        print(json.dumps(out), flush=True)
        return
    t = _clock()
    index = AttributionIndex.open(path)
    out["open_with_model_ms"] = _since(t)[0]
    t = _clock()
    index.top_influential(QUERY, k=20)
    out["first_query_ms"] = _since(t)[0]
    if what == "first":
        print(json.dumps(out), flush=True)
        return
    import numpy as np

    y = index.query_coordinates([QUERY])

    def search(where=None, coords=y):
        s = index.search([QUERY] * coords.shape[0], many=True).limit(20)
        t = _clock()
        (s.where(where) if where else s).to_list(coordinates=coords)
        return _since(t)

    def e2e():
        t = _clock()
        index.top_influential(QUERY, k=20)
        return _since(t)

    for _ in range(3):
        search()
    out["warm_query_ms"] = min(e2e()[0] for _ in range(repeat))
    rows = index.store.count()
    lines, counter = [], 0
    for name, unseen, repeated in FILTERS:
        fraction = index.store.count(repeated) / rows
        base, fresh, again = [], [], []
        search(repeated)
        for _ in range(repeat):
            counter += 1
            base.append(search())
            fresh.append(search(unseen.format(j=counter, d=counter % 10)))
            again.append(search(repeated))
        best = lambda runs, k: min(r[k] for r in runs)  # noqa: E731
        lines.append(
            {
                "filter": name,
                "fraction": fraction,
                "target": fraction + 0.1,
                "unfiltered_ms": best(base, 0),
                "unseen_ms": best(fresh, 0),
                "repeated_ms": best(again, 0),
                "unseen_x": best(fresh, 0) / best(base, 0),
                "repeated_x": best(again, 0) / best(base, 0),
                "unseen_cpu_x": best(fresh, 1) / best(base, 1),
                "repeated_cpu_x": best(again, 1) / best(base, 1),
            }
        )
    out["filters"] = lines
    rng = np.random.default_rng(0)
    y64 = np.repeat(y, 64, axis=0) + rng.standard_normal((64, y.shape[1])).astype(np.float32) * np.abs(y).mean()
    one, batch = [], []
    for _ in range(max(3, repeat // 2)):
        one.append(search())
        batch.append(search(coords=y64))
    out["batch"] = {
        "one_ms": min(r[0] for r in one),
        "batch_ms": min(r[0] for r in batch),
        "one_cpu_ms": min(r[1] for r in one),
        "batch_cpu_ms": min(r[1] for r in batch),
    }
    layout = index.layout
    products = 64 * rows * layout.nbytes * 8  # int8 x 1-bit products of the batch pre-scan
    out["batch"]["floor_cpu_ms_at_3ghz"] = products / 64 / 3e9 * 1e3
    out["rows"] = rows
    out["peak_rss_mib"] = peak_rss_bytes() / 2**20
    print(json.dumps(out), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", type=Path, default=REPO / "default-index", help="index whose rows are copied")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--commit", type=int, default=256, help="rows per commit (eogp ingest's default)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="threads of the query's gradient pass (1: on shared cores, OpenMP spinning "
        "otherwise dominates the end-to-end times)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep the grown index here (reused if present)")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--what", default="all", help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.measure is not None:
        measure(args.measure, args.repeat, args.torch_threads, args.what)
        return
    from eogp_index.store.maintenance import optimize
    from eogp_index.store.stored_index import StoredIndex

    work = args.workdir or Path(tempfile.mkdtemp(prefix="eogp-filters-"))
    path = work / "index"
    try:
        if not (path / "hot" / "state.json").exists():
            grow(args.index, path, args.rows, args.commit)
            report = optimize(StoredIndex.open(path))
            print(f"eogp optimize: {report.describe()}; steps {report.steps}", flush=True)

        def child(what):
            cmd = [
                sys.executable,
                __file__,
                "--measure",
                str(path),
                "--what",
                what,
                "--repeat",
                str(args.repeat),
                "--torch-threads",
                str(args.torch_threads),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            return json.loads(done.stdout.strip().splitlines()[-1])

        opened = [child("open") for _ in range(3)]
        firsts = [child("first") for _ in range(3)]
        run = child("all")
        print(f"\n{run['rows']:,} rows; load average {os.getloadavg()[0]:.1f}; torch threads {args.torch_threads}")
        print(
            f"import eogp_index.client {min(o['import_ms'] for o in opened):.0f} ms; model load "
            f"{min(o['model_load_ms'] for o in opened):.0f} ms; open (model given) "
            f"{min(o['open_ms'] for o in opened):.0f} ms (runs: {[round(o['open_ms']) for o in opened]}), then the "
            f"first query {min(o['first_query_model_given_ms'] for o in opened):.0f} ms "
            f"(runs: {[round(o['first_query_model_given_ms']) for o in opened]})"
        )
        print(
            f"open loading the model {min(f['open_with_model_ms'] for f in firsts):.0f} ms; first query "
            f"{min(f['first_query_ms'] for f in firsts):.0f} ms (runs: {[round(f['first_query_ms']) for f in firsts]})"
        )
        base = min(line["unfiltered_ms"] for line in run["filters"])
        print(
            f"warm query end to end {run['warm_query_ms']:.1f} ms = {run['warm_query_ms'] / base:.2f}x the search; "
            f"search (unfiltered) {base:.1f} ms"
        )
        print(
            f"{'filter':14s} {'f':>7s} {'target':>7s} {'unseen':>18s} {'repeated':>18s} {'unseen cpu':>10s} "
            f"{'rep. cpu':>9s}"
        )
        for line in run["filters"]:
            print(
                f"{line['filter']:14s} {line['fraction']:7.4f} {line['target']:6.3f}x "
                f"{line['unseen_ms']:8.1f} ms {line['unseen_x']:6.3f}x {line['repeated_ms']:8.1f} ms "
                f"{line['repeated_x']:6.3f}x {line['unseen_cpu_x']:9.3f}x {line['repeated_cpu_x']:8.3f}x"
            )
        b = run["batch"]
        print(
            f"batch of 64: {b['batch_ms']:.0f} ms = {b['batch_ms'] / b['one_ms']:.1f}x one query's search (wall); "
            f"CPU {b['batch_cpu_ms']:.0f} ms = {b['batch_cpu_ms'] / b['one_cpu_ms']:.1f}x; arithmetic floor of the "
            f"batch pre-scan {b['floor_cpu_ms_at_3ghz']:.0f} CPU-ms at 3 GHz = "
            f"{b['floor_cpu_ms_at_3ghz'] / b['one_cpu_ms']:.1f}x one query's CPU"
        )
        print(f"peak RSS of the measuring process {run['peak_rss_mib']:.0f} MiB")
        write_json(
            args.json,
            {
                "load_average": os.getloadavg()[0],
                "torch_threads": args.torch_threads,
                "open": opened,
                "first": firsts,
                **run,
            },
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
