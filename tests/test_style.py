"""One formatter and one linter, configured in pyproject.toml ([tool.ruff]): the suite fails when
a file is not formatted or a lint rule breaks. Fix with `ruff format . && ruff check --fix .`."""

from __future__ import annotations

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
