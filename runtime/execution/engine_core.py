"""EngineCore: one plugin runner on one rank, behind one interface.

The inline executor runs an EngineCore in the caller's process; every local or
external rank runs the same class, so a plugin behaves the same in all three modes.

A plugin's runner is either executing (``execute(request) -> result``, and/or
``execute_batch(requests) -> results``) or stepped (``add``/``step``/``has_unfinished``, for
plugins that schedule their own batches, as qwen3 does). The core gives both
the stepped shape, so one loop drives either:

    core.add(request_id, request)        # admit work (may raise for that request)
    for request_id, result, error in core.step():
        ...                              # error is None or the exception raised

An executing runner runs one admitted request per ``step``; its exception fails
that request only. ``run(id, request)`` runs one request at once; ``run_batch(ids, requests)``
runs a batch the engine formed (``runtime.core.lanes``): with ``max_batch_size > 1`` one
``execute_batch`` call, which must return one result per request, in order. An exception, or a
result of the wrong kind or length, fails exactly that batch's requests, each with the cause.
A runner with ``execute_batch`` but no ``execute`` runs a lone request as a batch of one.

Streams (``runtime.core.plugins``): ``add(request_id, request, stream=True)`` admits a
request through the runner's ``add_stream`` when it has one; ``step`` then also returns
``(request_id, Partial(chunk), None)`` for it. ``cancel(request_id)`` reaches the runner's
``cancel`` only for a stream it still holds (the core keeps their ids until each is
reported), and is a no-op otherwise.

Plugin info: a runner may define ``info() -> dict`` (plain values: counters, rates, names; the
qwen3 runner's prefix-cache and prefill figures). The core keeps a snapshot, ``info_snapshot``,
taken on this rank's thread after a step (or run) at most every ``INFO_REFRESH_S`` while the
runner works, and after the step that leaves it idle; other threads read the snapshot, never the
runner (the inline replica's status; a rank's heartbeat carries it to the engine).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from runtime.core.config import EngineConfig
from runtime.core.plugins import BuildContext, Entry, Partial

Completion = tuple[Any, Any, BaseException | None]
#: the longest a working runner's ``info_snapshot`` is left unrefreshed
INFO_REFRESH_S = 0.25
log = logging.getLogger("phyrt.engine")


def make_context(config: EngineConfig, *, rank: int = 0, world_size: int = 1,
                 replica_index: int = 0, device_index: int | None = None) -> BuildContext:
    """The BuildContext of one rank; resolves "auto" and the device index."""
    import torch

    target = config.device.resolve_target()
    if target == "cuda":
        index = 0 if device_index is None else device_index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device entry {index} is out of range: this process sees "
                f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES applies)"
            )
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    return BuildContext(
        rank=rank,
        world_size=world_size,
        replica_index=replica_index,
        device=device,
        target=target,
        params_dtype=config.device.torch_dtype,
        parallel=config.parallel,
    )


class EngineCore:
    """Builds the plugin's runner for one rank and drives it."""

    def __init__(self, entry: Entry, plugin_args: Any, ctx: BuildContext, max_batch_size: int = 1) -> None:
        """``max_batch_size`` (``BatchingConfig``): > 1 needs a runner with ``execute_batch``."""
        self.entry = entry
        self.ctx = ctx
        self.runner = entry.build(ctx, plugin_args)
        name = type(self.runner).__name__
        stepped = all(callable(getattr(self.runner, m, None)) for m in ("add", "step", "has_unfinished"))
        execute, execute_batch = getattr(self.runner, "execute", None), getattr(self.runner, "execute_batch", None)
        self._execute_batch = execute_batch if callable(execute_batch) and not stepped else None
        if not stepped and not callable(execute) and self._execute_batch is None:
            raise TypeError(f"{type(entry).__name__}.build returned {name}, which has neither execute(request), "
                            "execute_batch(requests) nor add/step/has_unfinished")
        if max_batch_size > 1 and self._execute_batch is None:
            why = "it is a stepped runner, which forms its own batches" if stepped else "it has none"
            raise TypeError(f"max_batch_size={max_batch_size} needs a runner with execute_batch(requests) -> "
                            f"results, and {name} cannot batch that way: {why} (use max_batch_size=1)")
        self._execute = execute if callable(execute) and max_batch_size == 1 else self._execute_one
        #: stepped runners batch whatever has been admitted; executing ones take one at a time
        self.stepped = stepped
        #: the engine's batches: up to this many requests per ``run_batch`` (1: one ``execute`` each)
        self.batch_size = max_batch_size
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()
        add_stream, cancel = getattr(self.runner, "add_stream", None), getattr(self.runner, "cancel", None)
        self._add_stream = add_stream if stepped and callable(add_stream) else None
        self._cancel = cancel if stepped and callable(cancel) else None
        self._streams: set[Any] = set()  # streamed ids the runner holds and may be told to cancel
        info = getattr(self.runner, "info", None)
        self._info = info if callable(info) else None
        #: the runner's ``info()`` as of its last refresh (see the module docstring); None without one
        self.info_snapshot: dict[str, Any] | None = None
        self._info_at = float("-inf")

    def add(self, request_id: Any, request: Any, stream: bool = False) -> None:
        if not self.stepped:
            self._pending.append((request_id, request))
        elif stream and self._add_stream is not None:
            self._add_stream(request_id, request)
            if self._cancel is not None:
                self._streams.add(request_id)
        else:
            self.runner.add(request_id, request)

    def cancel(self, request_id: Any) -> None:
        """The caller left the stream ``request_id``: the runner's ``cancel``, if it still holds it."""
        if request_id in self._streams:
            self._streams.discard(request_id)
            self._cancel(request_id)

    def has_unfinished(self) -> bool:
        return self.runner.has_unfinished() if self.stepped else bool(self._pending)

    def step(self) -> list[Completion]:
        """Advance the runner once; returns the requests that finished."""
        done = self._step()
        if self._info is not None:
            self._refresh_info()
        return done

    def _step(self) -> list[Completion]:
        if self.stepped:
            done = []
            streams = self._streams
            for request_id, outcome in self.runner.step():
                if isinstance(outcome, BaseException):
                    done.append((request_id, None, outcome))
                else:
                    done.append((request_id, outcome, None))
                if streams and not isinstance(outcome, Partial):
                    streams.discard(request_id)
            return done
        if not self._pending:
            return []
        return self.run(*self._pending.popleft())

    def run(self, request_id: Any, request: Any) -> list[Completion]:
        """``add`` then ``step`` in one call, for an executing runner with nothing admitted."""
        try:
            done = [(request_id, self._execute(request), None)]
        except Exception as exc:  # a request-local failure: report it as data
            done = [(request_id, None, exc)]
        if self._info is not None:
            self._refresh_info()
        return done

    def run_batch(self, request_ids: list[Any], requests: list[Any]) -> list[Completion]:
        """One batch the engine formed: ``execute_batch`` once (with ``max_batch_size`` > 1), else
        the one request's ``run``. A failure fails each of the batch's requests with its cause."""
        if self.batch_size == 1 and len(requests) == 1:
            return self.run(request_ids[0], requests[0])
        try:
            results = self._batch(requests)
            done = [(request_id, result, None) for request_id, result in zip(request_ids, results)]
        except Exception as exc:
            done = [(request_id, None, exc) for request_id in request_ids]
        if self._info is not None:
            self._refresh_info()
        return done

    def _batch(self, requests: list[Any]) -> list[Any]:
        results = self._execute_batch(list(requests))
        if not isinstance(results, (list, tuple)):
            raise TypeError(f"{type(self.runner).__name__}.execute_batch returned {type(results).__name__}, "
                            f"not a list of {len(requests)} results")
        if len(results) != len(requests):
            raise ValueError(f"{type(self.runner).__name__}.execute_batch returned {len(results)} results for a "
                             f"batch of {len(requests)} requests (one per request, in order)")
        return results

    def _execute_one(self, request: Any) -> Any:
        """``execute`` of a runner that batches: a batch of one."""
        return self._batch([request])[0]

    def _refresh_info(self) -> None:
        now = time.monotonic()
        if now - self._info_at < INFO_REFRESH_S and self.has_unfinished():
            return
        self._info_at = now
        try:
            info = self._info()
        except Exception as exc:  # a broken info() must not stop the serving
            log.warning("the plugin's info() failed (%s: %s); it is not asked again", type(exc).__name__, exc)
            self._info = None
            return
        self.info_snapshot = dict(info) if info is not None else None

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if callable(close):
            close()
