"""Outcomes: a submit's ``Request``, how its result becomes its reply, and who sends that reply, once.

Imports ``runtime.core.errors``, ``runtime.link`` (listener, client_protocol) and
``runtime.transport.protocol`` of the project; torch, for the request tensors.

    I/O thread: Request(identity, id, ...) -> pending.add -> engine.submit (or run here)
    engine thread (the future's done callback: on_done) or the thread that ran it (finish):
        pending.claim_entry(req)  True  -> encode the result (frames, or blocks of the
                                           client's result arena) and send it here, at once;
                                           past its deadline: DeadlineExceeded instead
                                  False -> a deadline answered it: the looping thread
                                           lets go of it (owed, then wake())
    I/O thread: settle(): owed requests leave the table (inputs_done if the client was told
        its inputs were held), then deadlines due (DeadlineExceeded; cancelled if queued)
    any thread: ok(...), error(...): a reply of another op

Invariants:
- A reply is sent once: the result, or the error of a deadline, cancel or failure,
  whichever claims the request first (``PendingTable`` decides, under its lock); a result
  that comes later is dropped without being encoded. A result that comes after the
  request's deadline counts as expired, however soon it would be sent: the deadline is a
  promise, not a race.
- A request is in the pending table from its admission until the engine let go of it,
  answered already (by a deadline) or not: that is what ``max_inflight`` counts. A request
  the I/O thread runs itself enters it only if the other I/O thread takes the loop
  meanwhile (``runtime.serving.server``); it has no future (``Request.future`` is None) and
  cannot be cancelled.
- Error replies carry a type of the protocol and a message clipped to ``MAX_MESSAGE_CHARS``,
  never a traceback; encoding never raises, so that a callback cannot lose a reply.
- ``send`` never blocks: a client that does not read loses only its own replies; result
  blocks of a reply not sent are given back at once.
- A stream's chunks (``chunk``, from the engine's thread) go out at once, numbered by
  ``seq``, and only while no reply ended the stream. A chunk that cannot be sent cancels
  the stream, whose reply is then an ``Overloaded`` error. The final reply carries the last
  chunk, ``final: true`` and the next ``seq``.
- Request tensors are views of the received bytes (read-only for frames): plugins must not
  write into their inputs.
"""

from __future__ import annotations

import collections
import math
import time
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from runtime.core.errors import EngineUnavailableError, RemoteError
from runtime.link.client_protocol import (error_reply, inputs_done, ok_reply, stream_chunk, stream_end,
                                          submit_reply)
from runtime.link.listener import PeerEntry, Responder
from runtime.link.peer_shm import ClientShm
from runtime.transport.protocol import PayloadEncoder, pack_plain

#: results at least this large go into the client's result arena when it asked for shm
RESULT_SHM_THRESHOLD = 64 * 1024
MAX_MESSAGE_CHARS = 2000
_OVERFLOW = ("Overloaded", "a chunk of this stream could not be sent (the client's queue was full: it did not "
                           "read), so the stream was cancelled")


