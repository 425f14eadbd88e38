"""One formatter and one linter, configured in pyproject.toml ([tool.ruff]): the suite fails when
a file is not formatted or a lint rule breaks. Fix with `ruff format . && ruff check --fix .`.
And the house rule no linter checks: no function of the library is longer than 120 lines."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0
    ):
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_check_passes():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_style_check_can_fail(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\nx=1\n")
    check = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=tmp_path, capture_output=True, text=True)
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode != 0 and "F401" in check.stdout
    assert fmt.returncode != 0 and "bad.py" in fmt.stdout + fmt.stderr


#: The longest a function of the library (eogp_index/, ingest/) may be, from its ``def`` line to
#: its last line, docstring included (its decorators are not counted).
MAX_FUNCTION_LINES = 120


def long_functions(root: Path, max_lines: int = MAX_FUNCTION_LINES) -> list:
    """``path:line name (n lines)`` of every function under ``root`` longer than ``max_lines``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_library_is_longer_than_120_lines():
    offenders = long_functions(ROOT / "eogp_index") + long_functions(ROOT / "ingest")
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them): " + "; ".join(offenders)


def test_the_function_length_check_can_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    assert long_functions(package) == [f"pkg/long.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
