"""The command line of `eogp` under torchrun, for the tests that compare its workers' result with
one process's."""

from __future__ import annotations

import sys
from typing import List


def torchrun_eogp(*args: str, workers: int = 2) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node W -m eogp_index.cli ARGS``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
            "-m", "eogp_index.cli", *args]  # fmt: skip
