"""Private names of torch, DeepSpeed and Python are used in one module, `albatross/compat.py`, each
checked against the versions it names: a scan of every module of the packages finds none
elsewhere, and the installed torch and DeepSpeed are among the versions checked."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from albatross import compat

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("albatross", "model", "data_prep", "pretrain", "finetune", "slurm", "engine", "study")
LIBRARIES = ("torch", "deepspeed")
INTERNAL_ATTRIBUTES = frozenset(
    {"averaged_gradients", "bit16_groups", "parallel_partitioned_bit16_groups",
     "single_partition_of_fp32_groups", "round_robin_bit16_offsets", "round_robin_bit16_meta",
     "real_dp_process_group", "_config", "_zero_padding", "_step_count"}
)  # fmt: skip
"""Internals of DeepSpeed's ZeRO optimizer and engine and of torch's schedulers."""
ALLOWED = {("albatross/compat.py", "*")}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private name of torch / DeepSpeed / Python a module's code uses
    (its docstrings and comments are not code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if any(_private(p) for p in name.split(".")):
                        found.append((node.lineno, name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(_private(p) for p in parts):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if node.attr in INTERNAL_ATTRIBUTES:
                found.append((node.lineno, name or node.attr))
            elif name is not None:
                root, *rest = name.split(".")
                library = root in LIBRARIES and any(_private(p) for p in rest)
                python = root in ("atexit", "sys") and bool(rest) and _private(rest[0])
                if library or python:
                    found.append((node.lineno, name))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _dotted(target.value) == "sys.modules":
                    found.append((node.lineno, "sys.modules[...] ="))
    return sorted(set(found))


def test_private_names_are_used_only_in_the_compatibility_module():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if (rel, "*") in ALLOWED:
                continue
            for line, name in private_uses(path.read_text()):
                if (rel, name) not in ALLOWED:
                    offenders.append(f"{rel}:{line}: {name}")
    assert not offenders, "private names outside albatross/compat.py:\n" + "\n".join(offenders)


def test_the_scan_finds_each_kind_of_private_name():
    source = '''
import torch._dynamo
from torch._inductor import config
from torch.nn.utils.parametrizations import _Orthogonal
import atexit, sys
x = torch._foreach_norm([])
zero.averaged_gradients.get(0)
scheduler._step_count = 3
atexit._run_exitfuncs()
sys.modules["mlflow"] = None
y = torch.__version__  # a dunder is public
"""torch._dynamo in a docstring is not code"""
'''
    names = [name for _, name in private_uses(source)]
    assert names == [
        "torch._dynamo",
        "torch._inductor.config",
        "torch.nn.utils.parametrizations._Orthogonal",
        "torch._foreach_norm",
        "zero.averaged_gradients",
        "scheduler._step_count",
        "atexit._run_exitfuncs",
        "sys.modules[...] =",
    ]


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("library", ["torch", "deepspeed", "python"])
def test_the_installed_versions_are_among_those_checked(library):
    if library == "python":
        installed = f"{sys.version_info.major}.{sys.version_info.minor}"
    else:
        installed = _major_minor(__import__(library).__version__)
    assert installed in compat.CHECKED[library], (
        f"{library} {installed} is not among the versions albatross/compat.py was checked against "
        f"({compat.CHECKED[library]}): check each of its functions against it, then add it"
    )
