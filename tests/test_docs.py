"""Documentation stays true: every CLI command shows an example, is described in the README or a
docs/ page and in the generated docs/cli-reference.md; the README stays short, and its links and
the docs/ pages' links lead somewhere."""

import re
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


def _docs_pages():
    """docs/*.md written by hand (the generated CLI reference mentions every command by itself)."""
    return sorted(p for p in (ROOT / "docs").glob("*.md") if p != cli_reference.REFERENCE)


def test_every_command_is_documented_in_the_readme_or_docs():
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *_docs_pages()])
    missing = [" ".join(path) for path, _ in _commands(cli) if f"eogp {' '.join(path)}" not in text]
    assert not missing, f"neither README.md nor docs/ mentions: {missing}"


README_MAX_BYTES = 12 * 1024


def test_readme_is_at_most_12_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a docs/ page and link it"
    )


_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def _broken_links(page: Path) -> list:
    """Relative links of a Markdown page (outside code blocks) whose file, or heading, is missing."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


def test_every_page_the_readme_links_to_exists():
    readme = ROOT / "README.md"
    assert _broken_links(readme) == [], "README.md links to missing files or headings"
    linked = {t.partition("#")[0] for t in _LINK.findall(_FENCE.sub("", readme.read_text(encoding="utf-8")))}
    assert "docs/README.md" in linked, "README.md does not link the docs/ index page"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_relative_link_in_docs_resolves(page):
    assert _broken_links(page) == [], f"{page.relative_to(ROOT)} links to missing files or headings"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_on_disk_format_has_a_spec():
    for name in ("index.md", "store.md", "manifest.schema.json"):
        assert (ROOT / "schemas" / name).is_file(), name


@pytest.mark.parametrize("path", [path for path, _ in cli_reference.commands()], ids=" ".join)
def test_cli_reference_shows_the_current_help(path):
    reference = cli_reference.REFERENCE.read_text(encoding="utf-8") if cli_reference.REFERENCE.is_file() else ""
    assert cli_reference.section(path) in reference, (
        f"docs/cli-reference.md is stale for `{' '.join(path)} --help`: run `{cli_reference.REGENERATE}`"
    )


def test_cli_reference_is_exactly_the_generated_page():
    assert cli_reference.REFERENCE.read_text(encoding="utf-8") == cli_reference.reference(), (
        f"docs/cli-reference.md is stale: run `{cli_reference.REGENERATE}`"
    )


def test_readme_links_the_cli_reference():
    assert "docs/cli-reference.md" in (ROOT / "README.md").read_text()


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _layout_block() -> str:
    page = ARCHITECTURE.read_text(encoding="utf-8")
    section = page[page.index("## Layout") :]
    return section.split("```")[1]


def test_architecture_layout_names_every_module_and_only_real_ones():
    block = _layout_block()
    named = set(re.findall(r"([A-Za-z_]+\.py)\b", block))
    folders = set(re.findall(r"([A-Za-z_]+)/", block))
    package = ROOT / "eogp_index"
    modules = {p.name for p in package.glob("*.py")} | {
        p.name
        for d in package.iterdir()
        if d.is_dir() and d.name not in ("evaluation", "kernels", "__pycache__")
        for p in d.glob("*.py")
    }
    modules.discard("__init__.py")
    modules.discard("version.py")
    assert sorted(modules - named) == [], "docs/architecture.md's Layout does not name these modules"
    real = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    assert sorted(named - real) == [], "docs/architecture.md's Layout names modules that do not exist"
    subpackages = {d.name for d in package.iterdir() if (d / "__init__.py").exists()}
    assert sorted(subpackages - folders) == [], "docs/architecture.md's Layout does not name these folders"
