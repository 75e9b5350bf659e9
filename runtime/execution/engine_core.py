"""EngineCore: one plugin runner on one rank, behind one interface.

The inline executor runs an EngineCore in the caller's process; every local or
external rank runs the same class, so a plugin behaves the same in all three modes.

A plugin's runner is either executing (``execute(request) -> result``) or stepped
(``add``/``step``/``has_unfinished``, for batching plugins). The core gives both
the stepped shape, so one loop drives either:

    core.add(request_id, request)        # admit work (may raise for that request)
    for request_id, result, error in core.step():
        ...                              # error is None or the exception raised

An executing runner runs one admitted request per ``step``; its exception fails
that request only.

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

    def __init__(self, entry: Entry, plugin_args: Any, ctx: BuildContext) -> None:
        self.entry = entry
        self.ctx = ctx
        self.runner = entry.build(ctx, plugin_args)
        stepped = all(callable(getattr(self.runner, m, None)) for m in ("add", "step", "has_unfinished"))
        if not stepped and not callable(getattr(self.runner, "execute", None)):
            raise TypeError(
                f"{type(entry).__name__}.build returned {type(self.runner).__name__}, which has "
                "neither execute(request) nor add/step/has_unfinished"
            )
        #: stepped runners batch whatever has been admitted; executing ones take one at a time
        self.batching = stepped
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
        if not self.batching:
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
        return self.runner.has_unfinished() if self.batching else bool(self._pending)

    def step(self) -> list[Completion]:
        """Advance the runner once; returns the requests that finished."""
        done = self._step()
        if self._info is not None:
            self._refresh_info()
        return done

    def _step(self) -> list[Completion]:
        if self.batching:
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
            done = [(request_id, self.runner.execute(request), None)]
        except Exception as exc:  # a request-local failure: report it as data
            done = [(request_id, None, exc)]
        if self._info is not None:
            self._refresh_info()
        return done

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
