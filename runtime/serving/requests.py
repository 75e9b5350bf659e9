"""Requests on the server: the requests in flight, and their replies' outcomes.

Imports only ``runtime.core.errors``, ``runtime.transport.protocol``, ``runtime.link.client_protocol``
and ``runtime.serving.shm`` from the project; torch, for the request tensors. What each op may
carry, and its checks, are ``runtime.link.client_protocol``'s.

    I/O thread                                  engine thread (the future's done callback)
    client_protocol's checks
    Request(identity, id, ...); engine.submit
    InFlight.add(req): table, deadline heap     outcome_of(req, future): the encoded result
                                                  (frames, or blocks of the client's result
                                                  arena), or an error
                                                InFlight.claim_reply(req, outcome): True ->
                                                  the engine thread sends the reply itself
    InFlight.expired(now): deadlines due        False (a deadline answered it, or it is late):
    InFlight.completed()  <------ deque ------    the I/O thread takes it from here
    send the reply

Invariants: a request is in ``InFlight`` from the engine's acceptance until its
outcome is back, answered already (by a deadline) or not: that is what
``max_inflight`` counts. An ``Outcome`` never holds a traceback, only an error
type of the protocol and a message clipped to ``MAX_MESSAGE_CHARS``;
``outcome_of`` never raises, so that a callback cannot lose a reply. Request
tensors are views of the received bytes (read-only for frames): plugins must not
write into their inputs.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, Mapping

import torch

from runtime.core.errors import EngineUnavailableError, RemoteError
from runtime.link.client_protocol import submit_reply
from runtime.transport.protocol import PayloadEncoder, pack_plain
from runtime.serving.shm import ClientShm

#: results at least this large go into the client's result arena when it asked for shm
RESULT_SHM_THRESHOLD = 64 * 1024
MAX_MESSAGE_CHARS = 2000
#: answered requests the deadline heap may hold beyond twice those in flight, before it drops them
_DEADLINES_SLACK = 64


class Rejected(Exception):
    """A request answered with an error reply of ``type``."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type


class Request:
    """One submit the engine holds (a plain class with slots: one is made per request)."""

    __slots__ = ("identity", "id", "future", "timeout_s", "client", "shm_results", "holds_inputs", "replied",
                 "notify_inputs", "deadline", "arrived", "stream", "seq", "overflow")

    def __init__(self, identity: bytes, id: Any, future: "Future | RunningHere | None" = None,
                 timeout_s: float | None = None, client: ClientShm | None = None, shm_results: bool = False,
                 holds_inputs: bool = False, replied: bool = False, notify_inputs: bool = False,
                 deadline: float | None = None, arrived: float | None = None) -> None:
        self.identity = identity
        self.id = id
        self.future = future
        self.timeout_s = timeout_s
        self.client = client
        self.shm_results = shm_results
        self.holds_inputs = holds_inputs  # the plugin may still read the client's shared memory
        self.replied = replied
        self.notify_inputs = notify_inputs  # tell the client when the engine lets go of its inputs
        self.deadline = deadline  # monotonic; set when the engine takes the request
        self.arrived = time.monotonic() if arrived is None else arrived
        self.stream: Any = None  # a stream op's StreamCall (``Engine.submit_stream``)
        self.seq = 0  # chunks of a stream sent so far
        self.overflow = False  # a chunk could not be sent: the stream was cancelled

    @property
    def key(self) -> tuple[bytes, Any]:
        return self.identity, self.id

    @property
    def op(self) -> str:
        return "submit" if self.stream is None else "stream"


class Outcome:
    """A request's reply: the result (a submit's: its whole reply header, packed; a stream's: a
    ``Packed`` value), with its frames or result blocks; or an error."""

    __slots__ = ("result", "frames", "blocks", "error", "late")

    def __init__(self, result: Any = None, frames: list[Any] | None = None,
                 blocks: list[tuple[str, int]] | None = None, error: tuple[str, str] | None = None,
                 late: bool = False) -> None:
        self.result = result
        self.frames = frames if frames is not None else []
        self.blocks = blocks if blocks is not None else []
        self.error = error
        self.late = late  # completed after its deadline


