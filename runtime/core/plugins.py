"""Plugins: how a model is declared to the runtime, and how a name finds it.

A plugin is an ``Entry`` subclass. The engine resolves a name in this order:

1. a name given to ``register_plugin`` in this process;
2. an entry point in the ``phyrt.plugins`` group (the built-ins are declared there
   too, so the runtime never imports ``models`` by name);
3. a ``"package.module:EntryClass"`` string.

Worker processes start fresh interpreters, where a ``register_plugin`` call made in
the parent may never have run. So the engine turns whatever name it was given into
the entry class's import path (``Entry.spec()``), and ranks resolve that.

An entry runs in two places. In the caller: ``configure(plugin_args)`` and
``validate_parallel`` (before any process could start), then ``validate_request``
(before each request is queued or sent).
On every rank: ``build(ctx, plugin_args)``, which returns the rank's runner, either

* an executing runner: ``execute(request) -> result``, one request at a time, or
* a stepped runner (batching plugins): ``add(request_id, request)``,
  ``step() -> list[(request_id, result)]`` and ``has_unfinished() -> bool``;
  ``step`` may also return ``(request_id, exception)`` to fail one request.

Streaming (``Engine.stream``, ``Client.stream``). A request submitted as a stream yields
chunks as they are made; two optional methods of a stepped runner give it that:

* ``add_stream(request_id, request)``: admit a request submitted as a stream. Its ``step``
  may then return ``(request_id, Partial(chunk))`` for it any number of times before its
  final ``(request_id, result)``, and that final result is the stream's last chunk (not the
  whole result: the caller sees the chunks in order, the last one included). A runner
  without ``add_stream`` is handed the request by ``add``; so is every request of an
  executing runner: the stream then has one chunk, the result.
* ``cancel(request_id)``: the caller left the stream. Stop working on the request and free
  what it holds; a later ``step`` still reports it once, with any outcome (it is dropped),
  so every rank ends it as it ends a finished request. Ids the runner no longer holds are
  never passed. Without ``cancel`` the request runs to its end and its chunks are dropped.

On a local replica every rank is handed the stream and the cancel alike; the output
rank's chunks are sent on, as its result is.
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

from runtime.core.config import ParallelConfig

ENTRY_POINT_GROUP = "phyrt.plugins"
KNOWN_DOMAINS = frozenset({"dense", "attention", "moe", "cfg", "pipeline"})
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

_registry: dict[str, type["Entry"]] = {}
_lock = threading.Lock()


class Partial:
    """A chunk of a streamed request's result: ``step()`` returns ``(request_id, Partial(chunk))``."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: Any) -> None:
        self.chunk = chunk

    def __repr__(self) -> str:
        return f"Partial({self.chunk!r})"


@dataclass(frozen=True)
class BuildContext:
    """What a rank knows about itself when its plugin is built.

    ``rank``/``world_size`` are positions inside the replica (not RANK/WORLD_SIZE of
    a launcher); ``device`` is a ``torch.device``; ``target`` is "cpu" or "cuda".
    """

    rank: int
    world_size: int
    replica_index: int
    device: Any
    target: str
    params_dtype: Any
    parallel: ParallelConfig

    @property
    def is_output_rank(self) -> bool:
        return self.rank == 0


