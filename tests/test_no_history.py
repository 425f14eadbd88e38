"""No history or measured figures in the library.

Comments and docstrings say why and give shapes; commit hashes, issue numbers and measured
figures (timings, bandwidths, speed-ups, recalls, CPU models) go stale there. They belong in
docs/ pages, next to the command that prints them, and in CHANGELOG.md. This test reads the
comments and string literals of every Python file of the library (eogp_index/, ingest/,
benchmarks/, examples/*.py, schemas/) and the whole text of its other files (schemas/*.md, the
server's static page).
"""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_NUM = r"(?<![\w.])~?\d+(?:[.,]\d+)?"
_OFFENCES = {
    "commit hash": re.compile(r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])"),
    "issue reference": re.compile(r"\b(?:issues?|PR|pull request)\s*#?\s*\d+|(?<![\w&#/])#\d{1,5}\b", re.IGNORECASE),
    "throughput figure": re.compile(_NUM + r"\s*(?:[KMGT]i?B|rows|req(?:uests)?|documents|queries)/s\b"),
    # "90s" or "{x:8s}" is not prose: seconds and minutes need a space before the unit.
    "timing figure": re.compile(
        _NUM + r"(?:\s*[–-]\s*\d+(?:\.\d+)?)?(?:\s*(?:ms|µs|ns)|\s+(?:s|sec|seconds|min|minutes))\b"
    ),
    # "1.91×", "2-4× the norm", "4x faster"; not a shape ("16384 × 256") or a target ("2x one's").
    "speed-up figure": re.compile(
        r"(?<![\w.])\d+(?:\.\d+)?×(?!\s*\d)"
        + "|"
        + _NUM
        + r"\s*[x×]\s+(?:faster|slower|cheaper|less|more)\b"
        + r"|\bspeed-?ups?\s+(?:of\s+)?~?\d",
        re.IGNORECASE,
    ),
    "quality figure": re.compile(
        r"\b(?:recall|correlation|NDCG)(?:@\d+)?\b[^;]{0,40}?(?<![\w.:+-])0?\.\d+", re.IGNORECASE
    ),
    "machine description": re.compile(r"\b(?:EPYC|Xeon|Zen\s?\d|Core i\d|load average \d)", re.IGNORECASE),
}
_TARGET = re.compile(r"≥|>=|≤|<=|at least|at most")


def _library_files():
    for folder in ("eogp_index", "ingest", "benchmarks", "schemas"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".png", ".ico"):
                yield path
    yield from sorted((ROOT / "examples").glob("*.py"))


def _prose(path: Path):
    """``(line, text)`` of what a reader takes as prose: comments and string literals of a Python
    file, every line of any other file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for i, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, line


def offences(path: Path) -> list:
    """``"path:line: kind: match"`` for every offence in ``path``."""
    found = []
    for lineno, line in _prose(path):
        for kind, pattern in _OFFENCES.items():
            for match in pattern.finditer(line):
                if _TARGET.search(line[max(0, match.start() - 12) : match.end()]):
                    continue  # a target ("recall@20 >= 0.95 at >= 5x") is no measurement
                found.append(
                    f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{lineno}: "
                    f"{kind}: {match.group(0)!r}"
                )
    return found


def test_the_library_holds_no_history_or_figures():
    found = [o for path in _library_files() for o in offences(path)]
    assert not found, (
        "history or measured figures outside docs/ and CHANGELOG.md (move figures to the "
        "docs/ page with the command that prints them):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "offence",
    [
        "# fixed in 3f2a9c1e",
        "# see issue 13",
        "# Targets (issue #13)",
        "# as #12 asked",
        "# the pre-scan reads ~13.5 GB/s",
        "# a 1% filter costs 2.4 ms",
        "# the first call compiles for ~30 s",
        "# 1.91× the bare pass",
        "# 4x faster than 64 separate scans",
        "# replicas=4 gives recall 0.88",
        "# the proxy's correlation with the score is 0.85 at R = 1",
        "# on a 2-core AMD EPYC Zen 4 VM",
    ],
)
def test_each_kind_of_offence_is_found(tmp_path, offence):
    path = tmp_path / "module.py"
    path.write_text(f'"""A module."""\n\n{offence}\nX = 1\n', encoding="utf-8")
    assert len(offences(path)) >= 1, offence


def test_code_and_plain_prose_pass(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(
        '"""Scores ``(nq, n)`` float32 of 64 modules x k=512 bits; the 8x smaller nibble tables."""\n\n'
        "# one pass over the codes per query batch (see docs/benchmarks.md for its speed)\n"
        "TIMEOUT_S = 30\nHASH = hashlib.sha256(b'abc').hexdigest()\n",
        encoding="utf-8",
    )
    assert offences(path) == []
