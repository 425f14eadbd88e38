"""Write ``docs/cli-reference.md``: every ``eogp`` command's ``--help``, in one page.

The page is generated, never edited, so it cannot drift from the commands;
``tests/test_docs.py`` fails when it is stale.

Example:
    python -m eogp_index.cli_reference            # rewrite docs/cli-reference.md
    python -m eogp_index.cli_reference --check    # exit 1 if it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import click
from click.testing import CliRunner

from eogp_index.cli import cli

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "cli-reference.md"
REGENERATE = "python -m eogp_index.cli_reference"

_HEADER = f"""# `eogp` command reference

<!-- Generated from each command's --help by `{REGENERATE}`; edit the commands, not this file. -->

Every command of `eogp`, as its `--help` prints it. Under `torchrun`, `eogp ingest` and
`eogp query` run one worker each: `torchrun --nproc_per_node N -m eogp_index.cli ingest ...`.
"""


Path_ = Tuple[str, ...]


def commands(group: click.Group = cli, path: Path_ = ("eogp",)) -> Iterator[Tuple[Path_, click.Command]]:
    """``(("eogp", "eval", "lds"), command)`` for the group and every command below it, in --help order."""
    yield path, group
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from commands(command, path + (name,))
        else:
            yield path + (name,), command


def help_text(path: Path_) -> str:
    """What ``<path> --help`` prints (80 columns, as CliRunner formats it)."""
    result = CliRunner().invoke(cli, [*path[1:], "--help"], prog_name=path[0])
    if result.exit_code != 0:
        raise RuntimeError(f"{' '.join(path)} --help failed: {result.output}")
    return result.output.rstrip() + "\n"


def section(path: Path_) -> str:
    return f"## {' '.join(path)}\n\n```text\n{help_text(path)}```\n"


def reference() -> str:
    """The whole page, as it should read now."""
    return "\n".join([_HEADER] + [section(path) for path, _ in commands()])


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--check" in argv:
        if not REFERENCE.is_file() or REFERENCE.read_text(encoding="utf-8") != text:
            print(f"{REFERENCE} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
