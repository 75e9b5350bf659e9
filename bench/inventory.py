"""Issue 33's before/after table: the shape of the I/O concurrency in phyrt's product code.

    python -m bench.inventory [--root CHECKOUT] [--rev GIT_REV] [--top N]

Reads ``runtime``, ``supervisor``, ``workers`` and ``models`` as text (``ast``), through
``bench.structure.load`` of the checkout itself (the counting ``tests/test_structure.py``
uses: a def's lines are ``end_lineno - lineno + 1``, nested defs counted again inside their
class); runs none of it. ``--rev`` measures a git revision instead of the working tree
(``git archive`` into a temporary directory). Prints markdown.

Automatic: modules/lines per package, largest classes/functions, future-like classes and
their uses, ``Future()`` construction sites, deadline-carrying classes, thread sites, lock
sites, constructors over 4 parameters, objects handed to several constructors in one
function, intra-package import arrows and floors, ``zmq.backend`` uses, duplicate file names.
By hand (``REQUEST_WALK`` below, checked against the tree: every module and function named
must exist): the modules a ``Client.call`` to a local tp=2 server crosses. Update it after
the change by reading the new code, as it was made here.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

LIMITS = {"module": 400, "class": 300, "function": 60}
PACKAGES = ("runtime", "supervisor", "workers", "models")

# (process, thread, module, function or class.method that runs there, what it does), in order.
# Traced by reading the code for: Client("ipc://...").call({"obs": float32[1, 32]}) against
# ``python -m runtime.launch --devices 0,1`` (plugin "policy", local mode, one replica, tp=2, CPU).
REQUEST_WALK = [
    # client process, the calling thread
    ("client", "caller", "runtime.client.client", "Client.call", "check, then the link's call"),
    ("client", "caller", "runtime.link.link", "Link.call", "prepare, enter, transmit, read"),
    ("client", "caller", "runtime.link.client_protocol", "plain_submit", "try the plain fast path (refused: a tensor)"),
    ("client", "caller", "runtime.link.current_session", "CurrentSession.encoder", "a PayloadEncoder over the shm session"),
    ("client", "caller", "runtime.transport.protocol", "PayloadEncoder.pack_message", "header + tensor frame"),
    ("client", "caller", "runtime.transport.codec", "pack", "msgpack fast path"),
    ("client", "caller", "runtime.core.futures", "Slot", "the caller's own future"),
    ("client", "caller", "runtime.link.dealer", "Dealer.enter", "register + take the socket, one lock"),
    ("client", "caller", "runtime.link.pending", "PendingTable.add_locked", "the request in flight"),
    ("client", "caller", "runtime.link.reader", "ReaderRole.take_locked", "the socket's holder (the reader)"),
    ("client", "caller", "runtime.link.lane", "_Announcer.put", "into the request ring, announce (the lane)"),
    ("client", "caller", "runtime.link.dealer", "Dealer.read", "spin-poll, read"),
    ("client", "caller", "runtime.transport.spin", "Spinner.wait", "spin before sleeping in zmq_poll"),
    # server process, the looping I/O thread
    ("server", "phyrt-server-0", "runtime.serving.server", "IoLoop.run", "poll, read a batch"),
    ("server", "phyrt-server-0", "runtime.link.listener", "Listener.read_batch", "ROUTER, then the lanes"),
    ("server", "phyrt-server-0", "runtime.link.peer_shm", "PeerSessions.read_lanes", "the doorbell's ids"),
    ("server", "phyrt-server-0", "runtime.link.lane", "Ring.get", "the request's frames"),
    ("server", "phyrt-server-0", "runtime.serving.handlers", "MessageHandler.handle", "decode, check, admit"),
    ("server", "phyrt-server-0", "runtime.transport.protocol", "unpack_header", "header, tensor refs"),
    ("server", "phyrt-server-0", "runtime.transport.codec", "loads", "msgpack C decode"),
    ("server", "phyrt-server-0", "runtime.link.peer_shm", "PeerSessions.get", "this client's shm state"),
    ("server", "phyrt-server-0", "runtime.link.client_protocol", "submit_options", "the op's fields and checks"),
    ("server", "phyrt-server-0", "runtime.serving.outcomes", "Request", "the request's entry"),
    ("server", "phyrt-server-0", "runtime.link.pending", "PendingTable.add", "in flight, with its deadline"),
    ("server", "phyrt-server-0", "runtime.engine", "Engine.submit", "validate_request, dispatch"),
    ("server", "phyrt-server-0", "models.policy", "PolicyEntry.validate_request", "the plugin's check", "compute"),
    ("server", "phyrt-server-0", "runtime.execution.dispatcher", "RequestDispatcher.submit", "choose + reserve"),
    ("server", "phyrt-server-0", "runtime.execution.executor", "ReplicaExecutor.submit_reserved", "future"),
    ("server", "phyrt-server-0", "runtime.execution.multiprocess", "MultiprocessExecutor._submit", "to its replica"),
    ("server", "phyrt-server-0", "supervisor.replica", "Replica.submit", "encode, register, queue"),
    ("server", "phyrt-server-0", "runtime.transport.wire", "pack_message", "the engine<->ranks codec"),
    ("server", "phyrt-server-0", "runtime.link.rank_window", "RankWindow.queue_locked",
     "its turn: the ranks' window has room"),
    ("server", "phyrt-server-0", "runtime.core.lanes", "Lanes.put", "priority order (taken at once here)"),
    ("server", "phyrt-server-0", "runtime.link.broadcast", "BroadcastWriter.write_all", "one slot, a post per rank"),
    ("server", "phyrt-server-0", "supervisor.supervisor", "WorkerSupervisor._queued",
     "nobody reads (the role's holder)? then wake the link thread"),
    # each rank process (2), its main thread
    ("rank 0 and rank 1", "main", "workers.serve_loop", "serve", "read the ring"),
    ("rank 0 and rank 1", "main", "runtime.link.broadcast", "BroadcastReader.recv", "wait on the semaphore"),
    ("rank 0 and rank 1", "main", "runtime.transport.wire", "unpack_message", "decode the request"),
    ("rank 0 and rank 1", "main", "runtime.transport.codec", "loads", "msgpack C decode"),
    ("rank 0 and rank 1", "main", "runtime.execution.engine_core", "EngineCore.run", "execute", "compute"),
    ("rank 0 and rank 1", "main", "models.policy", "PolicyRunner.execute", "the MLP", "compute"),
    ("rank 0 and rank 1", "main", "models.layers.linear", "RowParallelLinear.forward", "tp layers", "compute"),
    ("rank 0 and rank 1", "main", "runtime.parallel", "all_reduce", "P.all_reduce on dense_tp", "compute"),
    ("rank 0 and rank 1", "main", "runtime.parallel.shm_collectives", "ShmGroup.all_reduce", "CPU shm collective",
     "compute"),
    ("rank 0", "main", "workers.serve_loop", "_Answers.send", "\"done\" with the result (rank 0 only)"),
    ("rank 0", "main", "runtime.link.lane", "_Announcer.put", "into the answer ring, one byte (the answer lane)"),
    # server process, the supervisor's link thread (the reader when no caller reads)
    ("server", "phyrt-supervisor", "runtime.link.link_thread", "LinkThread._turn", "poll the ends' fds"),
    ("server", "phyrt-supervisor", "supervisor.supervisor", "WorkerSupervisor.poll_items", "what to poll"),
    ("server", "phyrt-supervisor", "runtime.link.reader", "ReaderRole.take_if_due", "the reader role, answers due"),
    ("server", "phyrt-supervisor", "runtime.link.rank_answers", "Answers.take_lane", "the announced answers, bookkeeping"),
    ("server", "phyrt-supervisor", "runtime.link.lane", "AnswerReader.take", "the answer's frame"),
    ("server", "phyrt-supervisor", "runtime.transport.wire", "unpack_message", "decode the answer"),
    ("server", "phyrt-supervisor", "supervisor.replica", "Replica.done", "claim the pending entry"),
    ("server", "phyrt-supervisor", "runtime.core.futures", "resolve", "complete the request's Future"),
    ("server", "phyrt-supervisor", "runtime.execution.executor", "ReplicaExecutor._done", "in-flight count"),
    ("server", "phyrt-supervisor", "runtime.serving.outcomes", "Replies.on_done", "claim, encode the reply"),
    ("server", "phyrt-supervisor", "runtime.link.client_protocol", "submit_reply", "the reply's header"),
    ("server", "phyrt-supervisor", "runtime.transport.protocol", "PayloadEncoder.pack_message", "reply + frame"),
    ("server", "phyrt-supervisor", "runtime.link.lane", "ServerLane.reply", "into the reply ring, one byte"),
    # client process, the calling thread again
    ("client", "caller", "runtime.link.dealer", "Dealer._read_lane", "the announced replies"),
    ("client", "caller", "runtime.link.awaited", "Awaited.handle", "claim, decode, TensorResolver"),
    ("client", "caller", "runtime.transport.protocol", "TensorResolver.resolve", "tensor frame -> numpy"),
    ("client", "caller", "runtime.core.futures", "Slot.set_result", "via Awaited.complete"),
]


def checkout(root: pathlib.Path, rev: str | None) -> tuple[pathlib.Path, tempfile.TemporaryDirectory | None]:
    if rev is None:
        return root, None
    tmp = tempfile.TemporaryDirectory(prefix="issue33-")
    data = subprocess.run(["git", "-C", str(root), "archive", rev, *PACKAGES, "bench"], check=True,
                          capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(data)).extractall(tmp.name)
    return pathlib.Path(tmp.name), tmp


def rel(root: pathlib.Path, path: pathlib.Path) -> str:
    return str(path.relative_to(root))


def src(node: ast.AST) -> str:
    return ast.unparse(node)


def package_of(m) -> str:
    return m.folder


# -- sections ------------------------------------------------------------------------------

def packages(modules) -> list[str]:
    rows = collections.OrderedDict()
    for m in sorted(modules.values(), key=lambda m: m.name):
        n, lines = rows.get(m.folder, (0, 0))
        rows[m.folder] = (n + 1, lines + m.lines)
    out = ["| package | modules | lines |", "|---|---:|---:|"]
    for folder, (n, lines) in sorted(rows.items()):
        out.append(f"| {folder} | {n} | {lines} |")
    for top in PACKAGES:
        mods = [m for m in modules.values() if m.name == top or m.name.startswith(top + ".")]
        out.append(f"| **{top}/ (all)** | {len(mods)} | {sum(m.lines for m in mods)} |")
    out.append(f"| **product total** | {len(modules)} | {sum(m.lines for m in modules.values())} |")
    return out


def largest(modules, top: int) -> list[str]:
    defs = [(lines, kind, f"{m.name}.{name}") for m in modules.values() for kind, name, lines in m.defs]
    out = []
    biggest = max(modules.values(), key=lambda m: m.lines)
    out.append(f"Largest module: {biggest.name} {biggest.lines} lines "
               f"({100 * biggest.lines / LIMITS['module']:.0f}% of {LIMITS['module']})")
    for kind in ("class", "function"):
        out += ["", f"| largest {kind} | lines | % of limit ({LIMITS[kind]}) |", "|---|---:|---:|"]
        for lines, _, name in sorted((d for d in defs if d[1] == kind), reverse=True)[:top]:
            out.append(f"| {name} | {lines} | {100 * lines / LIMITS[kind]:.0f}% |")
    return out


def _classes(trees):
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield path, node


def futures(root, trees) -> list[str]:
    out = []
    found = {}
    for path, cls in _classes(trees):
        bases = [src(b) for b in cls.bases]
        methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        slots = set()
        for n in cls.body:
            if isinstance(n, ast.Assign) and any(src(t) == "__slots__" for t in n.targets):
                try:
                    slots = set(ast.literal_eval(n.value))
                except ValueError:
                    pass
        future_base = any(b.split(".")[-1] == "Future" for b in bases)
        duck = "done" in methods and ({"result", "cancel", "wait"} & methods)
        holds_future = "future" in slots
        if future_base or duck:
            kind = "subclass of Future" if future_base else f"duck future ({', '.join(sorted(methods & {'done', 'result', 'cancel', 'wait', 'set_result', 'set_exception'}))})"
            found[cls.name] = (path, cls.lineno, kind)
    out += ["| future-like class | defined | kind | used at (product code) |", "|---|---|---|---|"]
    for name, (path, line, kind) in sorted(found.items()):
        uses = []
        for p, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id == name:
                    uses.append(f"{rel(root, p)}:{node.lineno}")
                elif isinstance(node, ast.Attribute) and node.attr == name:
                    uses.append(f"{rel(root, p)}:{node.lineno}")
        out.append(f"| {name} | {rel(root, path)}:{line} | {kind} | {', '.join(sorted(set(uses)))} |")
    made = []
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = src(node.func)
                if f in ("Future", "futures.Future", "concurrent.futures.Future", "asyncio.Future") \
                        or f.endswith("wrap_future") or f.endswith("create_future"):
                    made.append(f"{rel(root, p)}:{node.lineno} `{f}()`")
    out += ["", f"`Future()` / `wrap_future` construction sites ({len(made)}): " + "; ".join(sorted(made))]
    return out


def deadlines(root, trees) -> list[str]:
    out = ["| class | defined | deadline attribute / table |", "|---|---|---|"]
    for path, cls in _classes(trees):
        text = src(cls)
        attrs = sorted(set(re.findall(r"self\.(_?\w*deadline\w*)\b", text)) | (
            {"deadline (slot)"} if re.search(r"__slots__ = \([^)]*'deadline'", text) else set()))
        tables = sorted(set(re.findall(r"self\.(_?(?:pending|requests|running|table|_requests))\s*[:=]", text)))
        if attrs or tables:
            out.append(f"| {cls.name} | {rel(root, path)}:{cls.lineno} | {', '.join(attrs + tables)} |")
    return out


_THREAD_FUNCS = ("threading.Thread",)
_LOCK_FUNCS = ("threading.Lock", "threading.RLock", "threading.Condition", "threading.Semaphore",
               "threading.BoundedSemaphore")


def _assign_targets(tree):
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def threads(root, trees, texts) -> list[str]:
    out = ["| site | target | name |", "|---|---|---|"]
    n = 0
    for p, tree in sorted(trees.items()):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and src(node.func) in _THREAD_FUNCS:
                kw = {k.arg: src(k.value) for k in node.keywords}
                out.append(f"| {rel(root, p)}:{node.lineno} | {kw.get('target', '?')} | {kw.get('name', '?')} |")
                n += 1
    return [f"`threading.Thread(` sites: {n}", ""] + out


def locks(root, trees, texts, modules) -> list[str]:
    out = ["| site | kind | bound to | comment on the line |", "|---|---|---|---|"]
    n = 0
    for p, tree in sorted(trees.items()):
        lines = texts[p].splitlines()
        parents = _assign_targets(tree)
        for node in ast.walk(tree):
            kind = None
            if isinstance(node, ast.Call) and src(node.func) in _LOCK_FUNCS:
                kind = src(node.func).split(".")[-1]
            elif isinstance(node, ast.keyword) and node.arg == "default_factory" and src(node.value) in _LOCK_FUNCS:
                kind = src(node.value).split(".")[-1] + " (dataclass field)"
            if kind is None:
                continue
            parent = parents.get(node)
            while parent is not None and not isinstance(parent, (ast.Assign, ast.AnnAssign)):
                parent = parents.get(parent)
            target = ""
            if isinstance(parent, ast.Assign):
                target = ", ".join(src(t) for t in parent.targets)
            elif isinstance(parent, ast.AnnAssign):
                target = src(parent.target)
            line = lines[node.lineno - 1]
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            out.append(f"| {rel(root, p)}:{node.lineno} | {kind} | {target} | {comment} |")
            n += 1
    total = sum(m.lock_sites for m in modules.values())
    return [f"Lock/RLock/Condition/Semaphore constructions: {n}; `with ...lock:`/acquire/wait_for sites "
            f"(bench.structure's count): {total}", ""] + out


def arrows(modules, folder: str) -> list[str]:
    inside = {n: m for n, m in modules.items() if m.folder == folder}
    out = []
    for with_init in (False, True):
        nodes = {n for n in inside if with_init or n != folder}
        edges = sorted((a, b) for a in nodes for b in modules[a].imports if b in nodes)
        graph = collections.defaultdict(set)
        for a, b in edges:
            graph[a].add(b)
        memo = {}

        def depth(n, seen=()):
            if n in memo:
                return memo[n]
            if n in seen:
                return 0
            memo[n] = d = 1 + max((depth(s, seen + (n,)) for s in graph[n]), default=0)
            return d

        floors = max((depth(n) for n in nodes), default=0)
        chain, n = [], max(sorted(nodes), key=depth) if nodes else None
        while n is not None:
            chain.append(f"{n}/__init__" if n == folder else n.rsplit(".", 1)[-1])
            nxt = sorted(s for s in graph[n] if depth(s) == depth(n) - 1)
            n = nxt[0] if nxt else None
        label = "with __init__" if with_init else "without __init__"
        out.append(f"- {folder} ({label}): {len(nodes)} modules, {len(edges)} import arrows, "
                   f"{floors} floors (longest chain: {' -> '.join(chain)})")
        if not with_init:
            for a in sorted(graph):
                out.append(f"  - {a.rsplit('.', 1)[-1]} -> {', '.join(sorted(b.rsplit('.', 1)[-1] for b in graph[a]))}")
    return out


_PRIMITIVE = re.compile(r"^(int|float|str|bool|bytes|None|Any)( \| None)?$")


def constructors(root, trees) -> list[str]:
    out = ["| class | defined | params | of them not plain data | names |", "|---|---|---:|---:|---|"]
    for path, cls in sorted(_classes(trees), key=lambda pc: (str(pc[0]), pc[1].lineno)):
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            continue
        params = [a for a in init.args.args[1:] + init.args.kwonlyargs]
        if len(params) <= 4:
            continue
        collab = [a for a in params if a.annotation is None or not _PRIMITIVE.match(src(a.annotation))]
        names = ", ".join(a.arg for a in params)
        out.append(f"| {cls.name} | {rel(root, path)}:{init.lineno} | {len(params)} | {len(collab)} | {names} |")
    return out


def shared_args(root, trees) -> list[str]:
    """Objects (``self._x`` or a local name) handed to two or more constructors in one function."""
    out = []
    for p, tree in sorted(trees.items()):
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            uses = collections.defaultdict(list)
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    name = src(node.func).split(".")[-1]
                    if not name[:1].isupper():
                        continue
                    for arg in list(node.args) + [k.value for k in node.keywords]:
                        if isinstance(arg, (ast.Attribute, ast.Name)):
                            s = src(arg)
                            if s.startswith("self._") or isinstance(arg, ast.Name):
                                uses[s].append(name)
            for s, ctors in sorted(uses.items()):
                ctors = sorted(set(ctors))
                if len(ctors) >= 3:
                    out.append(f"- {rel(root, p)}:{fn.lineno} `{fn.name}`: `{s}` -> {', '.join(ctors)}")
    return out


def backend(root, texts) -> list[str]:
    out = []
    for p, text in sorted(texts.items()):
        for i, line in enumerate(text.splitlines(), 1):
            if "zmq.backend" in line:
                out.append(f"- {rel(root, p)}:{i}: `{line.strip()}`")
    return out


def duplicates(root) -> list[str]:
    names = collections.defaultdict(list)
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                names[path.name].append(rel(root, path))
    return [f"- {name} x{len(paths)}: {', '.join(paths)}" for name, paths in sorted(names.items()) if len(paths) > 1]


def walk(modules, trees_by_module) -> list[str]:
    out = ["| # | process | thread | module | code | does |", "|---:|---|---|---|---|---|"]
    missing = []
    for i, (proc, thread, mod, fn, what, *kind) in enumerate(REQUEST_WALK, 1):
        tree = trees_by_module.get(mod)
        ok = tree is not None and _has(tree, fn)
        if not ok:
            missing.append(f"{mod}:{fn}")
        tag = " (compute)" if kind else ""
        out.append(f"| {i} | {proc} | {thread} | {mod} | {fn}{'' if ok else ' (NOT FOUND)'} | {what}{tag} |")
    distinct = sorted({e[2] for e in REQUEST_WALK})
    io_only = sorted({e[2] for e in REQUEST_WALK if len(e) == 5})
    per = collections.OrderedDict()
    for proc, thread, mod, *_ in REQUEST_WALK:
        per.setdefault((proc, thread), [])
        if mod not in per[(proc, thread)]:
            per[(proc, thread)].append(mod)
    out += ["", f"Distinct product modules on the path: {len(distinct)} ({len(io_only)} without the plugin, "
                f"layers, collectives and EngineCore); processes: "
                f"{len({p for p, _ in per})} kinds (client, server, 2 ranks = 4 processes); threads: "
                f"{len(per)} (process, thread) pairs"]
    for (proc, thread), mods in per.items():
        out.append(f"- {proc} / {thread}: {len(mods)} modules: {', '.join(mods)}")
    if missing:
        out.append(f"\nStale entries (update REQUEST_WALK): {', '.join(missing)}")
    return out


def _has(tree: ast.AST, dotted: str) -> bool:
    parts = dotted.split(".")
    scope = [tree]
    for part in parts:
        found = [n for s in scope for n in ast.iter_child_nodes(s)
                 if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part]
        if not found:
            return False
        scope = found
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("/work/main"))
    parser.add_argument("--rev", default=None, help="a git revision of --root instead of its working tree")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    root, tmp = checkout(args.root.resolve(), args.rev)
    sys.path.insert(0, str(root))
    from bench.structure import load  # the checkout's own counting

    modules = load(root)
    texts = {m.path: m.path.read_text() for m in modules.values()}
    trees = {p: ast.parse(t) for p, t in texts.items()}
    by_module = {m.name: trees[m.path] for m in modules.values()}
    sections = [
        (f"Measured: {args.root}{' @ ' + args.rev if args.rev else ' (working tree)'}", []),
        ("A1. Modules and lines per package", packages(modules)),
        ("A2. Largest module, classes and functions", largest(modules, args.top)),
        ("A3. Future types", futures(root, trees)),
        ("A4. Classes carrying deadlines or request tables (heuristic; annotate by hand)", deadlines(root, trees)),
        ("A5. Thread creation sites", threads(root, trees, texts)),
        ("A6. Lock sites", locks(root, trees, texts, modules)),
        ("A7. Import arrows inside supervisor/ and runtime/client/", arrows(modules, "supervisor") + arrows(modules, "runtime.client")),
        ("A8a. Constructors taking more than 4 parameters", constructors(root, trees)),
        ("A8b. One object handed to 3+ constructors in one function", shared_args(root, trees)),
        ("A8c. zmq.backend uses", backend(root, texts)),
        ("A8d. Duplicate file names", duplicates(root)),
        ("A9. The modules a request crosses (Client.call -> local tp=2 server -> back)", walk(modules, by_module)),
    ]
    for title, body in sections:
        print(f"### {title}\n")
        print("\n".join(body))
        print()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
