"""The shape of the code: module sizes, the largest classes and functions, lock sites,
threads, environment knobs, and the import graph between modules and folders.

    python -m bench.structure [--root DIR] [--top N]

Reads the product packages (``runtime``, ``supervisor``, ``workers``, ``models``) as
text with ``ast``; runs nothing of them. ``tests/test_structure.py`` holds the limits
(modules < 400 lines, classes < 300, functions < 60, no import cycle between modules
or between folders, deferred imports included) against what this finds.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
from dataclasses import dataclass, field

PACKAGES = ("runtime", "supervisor", "workers", "models")
_LOCK_SITE = re.compile(r"with [^\n:]*(?:lock|_turn|_cond)\b[^\n:]*:|\.acquire\(|\.wait_for\(")
_THREAD = re.compile(r"threading\.Thread\(")
_KNOB = re.compile(r"PHYRT_[A-Z_]+")


@dataclass
class Module:
    name: str  # dotted
    path: pathlib.Path
    lines: int
    imports: set[str] = field(default_factory=set)  # project modules, deferred imports included
    defs: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, qualified name, lines)
    lock_sites: int = 0
    threads: int = 0
    knobs: set[str] = field(default_factory=set)

    @property
    def folder(self) -> str:
        parts = self.name.split(".")
        return ".".join(parts if self.path.name == "__init__.py" else parts[:-1])


def load(root: pathlib.Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            text = path.read_text()
            modules[".".join(parts)] = Module(".".join(parts), path, len(text.splitlines()))
    for module in modules.values():
        text = module.path.read_text()
        tree = ast.parse(text)
        module.imports = _imports(tree, module, modules)
        module.defs = list(_defs(tree, ""))
        module.lock_sites = len(_LOCK_SITE.findall(text))
        module.threads = len(_THREAD.findall(text))
        if re.search(r"os\.environ|getenv\(", text):
            module.knobs = set(_KNOB.findall(text))
    return modules


def _imports(tree: ast.AST, module: Module, modules: dict[str, Module]) -> set[str]:
    found: set[str] = set()
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module.name:
                found.add(name)
    return found


def _defs(tree: ast.AST, prefix: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            name = f"{prefix}{node.name}"
            yield kind, name, node.end_lineno - node.lineno + 1
            yield from _defs(node, f"{name}.")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    return {name: set(m.imports) for name, m in modules.items()}


def folder_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m in modules.values():
        edges = graph.setdefault(m.folder, set())
        for target in m.imports:
            folder = modules[target].folder
            if folder != m.folder:
                edges.add(folder)
    return graph


def report(root: pathlib.Path, top: int) -> str:
    modules = load(root)
    defs = [(lines, kind, f"{m.name}.{name}") for m in modules.values() for kind, name, lines in m.defs]
    out = [f"# Structure of {root}", "",
           f"{len(modules)} modules, {sum(m.lines for m in modules.values())} lines; "
           f"modules over 400 lines: {sum(m.lines > 400 for m in modules.values())}; "
           f"classes over 300: {sum(1 for d in defs if d[1] == 'class' and d[0] > 300)}; "
           f"functions over 60: {sum(1 for d in defs if d[1] == 'function' and d[0] > 60)}", "",
           "| largest modules | lines | lock sites | threads started |", "|---|---:|---:|---:|"]
    for m in sorted(modules.values(), key=lambda m: -m.lines)[:top]:
        out.append(f"| {m.name} | {m.lines} | {m.lock_sites} | {m.threads} |")
    for kind in ("class", "function"):
        out += ["", f"| largest {kind}es |  lines |".replace("classes", "classes").replace("functiones", "functions"),
                "|---|---:|"]
        for lines, _, name in sorted((d for d in defs if d[1] == kind), reverse=True)[:top]:
            out.append(f"| {name} | {lines} |")
    knobs = sorted({(k, m.name) for m in modules.values() for k in m.knobs})
    out += ["", f"Environment knobs read: {len({k for k, _ in knobs})} "
                f"({', '.join(f'{k} in {where}' for k, where in knobs) or 'none'})",
            f"Lock sites: {sum(m.lock_sites for m in modules.values())}; "
            f"thread starts: {sum(m.threads for m in modules.values())}", ""]
    folders = folder_graph(modules)
    out.append("Folder imports (deferred included):")
    for folder in sorted(folders):
        out.append(f"- {folder} -> {', '.join(sorted(folders[folder])) or '(nothing of the project)'}")
    out += ["", f"Module cycles: {cycles(module_graph(modules)) or 'none'}",
            f"Folder cycles: {cycles(folders) or 'none'}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent,
                        help="the checkout to read (default: this one)")
    parser.add_argument("--top", type=int, default=5, help="rows per table (default: 5)")
    args = parser.parse_args(argv)
    print(report(args.root.resolve(), args.top))


if __name__ == "__main__":
    main()
