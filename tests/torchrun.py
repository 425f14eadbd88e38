"""The command line of `eogp` under torchrun, for the tests that compare its workers' result with
one process's, and its run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]


def torchrun_eogp(*args: str, workers: int = 2) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node W -m eogp_index.cli ARGS``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
            "-m", "eogp_index.cli", *args]  # fmt: skip


def run_torchrun_eogp(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """:func:`torchrun_eogp` of ``args`` run from the repository root (300 s at most) with ``env``,
    its output captured as text; it must exit 0 (the assertion shows the end of its stderr)."""
    done = subprocess.run(torchrun_eogp(*args), cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
