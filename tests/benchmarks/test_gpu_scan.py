"""benchmarks/gpu_scan.py runs in the suite with --device cpu, so that the GPU timing cannot rot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_scan.py"


def test_gpu_scan_times_every_route_and_the_torch_scores_match_numba(tmp_path):
    if str(SCRIPT.parent) not in sys.path:
        sys.path.append(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_scan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "scan.json"
    argv = ["--device", "cpu", "--rows", "300", "--modules", "3", "-k", "24", "--nq", "3", "--repeat", "1"]
    assert module.main(argv + ["--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for route in ("numba scan_scores", "numba scan_top_k", "torch, codes on the host", "torch, codes resident"):
        assert figures[f"{route} nq=1"] > 0 and figures[f"{route} nq=3"] > 0
    assert figures["max_relative_difference"] < 1e-5
