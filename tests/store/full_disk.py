"""A full disk, on a real small file system: run by tests/store/test_hot.py, on a tmpfs mounted
at SMALL (by the test, or inside ``unshare --map-root-user --mount`` where it may not mount).

    python full_disk.py INDEX SMALL SHARD FREE_BYTES QUERY

Copies the index INDEX (without its hot copy) to SMALL/idx, fills SMALL until FREE_BYTES are
free, then runs, each as its own ``eogp`` process (a SIGBUS kills that process, not this one):
``eogp ingest SMALL/idx SHARD --store-text`` and ``eogp query SMALL/idx --text QUERY --json``.
Also maps a file larger than what is free the way the hot copy maps its arrays. Prints a JSON
report: each command's exit status and output, and the rows the table holds after the ingest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _eogp(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "eogp_index.cli", *args], capture_output=True, text=True)
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def _fill(small: Path, free: int) -> None:
    """Take the file system's free space down to ``free`` bytes with one allocated file."""
    excess = shutil.disk_usage(small).free - free
    if excess > 0:
        with open(small / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, excess)


def _map_more_than_free(small: Path) -> str:
    """What mapping a file larger than the free space does, as the hot copy maps its arrays."""
    import numpy as np

    try:
        from eogp_index.store.hot import _reserved_memmap, is_no_space
    except ImportError as exc:
        return repr(exc)
    try:
        _reserved_memmap(small / "probe.npy", np.uint8, (shutil.disk_usage(small).free + (1 << 20),))
    except OSError as exc:
        return "no space" if is_no_space(exc) else repr(exc)
    finally:
        (small / "probe.npy").unlink(missing_ok=True)
    return "mapped"


def main(index: str, small: str, shard: str, free: str, query: str) -> None:
    import lance

    small_dir = Path(small)
    target = small_dir / "idx"
    shutil.copytree(index, target, ignore=shutil.ignore_patterns("hot"))
    _fill(small_dir, int(free))
    report = {"free_before": shutil.disk_usage(small_dir).free, "started": time.perf_counter()}
    report["ingest"] = _eogp("ingest", str(target), shard, "--store-text", "--id-field", "id")
    tables = [p for p in target.iterdir() if p.suffix == ".lance"]
    report["rows"] = lance.dataset(str(tables[0])).count_rows()
    report["query"] = _eogp("query", str(target), "--text", query, "-k", "5", "--json")
    report["mapped"] = _map_more_than_free(small_dir)
    report["seconds"] = time.perf_counter() - report.pop("started")
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
