"""Engine: the one interface for every deployment shape.

    Engine.submit(request)
      -> plugin.validate_request(request)      in the caller; its error is raised here
      -> RequestDispatcher                     least in flight among healthy replicas
           -> ReplicaExecutor[i].submit        inline thread | local worker group | torchrun rank
      <- concurrent.futures.Future

Everything that can be checked before a process starts is checked in the caller,
in this order: the plugin resolves, ``configure(plugin_args)``,
``validate_parallel(parallel)``, the deployment's mode and device placement.

``stream(request)`` submits the request as a stream (``runtime.execution.stream_call``): the
replica's runner may send chunks before its last one (see ``runtime.core.plugins``);
``submit_stream`` is the same with a callback instead of an iterator (the server's way).

A local deployment with ``replica_restarts`` rebuilds failed replicas in the background
(``runtime.execution.restarts``); ``replicas`` and ``can_serve`` then report rebuilds.

``empty(shape, dtype)`` gives a tensor where the replica's transport reads it directly (a
local replica's request shared memory), so that a large input crosses with no copy.

``step`` runs through the dispatcher's ``call``: the calling thread waits there, and a
local replica lets it read its own answer (``submit``'s future only waits: whichever
thread reads the answers completes it). A server reaches an idle inline replica through ``inline_runner()`` (see
``runtime.execution.inline.IdleRunner``); nothing else crosses these layers.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from runtime.core.config import DeploymentConfig, EngineArgs
from runtime.execution.dispatcher import RequestDispatcher
from runtime.core.errors import EngineUnavailableError
from runtime.core.priority import check_priority
from runtime.execution.executor import ReplicaExecutor, ReplicaStatus
from runtime.core.plugins import Entry, resolve_plugin

if TYPE_CHECKING:
    from runtime.execution.inline import IdleRunner
    from runtime.execution.restarts import RestartController, Starter
    from runtime.execution.stream_call import Stream, StreamCall

__all__ = ["Engine", "ReplicaStatus"]

#: how long an engine nobody closed waits for a running request at interpreter exit
_EXIT_TIMEOUT_S = 5.0


class Engine:
    """Serve a plugin inline, on local worker groups, or as one torchrun rank.

    ``Engine(EngineArgs(plugin="policy"))`` runs inline; ``deployment`` chooses
    otherwise (see ``DeploymentConfig``). Use it as a context manager, or call
    ``close()``; an engine nobody closed is closed at interpreter exit.
    """

    def __init__(self, args: EngineArgs, deployment: DeploymentConfig | None = None) -> None:
        if not isinstance(args, EngineArgs):
            raise TypeError(f"Engine needs EngineArgs, got {args!r}")
        if deployment is None:
            deployment = DeploymentConfig()
        if not isinstance(deployment, DeploymentConfig):
            raise TypeError(f"deployment must be a DeploymentConfig, got {deployment!r}")
        self.args = args
        self.deployment = deployment

        entry_cls = resolve_plugin(args.plugin)
        self._entry: Entry = entry_cls()
        self._entry.configure(args.plugin_args)
        parallel = args.config.parallel
        self._entry.validate_parallel(parallel)
        self.ranks_per_replica = parallel.infer_replica_world_size()
        self.mode = deployment.resolve_mode(self.ranks_per_replica)
        placement = deployment.placement(self.ranks_per_replica)

        self._rebuild: Starter | None = None  # local mode: starts one replica anew
        executors = self._start_executors(entry_cls, placement)
        self._dispatcher = RequestDispatcher(executors)
        self._restarts: RestartController | None = None
        if self._rebuild is not None and deployment.replica_restarts > 0:
            from runtime.execution.restarts import RestartController

            self._restarts = RestartController(self._dispatcher, self._rebuild, deployment.replica_restarts,
                                               deployment.restart_backoff_s,
                                               deployment.process_config.startup_timeout_s)
        self._finalizer = weakref.finalize(self, _close_at_exit, self._dispatcher, self._restarts)

    def _start_executors(self, entry_cls: type[Entry], placement: list[tuple[int, ...]]) -> list[ReplicaExecutor]:
        if self.mode == "inline":
            from runtime.execution.inline import InlineExecutor
            from runtime.execution.engine_core import EngineCore, make_context

            devices = placement[0]
            ctx = make_context(self.args.config, device_index=devices[0] if self.deployment.devices else None)
            batching = self.args.config.batching
            core = EngineCore(self._entry, self.args.plugin_args, ctx, batching.max_batch_size)
            return [InlineExecutor(core, 0, devices, batching.max_delay_ms / 1000)]
        if self.mode == "local":
            import msgpack

            from runtime.execution.multiprocess import MultiprocessExecutor
            from runtime.execution.restarts import local_starter
            from supervisor import WorkerSupervisor

            try:  # the ranks decode with string map keys only, as every phyrt message
                msgpack.unpackb(msgpack.packb(self.args.plugin_args, use_bin_type=True), raw=False)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(
                    "plugin_args must be plain data (dicts with string keys, lists, strings, numbers, "
                    "bytes) to reach "
                    f"worker processes: {exc}") from None
            target = self.args.config.device.resolve_target()
            supervisor = WorkerSupervisor(self.args, entry_cls.spec(), placement, self.deployment.process_config,
                                          target)
            self._rebuild = local_starter(self.args, entry_cls.spec(), placement, self.deployment.process_config,
                                          target)
            return [MultiprocessExecutor(supervisor, i, devices) for i, devices in enumerate(placement)]
        if self.mode == "external":
            from runtime.execution.external import ExternalExecutor

            # this process is one rank torchrun made; every rank builds its part and joins the group
            return [ExternalExecutor.start(self._entry, self.args, self.deployment)]
        raise NotImplementedError(f"deployment mode {self.mode!r} is not available in this build")

    # -- requests ------------------------------------------------------------------

    def submit(self, request: Any, *, priority: int = 0) -> Future:
        """Validate ``request`` here, then hand it to a replica; returns at once.

        ``priority`` (an int): larger is sooner. A replica serves its queued requests highest
        priority first, FIFO within a level, and fills a batch from the highest levels first;
        a request already running is never preempted.

        Raises the plugin's own error for a bad payload, ``TypeError``/``ValueError`` for a bad
        priority, and ``EngineUnavailableError`` when the engine is closed or no replica is healthy.
        """
        if not self._finalizer.alive:
            raise EngineUnavailableError("the engine is closed")
        priority = check_priority(priority)
        self._entry.validate_request(request)
        return self._dispatcher.submit(request, None, priority)

    def stream(self, request: Any, timeout: float | None = None, *, priority: int = 0) -> Stream:
        """Run ``request`` as a stream: an iterator of its chunks, as the plugin makes them.

        Validation errors and ``EngineUnavailableError`` are raised here. ``timeout``
        (seconds) bounds the whole stream (``TimeoutError`` from ``next``). Leaving early
        (``break`` inside ``with``, ``close()``, or dropping the iterator) cancels the
        request; a replica that fails meanwhile ends it with ``EngineUnavailableError``.
        A plugin that does not stream gives one chunk: its result.
        """
        from runtime.execution.stream_call import Stream

        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        stream = Stream(timeout)
        return stream.start(self._submit_call(request, stream.call, priority))

    def submit_stream(self, request: Any, on_chunk: Callable[[Any], None], *, priority: int = 0) -> StreamCall:
        """Submit ``request`` as a stream: ``on_chunk(chunk)`` for each chunk but the last (called
        from the engine's thread: it must not block), ``.future`` for the last chunk, ``.cancel()``."""
        from runtime.execution.stream_call import StreamCall

        call = StreamCall(on_chunk)
        call.future = self._submit_call(request, call, priority)
        return call

    def _submit_call(self, request: Any, call: StreamCall, priority: int) -> Future:
        if not self._finalizer.alive:
            raise EngineUnavailableError("the engine is closed")
        priority = check_priority(priority)
        self._entry.validate_request(request)
        return self._dispatcher.submit(request, call, priority)

    def empty(self, shape: Any, dtype: Any = None) -> Any:
        """A new, uninitialised CPU tensor placed where this engine's transport reads it.

        On a local replica it lies in that replica's request shared memory: a request that
        carries it (or a contiguous slice of it) reaches the ranks with no copy. Inline (and
        under torchrun) it is an ordinary tensor, which those modes read as it is. ``dtype``:
        a ``torch.dtype``, float32 when None.

        Ownership. The tensor is yours: write it, send it in any number of requests, keep it
        for as long as you like. Its memory goes back to the engine's pool once you dropped
        every reference to it *and* every request that carried it was answered, whichever
        comes last; it stays valid after ``close()``. Do not write it while a request that
        carries it runs: the ranks read the very memory you write, so they may see the new
        values, the old ones or a mix (never freed memory). A tensor from another engine or
        a closed one is copied as any other tensor. With several replicas it is placed in the
        replica the next request would go to; a request routed to another replica copies it.
        """
        import torch

        if not self._finalizer.alive:
            raise EngineUnavailableError("the engine is closed")
        dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if not isinstance(dims, (tuple, list, torch.Size)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"shape must be an int or a sequence of ints >= 0, got {shape!r}")
        if dtype is None:
            dtype = torch.float32
        if not isinstance(dtype, torch.dtype) or dtype.is_complex:
            raise TypeError(f"dtype must be a real torch.dtype, got {dtype!r}")
        return self._dispatcher.empty(tuple(dims), dtype)

    def inline_runner(self) -> IdleRunner | None:
        """The one inline replica's ``IdleRunner`` (runs a request in the calling thread when
        the replica holds nothing else); None in any other mode."""
        executors = self._dispatcher.executors
        if self.mode != "inline" or len(executors) != 1:
            return None
        return executors[0].idle_runner(self._entry.validate_request)

    def step(self, request: Any, timeout: float | None = None, *, priority: int = 0) -> Any:
        """Run one request and return its result.

        With ``timeout`` (seconds), raises ``TimeoutError`` when no result came in
        time; a request that was still queued is then cancelled, one that was
        running goes on and its result is dropped. ``priority``: as in ``submit``.
        """
        if not self._finalizer.alive:
            raise EngineUnavailableError("the engine is closed")
        priority = check_priority(priority)
        self._entry.validate_request(request)
        return self._dispatcher.call(request, timeout, priority)

    # -- state ---------------------------------------------------------------------

    @property
    def replicas(self) -> list[ReplicaStatus]:
        """Each replica's health and in-flight count (and rebuilds, with ``replica_restarts``)."""
        if self._restarts is not None:
            return self._restarts.statuses()
        return self._dispatcher.statuses()

    @property
    def can_serve(self) -> bool:
        """Whether some replica is healthy or being rebuilt (False once closed)."""
        if self.closed:
            return False
        return any(status.healthy or status.restarting for status in self.replicas)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self, timeout: float | None = None) -> None:
        """Cancel queued work, fail pending managed requests, stop and release
        everything. Idempotent. ``timeout`` bounds the wait for a running inline
        request (None waits for it)."""
        if self._finalizer.detach() is not None:
            _close(self._dispatcher, self._restarts, timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(r.healthy for r in self.replicas)} healthy"
        return (f"Engine(plugin={self.args.plugin!r}, mode={self.mode!r}, "
                f"replicas={self.deployment.replica_count}, ranks_per_replica={self.ranks_per_replica}, {state})")


def _close(dispatcher: RequestDispatcher, restarts: RestartController | None, timeout: float | None) -> None:
    """Rebuilds stop first (none is swapped in after this), then the replicas close; a
    rebuild's start still under way is waited for and closed."""
    if restarts is not None:
        restarts.stop()
    try:
        dispatcher.close(timeout)
    finally:
        if restarts is not None:
            restarts.join()


def _close_at_exit(dispatcher: RequestDispatcher, restarts: RestartController | None) -> None:
    _close(dispatcher, restarts, _EXIT_TIMEOUT_S)
