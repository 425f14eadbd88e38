"""Documentation stays true: every CLI command shows an example and is described in the README."""

from pathlib import Path

from click.testing import CliRunner

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
