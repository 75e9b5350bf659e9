"""The shape DESIGN.md section 1 asks for, checked on the product packages (``bench.structure``):
modules under 400 lines, classes under 300, functions under 60; imports that point one way,
between modules and between folders, deferred imports included; bench/ and examples/ use
public names only."""

from __future__ import annotations

import ast
import pathlib

import pytest

from bench.structure import cycles, folder_graph, load, module_graph

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def modules():
    return load(ROOT)


def test_modules_classes_and_functions_stay_small(modules):
    too_big = [f"module {m.name}: {m.lines} lines" for m in modules.values() if m.lines > 400]
    for m in modules.values():
        for kind, name, lines in m.defs:
            if (kind == "class" and lines > 300) or (kind == "function" and lines > 60):
                too_big.append(f"{kind} {m.name}.{name}: {lines} lines")
    assert too_big == []


def test_no_import_cycle_between_modules_or_folders(modules):
    assert cycles(module_graph(modules)) == []
    assert cycles(folder_graph(modules)) == []


def test_the_layers_point_the_way_design_says(modules):
    folders = folder_graph(modules)
    assert folders["runtime.core"] == set()
    assert folders["runtime.transport"] <= {"runtime.core"}
    assert folders["runtime.client"] <= {"runtime.core", "runtime.transport"}
    assert not {"workers", "models"} & set().union(*(folders[f] for f in folders if f.startswith("runtime")))
    assert folders["supervisor"] <= {"runtime.core", "runtime.transport"}  # ranks are spawned by module path
    assert all(not f.startswith("runtime.") or f == "runtime.parallel" for f in folders["models"] - {"runtime"})


def test_bench_and_examples_use_public_names_only():
    """No ``obj._private`` of a product object and no ``from x import _private`` in bench/ or examples/."""
    own = {"self", "cls"}
    found = []
    for folder in ("bench", "examples"):
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            # modules other than the product's (bench's own helpers may share private names)
            local_modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                             for a in n.names if not a.name.startswith(("runtime", "supervisor", "workers", "models"))}
            local_modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                              and (n.module or "").split(".")[0] in ("bench", "examples") for a in n.names}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        ("runtime", "supervisor", "workers", "models")):
                    found += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_")]
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    base = node.value
                    if isinstance(base, ast.Name) and (base.id in own or base.id in local_modules):
                        continue
                    found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []
