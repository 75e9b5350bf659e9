"""MessageHandler: what the server does with one client message, without a socket or threads of its own.

Imports ``runtime.serving`` (outcomes, metrics), ``runtime.link`` (client_protocol: what each op
may carry, its checks and its replies; listener: the requests in flight and the peers' shared
memory), ``runtime.transport.protocol`` and ``runtime.core.errors`` of the project.

    handle(identity, [header, *tensor frames], turn)
      header: decoded one frame at a time, lengths bounded by the frame; op, id and fields checked
      submit  -> limits, tensors resolved (frames: read-only views; shm: the sender's own segments)
                 -> a Request in the pending table (link.pending, keyed (identity, id))
                 -> idle inline engine and a ``turn``: IdleRunner.run here (turn.hand_over first)
                 -> else engine.submit (its ``priority``, if any); Replies.on_done sends the reply
      stream  -> as submit, then engine.submit_stream: Replies.chunk sends each chunk from the
                 engine's thread, Replies.on_done the last (``final``); cancel, a deadline or a
                 chunk the client does not take cancel it (the runner frees what it holds)
      cancel, ping, info, register, release -> answered here (release: no reply; info:
                 ``runtime.serving.description``)
      a malformed message -> an InvalidRequest reply; a refused one -> its typed error reply
    settle()        the I/O thread's share of the replies (Replies.settle)
    housekeeping()  shared memory of silent clients dropped; rejected messages logged

Invariants:
- Everything a client sends is untrusted: unknown ops and fields are refused, tensor
  references are checked against the frames and against the segments that very
  connection registered, and the plugin's ``validate_request`` runs before queueing.
  Nothing a message holds escapes ``handle`` as an exception (a server bug aside).
- ``max_inflight`` counts requests the engine still holds, answered or not (the pending table).
- Engine calls return at once (``Engine.submit`` validates and queues); the one that
  runs the plugin here (``IdleRunner.run``) calls ``turn.hand_over()`` first, so that
  the socket is read by another thread meanwhile, and ``turn.take_back()`` once the
  plugin returned, before it sends the reply.
- Shared memory is offered over ipc:// only, per connection (``runtime.link.peer_shm``).

Driving it directly (``bench.fuzz`` does): ``MessageHandler(engine, Responder(address, send))``,
then ``handle`` messages, ``settle()`` until ``inflight`` is 0, and ``close()``; the engine stays
the caller's.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from runtime.core.errors import EngineUnavailableError, ProtocolError
from runtime.link.client_protocol import (HEADER_FIELDS, OP_FIELDS, cancel_result, lane_fields,
                                          no_frames, ping_result, register_fields, register_result, release_blocks,
                                          submit_options)
from runtime.link.listener import Responder
from runtime.link.peer_shm import ClientShm, ShmClientsFull
from runtime.serving.description import describe
from runtime.serving.metrics import NullMetrics
from runtime.serving.outcomes import Rejected, Replies, Request, clip, request_tensor
from runtime.transport.protocol import MAX_TENSOR_FRAMES, TensorResolver, is_request_id, unpack_header

log = logging.getLogger("phyrt.server")

DEFAULT_MAX_INFLIGHT = 256
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 20
_ALLOWED_FIELDS = {op: HEADER_FIELDS | fields for op, fields in OP_FIELDS.items()}
_NO_EXTRA: dict[str, Any] = {}  # engine.submit's keyword arguments for a request of priority 0


@dataclass(frozen=True)
class ServerOptions:
    """Limits and extras of a server: ``info`` adds fields to what the ``info`` op answers."""

    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    client_timeout_s: float = 60.0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.max_inflight, bool) or not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {self.max_inflight!r}")
        if (isinstance(self.max_message_bytes, bool) or not isinstance(self.max_message_bytes, int)
                or self.max_message_bytes < 1024):
            raise ValueError(f"max_message_bytes must be an int >= 1024, got {self.max_message_bytes!r}")

    @property
    def max_header_bytes(self) -> int:
        return min(MAX_HEADER_BYTES, self.max_message_bytes)


class Turn(Protocol):
    """The loop a submit run in the reading thread gives up meanwhile (``runtime.serving.server``):
    ``lend(req)`` before, ``hand_over()`` as it starts, ``take_back()`` after (True: nobody took
    the loop meanwhile, so nobody adopted ``req`` into the pending table either)."""

    def lend(self, request: Any) -> None: ...

    def hand_over(self) -> None: ...

    def take_back(self) -> bool: ...


class MessageHandler:
    """Handles the messages ``link`` receives for ``engine``; replies go through ``link.send``."""

    def __init__(self, engine: Any, link: Responder, options: ServerOptions = ServerOptions(), *,
                 metrics: Any = None) -> None:
        self.server_id = secrets.token_hex(8)
        self.address = link.address
        self._engine = engine
        self._options = options
        self._ipc = link.address.startswith("ipc://")
        self._metrics = metrics if metrics is not None else NullMetrics()
        self._metered = getattr(self._metrics, "on", True)
        self._max_header_bytes = options.max_header_bytes
        self._runner = engine.inline_runner()
        self._cancellable = engine.mode == "inline"  # local ranks run whatever they were sent
        self.requests = link.pending  # (identity, id) -> Request
        self.shm = link.peers
        self.accepting = True
        self.replies = Replies(link, self._metrics, self._cancellable)
        self._rejected = 0
        self._last_reject_log = time.monotonic()
        # request tensors are deliberately read-only views of the received frames
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

    @property
    def runs_here(self) -> bool:
        """Whether a submit may run in the thread that read it (an inline engine)."""
        return self._runner is not None

    @property
    def inflight(self) -> int:
        return len(self.requests)

    def stop_accepting(self) -> None:
        """New submits get EngineUnavailable from now on; ping and info still answer."""
        self.accepting = False
        self.replies.draining = True

    def settle(self) -> float:
        """Send the replies the I/O thread owes (``Replies.settle``); returns the time used."""
        return self.replies.settle()

    def close(self) -> None:
        """Unmap and unlink every client's shared memory."""
        self.shm.close()

    # -- one message --------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], turn: Turn | None = None) -> None:
        """One message as the ROUTER hands it over: [header, *tensor frames]. ``turn``: a
        submit may run in this thread if the engine is idle (the loop is given up meanwhile)."""
        op = request_id = None
        started = time.monotonic()
        try:
            if len(frames) > 1 + MAX_TENSOR_FRAMES:
                raise ProtocolError(f"{len(frames) - 1} tensor frames; at most {MAX_TENSOR_FRAMES}")
            head, refs = frames[0], []
            header = unpack_header(head.buffer if isinstance(head, zmq.Frame) else head,
                                   self._max_header_bytes, refs)
            op, request_id = header.get("op"), header.get("id")
            allowed = _ALLOWED_FIELDS.get(op) if isinstance(op, str) else None
            if allowed is None:
                bad_op, op = op, None
                raise ProtocolError(f"unknown op {bad_op!r}; known: {sorted(OP_FIELDS)}"[:300])
            if not is_request_id(request_id):
                bad_id, request_id = request_id, None
                raise ProtocolError(f"id must be an int in [0, 2**64) or a str of 1 to 128 characters, "
                                    f"got {bad_id!r}"[:300])
            if not header.keys() <= allowed:
                unknown = header.keys() - HEADER_FIELDS - OP_FIELDS[op]
                raise ProtocolError(f"unknown fields {sorted(unknown)} for op {op!r}; "
                                    f"allowed: {sorted(OP_FIELDS[op])}"[:300])
            if self._metered:
                self._metrics.on_request(op)
            client = self.shm.get(identity)
            if client is not None:
                client.last_seen = started
            if op == "submit" or op == "stream":
                self._op_submit(identity, request_id, header, frames[1:], client, bool(refs),
                                turn if op == "submit" else None, op == "stream", started)
            else:
                getattr(self, f"_op_{op}")(identity, request_id, header, frames[1:], client)
        except ProtocolError as exc:
            self._note_rejected(exc)
            self._metrics.on_reply(False, "InvalidRequest", time.monotonic() - started, op=op or "other")
            self.replies.error(identity, op, request_id, "InvalidRequest", clip(str(exc)))
        except Rejected as exc:
            self._metrics.on_reply(False, exc.type, time.monotonic() - started, op=op or "other")
            self.replies.error(identity, op, request_id, exc.type, clip(str(exc)))

    # -- submit -------------------------------------------------------------------------

    def _op_submit(self, identity: bytes, request_id: Any, header: dict, frames: list, client: ClientShm | None,
                   tensors: bool, turn: Turn | None, stream: bool = False, started: float = 0.0) -> None:
        """``tensors``: the header holds tensor references (False: the payload is plain data);
        ``stream``: a stream op (never run here).

        The request enters the pending table before the engine sees it (it leaves again if the
        engine refuses it); one run here enters it only if another thread takes the loop
        meanwhile (``Turn.lend``). The result blocks a submit's ``release`` gives back are freed
        once the request is answered or handed to the engine: one run here waits for its run only."""
        timeout_s, shm_results, priority = submit_options(header)
        released = None
        if "release" in header:
            released = release_blocks(header["release"])
            if released is None:
                raise ProtocolError("release must be a list of at most 4096 [segment, offset] blocks")
        try:
            req, payload = self._admit(identity, request_id, header, frames, client, tensors, timeout_s,
                                       shm_results, started)
            if stream or turn is None or self._runner is None or not self._run_here(req, payload, turn, priority):
                self.requests.add(req)
                try:
                    self._to_engine(req, payload, priority, stream)
                except BaseException:
                    if req.future is None:  # the engine did not take it
                        self.requests.remove(req)
                    raise
        finally:
            if released and client is not None:
                client.release(released, mapped=True)

    def _admit(self, identity: bytes, request_id: Any, header: dict, frames: list, client: ClientShm | None,
               tensors: bool, timeout_s: float | None, shm_results: bool, started: float) -> tuple[Request, Any]:
        """The checks before the engine sees a submit; its ``Request`` and decoded payload."""
        if not self.accepting:
            raise Rejected("EngineUnavailable", "the server is shutting down")
        table = self.requests.table
        if len(table) >= self._options.max_inflight:
            raise Rejected("Overloaded", f"{len(table)} requests in flight, the server's limit "
                                         f"(--max-inflight {self._options.max_inflight}); retry later")
        if (identity, request_id) in table:
            raise ProtocolError(f"request id {request_id!r} is already in flight on this connection"[:300])
        if tensors or frames:
            resolver = TensorResolver(frames, request_tensor, client.view if client is not None else None)
            payload = resolver.resolve(header["payload"])
            resolver.finish()
            holds_inputs = bool(resolver.shm_blocks) and self._cancellable
        else:
            payload, holds_inputs = header["payload"], False
        req = Request(identity, request_id, client, timeout_s, shm_results and client is not None, holds_inputs,
                      started)
        return req, payload

    def _to_engine(self, req: Request, payload: Any, priority: int, stream: bool) -> None:
        """``engine.submit``, or ``engine.submit_stream`` whose chunks ``Replies.chunk`` sends;
        ``priority`` is passed when not 0 (the engine's default)."""
        engine, extra = self._engine, {"priority": priority} if priority else _NO_EXTRA
        try:
            if stream:
                call = engine.submit_stream(payload, functools.partial(self.replies.chunk, req), **extra)
                req.stream, future = call, call.future
            else:
                future = engine.submit(payload, **extra)
        except EngineUnavailableError as exc:
            raise Rejected("EngineUnavailable", str(exc)) from None
        except Exception as exc:  # the plugin's validate_request (or encoding for local ranks) refused it
            raise Rejected("InvalidRequest", f"{type(exc).__name__}: {exc}") from None
        req.future = future
        if req.overflow:  # a chunk of the stream went unsent before the call was known here
            req.stream.cancel()
        future.add_done_callback(functools.partial(self.replies.on_done, req))

    def _run_here(self, req: Request, payload: Any, turn: Turn, priority: int) -> bool:
        """Run ``req`` in this thread if the engine is idle (True: answered, or failing as a
        submitted request would); the loop is handed over first and taken back after the reply.
        Adopted meanwhile, ``req`` is in the pending table without a future: it cannot be cancelled."""
        turn.lend(req)
        try:
            ran, result, error = self._runner.run(payload, turn.hand_over, priority)
        except Exception as exc:  # the plugin's validate_request refused it
            raise Rejected("InvalidRequest", f"{type(exc).__name__}: {exc}") from None
        if ran:
            # the loop first: a reply sent by the looping thread wakes nobody (a message that came
            # meanwhile is read before it sleeps); sent by a thread that gave the loop up, it wakes
            # the looping thread, which cost a pipe write and read per request under load
            self.replies.finish(req, result, error, ours=turn.take_back())  # sends the reply
        return ran

    # -- the other ops ----------------------------------------------------------------------

    def _op_cancel(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        target = header.get("target")
        if not is_request_id(target):
            raise ProtocolError(f"cancel needs the target id of a submit, got {target!r}"[:300])
        req = self.requests.get((identity, target))
        if req is None or req.claimed:
            outcome = cancel_result(False, f"request {target!r} is not in flight")
        elif req.stream is not None:  # its final reply follows once the runner let go of it
            req.stream.cancel()
            outcome = cancel_result(True, "the stream was cancelled")
        elif not self._cancellable:
            outcome = cancel_result(False, "requests on local replicas go to their ranks at once and cannot be "
                                           "cancelled")
        elif req.future is not None and req.future.cancel():  # its Cancelled reply follows from the callback
            outcome = cancel_result(True, "cancelled while queued")
        else:
            outcome = cancel_result(False, "already running")
        self.replies.ok(identity, "cancel", request_id, outcome)

    def _op_ping(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        self.replies.ok(identity, "ping", request_id, ping_result(self.server_id, time.time()))

    def _op_info(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        self.replies.ok(identity, "info", request_id, self.info())

    def _op_register(self, identity: bytes, request_id: Any, header: dict, frames: list,
                     client: ClientShm | None) -> None:
        no_frames(frames)
        if not self._ipc:
            raise ProtocolError("shared memory is offered over ipc:// only")
        run_id, segments, pid = register_fields(header)
        try:
            client = self.shm.register(identity, run_id, segments, pid)
        except ShmClientsFull as exc:
            raise Rejected("Overloaded", str(exc)) from None
        result = register_result(client.run_id, client.result_run_id, segments)
        self.replies.ok(identity, "register", request_id, result)

    def _op_lane(self, identity: bytes, request_id: Any, header: dict, frames: list, client: ClientShm | None) -> None:
        no_frames(frames)
        try:  # refused, not malformed: its segment is gone when the client closed before we read this
            result = self.shm.open_lane(client, *lane_fields(header))
        except ShmClientsFull as exc:
            raise Rejected("Overloaded", str(exc)) from None
        except ProtocolError as exc:
            raise Rejected("InvalidRequest", str(exc)) from None
        self.replies.ok(identity, "lane", request_id, result)

    def _op_release(self, identity: bytes, request_id: Any, header: dict, frames: list,
                    client: ClientShm | None) -> None:
        keys = release_blocks(header.get("blocks"))
        if frames or client is None or keys is None:
            return  # nothing to answer: a bad release only fails to free its sender's own blocks
        client.release(keys, mapped=True)

    def info(self) -> dict[str, Any]:
        """What ``info`` answers (``runtime.serving.description``)."""
        return describe(self._engine, {"server_id": self.server_id, "address": self.address},
                        {"inflight": len(self.requests), "max_inflight": self._options.max_inflight,
                         "accepting": self.accepting, "shm": self._ipc}, self._options.info)

    # -- upkeep -------------------------------------------------------------------------

    def housekeeping(self, now: float) -> None:
        """Drop the shared memory of clients silent for ``client_timeout_s``; log rejections."""
        self.shm.drop_gone(now, self._options.client_timeout_s)
        if self._rejected:
            log.warning("rejected %d malformed message(s) in the last %.0f s", self._rejected,
                        now - self._last_reject_log)
            self._rejected = 0
            self._last_reject_log = now

    def _note_rejected(self, exc: Exception) -> None:
        self._rejected += 1
        log.debug("malformed message: %s", exc)
