"""InlineExecutor: the plugin runs in the caller's process, on one background thread.

    caller threads --submit--> Lanes --> serve thread --> EngineCore.run_batch() | .step()
                   <--------- Future.set_result / set_exception ------------'

    a server's I/O thread --IdleRunner.run(request, hand_over)--> EngineCore.run()   (same thread)
                          <-- (True, result, error), or (False, None, None): submit it instead

Invariants:
- Requests start highest priority first, in submission order within a level
  (``runtime.core.lanes``). A request still queued can be cancelled
  (``Future.cancel()``); it runs once the serve thread holds the runner for it (one the
  serve thread waits with, behind a request an ``IdleRunner`` runs, is still queued).
- A stepped runner is handed everything queued at each step, so concurrent requests
  share forward passes; an executing runner takes one request at a time, or with
  ``BatchingConfig.max_batch_size > 1`` one batch the lanes formed (one ``execute_batch``).
- A plugin exception fails that request's future with the plugin's own exception
  and the replica stays healthy. Only a ``BaseException`` that is not an
  ``Exception`` (say ``SystemExit`` from plugin code) takes the replica down.
- The serve thread is a daemon: an engine nobody closed never keeps the interpreter
  alive; ``Engine`` closes it from a ``weakref.finalize`` at exit.

Streams: a streamed request's ``StreamCall`` gets each ``Partial`` chunk from the serve
thread; its cancel cancels the future while queued, else asks the serve thread to pass
``cancel`` to the runner before its next step (the future then completes as the runner
reports the id, and the caller has stopped listening).

``IdleRunner`` (``Engine.inline_runner()``) is the one extra capability, for a server that
wants an idle engine to answer in the thread that read the request (no hop to the serve
thread and back). ``run(request, hand_over)`` validates the request with the plugin's
``validate_request`` (its error is raised there), then runs it in the calling thread if
the replica is serving, holds no other request and its runner executes one request at a
time, unbatched; ``hand_over()`` is called once that is decided, before the plugin runs (the server
gives its loop to another thread then). The runner is entered by one thread at a time
(``_exec_lock``), so this path and the serve thread never overlap; the request counts as
in flight while it runs, so a submit meanwhile queues behind it. Otherwise nothing ran
and the caller submits the request as usual.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable

from runtime.core.batch_key import batch_key
from runtime.core.errors import EngineUnavailableError
from runtime.execution.executor import ReplicaExecutor
from runtime.core.futures import resolve
from runtime.core.plugins import Partial
from runtime.execution.engine_core import EngineCore
from runtime.core.lanes import Lanes

_DECLINED: tuple[bool, Any, BaseException | None] = (False, None, None)


class InlineExecutor(ReplicaExecutor):
    mode = "inline"
    streams = True

    def __init__(self, core: EngineCore, index: int = 0, devices: tuple[int, ...] = (),
                 max_delay_s: float = 0.0) -> None:
        """``max_delay_s``: how long a batch waits for more after its first request
        (``core.batch_size`` > 1 only)."""
        super().__init__(index, devices)
        self._core = core
        self._lanes = Lanes(core.batch_size, max_delay_s, batch_key)
        self._ids = itertools.count()
        self._running: dict[int, Future] = {}
        self._streams: dict[int, Any] = {}  # request id -> StreamCall, while running
        self._cancels: collections.deque = collections.deque()  # streams to cancel before the next step
        self._closed = False
        self._close_lock = threading.Lock()
        self._exec_lock = threading.Lock()  # held while the runner runs, by either thread
        self._thread = threading.Thread(target=self._serve, name=f"phyrt-inline-{index}", daemon=True)
        self._thread.start()

    def plugin_info(self) -> dict | None:
        return self._core.info_snapshot

    def queue_stats(self) -> dict | None:
        return self._lanes.stats.snapshot()

    def _submit(self, request: Any, future: Future, stream: Any = None, priority: int = 0) -> None:
        with self._close_lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            request_id = next(self._ids)
            self._lanes.put((request_id, request, future, stream), request, priority)
        if stream is not None:
            stream.bind_cancel(functools.partial(self._cancel_stream, request_id, future))

    def _cancel_stream(self, request_id: int, future: Future) -> None:
        """A stream's cancel hook (any thread): dropped while queued, else cancelled by the runner."""
        if not future.cancel():
            self._cancels.append(request_id)

    # -- the serve thread ----------------------------------------------------------

    def _serve(self) -> None:
        core = self._core
        try:
            while True:
                # Block for new work only when the runner has nothing left to advance.
                if self._lanes.wait(block=not core.has_unfinished(), take=False)[1]:
                    return  # close() failed what was queued
                # requests are taken only once the runner is ours: while another thread runs one
                # (IdleRunner) the rest stay queued, where a deadline can cancel them and a higher
                # priority that comes meanwhile still goes first
                with self._exec_lock:
                    taken, _ = self._lanes.wait(block=False)
                    if core.stepped:
                        self._admit(taken + self._lanes.take_all())
                        while self._cancels:
                            core.cancel(self._cancels.popleft())
                        done = core.step() if core.has_unfinished() else []
                    else:
                        done = self._run(taken)
                for request_id, result, error in done:
                    if type(result) is Partial:
                        stream = self._streams.get(request_id)
                        if stream is not None:
                            stream.put(result.chunk)
                        continue
                    self._streams.pop(request_id, None)
                    future = self._running.pop(request_id, None)
                    if future is None:
                        continue
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
        except BaseException as exc:  # the runner itself broke: nothing it holds can finish
            reason = f"inline runner failed: {type(exc).__name__}: {exc}"
            self.mark_failed(reason)
            self._fail_running(reason, exc)
            # the thread ends here; the failure is the replica's state
            self._give_back(self._lanes.close(reason), reason)

    def _run(self, taken: list[tuple[int, Any, Future, Any]]) -> list:
        """Holding the runner: one batch of an executing runner (those not cancelled meanwhile)."""
        batch = [item for item in taken if item[2].set_running_or_notify_cancel()]
        for request_id, _, future, stream in batch:
            self._running[request_id] = future
            if stream is not None:
                self._streams[request_id] = stream
        if not batch:
            return []
        return self._core.run_batch([item[0] for item in batch], [item[1] for item in batch])

    def idle_runner(self, validate: Callable[[Any], None]) -> "IdleRunner":
        """This replica's ``IdleRunner``; ``validate`` is the plugin's ``validate_request``."""
        return IdleRunner(self, validate)

    def _run_idle(self, validate: Callable[[Any], None], request: Any, hand_over: Callable[[], None],
                  priority: int = 0) -> tuple[bool, Any, BaseException | None]:
        """``IdleRunner.run``: see the module docstring."""
        if self._closed or self._error is not None:
            return _DECLINED  # the caller's submit says why
        validate(request)
        if self._core.stepped or self._core.batch_size > 1 or not self._exec_lock.acquire(blocking=False):
            return _DECLINED
        try:
            with self._state_lock:
                if self._closed or self._error is not None or self._inflight:
                    return _DECLINED
                self._inflight += 1  # a submit meanwhile queues behind this one
            self._lanes.stats.record(((priority, 0.0),), 1)  # a batch of one that waited for nothing
            try:
                hand_over()
                try:
                    [(_, result, error)] = self._core.run(next(self._ids), request)
                except BaseException as exc:  # the runner itself broke, as in the serve thread
                    reason = f"inline runner failed: {type(exc).__name__}: {exc}"
                    self.mark_failed(reason)
                    error = EngineUnavailableError(reason)
                    error.__cause__ = exc
                    result = None
                return True, result, error
            finally:
                with self._state_lock:
                    self._inflight -= 1
        finally:
            self._exec_lock.release()

    def _admit(self, taken: list[tuple[int, Any, Future, Any]]) -> None:
        """Holding the runner: move ``taken`` into a stepped core (those not cancelled meanwhile)."""
        for request_id, request, future, stream in taken:
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                self._core.add(request_id, request, stream is not None)
            except Exception as exc:
                future.set_exception(exc)
                continue
            self._running[request_id] = future
            if stream is not None:
                self._streams[request_id] = stream

    def _give_back(self, taken: list[tuple[int, Any, Future, Any]], reason: str) -> None:
        """Requests that will not run: cancelled if still possible, else failed with ``reason``."""
        for _, _, future, _ in taken:
            if not future.cancel():
                _fail(future, reason)

    def _fail_running(self, reason: str, cause: BaseException | None = None) -> None:
        running, self._running = self._running, {}
        self._streams = {}
        for future in running.values():
            _fail(future, reason, cause)

    # -- shutdown ------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Cancel queued requests, let the running one finish, stop the thread.

        ``timeout`` bounds the wait for the running request; past it, its future
        fails with ``EngineUnavailableError`` and the (daemon) thread is abandoned.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self.mark_failed("the engine is closed")
            self._give_back(self._lanes.close(), "the engine is closed")  # the serve thread stops
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():
            self._fail_running(f"the engine closed while a request was still running after {timeout} s")
            return
        self._fail_running("the engine is closed")
        # a request running in another thread (IdleRunner) finishes before the runner closes
        if not self._exec_lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            self._core.close()
        finally:
            self._exec_lock.release()


class IdleRunner:
    """Runs a request in the calling thread when the inline replica is idle (module docstring)."""

    __slots__ = ("run",)

    def __init__(self, executor: InlineExecutor, validate: Callable[[Any], None]) -> None:
        #: ``run(request, hand_over, priority=0)``: validate ``request`` (raising the plugin's error),
        #: then run it here if the replica holds nothing else, calling ``hand_over()`` first: ``(True,
        #: result, error)``; otherwise ``(False, None, None)``, nothing ran, and the caller
        #: submits it. (The executor's method itself: no Python frame of its own per request.)
        self.run: Callable[..., tuple[bool, Any, BaseException | None]] = functools.partial(
            executor._run_idle, validate)


def _fail(future: Future, reason: str, cause: BaseException | None = None) -> None:
    error = EngineUnavailableError(reason)
    error.__cause__ = cause
    resolve(future, error=error)
