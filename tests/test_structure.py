"""The rules of ARCHITECTURE.md (sections 1 and 2), checked on the product packages (``bench.structure``):
modules of at most 400 lines, classes 300, functions 60; imports that point one way, between modules
and between folders, deferred imports included; the layers of its table; bench/ and examples/ use
public names only. ARCHITECTURE.md must state the limits and name the packages that these tests use."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from bench.structure import cycles, folder_graph, load, module_graph

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

#: the size limits (lines, inclusive) of ARCHITECTURE.md section 2
MODULE_LINES = 400
CLASS_LINES = 300
FUNCTION_LINES = 60

#: folder -> the project folders it may import at most (ARCHITECTURE.md section 1)
MAY_IMPORT = {
    "runtime.core": set(),
    "runtime.transport": {"runtime.core"},
    "runtime.link": {"runtime.core", "runtime.transport"},
    "runtime.client": {"runtime.core", "runtime.transport", "runtime.link"},
    "supervisor": {"runtime.core", "runtime.transport", "runtime.link"},  # ranks are spawned by module path
}
#: folders that no ``runtime`` folder imports (ranks start by module path, plugins through the registry)
NOT_FROM_RUNTIME = {"workers", "models"}
#: the only ``runtime`` folders that ``models`` and its subfolders import
MODELS_FROM_RUNTIME = {"runtime", "runtime.parallel"}
#: folders whose modules use only public names of the product
PUBLIC_NAMES_ONLY = ("bench", "examples")
#: ``threading.Thread(`` sites in the product at most (issue 33; ARCHITECTURE.md section 3)
MAX_THREAD_SITES = 10
#: folders that issue 33 narrowed, and how many modules (``__init__.py`` included) each may have
MAX_MODULES = {"supervisor": 5, "runtime.client": 7}
#: how many collaborators (parameters that are not plain data) a constructor may take (issue 33)
MAX_COLLABORATORS = 4
#: annotations of plain data: numbers, text, containers, torch dtypes and devices, configs
DATA = re.compile(r"(None|int|float|str|bool|bytes|list|tuple|dict|frozenset|Sequence|mmap\.mmap"
                  r"|torch\.\w+|\w*Config|EngineArgs|CurveKeys)(\[.*\])?")
#: file names that every package folder may have
SHARED_FILE_NAMES = {"__init__.py", "__main__.py"}
#: the only other file names that two product modules share, and the modules sharing each.
#: issue 33 (docs/dev/link-plan.md): none left; client/errors.py is client/server_errors.py since S5.
SAME_NAME_FOR_NOW: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def modules():
    return load(ROOT)


def test_modules_classes_and_functions_stay_small(modules):
    limits = {"class": CLASS_LINES, "function": FUNCTION_LINES}
    too_big = [f"module {m.name}: {m.lines} lines" for m in modules.values() if m.lines > MODULE_LINES]
    for m in modules.values():
        for kind, name, lines in m.defs:
            if lines > limits[kind]:
                too_big.append(f"{kind} {m.name}.{name}: {lines} lines")
    assert too_big == []


def test_no_import_cycle_between_modules_or_folders(modules):
    assert cycles(module_graph(modules)) == []
    assert cycles(folder_graph(modules)) == []


def test_the_layers_point_the_way_architecture_says(modules):
    folders = folder_graph(modules)
    beyond = {folder: folders[folder] - allowed for folder, allowed in MAY_IMPORT.items()}
    assert beyond == {folder: set() for folder in MAY_IMPORT}
    assert not NOT_FROM_RUNTIME & set().union(*(folders[f] for f in folders if _in("runtime", f)))
    from_models = set().union(*(folders[f] for f in folders if _in("models", f)))
    assert {f for f in from_models if _in("runtime", f)} <= MODELS_FROM_RUNTIME


def _in(package: str, folder: str) -> bool:
    return folder == package or folder.startswith(package + ".")


def _section(text: str, title: str) -> str:
    """The body of the ``## `` section of ARCHITECTURE.md whose heading contains ``title``."""
    match = re.search(rf"^## [^\n]*{re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"ARCHITECTURE.md has no section titled {title!r}"
    return match.group(1)


def test_the_narrowed_folders_keep_their_module_counts(modules):
    counts = {folder: sum(1 for m in modules.values() if m.name.rpartition(".")[0] == folder
                          or m.name == folder) for folder in MAX_MODULES}
    assert {f: n for f, n in counts.items() if n > MAX_MODULES[f]} == {}
    assert all(counts.values())  # (the folders exist: a rename must update this test)


def test_no_constructor_takes_more_than_four_collaborators(modules):
    """Issue 33: objects wired by a handful of collaborators, not by shared state passed around. A
    collaborator is a parameter of ``__init__`` whose annotation is not plain data (``DATA``): an
    object, a callable, ``Any``, or nothing said."""
    wide = []
    for m in modules.values():
        for cls in (n for n in ast.walk(ast.parse(m.path.read_text())) if isinstance(n, ast.ClassDef)):
            for init in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                args = init.args.posonlyargs + init.args.args[1:] + init.args.kwonlyargs
                objects = [a.arg for a in args if a.annotation is None or not all(
                    DATA.fullmatch(part.strip()) for part in ast.unparse(a.annotation).split("|"))]
                if len(objects) > MAX_COLLABORATORS:
                    wide.append(f"{m.name}.{cls.name}({', '.join(objects)})")
    assert wide == []


def test_no_two_product_modules_share_a_file_name(modules):
    """A file name says what its module holds, once: no two modules of the product packages share
    one (issue 33), beyond ``__init__.py``, ``__main__.py`` and the pairs of ``SAME_NAME_FOR_NOW``,
    which must still be exactly the modules sharing a name (so that an entry goes with its pair)."""
    by_name: dict[str, set[str]] = {}
    for m in modules.values():
        if m.path.name not in SHARED_FILE_NAMES:
            by_name.setdefault(m.path.name, set()).add(m.path.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert shared == SAME_NAME_FOR_NOW


def test_architecture_states_the_limits_and_the_layers_these_tests_enforce():
    """The rules live in ARCHITECTURE.md: its size table gives the limits used above, and its
    layer table has a row for every package that the layer rules above name."""
    text = ARCHITECTURE.read_text()
    sizes = dict(re.findall(r"^\|\s*(module|class|function)\s*\|\s*(?:≤|<=|at most)\s*(\d+)\s*\|",
                            _section(text, "Size rules"), re.M))
    assert {unit: int(n) for unit, n in sizes.items()} == {
        "module": MODULE_LINES, "class": CLASS_LINES, "function": FUNCTION_LINES}
    rows = {m.group(1) for m in re.finditer(r"^\|\s*`([\w.]+)`", _section(text, "Packages and layers"), re.M)}
    named = set(MAY_IMPORT).union(*MAY_IMPORT.values(), NOT_FROM_RUNTIME, MODELS_FROM_RUNTIME, PUBLIC_NAMES_ONLY)
    assert named - rows == set()


def test_architecture_counts_the_thread_sites_and_names_each_thread(modules):
    """Section 3 says how many ``threading.Thread(`` sites the product has (``MAX_THREAD_SITES`` at
    most) and names each thread a site starts, so that a new thread cannot come in unsaid."""
    section = _section(ARCHITECTURE.read_text(), "Processes and threads")
    stated = re.search(r"There are (\d+) `threading\.Thread\(` sites", section)
    assert stated, "ARCHITECTURE.md section 3 does not say how many thread sites there are"
    assert int(stated.group(1)) == sum(m.threads for m in modules.values()) <= MAX_THREAD_SITES
    names = set()
    for m in modules.values():
        for call in re.findall(r"threading\.Thread\((.*?)\)\s*$", m.path.read_text(), re.M | re.S):
            names.update(re.findall(r"name=f?[\"'](phyrt-[a-z-]+)", call))
    assert len(names) >= 8  # the literal names (LinkThread and SpawnThread take theirs as an argument)
    assert {n for n in names if f"`{n}" not in section} == set()


def test_bench_and_examples_use_public_names_only():
    """No ``obj._private`` of a product object and no ``from x import _private`` in bench/ or examples/."""
    own = {"self", "cls"}
    found = []
    for folder in PUBLIC_NAMES_ONLY:
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            # modules other than the product's (bench's own helpers may share private names)
            local_modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                             for a in n.names if not a.name.startswith(("runtime", "supervisor", "workers", "models"))}
            local_modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                              and (n.module or "").split(".")[0] in PUBLIC_NAMES_ONLY for a in n.names}
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
