"""What the benchmarks share: the best of several timed runs, the process's peak memory, and the
``--json PATH`` option that writes the figures a script prints as one JSON object.

The scripts import this module as ``common``: Python puts a script's own directory first on
``sys.path``. They import ``eogp_index`` (and ``ingest``) as installed, never from a path.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional


class Best(NamedTuple):
    """The fastest of several runs of one call."""

    seconds: float  # its wall time
    cpu_seconds: float  # its process CPU time: about threads x wall when nothing else competes
    value: Any  # what the last run returned


def best_of(fn: Callable[[], Any], repeat: int = 3) -> Best:
    """Run ``fn`` ``repeat`` times; the fastest run's wall and CPU time, and the last result.

    CPU time much below threads x wall means other processes were competing for the cores and
    the wall times are pessimistic.
    """
    best, best_cpu, value = float("inf"), 0.0, None
    for _ in range(max(1, int(repeat))):
        c0, t0 = time.process_time(), time.perf_counter()
        value = fn()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        if t < best:
            best, best_cpu = t, c
    return Best(best, best_cpu, value)


def peak_rss_bytes() -> int:
    """Peak resident set of this process in bytes.

    ``VmHWM`` from ``/proc/self/status`` where there is one (Linux; it starts afresh at ``exec``,
    so a child process measures only itself), else ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json PATH``: also write the printed figures as one JSON object to ``PATH``; ``-``
    prints the JSON (in place of the closing table, where a script prints one)."""
    parser.add_argument(
        "--json", metavar="PATH", default=None, help="also write the figures as one JSON object to PATH ('-': print it)"
    )


def _plain(value: Any) -> Any:
    """numpy scalars and arrays, paths and sets as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (Path, set, frozenset)):
        return str(value) if isinstance(value, Path) else sorted(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_json(path: Optional[str], figures: Any) -> None:
    """Write ``figures`` to ``path`` as JSON (``-``: to stdout; ``None``: nowhere)."""
    if path is None:
        return
    text = json.dumps(figures, indent=2, default=_plain)
    if path == "-":
        print(text, flush=True)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def prints_json(args: argparse.Namespace) -> bool:
    """Whether the JSON replaces the usual output (``--json -``)."""
    return getattr(args, "json", None) == "-"
