#!/usr/bin/env python
"""How far the half-precision fidelity test's measurement moves when the CPU's kernels change.

``tests/gradients/test_dtype.py::test_half_precision_index_keeps_float32_fidelity`` compares a
bf16/fp16 index with a float32 one, both against kronfluence's float32 EK-FAC scores. Another CPU
runs other kernels (vector widths, oneDNN's AMX/AVX-512 paths, thread splits), so other
roundings. This builds the test's tiny-Llama indexes (float32, bfloat16, float16) under kernel
variants that this CPU can run, each in its own process:

* ``this CPU``: as the test runs;
* ``1 thread``: ``torch.set_num_threads(1)``, other splits of every parallel reduction;
* ``ATEN_CPU_CAPABILITY=default``: PyTorch's kernels without vector instructions.

and for two fitting sets: the indexed documents themselves (the test's former setting) and 32
other documents (its setting now). Every index is scored against one reference (kronfluence's,
from the first variant's float32 factors of that fitting set); each row gives the mean NDCG@20 and
Spearman over the 24 queries and, paired by query, the mean difference from the first variant's
float32 index and its standard error.

    python benchmarks/half_precision_fidelity.py [--kind llama|shipped] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_json_argument, prints_json, write_json

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "this CPU": {},
    "1 thread": {"THREADS": "1"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
}
DTYPES = ("float32", "bfloat16", "float16")


def child(kind: str, fit: str, folder: str) -> None:
    """Build the three indexes under this process's kernels; save their scores (and the
    reference, where none is saved yet) as ``.npy`` under ``folder``."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gradients")]
    import numpy as np
    import test_dtype as T
    import torch
    from tinymodels import kronfluence_scores

    if os.environ.get("THREADS"):
        torch.set_num_threads(int(os.environ["THREADS"]))
    reference = Path(folder) / "reference.npy"
    for dtype in DTYPES:
        with tempfile.TemporaryDirectory() as work:
            index, scores = T._scores(
                Path(work) / "idx", kind, "256B", dtype, fit=T.TRAIN if fit == "indexed" else T.FIT
            )
            if dtype == "float32" and not reference.exists():
                np.save(reference, kronfluence_scores(index, T.QUERIES, T.TRAIN))
        np.save(Path(folder) / f"{dtype}.npy", scores)


def paired(ours, base) -> dict:
    import numpy as np

    diff = ours - base
    diff = diff[~np.isnan(diff)]
    return {
        "mean": float(np.nanmean(ours)),
        "diff": float(diff.mean()),
        "se": float(diff.std(ddof=1) / np.sqrt(diff.size)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["llama", "shipped"], default="llama")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "FIT", "FOLDER"), help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from eogp_index.evaluation.metrics import ndcg_at_k_per_query, spearman_per_query

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fit in ("indexed", "apart"):
            folder = Path(tmp) / fit
            for name, env in VARIANTS.items():
                (folder / name).mkdir(parents=True)
                # The first variant writes the reference; the others read it from its folder.
                target = folder / name
                if name != "this CPU":
                    os.link(folder / "this CPU" / "reference.npy", target / "reference.npy")
                subprocess.run(
                    [sys.executable, __file__, "--child", args.kind, fit, str(target)],
                    env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                    check=True,
                    stderr=subprocess.DEVNULL,
                )
            reference = np.load(folder / "this CPU" / "reference.npy")
            base = np.load(folder / "this CPU" / "float32.npy")
            for name in VARIANTS:
                for dtype in DTYPES:
                    scores = np.load(folder / name / f"{dtype}.npy")
                    rows.append(
                        {
                            "fit": fit,
                            "kernels": name,
                            "dtype": dtype,
                            "ndcg@20": paired(
                                ndcg_at_k_per_query(scores, reference, 20), ndcg_at_k_per_query(base, reference, 20)
                            ),
                            "spearman": paired(
                                spearman_per_query(scores, reference), spearman_per_query(base, reference)
                            ),
                        }
                    )
    if not prints_json(args):
        print("| fitted on | kernels | dtype | NDCG@20 | paired diff (SE) | Spearman | paired diff (SE) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            n, s = r["ndcg@20"], r["spearman"]
            print(
                f"| {r['fit']} | {r['kernels']} | {r['dtype']} | {n['mean']:.3f} | {n['diff']:+.4f} ({n['se']:.4f}) "
                f"| {s['mean']:.3f} | {s['diff']:+.4f} ({s['se']:.4f}) |"
            )
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
