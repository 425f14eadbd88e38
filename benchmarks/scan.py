"""Throughput of the exact scaled-sign scan (eogp_index.search.scan) on a warm in-memory store.

Builds a random store of ``--gb`` GB of packed codes (default 64 modules x k=512 bits, i.e.
4096 bytes per row, ~244k rows per GB), then measures, in the same process:

* memory-read bandwidth: ``numpy.sum`` over a uint64 view of the same bytes (best of 3);
* single-query ``scan_scores`` (exact, every row) and single-query ``scan_top_k``;
* single-query ``scan_top_k`` of unit-normalized scores (``--normalize unit``: each row's scales
  divided by its norm) next to the unnormalized one on the same float32 scales;
* a batch of ``--nq`` queries for both (one pass over the codes per call);
* ``scan_scores`` and ``scan_top_k`` restricted to a random 1% of the rows;
* with ``--planes-batch`` on AVX512-VNNI hosts, the batch top-k again with the portable
  bit-plane pre-scan.

The header names the pre-scan forms in use and the load average (other processes on the
machine make the wall times pessimistic; compare the CPU times).

Each line prints the wall time (best run), that run's process CPU time (about threads x wall
when nothing else competes for the cores) and the ratio against the target:
single-query throughput >= 0.5 x bandwidth, normalized top-k >= 0.9 x unnormalized, batch time
<= 8 x single, 1% subset <= 5% of the full scan. Targets are reported, never asserted.
``--json PATH`` also writes the numbers as one JSON object.

Usage: python benchmarks/scan.py --gb 1.0 [--json PATH] [--planes-batch]
"""

from __future__ import annotations

import argparse
import os
import sys

import common
import numpy as np

from eogp_index.search import scan as scan_module
from eogp_index.search.normalize import unit_normalized
from eogp_index.search.scan import SignLayout, scan_scores, scan_top_k
from eogp_index.store.codecs import Encoded

CPU = {}  # "" -> process CPU seconds of the last measurement's best run


