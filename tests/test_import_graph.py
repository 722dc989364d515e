"""No import cycles inside nanoserve: every module imports, and the graph of nanoserve-internal
imports (module-level, the lazy ones inside functions and those under ``if TYPE_CHECKING:``, all
counted) has no cycle, so a lower layer never imports a higher one. An annotation-only import is
still an arrow between layers: a circle hidden under TYPE_CHECKING is a circle all the same. The
same holds between folders (each package under nanoserve/ one node, each top-level module one)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import nanoserve

PACKAGE_DIR = Path(nanoserve.__file__).parent


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_modules(name: str, known: set[str], source: str | None = None) -> set[str]:
    """The nanoserve modules `name` imports, anywhere in its body (TYPE_CHECKING blocks
    included). `source`: the module's text, when not read from the package."""
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text() if source is None else source, str(path)))
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = walk(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return None


# Modules that need an optional package at import time (checked only where it is installed).
OPTIONAL = {"nanoserve.bench.serve_plot": "matplotlib"}


@pytest.mark.parametrize("name", [n for n in module_names() if n != "nanoserve.__main__"])
def test_every_module_imports(name):  # (__main__ runs the command line when imported)
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    importlib.import_module(name)


def test_no_import_cycle():
    names = module_names()
    known = set(names)
    graph = {name: imported_modules(name, known) for name in names}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# Folder-level cycles that exist today, each named by the arrow that closes it (a lower folder
# or top-level module importing a higher one). The redesign of issue 53 removes them: this list
# may only shrink. A new folder cycle fails test_no_new_folder_cycle; an entry whose cycle is
# gone fails test_known_folder_cycles_still_exist, so a fixed cycle leaves the list with its fix.
KNOWN_FOLDER_CYCLES: set[tuple[str, str]] = set()


def folder_of(name: str) -> str:
    """The node a module belongs to at folder level: its top-level package under nanoserve/
    (engine, server, models, ...), or the top-level module itself (config, envs, ...)."""
    parts = name.split(".")[1:]
    return parts[0] if parts else "__init__"


def folder_graph() -> dict[str, set[str]]:
    """Folder -> the folders it imports (imports inside one folder are not arrows)."""
    names = module_names()
    known = set(names)
    graph: dict[str, set[str]] = {}
    for name in names:
        source = folder_of(name)
        targets = {folder_of(target) for target in imported_modules(name, known)}
        graph.setdefault(source, set()).update(targets - {source})
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return False


def test_folder_of():
    assert folder_of("nanoserve.engine.scheduler") == "engine"
    assert folder_of("nanoserve.server.http.connection") == "server"
    assert folder_of("nanoserve.config") == "config"
    assert folder_of("nanoserve") == "__init__"


def test_no_new_folder_cycle():
    graph = folder_graph()
    for source, target in KNOWN_FOLDER_CYCLES:
        graph[source].discard(target)
    cycle = find_cycle(graph)
    assert cycle is None, "folder cycle: " + " -> ".join(cycle)


def test_known_folder_cycles_still_exist():
    """Each allowed arrow is still there and still closes a cycle; remove the entry otherwise."""
    graph = folder_graph()
    gone = sorted(
        (source, target)
        for source, target in KNOWN_FOLDER_CYCLES
        if target not in graph.get(source, set()) or not reaches(graph, target, source)
    )
    assert gone == [], f"no longer a cycle, remove from KNOWN_FOLDER_CYCLES: {gone}"


def test_reaches():
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert reaches(graph, "a", "c")
    assert not reaches(graph, "c", "a")


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_imports_count():
    """A circle closed by an annotation-only import is found."""
    known = {"nanoserve.engine.llm_engine", "nanoserve.engine.request"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from nanoserve.engine.llm_engine import LLMEngine\n"
    )
    graph = {
        "nanoserve.engine.request": imported_modules("nanoserve.engine.request", known, source),
        "nanoserve.engine.llm_engine": {"nanoserve.engine.request"},
    }
    assert graph["nanoserve.engine.request"] == {"nanoserve.engine.llm_engine"}
    assert find_cycle(graph) is not None


def _every_import(path: Path, package: str | None = None) -> set[str]:
    """Every module a file names in an import statement, TYPE_CHECKING ones and lazy ones too
    (relative imports resolved against the file's package, by default where it lies)."""
    if package is None:
        package = ".".join(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_distributed_never_imports_the_engine_or_the_models():
    """distributed/ knows process groups and launching; the engine hands the launcher its
    worker entry point (engine/worker.py), not the other way round."""
    higher = ("nanoserve.engine", "nanoserve.models")
    arrows = sorted(
        f"{path.relative_to(PACKAGE_DIR.parent)} imports {name}"
        for path in (PACKAGE_DIR / "distributed").rglob("*.py")
        for name in _every_import(path)
        if any(name == top or name.startswith(top + ".") for top in higher)
    )
    assert arrows == []


def test_every_import_sees_lazy_and_type_checking_imports(tmp_path):
    sample = PACKAGE_DIR / "engine" / "worker.py"  # imports the launcher at module level
    assert "nanoserve.distributed.launcher" in _every_import(sample)
    source = tmp_path / "probe.py"  # as if in nanoserve/distributed/
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import worker\n"
        "def f():\n    import nanoserve.models.llama\n"
    )
    found = _every_import(source, "nanoserve.distributed")
    assert {"nanoserve.engine.worker", "nanoserve.models.llama"} <= found
