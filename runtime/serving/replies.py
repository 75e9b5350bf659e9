"""Replies: every reply of the server, and which thread sends a submit's one reply.

Imports ``runtime.serving.requests`` and ``runtime.link.client_protocol`` (every reply's
fields) of the project.

    engine thread (done callback)       on_done(req, future) -> finish(req, outcome)
                                          claim_reply: True  -> send the reply here, at once
                                                       False -> wake(): the I/O thread owes it
    I/O thread                          settle(): outcomes owed (late ones: DeadlineExceeded),
                                          then deadlines due (DeadlineExceeded, cancel if queued)
    any thread                          ok(...), error(...): a reply of another op

Invariants:
- A reply is sent once: the result, or the error of a deadline, cancel or failure,
  whichever comes first (``InFlight.claim_reply`` decides, under its lock); a result
  that comes later is dropped (its result blocks given back, and the client told
  ``inputs_done`` when its shared-memory inputs were still held).
- Error replies carry a type of the protocol and a message, never a traceback.
- ``send`` never blocks (``ServerSocket.send``): a client that does not read loses only
  its own replies; result blocks of a reply not sent are given back at once.
- A stream's chunks (``chunk``, from the engine's thread) go out at once, numbered by
  ``seq``, and only while no reply ended the stream; the server keeps none. A chunk that
  cannot be sent (the client's queue is full: it does not read) cancels the stream, whose
  reply is then an ``Overloaded`` error. The final reply carries the last chunk,
  ``final: true`` and the next ``seq``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable

from runtime.link.client_protocol import error_reply, inputs_done, ok_reply, stream_chunk, stream_end
from runtime.serving.requests import InFlight, Outcome, Request, outcome_of, outcome_of_result

#: ``ServerSocket.send(identity, header, frames=()) -> bool``: ``header`` a dict or its packed bytes
#: (a submit's reply, ``Outcome.result``); False when the reply could not be sent
Send = Callable[..., bool]


class Replies:
    """Sends through ``send``; ``wake()`` tells the I/O thread it owes a reply (or that the
    last request is done while ``draining``)."""

    def __init__(self, send: Send, requests: InFlight, metrics: Any, cancellable: bool,
                 wake: Callable[[], None]) -> None:
        self._send = send
        self._requests = requests
        self._metrics = metrics
        self._metered = getattr(metrics, "on", True)  # NullMetrics: no calls, no clock read per reply
        self._cancellable = cancellable  # inline engines cancel queued work; local ranks cannot
        self._wake = wake
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
        if req.replied or req.overflow:
            return
        outcome = outcome_of_result(req, chunk, None, chunk=True)
        if outcome.error is None and self._send(req.identity, stream_chunk(req.id, outcome.result, req.seq),
                                                outcome.frames):
            req.seq += 1
            return
        if outcome.blocks:
            req.client.release(outcome.blocks, mapped=False)
        req.overflow = True  # a chunk lost: the stream cannot go on
        if req.stream is not None:
            req.stream.cancel()

    def on_done(self, req: Request, future: Future) -> None:
        """The engine future's done callback: encode and send the reply where the future
        completed, unless a deadline answered first (then the I/O thread finishes it)."""
        self.finish(req, outcome_of(req, future))

    def finish(self, req: Request, outcome: Outcome) -> None:
        """``req`` has its outcome (any thread): reply now, or leave it to the I/O thread."""
        if not self._requests.claim_reply(req, outcome):
            self._wake()
            return
        self._reply(req, outcome)
        if self.draining:  # the I/O thread notices when the last one is done
            self._wake()

    def _reply(self, req: Request, outcome: Outcome) -> None:
        """Send ``req``'s reply (any thread; the request has been claimed for it)."""
        if self._metered:
            self._metrics.on_reply(outcome.error is None, outcome.error[0] if outcome.error else None,
                                   time.monotonic() - req.arrived)
        if req.overflow and outcome.error is None:
            outcome.error = ("Overloaded", "a chunk of this stream could not be sent (the client's queue was "
                                           "full: it did not read), so the stream was cancelled")
        if outcome.error is not None:
            sent = self.error(req.identity, req.op, req.id, *outcome.error)
        elif req.stream is not None:
            sent = self._send(req.identity, stream_end(req.id, outcome.result, req.seq), outcome.frames)
        else:
            sent = self._send(req.identity, outcome.result, outcome.frames)  # the packed reply
        if not sent and outcome.blocks:
            req.client.release(outcome.blocks, mapped=False)

    # -- the I/O thread -------------------------------------------------------------------

    def settle(self) -> float:
        """Send what the I/O thread owes: outcomes left to it, then deadlines due. Returns
        the time deadlines were checked at."""
        now = time.monotonic()
        if self._requests.owed(now):  # (most turns of the loop owe nothing)
            self._finish_completed()
            now = time.monotonic()
            self._expire_deadlines(now)
        return now

    def _finish_completed(self) -> None:
        for req, outcome in self._requests.completed():
            if outcome.late and not req.replied:
                req.replied = True
                self._metrics.on_reply(False, "DeadlineExceeded", time.monotonic() - req.arrived)
                self.error(req.identity, req.op, req.id, "DeadlineExceeded",
                           f"no result within timeout_s={req.timeout_s} (the request was still running; "
                           "its result came too late and was dropped)")
            if req.replied:  # a deadline answered it already
                if outcome.blocks:
                    req.client.release(outcome.blocks, mapped=False)
                if req.notify_inputs:
                    self._send(req.identity, inputs_done(req.id))
                continue
            req.replied = True  # (not reached: claim_reply sends every outcome that is neither late nor answered)
            self._reply(req, outcome)

    def _expire_deadlines(self, now: float) -> None:
        for req in self._requests.expired(now):  # neither answered nor done; marked replied
            self._metrics.on_reply(False, "DeadlineExceeded", now - req.arrived)
            cancelled = self._cancellable and req.future.cancel()
            if req.stream is not None:
                req.stream.cancel()  # its runner lets go of it (an LLM's KV blocks, say)
            req.notify_inputs = req.holds_inputs and not cancelled
            state = "cancelled while queued" if cancelled else "still running; its result will be dropped"
            self.error(req.identity, req.op, req.id, "DeadlineExceeded",
                       f"no result within timeout_s={req.timeout_s} (the request was {state})",
                       inputs_held=req.notify_inputs)