def best_of(fn, repeat: int) -> float:
    """:func:`common.best_of`'s wall time; its CPU time goes to ``CPU[""]`` for :func:`report`."""
    best = common.best_of(fn, repeat)
    CPU[""] = best.cpu_seconds
    return best.seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="size of the packed codes in GB (1e9 bytes)")
    ap.add_argument("--modules", type=int, default=64)
    ap.add_argument("--k", type=int, default=512, help="coordinates (bits) per module")
    ap.add_argument("--nq", type=int, default=64, help="queries in the batch measurement")
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (single-query lines)")
    ap.add_argument("--subset", type=float, default=0.01, help="fraction of rows for the filtered scan")
    ap.add_argument("--seed", type=int, default=0)
    common.add_json_argument(ap)
    ap.add_argument(
        "--planes-batch",
        action="store_true",
        help="also time the query batch's top-k with the bit-plane pre-scan (on AVX512-VNNI hosts)",
    )
    args = ap.parse_args(argv)

    layout = SignLayout((args.k,) * args.modules)
    n = max(1, int(args.gb * 1e9 // layout.nbytes))
    rng = np.random.default_rng(args.seed)
    codes = rng.integers(0, 256, size=(n, layout.nbytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, size=(n, layout.num_modules)).astype(np.float16)
    y1 = rng.standard_normal((1, layout.num_coords)).astype(np.float32)
    yb = rng.standard_normal((args.nq, layout.num_coords)).astype(np.float32)
    subset = np.sort(rng.choice(n, size=max(1, int(n * args.subset)), replace=False)).astype(np.int64)
    gb = codes.nbytes / 1e9

    # Warm-up: compile (or load from cache) every kernel variant used below, on a few rows.
    few = codes[:256], scales[:256]
    scan_scores(*few, y1, layout)
    scan_scores(*few, yb, layout)
    scan_top_k(*few, y1, layout, args.topk)
    scan_top_k(*few, yb[:2], layout, args.topk)
    scan_top_k(*few, yb, layout, args.topk)  # batches of >= 3 queries take the batch pre-scan
    scan_top_k(*few, y1, layout, args.topk, rows=np.arange(0, 256, 3))

    words = codes.reshape(-1).view(np.uint64)
    bw_t = best_of(words.sum, 3)
    bandwidth = gb / bw_t

    vnni = scan_module._prescan_vnni()
    res: dict = {
        "gb": gb,
        "rows": n,
        "nbytes_per_row": layout.nbytes,
        "modules": args.modules,
        "k": args.k,
        "threads": int(__import__("numba").get_num_threads()),
        "bandwidth_gbps": bandwidth,
        "bandwidth_s": bw_t,
        "prescan_vnni": vnni,
        "load_average": os.getloadavg(),
    }
    lines = [
        f"store: {n} rows x {layout.nbytes} B = {gb:.3f} GB ({args.modules} modules x k={args.k}), "
        f"{res['threads']} threads, load average {os.getloadavg()[0]:.2f}",
        "top-k pre-scan: bit planes for one query, "
        + ("AVX512-VNNI query groups for batches" if vnni else "bit planes for batches (no AVX512-VNNI)"),
        f"memory read (numpy sum, uint64): {bw_t:.3f} s  {bandwidth:.2f} GB/s",
    ]

    def report(name, seconds, target_text, ratio, ok, **extra):
        cpu = CPU.pop("", 0.0)
        res[name] = {"seconds": seconds, "cpu_seconds": cpu, "ratio": ratio, "target_met": ok, **extra}
        lines.append(f"{name}: {seconds:.3f} s (cpu {cpu:.2f} s)  {target_text}  [{'ok' if ok else 'MISSED'}]")

    t1 = best_of(lambda: scan_scores(codes, scales, y1, layout), args.repeat)
    r = (gb / t1) / bandwidth
    report("scan_scores_1q", t1, f"{gb / t1:.2f} GB/s = {r:.3f} x bandwidth (target >= 0.5)", r, r >= 0.5)

    tk1 = best_of(lambda: scan_top_k(codes, scales, y1, layout, args.topk), args.repeat)
    r = (gb / tk1) / bandwidth
    report(
        f"scan_top_k_1q_k{args.topk}", tk1, f"{gb / tk1:.2f} GB/s = {r:.3f} x bandwidth (target >= 0.5)", r, r >= 0.5
    )

    # Unit-normalized scores (--normalize unit): the same kernels on each row's scales divided by
    # its norm, which the hot copy divides once per table version; both lines read float32 scales,
    # as the hot copy holds them.
    scales32 = scales.astype(np.float32)
    prep = best_of(lambda: unit_normalized(Encoded(signs=codes, scales=scales32), layout), 1)
    unit = unit_normalized(Encoded(signs=codes, scales=scales32), layout).scales
    tkf = best_of(lambda: scan_top_k(codes, scales32, y1, layout, args.topk), args.repeat)
    tkn = best_of(lambda: scan_top_k(codes, unit, y1, layout, args.topk), args.repeat)
    r = tkf / tkn
    report(
        f"scan_top_k_1q_k{args.topk}_unit",
        tkn,
        f"{gb / tkn:.2f} GB/s = {r:.3f} x the unnormalized top-k on the same float32 scales ({gb / tkf:.2f} GB/s, "
        f"{tkf:.3f} s) (target >= 0.9); dividing the scales once: {prep:.3f} s",
        r,
        r >= 0.9,
        unnormalized_seconds=tkf,
        divide_seconds=prep,
    )

    tb = best_of(lambda: scan_scores(codes, scales, yb, layout), 1)
    r = tb / t1
    report(f"scan_scores_{args.nq}q", tb, f"= {r:.2f} x one query's (target <= 8)", r, r <= 8)

    tkb = best_of(lambda: scan_top_k(codes, scales, yb, layout, args.topk), 1)
    r = tkb / tk1
    report(f"scan_top_k_{args.nq}q_k{args.topk}", tkb, f"= {r:.2f} x one query's (target <= 8)", r, r <= 8)

    if args.planes_batch and vnni:  # the portable form of the batch pre-scan, for comparison
        scan_module._PRESCAN_VNNI = False
        try:
            scan_top_k(*few, yb, layout, args.topk)
            tkp = best_of(lambda: scan_top_k(codes, scales, yb, layout, args.topk), 1)
        finally:
            scan_module._PRESCAN_VNNI = None
        r = tkp / tk1
        report(
            f"scan_top_k_{args.nq}q_k{args.topk}_bit_planes", tkp, f"= {r:.2f} x one query's (target <= 8)", r, r <= 8
        )

    ts = best_of(lambda: scan_scores(codes, scales, y1, layout, rows=subset), args.repeat)
    r = ts / t1
    report(
        "scan_scores_1q_subset",
        ts,
        f"({subset.size} rows) = {r:.4f} x full scan (target <= 0.05)",
        r,
        r <= 0.05,
        rows=int(subset.size),
    )

    tks = best_of(lambda: scan_top_k(codes, scales, y1, layout, args.topk, rows=subset), args.repeat)
    r = tks / tk1
    report(
        f"scan_top_k_1q_k{args.topk}_subset",
        tks,
        f"({subset.size} rows) = {r:.4f} x full top-k (target <= 0.05)",
        r,
        r <= 0.05,
        rows=int(subset.size),
    )

    lines.append(f"load average after: {os.getloadavg()[0]:.2f}")
    if not common.prints_json(args):
        print("\n".join(lines))
    common.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