def request_tensor(buf: memoryview, name: str, shape: list[int]) -> torch.Tensor:
    """A tensor over the received bytes, without a copy (read-only for frames)."""
    dtype = getattr(torch, name)
    count = math.prod(shape)
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class InFlight:
    """The requests the engine holds for one server, by (identity, id), with their deadlines.

    The table, ``Request.replied`` and each connection's request count change under
    ``lock``: the I/O thread adds requests and answers deadlines, while the thread
    that completes a request's future claims its reply (``claim_reply``) and sends
    it at once. The deadline heap is the I/O thread's alone.

    An answered request's heap entry is not removed at once (a heap cannot drop an entry
    from its middle): ``add`` drops every answered one when the heap holds more than
    twice the requests in flight, so what the heap keeps alive grows with the requests in
    flight, not with those answered within a timeout (before, a server answering 8
    client processes, each request with a 60 s timeout, held 26,644 answered requests
    after 14 s, and the collector's full passes over them took about 120 ms each).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._requests: dict[tuple[bytes, Any], Request] = {}
        #: the table itself, to read (``len``, ``in``) on the request path without a Python call
        self.table: Mapping[tuple[bytes, Any], Request] = self._requests
        self._deadlines: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()
        self._completions: collections.deque[tuple[Request, Outcome]] = collections.deque()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, key: tuple[bytes, Any]) -> bool:
        return key in self._requests

    def get(self, key: tuple[bytes, Any]) -> Request | None:
        return self._requests.get(key)

    def add(self, req: Request) -> None:
        """``req`` was taken by the engine; its future is set (I/O thread)."""
        if req.timeout_s is not None:
            req.deadline = time.monotonic() + req.timeout_s
            deadlines = self._deadlines
            if len(deadlines) > 2 * len(self._requests) + _DEADLINES_SLACK:
                self._deadlines = deadlines = _pending_only(deadlines)
            heapq.heappush(deadlines, (req.deadline, next(self._seq), req))
        with self.lock:
            self._requests[req.key] = req
            if req.client is not None:
                req.client.requests += 1

    def owed(self, now: float) -> bool:
        """Whether ``completed()`` or ``expired(now)`` has anything (the I/O thread)."""
        return bool(self._completions) or bool(self._deadlines) and self._deadlines[0][0] <= now

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def claim_reply(self, req: Request, outcome: Outcome) -> bool:
        """Any thread, once ``req``'s outcome is known: True if the caller is to send it now.

        Then ``req`` has left the table. Otherwise (a deadline answered it already, or
        the outcome came after the deadline) the outcome waits in ``completed()`` for
        the I/O thread (the caller then wakes it). An outcome that came after the
        request's deadline counts as expired, however soon it would be sent: the
        deadline is a promise, not a race.
        """
        with self.lock:
            if req.deadline is not None and time.monotonic() > req.deadline and outcome.error is None:
                outcome.late = True
            if req.replied or outcome.late:
                self._completions.append((req, outcome))
                return False
            req.replied = True
            self._drop(req)
            return True

    def complete(self, req: Request, outcome: Outcome) -> None:
        """Any thread: hand ``req``'s outcome to the I/O thread (the caller then wakes it)."""
        with self.lock:
            if req.deadline is not None and time.monotonic() > req.deadline and outcome.error is None:
                outcome.late = True
            self._completions.append((req, outcome))

    def completed(self) -> Iterator[tuple[Request, Outcome]]:
        """The outcomes handed over so far; each request leaves the table as it is yielded."""
        while self._completions:
            with self.lock:
                req, outcome = self._completions.popleft()
                self._drop(req)
            yield req, outcome

    def expired(self, now: float) -> Iterator[Request]:
        """Requests whose deadline is due and that are neither answered nor done; each is
        marked replied (its reply is the caller's to send)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            with self.lock:
                if req.replied or req.future.done():
                    continue
                req.replied = True
            yield req

    def _drop(self, req: Request) -> None:
        if self._requests.pop(req.key, None) is not None and req.client is not None:
            req.client.requests -= 1


def _pending_only(deadlines: list[tuple[float, int, Request]]) -> list[tuple[float, int, Request]]:
    """The deadline heap without the requests answered already (``expired`` would skip them)."""
    kept = [entry for entry in deadlines if not entry[2].replied]
    heapq.heapify(kept)
    return kept


def clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def outcome_of(req: Request, future: Future) -> Outcome:
    """The reply to ``req`` once ``future`` is done; runs on the thread that completed it."""
    if future.cancelled():
        return Outcome(error=("Cancelled", "the request was cancelled while queued"))
    try:
        result = future.result(0)  # done: one look at it, not three
    except BaseException as exc:  # what the engine failed it with
        return outcome_of_result(req, None, exc)
    return outcome_of_result(req, result, None)


def outcome_of_result(req: Request, result: Any, error: BaseException | None, chunk: bool = False) -> Outcome:
    """The reply to ``req`` given what running it gave: ``result``, or ``error`` (not None);
    ``chunk``: a stream's partial result (a stream's ``req.stream`` may not be set yet)."""
    try:
        if error is not None:
            return Outcome(error=_error_of(error))
        return _encode_result(req, result, not chunk and req.stream is None)
    except BaseException as exc:  # never let a callback lose a reply
        return Outcome(error=("PluginError", clip(f"the result could not be sent: {type(exc).__name__}: {exc}")))


class RunningHere:
    """What stands for the future of a request a server thread runs itself (``Request.future``):
    running from the start, so never cancelled; done once ``finished``."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return self.finished


def _encode_result(req: Request, result: Any, submit: bool) -> Outcome:
    """The encoded result: a ``Packed`` value, or with ``submit`` the whole reply of a submit
    (``submit_reply``, packed in one go: the bytes ``pack_header`` makes of it)."""
    if submit:
        header = submit_reply(req.id, result)
        body: Any = pack_plain(header, "result")  # no tensor: no encoder
        if body is not None:
            return Outcome(result=body)
    client = req.client if req.shm_results else None
    encoder = PayloadEncoder(copy=False, place=client.place_result if client is not None else None,
                             shm_threshold=RESULT_SHM_THRESHOLD)
    try:
        if submit:
            body = encoder.pack_message(header, "result")
        else:
            body = encoder.pack(result, "result")
    except (TypeError, ValueError) as exc:
        if client is not None:
            client.release(encoder.blocks, mapped=False)
        return Outcome(error=("PluginError", clip(f"the plugin's result cannot be sent: {exc}")))
    return Outcome(result=body, frames=encoder.frames, blocks=encoder.blocks)


def _error_of(exc: BaseException) -> tuple[str, str]:
    """The reply error of an engine failure; text only, never a traceback."""
    if isinstance(exc, EngineUnavailableError):
        if isinstance(exc.__cause__, RemoteError):  # the plugin raised inside a local rank
            return "PluginError", clip(f"{exc} (that replica is out of service now)")
        return "EngineUnavailable", clip(str(exc))
    return "PluginError", clip(f"{type(exc).__name__}: {exc}")
