"""The exact scan on a GPU (torch) beside the CPU kernels (numba), on one random store.

Builds ``--rows`` random rows of ``--modules`` x ``-k`` bits (2 KB per row by default, the
paper's default code), then times in one process, best of ``--repeat``:

* ``numba``: ``scan_scores`` (every row's score) and ``scan_top_k`` on the CPU cores;
* ``torch, codes on the host``: ``scan_scores_torch`` given the numpy store, as the torch route
  scores the hot copy today (each chunk copied to the device per call);
* ``torch, codes resident``: the same kernel given the store already on the device.

Each line prints one query and a batch of ``--nq`` queries, and its speed against the numba
line. The scores of the torch kernel are checked against numba's (largest difference over the
largest score); nothing is asserted on time.

Usage: python benchmarks/gpu_scan.py [--device cuda] [--rows 1000000] [--nq 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys

import common
import numpy as np

from eogp_index.search.scan import SignLayout, scan_scores, scan_scores_torch, scan_top_k


def _timed(fn, repeat: int, sync) -> float:
    def run():
        out = fn()
        sync()
        return out

    run()  # warm-up: kernels compiled or loaded, device memory allocated
    return common.best_of(run, repeat).seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device of the GPU lines (cpu: the same lines on the CPU)")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--modules", type=int, default=64)
    ap.add_argument("-k", type=int, default=256, help="bits per module")
    ap.add_argument("--nq", type=int, default=64, help="queries in the batch lines")
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    common.add_json_argument(ap)
    args = ap.parse_args(argv)

    import numba
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the CPU stand-in", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    layout = SignLayout((args.k,) * args.modules)
    rng = np.random.default_rng(args.seed)
    codes = rng.integers(0, 256, size=(args.rows, layout.nbytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, size=(args.rows, layout.num_modules)).astype(np.float16)
    ys = {1: rng.standard_normal((1, layout.num_coords)).astype(np.float32)}
    ys[args.nq] = rng.standard_normal((args.nq, layout.num_coords)).astype(np.float32)
    resident = torch.from_numpy(codes).to(args.device), torch.from_numpy(scales).to(args.device)

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    figures: dict = {"rows": args.rows, "bytes_per_row": layout.nbytes, "device": name}
    figures["numba_threads"] = numba.get_num_threads()
    lines = [
        f"store: {args.rows} rows x {layout.nbytes} B = {codes.nbytes / 1e9:.2f} GB; "
        f"torch on {name}; numba on {figures['numba_threads']} CPU threads"
    ]
    routes = {
        "numba scan_scores": lambda y: scan_scores(codes, scales, y, layout),
        "numba scan_top_k": lambda y: scan_top_k(codes, scales, y, layout, args.topk),
        "torch, codes on the host": lambda y: scan_scores_torch(codes, scales, y, layout, args.device),
        "torch, codes resident": lambda y: scan_scores_torch(*resident, y, layout, args.device),
    }
    for nq, y in ys.items():
        base = None
        for route, fn in routes.items():
            seconds = _timed(lambda: fn(y), args.repeat, sync)
            base = base or seconds
            figures[f"{route} nq={nq}"] = seconds
            lines.append(
                f"{route:<26} {nq:>3} queries  {seconds * 1e3:9.2f} ms  {codes.nbytes / seconds / 1e9:8.1f} GB/s  "
                f"{base / seconds:6.2f}x numba scan_scores"
            )
    reference = scan_scores(codes, scales, ys[args.nq], layout)
    got = scan_scores_torch(*resident, ys[args.nq], layout, args.device).cpu().numpy()
    figures["max_relative_difference"] = float(np.abs(got - reference).max() / np.abs(reference).max())
    lines.append(
        f"torch against numba: largest difference {figures['max_relative_difference']:.2e} of the largest score"
    )
    if not common.prints_json(args):
        print("\n".join(lines))
    common.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
