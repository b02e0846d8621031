"""The project's modules import each other one way: no cycle, counting every import statement,
those inside functions too (a lazy import hides a cycle, it does not remove it), but not those
under ``if TYPE_CHECKING:`` (never run). ``from a.b import c`` is an edge to ``a.b.c`` when
that is a module, else to ``a.b``; a package's ``__init__`` importing its own submodules is not
an edge back from them."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("albatross", "model", "data_prep", "pretrain", "finetune", "slurm", "engine", "study")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    mods = modules(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []  # ast.walk reads the body later: never-run imports dropped
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_project_has_no_import_cycle():
    graph = import_graph(REPO, PACKAGES)
    assert len(graph) > 100  # the packages were found
    found = cycles(graph)
    described = [
        ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found
    ]  # fmt: skip
    assert not found, "import cycles:\n" + "\n".join(described)


def test_a_cycle_is_found_even_through_a_lazy_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg import a\n")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert cycles(graph) == [["pkg.a", "pkg.b"]]  # b imports a inside a function
    assert graph["pkg.c"] == set()  # TYPE_CHECKING only


ROOMS = ("engine", "model", "pretrain", "finetune", "data_prep")
MAX_LINES = 800


def test_no_module_of_the_core_packages_is_over_800_lines():
    """A module past ~800 lines has more than one job: split it by job."""
    long = {
        str(path.relative_to(REPO)): n
        for package in ROOMS
        for path in (REPO / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
