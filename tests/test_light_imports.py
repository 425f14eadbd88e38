"""`import eogp_index.cli` and `eogp --help` load no torch (nor transformers, kronfluence, numba, lancedb):
the command line answers at once, and the heavy libraries load only in the commands that use them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "kronfluence", "numba", "lancedb")
REPORT_HEAVY = f"import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["eogp_index", "eogp_index.cli", "eogp_index.evaluation.config"])
def test_import_loads_no_heavy_library(module):
    result = _python(f"import {module}; {REPORT_HEAVY}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import {module} loads {result.stdout.strip()}"


@pytest.mark.parametrize(
    "args",
    [["--help"], ["fit", "--help"], ["ingest", "--help"], ["query", "--help"], ["eval", "lds", "--help"]],
    ids=" ".join,
)
def test_help_loads_no_heavy_library(args):
    code = (
        f"from eogp_index.cli import cli\ntry:\n    cli.main({args!r}, prog_name='eogp')\n"
        f"except SystemExit as exit:\n    assert exit.code == 0, exit.code\n{REPORT_HEAVY}"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "Usage: eogp" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout.strip().splitlines()[-1]


def test_eogp_script_help_works():
    script = shutil.which("eogp", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "eogp_index.cli"]
    result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage: eogp" in result.stdout and "Commands:" in result.stdout


def test_lazy_names_resolve():
    import eogp_index

    assert eogp_index.ConfigError.__name__ == "ConfigError"
    assert eogp_index.AttributionIndex.__module__ == "eogp_index.client"
    assert set(eogp_index.__all__) <= set(dir(eogp_index))
    with pytest.raises(AttributeError):
        eogp_index.no_such_name  # noqa: B018
