"""Fixtures of the ingest tests: a killed ingest (the tokenizer and shard writers are in
tests/shards.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _quiet(quiet_datasets):
    """No progress bars or cache writes outside tmp_path from `datasets`."""


_KILLED_INGEST = """
import sys, time
from eogp_index.client import AttributionIndex
from eogp_index.config import GradientConfig
from ingest.pipeline import run_ingest
from ingest.records import RecordSpec

index = AttributionIndex.open(sys.argv[1], gradients=GradientConfig(batch_size=2, device="cpu"))
commit = index.store.add

def slow_commit(rows):
    # Widen the time between commits so that the test's SIGKILL lands mid-shard.
    time.sleep(0.25)
    return commit(rows)

index.store.add = slow_commit
run_ingest(index, [sys.argv[2]], spec=eval(sys.argv[3]), batch_size=2, progress=False)
"""


def kill_mid_ingest(index_dir: Path, shard: str, spec: str, *, at_least: int) -> int:
    """Start ``run_ingest(index_dir, [shard], spec=<spec, a RecordSpec(...) expression>)`` in a
    child process (2 rows per commit), SIGKILL it once ``at_least`` rows are committed, and
    return the rows committed by then."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import lance

    repo = Path(__file__).resolve().parents[2]
    script = index_dir.parent / "killed_ingest.py"
    script.write_text(_KILLED_INGEST)
    log_path = index_dir.parent / "killed_ingest.log"
    uri = str(index_dir / "examples.lance")
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [sys.executable, str(script), str(index_dir), shard, spec],
            cwd=repo,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and child.poll() is None:
                try:
                    if lance.dataset(uri).count_rows() >= at_least:
                        break
                except Exception:  # no table yet
                    pass
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, log_path.read_text()[-2000:]
    return lance.dataset(uri).count_rows()


@pytest.fixture(scope="session")
def killed_ingest():
    return kill_mid_ingest
