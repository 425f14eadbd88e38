"""`eogp serve` under load: one client, then 32 concurrent clients, against the demo index grown to 100k rows.

Steps, all in one run (bounded: each phase has a fixed duration, the whole run a deadline):

1. the demo index (``default-index``, as ``make demo`` builds it; built here with the same
   commands when missing) is copied to a work directory and grown to ``--rows`` rows by writing
   copies of its real rows with fresh ids through the table's documented format (``schemas/store.md``)
   — no model pass per row;
2. ``eogp serve`` starts as its own process on 127.0.0.1 with its default settings (batching
   window on) and is warmed up with a few queries;
3. one client sends queries back to back for ``--single-seconds``; then ``--clients`` clients
   do so together for ``--seconds``. Queries are the demo's held-out docstrings, with a mix of
   filters, k and directions (so batches hold several scan groups).

Prints throughput, p50 and p99 latency and the error count of each phase, the server's RSS at
start and end, and the targets: zero errors, RSS growth under 10%, and throughput at 32 clients at
least 2x one client's (micro-batching at work). Targets are printed, never asserted. ``--json
PATH`` also writes the figures as one JSON object.

The clients are a minimal HTTP/1.1 keep-alive loop on asyncio streams, so that the load generator
takes as little as possible of the 2 cores it shares with the server.

Usage: python benchmarks/serve.py [--rows 100000] [--clients 32] [--seconds 30] [--single-seconds 10]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List, Tuple

from common import add_json_argument, write_json

ROOT = Path(__file__).resolve().parents[1]
EOGP = [sys.executable, "-m", "eogp_index.cli"]
DEMO = ROOT / "examples" / "default"
FILTERS = [None, None, "kind = 'function'", "kind = 'class'", "n_chars > 300"]


def build_demo_index(path: Path) -> None:
    """``make demo``'s fit and ingest (with stored text), when no demo index exists yet."""
    print(f"building the demo index at {path} (make demo's fit and ingest; a few minutes)", flush=True)
    subprocess.run(
        [
            *EOGP,
            "fit",
            str(DEMO / "model"),
            "--data",
            str(DEMO / "corpus" / "train.jsonl.gz"),
            "--out",
            str(path),
            "-k",
            "256",
            "--curvature-examples",
            "256",
            "--pca-examples",
            "512",
            "--max-tokens",
            "128",
            "--overwrite",
            "--json",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=1800,
    )
    ingest = [
        *EOGP,
        "ingest",
        str(path),
        str(DEMO / "corpus" / "train.jsonl.gz"),
        "--id-field",
        "id",
        "--metadata",
        "module",
        "--metadata",
        "kind",
        "--metadata",
        "qualname",
        "--metadata",
        "n_chars",
        "--json",
    ]
    help_text = subprocess.run([*EOGP, "ingest", "--help"], capture_output=True, text=True).stdout
    subprocess.run(
        ingest + (["--store-text"] if "--store-text" in help_text else []),
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=1800,
    )


def grow(path: Path, rows: int) -> Tuple[int, float]:
    """Append copies of the stored rows, with fresh ids, until the table holds ``rows`` rows.

    Every column is copied as stored (codes, metadata, text); only ``id`` changes
    (``<id>~copy<j>``), so the ids stay unique. One commit per 16k rows.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from eogp_index.store.stored_index import StoredIndex

    started = time.perf_counter()
    store = StoredIndex.open(path).store
    real = store.dataset().to_table()
    have = store.count()
    copy = 0
    while have < rows:
        chunk = []
        while have + sum(t.num_rows for t in chunk) < rows and sum(t.num_rows for t in chunk) < 16384:
            copy += 1
            take = min(real.num_rows, rows - have - sum(t.num_rows for t in chunk))
            part = real.slice(0, take)
            fresh = pc.binary_join_element_wise(part["id"], pa.scalar(f"~copy{copy}"), "")
            chunk.append(part.set_column(part.schema.get_field_index("id"), "id", fresh))
        table = pa.concat_tables(chunk)
        store.add(table.cast(store.schema))
        have += table.num_rows
    return store.count(), time.perf_counter() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request_bodies(seed: int = 0) -> List[bytes]:
    texts = [json.loads(line)["text"] for line in (DEMO / "queries.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    bodies = []
    for _ in range(512):
        body = {"text": rng.choice(texts), "k": rng.choice([10, 20]), "direction": rng.choice(["both", "positive"])}
        where = rng.choice(FILTERS)
        if where:
            body["where"] = where
        bodies.append(json.dumps(body).encode())
    return bodies


async def _client(port: int, bodies, stop_at: float, latencies: List[float], errors: List[str]) -> None:
    """Back-to-back POST /v1/query on one keep-alive connection until ``stop_at``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            body = next(bodies)
            head = (
                f"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            started = time.perf_counter()
            writer.write(head + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                errors.append(f"{status} {payload[:200]!r}")
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        errors.append(f"connection: {exc!r}")
    finally:
        writer.close()


def load(port: int, clients: int, seconds: float, bodies: List[bytes]) -> dict:
    """``clients`` concurrent clients for ``seconds``: throughput, p50/p99 latency, errors."""
    latencies: List[float] = []
    errors: List[str] = []
    cycle = itertools.cycle(bodies)

    async def run():
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_client(port, cycle, stop_at, latencies, errors) for _ in range(clients)))

    started = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)

    def pct(p):
        return 1000 * ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")

    return {
        "clients": clients,
        "requests": len(latencies),
        "seconds": round(elapsed, 2),
        "throughput": len(latencies) / elapsed,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / "default-index", help="the demo index (built if missing)")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--single-seconds", type=float, default=10.0)
    parser.add_argument("--work", type=Path, default=None, help="where the grown copy goes (default: a temp dir)")
    add_json_argument(parser)
    parser.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="OPT",
        help="passed to eogp serve (repeatable), e.g. --serve-option=--batch-window-ms=5",
    )
    args = parser.parse_args(argv)

    if not (args.index / "manifest.json").exists():
        build_demo_index(args.index)
    work = args.work or Path(tempfile.mkdtemp(prefix="eogp-serve-bench-"))
    grown = work / "index"
    if grown.exists():
        shutil.rmtree(grown)
    shutil.copytree(args.index, grown)
    rows, grow_s = grow(grown, args.rows)
    print(f"index: {rows} rows ({args.index.name} grown by copying its rows with fresh ids, {grow_s:.1f} s)")

    port = free_port()
    log = work / "serve.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [*EOGP, "serve", str(grown), "--port", str(port), "--device", "cpu", *args.serve_option],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        started = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() - started > 300:
                    print(log.read_text()[-3000:])
                    raise SystemExit("eogp serve did not start")
                time.sleep(0.2)
        print(
            f"server: pid {server.pid}, ready in {time.monotonic() - started:.1f} s "
            f"(imports, model, hot copy of {rows} rows, kernels)"
        )
        bodies = request_bodies()
        # Warm-up, alone and in a burst: the first passes of each batch size allocate their buffers,
        # so "start" is the server as it runs, and growth after it is what a leak would show.
        load(port, 1, 2.0, bodies)
        load(port, args.clients, 4.0, bodies)
        rss_start = rss_mb(server.pid)
        single = load(port, 1, args.single_seconds, bodies)
        many = load(port, args.clients, args.seconds, bodies)
        rss_end = rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    batches = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{") and '"batch"' in line]
    sizes = [b["queries"] for b in batches[-200:]]

    print(f"\n{'':<12}{'requests':>9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for name, r in (("1 client", single), (f"{args.clients} clients", many)):
        print(
            f"{name:<12}{r['requests']:>9}{r['throughput']:>9.1f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['errors']:>8}"
        )
        for error in r["first_errors"]:
            print(f"    e.g. {error}")
    growth = (rss_end - rss_start) / rss_start
    speedup = many["throughput"] / single["throughput"]
    print(f"server RSS: {rss_start:.0f} MB after warm-up, {rss_end:.0f} MB at the end ({100 * growth:+.1f}%)")
    if sizes:
        print(f"batch size (last {len(sizes)} batches): mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)}")
    print("\ntargets (printed, not asserted):")
    print(
        f"  errors = 0 ........................ {single['errors'] + many['errors']}  "
        f"{'met' if single['errors'] + many['errors'] == 0 else 'MISSED'}"
    )
    print(f"  RSS growth < 10% .................. {100 * growth:+.1f}%  {'met' if growth < 0.10 else 'MISSED'}")
    print(
        f"  throughput {args.clients} clients >= 2x one .... {speedup:.2f}x  {'met' if speedup >= 2 else 'MISSED'}"
        f"  (lone-client p50 {single['p50_ms']:.1f} ms with the batching window on)"
    )
    write_json(
        args.json,
        {
            "rows": rows,
            "single": single,
            "many": many,
            "rss_start_mb": rss_start,
            "rss_end_mb": rss_end,
            "speedup": speedup,
        },
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
