"""benchmarks/cluster.py runs in the suite at tiny sizes, so that it cannot rot: every shard count
answers, and the figures it prints are whole."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster.py"
ray = pytest.importorskip("ray")


def _load():
    if str(SCRIPT.parent) not in sys.path:  # run as a script, it finds benchmarks/common.py there
        sys.path.append(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("cluster_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def small_ray():
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.cluster
def test_cluster_benchmark_runs_on_two_shards(tmp_path, small_ray):
    benchmark = _load()
    out = tmp_path / "figures.json"
    args = ["--rows", "600", "--modules", "2", "--k", "64", "--fragments", "3", "--shards", "2"]
    assert benchmark.main([*args, "--repeat", "1", "--workdir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [line["shards"] for line in figures["runs"]] == [2]
    for line in figures["runs"]:
        assert sum(m["rows"] for m in line["memory"]) == 600
        assert line["query_ms"] >= line["slowest_scan_ms"] > 0
        assert all(m["rss_mib"] > 0 and m["plan_mib"] > figures["fixed_mib"] for m in line["memory"])
