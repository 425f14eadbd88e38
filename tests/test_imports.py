"""The floor plan holds: imports run one way along the pipeline, with no cycles between files.

Every ``import`` statement of the package is read from the source (imports inside functions too,
which a runtime check would miss), resolved to the file it names, and checked.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eogp_index", "ingest")

#: Pipeline layers, lowest first: a file may import its own layer or lower ones only.
LAYERS = [
    ("eogp_index.errors", "eogp_index.config", "eogp_index.schemas", "eogp_index.version"),
    ("eogp_index.data",),
    ("eogp_index.gradients",),
    ("eogp_index.fit",),
    ("eogp_index.store",),
    ("eogp_index.encode",),
    ("eogp_index.search",),
    ("eogp_index.client",),
    (
        "ingest",
        "eogp_index.cluster",
        "eogp_index.evaluation",
        "eogp_index.cli",
        "eogp_index.serve",
        "eogp_index.cli_options",
        "eogp_index.cliutil",
        "eogp_index.cli_reference",
        "eogp_index.__init__",
    ),
]
#: The library core: everything but the command line and the evaluation layer. It never imports ingest.
NOT_CORE = (
    "eogp_index.evaluation",
    "eogp_index.cli",
    "eogp_index.cli_options",
    "eogp_index.cliutil",
    "eogp_index.cli_reference",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts)


def _files() -> Dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[_module_name(path)] = path
    return files


def _resolve(name: str, files: Dict[str, Path]) -> str | None:
    """The file module an import names: ``a.b.c`` is ``a.b.c``, or the package ``a.b.c.__init__``,
    or (for ``from a.b import c`` where ``c`` is a name) the module ``a.b``."""
    for candidate in (name, f"{name}.__init__"):
        if candidate in files:
            return candidate
    parent = name.rpartition(".")[0]
    if parent:
        return _resolve(parent, files)
    return None


def _imports(module: str, path: Path, files: Dict[str, Path]) -> Set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.rpartition(".")[0] if not module.endswith("__init__") else module.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, files)
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> Dict[str, Set[str]]:
    files = _files()
    return {module: _imports(module, path, files) for module, path in files.items()}


def _layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py; place it in LAYERS")


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_lazy_imports():
    # A test that cannot fail is a defect: the walk must see imports inside functions.
    graph = _graph()
    assert "eogp_index.search.scan" in graph["eogp_index.search.searchers"]  # imported inside a function
    assert "ingest.pipeline" in graph["eogp_index.cli"]


def test_no_import_cycle_between_files():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_core_never_imports_ingest():
    offenders = {
        module: sorted(t for t in targets if t.startswith("ingest"))
        for module, targets in _graph().items()
        if module.startswith("eogp_index") and not module.startswith(NOT_CORE)
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_imports_run_down_the_pipeline():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_tests_mirror_the_package_folders():
    """tests/<folder>/ holds the tests of eogp_index/<folder>/ (or of ingest/, benchmarks/); every
    folder of the package has one, and nothing else sits in tests/ but fixtures/."""
    folders = {p.name for p in (ROOT / "eogp_index").iterdir() if (p / "__init__.py").is_file()}
    test_folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders - test_folders) == [], "package folders without a tests/ folder"
    assert sorted(test_folders - folders - {"ingest", "benchmarks", "fixtures"}) == [], (
        "tests/ folders that mirror nothing"
    )
