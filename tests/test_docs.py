"""Documentation stays true: every CLI command shows an example, is described in the README and
in the generated docs/cli-reference.md."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from eogp_index import cli_reference
from eogp_index.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def _commands(group, prefix=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, prefix + (name,))
        else:
            yield prefix + (name,), command


def test_every_command_has_an_example_in_its_help():
    runner = CliRunner()
    for path, _ in _commands(cli):
        result = runner.invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, path
        assert "Example:" in result.output, f"eogp {' '.join(path)} --help shows no Example:"


def test_every_command_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [" ".join(path) for path, _ in _commands(cli) if f"eogp {' '.join(path)}" not in readme]
    assert not missing, f"README.md does not mention: {missing}"


def test_every_on_disk_format_has_a_spec():
    for name in ("index.md", "store.md", "manifest.schema.json"):
        assert (ROOT / "schemas" / name).is_file(), name


@pytest.mark.parametrize("path", [path for path, _ in cli_reference.commands()], ids=" ".join)
def test_cli_reference_shows_the_current_help(path):
    reference = cli_reference.REFERENCE.read_text(encoding="utf-8") if cli_reference.REFERENCE.is_file() else ""
    assert cli_reference.section(path) in reference, (
        f"docs/cli-reference.md is stale for `{' '.join(path)} --help`: run `{cli_reference.REGENERATE}`")


def test_cli_reference_is_exactly_the_generated_page():
    assert cli_reference.REFERENCE.read_text(encoding="utf-8") == cli_reference.reference(), (
        f"docs/cli-reference.md is stale: run `{cli_reference.REGENERATE}`")


def test_readme_links_the_cli_reference():
    assert "docs/cli-reference.md" in (ROOT / "README.md").read_text()


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    return section.split("```")[1]


def test_readme_layout_names_every_module_and_only_real_ones():
    import re

    block = _layout_block()
    named = set(re.findall(r"([A-Za-z_]+\.py)\b", block))
    folders = set(re.findall(r"([A-Za-z_]+)/", block))
    package = ROOT / "eogp_index"
    modules = {p.name for p in package.glob("*.py")} | {p.name for d in package.iterdir() if d.is_dir()
                                                        and d.name not in ("evaluation", "kernels", "__pycache__")
                                                        for p in d.glob("*.py")}
    modules.discard("__init__.py")
    modules.discard("version.py")
    assert sorted(modules - named) == [], "README's Layout does not name these modules"
    real = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    assert sorted(named - real) == [], "README's Layout names modules that do not exist"
    subpackages = {d.name for d in package.iterdir() if (d / "__init__.py").exists()}
    assert sorted(subpackages - folders) == [], "README's Layout does not name these folders"