class Rejected(Exception):
    """A request answered with an error reply of ``type``."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type


class Request(PeerEntry):
    """One submit or stream in flight, keyed (identity, id) in the pending table (``claimed``: its
    reply is someone's to send); ``peer``: the client's shm session, if any."""

    __slots__ = ("future", "timeout_s", "shm_results", "holds_inputs", "notify_inputs", "arrived", "stream",
                 "seq", "overflow")

    def __init__(self, identity: bytes, id: Any, client: ClientShm | None = None, timeout_s: float | None = None,
                 shm_results: bool = False, holds_inputs: bool = False, arrived: float | None = None) -> None:
        arrived = time.monotonic() if arrived is None else arrived
        self.key = (identity, id)
        self.deadline = None if timeout_s is None else arrived + timeout_s
        self.claimed = False
        self.identity = identity
        self.id = id
        self.peer = client
        self.future: Any = None  # the engine's Future; None while the I/O thread runs it itself
        self.timeout_s = timeout_s
        self.shm_results = shm_results
        self.holds_inputs = holds_inputs  # the plugin may still read the client's shared memory
        self.notify_inputs = False  # tell the client when the engine lets go of its inputs
        self.arrived = arrived
        self.stream: Any = None  # a stream op's StreamCall (``Engine.submit_stream``)
        self.seq = 0  # chunks of a stream sent so far
        self.overflow = False  # a chunk could not be sent: the stream was cancelled

    @property
    def op(self) -> str:
        return "submit" if self.stream is None else "stream"


def request_tensor(buf: memoryview, name: str, shape: list[int]) -> torch.Tensor:
    """A tensor over the received bytes, without a copy (read-only for frames)."""
    dtype = getattr(torch, name)
    count = math.prod(shape)
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def _error_of(exc: BaseException) -> tuple[str, str]:
    """The reply error of an engine failure; text only, never a traceback."""
    if isinstance(exc, EngineUnavailableError):
        if isinstance(exc.__cause__, RemoteError):  # the plugin raised inside a local rank
            return "PluginError", clip(f"{exc} (that replica is out of service now)")
        return "EngineUnavailable", clip(str(exc))
    return "PluginError", clip(f"{type(exc).__name__}: {exc}")


def encode(req: Request, result: Any, submit: bool) -> tuple[Any, Sequence[Any], Sequence[tuple[str, int]]]:
    """``result`` as sent: (a ``Packed`` value, or with ``submit`` the whole reply of a submit packed in
    one go; its frames; its blocks of the client's result arena). TypeError or ValueError (nothing
    kept) for a result the wire cannot carry."""
    if submit:
        header = submit_reply(req.id, result)
        body: Any = pack_plain(header, "result")  # no tensor: no encoder
        if body is not None:
            return body, (), ()
    client = req.peer if req.shm_results else None
    encoder = PayloadEncoder(copy=False, place=client.place_result if client is not None else None,
                             shm_threshold=RESULT_SHM_THRESHOLD)
    try:
        body = encoder.pack_message(header, "result") if submit else encoder.pack(result, "result")
    except BaseException:
        if client is not None:
            client.release(encoder.blocks, mapped=False)
        raise
    return body, encoder.frames, encoder.blocks


def _cannot_send(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, (TypeError, ValueError)):
        return "PluginError", clip(f"the plugin's result cannot be sent: {exc}")
    return "PluginError", clip(f"the result could not be sent: {type(exc).__name__}: {exc}")


class Replies:
    """Every reply of one server, through ``link`` (its ``send``, ``wake`` and pending table)."""

    def __init__(self, link: Responder, metrics: Any, cancellable: bool) -> None:
        self._send = link.send
        self._wake = link.wake
        self._pending = link.pending
        self._metrics = metrics
        self._metered = getattr(metrics, "on", True)  # NullMetrics: no calls, no clock read per reply
        self._cancellable = cancellable  # inline engines cancel queued work; local ranks cannot
        #: requests a deadline answered whose engine let go of them since: the looping thread's to finish
        self._owed: collections.deque[Request] = collections.deque()
        self.draining = False  # not accepting: the I/O thread wants to know when a request is done

    # -- replies of any op --------------------------------------------------------------

    def ok(self, identity: bytes, op: str, request_id: Any, result: Any) -> bool:
        return self._send(identity, ok_reply(op, request_id, result))

    def error(self, identity: bytes, op: Any, request_id: Any, kind: str, message: str,
              inputs_held: bool | None = None) -> bool:
        return self._send(identity, error_reply(op, request_id, kind, message, inputs_held))

    # -- a submit's outcome ---------------------------------------------------------------

    def chunk(self, req: Request, chunk: Any) -> None:
        """A stream's partial chunk (the engine's thread): sent at once, or the stream cancelled."""
        if req.claimed or req.overflow:
            return
        try:
            body, frames, blocks = encode(req, chunk, False)
        except BaseException:
            body = blocks = None
        if body is not None:
            if self._send(req.identity, stream_chunk(req.id, body, req.seq), frames):
                req.seq += 1
                return
            if blocks:
                req.peer.release(blocks, mapped=False)
        req.overflow = True  # a chunk lost: the stream cannot go on
        if req.stream is not None:
            req.stream.cancel()

    def on_done(self, req: Request, future: Future) -> None:
        """The engine future's done callback: the reply goes out where the future completed."""
        if future.cancelled():
            self.finish(req, None, None, cancelled=True)
            return
        try:
            result = future.result(0)  # done: one look at it, not three
        except BaseException as exc:  # what the engine failed it with
            self.finish(req, None, exc)
            return
        self.finish(req, result, None)

    def finish(self, req: Request, result: Any, error: BaseException | None, cancelled: bool = False,
               ours: bool = False) -> None:
        """The engine let go of ``req`` (any thread), with ``result`` or ``error``: reply now,
        unless a deadline answered it (then the looping thread finishes it). ``ours``: nobody
        else saw ``req`` (it ran here and stayed out of the pending table): no claim needed."""
        if ours:
            req.claimed = True
        elif not self._pending.claim_entry(req):
            self._owed.append(req)
            self._wake()
            return
        try:
            if cancelled:
                outcome = ("Cancelled", "the request was cancelled while queued")
            elif error is not None:
                outcome = _error_of(error)
            elif req.deadline is not None and time.monotonic() > req.deadline:
                outcome = ("DeadlineExceeded", f"no result within timeout_s={req.timeout_s} (the request was "
                                               "still running; its result came too late and was dropped)")
            elif req.overflow:
                outcome = _OVERFLOW
            else:
                outcome = None
                self._reply(req, result)
            if outcome is not None:
                self._fail(req, outcome)
        except BaseException as exc:  # never let a callback lose a reply
            self._fail(req, ("PluginError", clip(f"the result could not be sent: {type(exc).__name__}: {exc}")))
        if self.draining:  # the I/O thread notices when the last one is done
            self._wake()

    def _reply(self, req: Request, result: Any) -> None:
        try:
            body, frames, blocks = encode(req, result, req.stream is None)
        except BaseException as exc:
            self._fail(req, _cannot_send(exc))
            return
        if self._metered:
            self._metrics.on_reply(True, None, time.monotonic() - req.arrived)
        if req.stream is not None:
            sent = self._send(req.identity, stream_end(req.id, body, req.seq), frames)
        else:  # the packed reply: by the client's lane if it has one (runtime.link.lane)
            lane = req.peer.lane if req.peer is not None else None
            sent = ((lane is not None and type(body) is bytes and lane.reply([body, *frames]))
                    or self._send(req.identity, body, frames))
        if not sent and blocks:
            req.peer.release(blocks, mapped=False)

    def _fail(self, req: Request, error: tuple[str, str]) -> None:
        if self._metered:
            self._metrics.on_reply(False, error[0], time.monotonic() - req.arrived)
        self.error(req.identity, req.op, req.id, *error)

    # -- the I/O thread -------------------------------------------------------------------

    def owed(self, now: float) -> bool:
        """Whether ``settle`` has anything to do: owed requests, or a deadline due."""
        if self._owed:
            return True
        deadline = self._pending.peek_deadline()
        return deadline is not None and deadline <= now

    def settle(self) -> float:
        """What the I/O thread owes: requests a deadline answered, then deadlines due. Returns
        the time deadlines were checked at."""
        now = time.monotonic()
        if self.owed(now):  # (most turns of the loop owe nothing)
            owed, pending = self._owed, self._pending
            while owed:
                req = owed.popleft()
                pending.remove(req)
                if req.notify_inputs:
                    self._send(req.identity, inputs_done(req.id))
            now = time.monotonic()
            self._expire(now)
        return now

    def _expire(self, now: float) -> None:
        for req in self._pending.expired(now, keep=True):  # answered by us; in the table until let go of
            self._metrics.on_reply(False, "DeadlineExceeded", now - req.arrived)
            future = req.future
            cancelled = self._cancellable and future is not None and future.cancel()
            if req.stream is not None:
                req.stream.cancel()  # its runner lets go of it (an LLM's KV blocks, say)
            req.notify_inputs = req.holds_inputs and not cancelled
            state = "cancelled while queued" if cancelled else "still running; its result will be dropped"
            self.error(req.identity, req.op, req.id, "DeadlineExceeded",
                       f"no result within timeout_s={req.timeout_s} (the request was {state})",
                       inputs_held=req.notify_inputs)
