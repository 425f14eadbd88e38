"""benchmarks/gpu_check.py runs in the suite on the CPU (Gloo, CPU FAISS), so that the GPU check
a CUDA machine runs cannot rot: every stage must run, compare and pass."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _load():
    if str(SCRIPT.parent) not in sys.path:  # run as a script, it finds benchmarks/common.py there
        sys.path.append(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
def test_gpu_check_passes_every_stage_on_cpu(tmp_path, capsys):
    gpu_check = _load()
    status = gpu_check.main(
        [
            "--device",
            "cpu",
            "--documents",
            "32",
            "-k",
            "8",
            "--max-tokens",
            "48",
            "--top",
            "5",
            "--work",
            str(tmp_path),
            "--json",
            "-",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == [name for name, _ in gpu_check.STAGES]
    assert {name: s["status"] for name, s in stages.items()} == {name: "ok" for name in stages}, report
    assert status == 0
    assert "2 workers (Gloo)" in stages["ingest x2 (torchrun)"]["detail"]


def test_comparison_refuses_a_swapped_ranking_and_a_wrong_score():
    gpu_check = _load()
    comparison = gpu_check.Comparison(rtol=1e-3)
    # Tied within the tolerance: either order passes, and the swap is counted.
    comparison.ranking("tie", ["a", "b", "c"], [3.0, 2.0, 1.9999], ["a", "c", "b"], [3.0, 1.9999, 2.0])
    assert comparison.ties_swapped == 2
    with pytest.raises(gpu_check.Mismatch, match="rank 2 is 'c' on the device"):
        comparison.ranking("swap", ["a", "b", "c"], [3.0, 2.0, 1.0], ["a", "c", "b"], [3.0, 1.0, 2.0])
    with pytest.raises(gpu_check.Mismatch, match=r"scores differ by 1\.0\de-02"):
        comparison.scores("score", np.array([[1.0, -0.5]]), np.array([[1.01, -0.5]]))