class Entry:
    """Base class of every plugin. Subclass it and override ``build``."""

    #: the registered name (informational; resolution uses the registry key)
    name: ClassVar[str] = ""
    #: the parallel domains this plugin implements; empty means "single rank only"
    parallel_domains: ClassVar[frozenset[str] | set[str] | tuple[str, ...]] = frozenset()

    @classmethod
    def spec(cls) -> str:
        """The ``"module:Class"`` path that a fresh interpreter resolves to this class."""
        return f"{cls.__module__}:{cls.__qualname__}"

    def validate_parallel(self, parallel: ParallelConfig) -> None:
        """Reject any layout this plugin does not implement (runs in the caller).

        The default refuses every split of a domain the plugin did not declare, so a
        topology it cannot run fails before a process is spawned instead of running
        duplicate models. A domain's dp that merely fills the partition is fine when
        some declared domain does the splitting.
        """
        declared = set(self.parallel_domains)
        unknown = declared - KNOWN_DOMAINS
        if unknown:
            raise ValueError(
                f"plugin {self._label()} declares unknown parallel domains {sorted(unknown)}; "
                f"known: {sorted(KNOWN_DOMAINS)}"
            )
        problems = []
        for outer in ("pipeline", "cfg"):
            size = getattr(parallel.outer, f"{outer}_size")
            if size > 1 and outer not in declared:
                problems.append(f"outer.{outer}_size={size}")
        for domain in ("dense", "attention", "moe"):
            if domain in declared:
                continue
            for split, size in getattr(parallel, domain).split_sizes().items():
                if size > 1:
                    problems.append(f"{domain}.{split}_size={size}")
        if parallel.partition_size > 1 and not declared & {"dense", "attention", "moe"}:
            problems.append(f"a partition of {parallel.partition_size} ranks")
        if problems:
            raise ValueError(
                f"plugin {self._label()} does not implement {', '.join(problems)}; it declares "
                f"parallel_domains={sorted(declared) or '[] (single rank only)'}"
            )

    def configure(self, plugin_args: Any) -> None:
        """Check and keep ``plugin_args`` in the caller, before any rank is built.

        Called once per engine, before ``validate_parallel`` and every
        ``validate_request``, so that request checks can depend on the arguments
        (an observation size, a vocabulary). Raise ``ValueError``/``TypeError`` for
        bad arguments; the engine fails before it starts anything.
        """

    def validate_request(self, request: Any) -> None:
        """Raise (ValueError, TypeError, ...) for a payload this plugin cannot take.

        Runs in the caller before the request is queued or sent to any rank.
        """

    def build(self, ctx: BuildContext, plugin_args: Any) -> Any:
        """Build this rank's runner (see the module docstring). Runs on every rank."""
        raise NotImplementedError(f"plugin {self._label()} does not implement build()")

    def _label(self) -> str:
        return repr(self.name or type(self).__name__)


def register_plugin(name: str, entry: type[Entry] | None = None):
    """Register ``entry`` under ``name``; usable as ``@register_plugin("name")``.

    Registering a different class under a taken name is an error; registering the
    same class again (a module imported twice) is allowed.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"plugin name must be a non-empty string without ':', got {name!r}")

    def _register(cls: type[Entry]) -> type[Entry]:
        if not (isinstance(cls, type) and issubclass(cls, Entry)):
            raise TypeError(f"register_plugin({name!r}) needs an Entry subclass, got {cls!r}")
        with _lock:
            old = _registry.get(name)
            if old is not None and old.spec() != cls.spec():
                raise ValueError(f"plugin name {name!r} is already registered to {old.spec()}")
            _registry[name] = cls
        return cls

    return _register(entry) if entry is not None else _register


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_plugins() -> list[str]:
    """Every name ``resolve_plugin`` would accept without a ``module:Class`` string."""
    with _lock:
        names = set(_registry)
    return sorted(names | set(_entry_points()))


def resolve_plugin(name: str) -> type[Entry]:
    """The ``Entry`` class behind a registered name, an entry point or a spec string."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"plugin must be a non-empty string, got {name!r}")
    with _lock:
        cls = _registry.get(name)
    if cls is not None:
        return cls
    eps = _entry_points()
    if name in eps:
        try:
            cls = eps[name].load()
        except Exception as exc:
            raise ImportError(f"plugin {name!r}: entry point {eps[name].value!r} failed to load: {exc}") from exc
        return _checked(name, cls)
    if ":" in name:
        if not _SPEC.match(name):
            raise ValueError(f"plugin spec must look like 'package.module:EntryClass', got {name!r}")
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"plugin {name!r}: cannot import module {module_name!r}: {exc}") from exc
        cls = module
        for part in attr.split("."):  # a class nested in another class is "Outer.Inner"
            try:
                cls = getattr(cls, part)
            except AttributeError:
                raise ImportError(f"plugin {name!r}: module {module_name!r} has no attribute {attr!r}") from None
        return _checked(name, cls)
    raise ValueError(
        f"unknown plugin {name!r}; known plugins: {', '.join(known_plugins()) or '(none)'}; "
        "or pass 'package.module:EntryClass'"
    )


def _checked(name: str, cls: Any) -> type[Entry]:
    if not (isinstance(cls, type) and issubclass(cls, Entry)):
        raise TypeError(f"plugin {name!r} resolved to {cls!r}, which is not an Entry subclass")
    return cls
