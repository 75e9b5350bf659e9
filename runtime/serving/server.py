"""Server: an Engine behind a ZeroMQ ROUTER socket (the wire is described in runtime.transport.protocol).

    clients (DEALER)                  I/O thread                                         engine
    [header, *tensor frames] ----->  recv (tensor frames: no copy), decode, check,
                                     engine.submit ------------------------------------>  Future
                                     ping, info, cancel, register, release;
                                     deadlines from a heap
                                                          done callback, on the engine's thread:
    <----- [header, *tensor frames] ------------------    encodes the result and sends the reply
                                     (the I/O thread      (never blocks: NOBLOCK)
                                     sends it instead
                                     when a deadline
                                     answered first)

With an inline engine, two I/O threads take turns running the loop above. When the
engine holds no other request, the looping thread runs a submit itself
(``Engine.run_if_idle``): an idle server answers in the thread that read the request,
with no hop to the engine's thread (a hop that cost about as much as the rest of the
round trip here). It gives the loop up first (``_hand_over``, which wakes nobody) and
takes it back when the request is done; if the request still runs at the other
thread's next look (every ``_STANDBY_TICK_S``), that thread takes the loop, so the
socket, pings and deadlines wait at most that long for a long request. A submit that
finds the engine busy goes to the engine's thread. Before sleeping, the looping
thread polls for a short while (``runtime.transport.spin``) while the engine holds nothing: a
thread woken from sleep ran this path about twice as slowly on our machines.

Invariants:
- One thread runs the loop at a time (``_looper``, under ``_turn``).
- The ROUTER is used under ``_sock_lock`` only (ZMQ sockets are not thread-safe):
  the I/O thread reads and answers there, and the thread that completes a request
  sends its reply at once, without a hop back to the I/O thread. The I/O thread
  sleeps in ``poll`` on the socket's (edge-triggered) ``ZMQ_FD`` without the lock;
  so every holder checks ``EVENTS`` after its send, and wakes the I/O thread
  when messages are waiting. Engine calls made by the looping thread return at once
  (``Engine.submit`` validates and queues; ``run_if_idle`` runs the plugin only after
  the loop was handed over); the socket is never held across one.
- Everything a client sends is untrusted: ``MAXMSGSIZE`` drops oversized messages
  (and their sender's connection), headers are decoded one frame at a time with
  lengths bounded by the frame, unknown ops and fields are refused, tensor
  references are checked against the frames and against the segments that very
  connection registered, and the plugin's ``validate_request`` runs before queueing.
  A malformed message gets an ``InvalidRequest`` reply; replies are sent with
  NOBLOCK and ROUTER_MANDATORY, so a client that does not read only loses its own
  replies. Error replies carry a type and a message, never a traceback.
- Request tensors that arrive as frames are read-only views of the received
  frame (no copy); from shared memory they are views of the client's block.
  Plugins must not write into their inputs.
- A reply is sent once: the result, or the error of a deadline, cancel or
  failure, whichever comes first (``InFlight.claim_reply`` decides, under its
  lock); a result that comes later is dropped.
- ``max_inflight`` counts requests the engine still holds, answered or not.
- Shared memory (ipc:// only) is per connection (``runtime.serving.shm``): inputs
  from segments that the client registered (mapped, then unlinked at once), results
  into an arena the server keeps for that client, each name unlinked once the client
  has mapped it. A client silent for ``client_timeout_s`` loses this state.
- Same-host trust: ipc:// sockets live in an owner-only directory, so a peer is a
  process of the same user; such a process can also signal or ptrace the server,
  so shared memory does not try to defend against it (it could, say, truncate a
  segment it registered).

The server owns the engine it serves: ``close()`` stops accepting, drains, and closes both.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import secrets
import select
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from runtime.transport.endpoints import CurveKeys, check_address
from runtime.core.errors import EngineUnavailableError, ProtocolError
from runtime.serving.metrics import NullMetrics
from runtime.transport.protocol import (MAX_TENSOR_FRAMES, PROTOCOL_VERSION, TensorResolver, is_request_id, pack_header,
                              unpack_header)
from runtime.serving.requests import (HEADER_FIELDS, OP_FIELDS, InFlight, Outcome, Rejected, Request, RunningHere,
                                     clip, no_frames, outcome_of, outcome_of_result, register_fields, release_blocks,
                                     request_tensor, submit_options)
from runtime.serving.shm import ClientShm, ShmClientsFull, ShmSessions
from runtime.transport.shm import sweep_stale
from runtime.transport.spin import budget_ns, spin
from runtime.transport.wake_pipe import WakePipe

log = logging.getLogger("phyrt.server")

DEFAULT_MAX_INFLIGHT = 256
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 20
_RECV_BATCH = 256
_HOUSEKEEPING_S = 1.0
# how often the standby I/O thread looks whether a request run by the looping thread still runs (then
# it takes the loop over): the longest a request leaves the socket unread, give or take a GIL switch
_STANDBY_TICK_S = 0.01
# plain ints: pyzmq's enum members cost microseconds in every ``&`` and call on the hot path
_NOBLOCK, _SNDMORE, _POLLIN = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.POLLIN)
_EVENTS, _RCVMORE = int(zmq.EVENTS), int(zmq.RCVMORE)
_ALLOWED_FIELDS = {op: HEADER_FIELDS | fields for op, fields in OP_FIELDS.items()}


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, Any]:
    from importlib import metadata

    try:
        phyrt_version = metadata.version("phyrt")
    except metadata.PackageNotFoundError:
        phyrt_version = "unknown"
    return {"phyrt": phyrt_version, "protocol": PROTOCOL_VERSION, "python": platform.python_version(),
            "torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "msgpack": ".".join(map(str, msgpack.version)), "numpy": np.__version__}


# --------------------------------------------------------------------------- the server


class Server:
    """Serves ``engine`` on ``address`` (bound here; ``start()`` runs the I/O thread)."""

    def __init__(self, engine: Any, address: str, *, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, curve: CurveKeys | None = None,
                 client_timeout_s: float = 60.0, info: dict[str, Any] | None = None,
                 metrics: Any = None) -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be an int >= 1024, got {max_message_bytes!r}")
        check_address(address, curve is not None)
        self._engine = engine
        self._metrics = metrics if metrics is not None else NullMetrics()
        self._max_inflight = max_inflight
        self._max_header = min(MAX_HEADER_BYTES, max_message_bytes)
        self._client_timeout_s = client_timeout_s
        self._extra_info = dict(info or {})
        self._cancellable = engine.mode == "inline"  # local ranks run whatever they were sent
        self.server_id = secrets.token_hex(8)
        self._ipc = address.startswith("ipc://")
        self._requests = InFlight()  # what max_inflight counts
        self._shm = ShmSessions()
        self._accepting = True
        self._stop = False
        self._idle = threading.Event()  # not accepting, and the engine holds nothing of ours
        self._drained = threading.Event()  # idle, or told not to wait (skip_drain)
        self._rejected = 0
        self._last_reject_log = time.monotonic()
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        # Two I/O threads take turns running the loop (``_looper`` under ``_turn``): an inline
        # engine holding no other request runs a submit in the looping thread, which gives the
        # loop up first; the standby thread takes it within _STANDBY_TICK_S if the request still
        # runs, so an idle server answers without waking any other thread (module docstring)
        self._turn = threading.Lock()
        self._stopping = threading.Event()  # wakes the standby thread at close
        self._looper: int | None = None
        self._run_here = engine.mode == "inline"  # (Engine.run_if_idle declines in other modes anyway)
        self._may_run_here = False
        # the looping thread polls a moment before sleeping (runtime.transport.spin) when it runs requests itself
        self._spin_budget = budget_ns("server") if self._run_here else 0
        self._next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        self._closed = False
        # request tensors are deliberately read-only views of the received frames
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

        self._ctx = zmq.Context(1)
        self._auth = None
        self._router = None
        self._router_open = False
        self._sock_lock = threading.Lock()  # every use of the ROUTER
        self._io_thread_id: int | None = None
        self._recheck = False  # the I/O thread's own send may have hidden waiting messages from poll
        self._wake_pipe: WakePipe | None = None
        success = False
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if curve is not None:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=curve.authorized_clients or zmq.auth.CURVE_ALLOW_ANY)
                self._router.curve_secretkey = curve.secret
                self._router.curve_publickey = curve.public
                self._router.curve_server = True
            self._router.bind(address)
            self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._ipc:
                os.chmod(self.address[len("ipc://"):], 0o600)
            self._router_fd = self._router.getsockopt(zmq.FD)
            self._router_open = True
            self._wake_pipe = WakePipe()
            success = True
        finally:
            if not success:
                self._release_sockets()

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> "Server":
        sweep_stale()  # names left by phyrt processes that were killed
        # the second I/O thread is the standby of a looping thread that runs requests itself
        self._threads = [threading.Thread(target=self._loop_main, name=f"phyrt-server-{i}", daemon=True)
                         for i in range(2 if self._run_here else 1)]
        self._thread = self._threads[0]
        for thread in self._threads:
            thread.start()
        return self

    @property
    def inflight(self) -> int:
        return len(self._requests)

    def stop_accepting(self) -> None:
        """New submits get EngineUnavailable from now on; ping and info still answer."""
        self._accepting = False
        self._wake()

    def skip_drain(self) -> None:
        """Make a ``close()`` that waits for in-flight requests stop waiting now."""
        self.stop_accepting()
        self._drained.set()

    def wait_drained(self, timeout: float | None) -> bool:
        """After ``stop_accepting``: wait until the engine holds no request; False on time-out."""
        return self._drained.wait(timeout)

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_timeout_s``,
        then close the engine (failing what is left), send the last replies and release
        every socket, segment and the ipc socket file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        running = self._thread is not None and self._thread.is_alive()
        if running:
            self.stop_accepting()
            if not self.wait_drained(drain_timeout_s):
                log.warning("%d request(s) still in flight after %.1f s; failing them", len(self._requests),
                            drain_timeout_s)
        try:
            self._engine.close(timeout=2.0)
        finally:
            if running:
                self._idle.wait(2.0)  # the engine failed what it held: let those replies go out
                self._stop = True
                self._wake()
                self._stopping.set()
                for thread in self._threads:
                    thread.join(10)
            self._release_sockets()
            self._shm.close()
            sweep_stale()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _release_sockets(self) -> None:
        with self._sock_lock:  # a completion that comes later finds the socket closed, and drops its reply
            self._router_open = False
            if self._router is not None and not self._router.closed:
                # a moment for the last replies to reach their clients
                self._router.close(linger=500 if self._thread is not None else 0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        if getattr(self, "_ipc", False) and hasattr(self, "address"):
            try:  # libzmq removes its socket file; make sure, so a restart can bind the path again
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass
        if self._wake_pipe is not None:  # a late callback's wake-up is a no-op from now on
            self._wake_pipe.close()

    def _wake(self) -> None:
        self._wake_pipe.wake()

    # -- the I/O thread ---------------------------------------------------------------

    def _loop_main(self) -> None:
        """One of the two I/O threads: run the loop whenever it is this thread's turn.

        The thread not looping is the standby: every ``_STANDBY_TICK_S`` it looks whether
        the loop is free (the looping thread is running a request: ``_hand_over``) and takes
        it if so. Nobody is woken for a request that ends before the next tick: its thread
        takes the loop back (``_take_back``). Waking the standby at once cost more than the
        rest of a small request's round trip here, and a timer armed per request (timerfd)
        slowed the whole request down more than it saved.
        """
        me = threading.get_ident()
        while not self._stop:
            with self._turn:
                take = self._looper is None and not self._stop
                if take:
                    self._looper = me
            if take:
                self._run()
            else:
                self._stopping.wait(_STANDBY_TICK_S)

    def _hand_over(self) -> None:
        """The looping thread is about to run a request itself: the standby thread takes the
        loop (and the socket) at its next tick, unless this thread takes it back first."""
        with self._turn:
            self._looper = None
            self._io_thread_id = None  # this thread's sends wake the next looper from now on

    def _take_back(self) -> None:
        """After running a request: keep looping, unless the other thread took the loop (then
        ``_run`` sees ``_looper`` is another thread's and returns)."""
        me = threading.get_ident()
        with self._turn:
            if self._looper is not None or self._stop:
                return
            self._looper = self._io_thread_id = me
        self._recheck = True  # messages that came meanwhile: read them before sleeping

    def _run(self) -> None:
        """The loop, until ``close()`` or until this thread handed it over (``_hand_over``)."""
        me = self._io_thread_id = threading.get_ident()
        poller = select.poll()
        poller.register(self._router_fd, select.POLLIN)  # edge-triggered: see the module's invariants
        poller.register(self._wake_pipe.fd, select.POLLIN)
        wake_fd = self._wake_pipe.fd
        spin_budget = self._spin_budget
        poll_now = functools.partial(poller.poll, 0)
        more = True  # messages may be waiting: read before sleeping
        try:
            while not self._stop:
                next_housekeeping = self._next_housekeeping
                if more or self._recheck:
                    wait_ms = 0.0
                else:
                    now = time.monotonic()
                    wait = next_housekeeping - now
                    deadline = self._requests.next_deadline()
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    wait_ms = max(0.0, wait) * 1000 + 1
                events = None
                if spin_budget and wait_ms > 0 and not self._requests:  # (an engine thread at work needs the GIL)
                    events = spin(poll_now, min(spin_budget, int(wait_ms * 1e6)))
                if not events:
                    events = poller.poll(wait_ms)
                if events and (len(events) > 1 or events[0][0] == wake_fd):
                    self._wake_pipe.drain()
                self._recheck = False
                # bookkeeping before the messages: the last thing before sleeping again is handing
                # requests to the engine, whose woken thread then waits for the GIL the least
                self._finish_completed()
                now = time.monotonic()
                self._expire_deadlines(now)
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    self._next_housekeeping = now + _HOUSEKEEPING_S
                if not self._accepting and not self._requests:
                    self._idle.set()
                    self._drained.set()
                batch, more = self._read_router()
                last = len(batch) - 1
                for i, (identity, frames) in enumerate(batch):
                    # the last message read, with nothing else waiting: a submit may run in this thread
                    self._may_run_here = self._run_here and i == last and not more
                    try:
                        self._handle(identity, frames)
                    except Exception:  # a server bug must not take the loop down
                        log.exception("failed to handle a message from %r", identity)
                        self._reply_error(identity, None, None, "InvalidRequest",
                                          "the server could not process this message (see its log)")
                    if self._looper != me:  # it ran one here and the other thread loops now
                        return
        except BaseException:  # a bug: log it, and let close() release what is left
            log.exception("the server's I/O thread failed")
            self._stop = True  # the other I/O thread does not take over a broken loop
            self._stopping.set()
            self._idle.set()
            self._drained.set()

    def _read_router(self) -> tuple[list[tuple[bytes, list[Any]]], bool]:
        """What has arrived, as (identity, [header, *tensor frames]); True if a full batch (read on)."""
        batch: list[tuple[bytes, list[Any]]] = []
        with self._sock_lock:
            if not self._router_open:
                return batch, False
            router = self._router
            while router.getsockopt(_EVENTS) & _POLLIN:
                identity = router.recv(_NOBLOCK, copy=False)  # a Frame knows in C whether parts follow
                if not identity.more:
                    continue
                head = router.recv(copy=False)
                frames: list[Any] = [head.bytes]
                more = head.more
                while more:  # the parts of a message arrive together; tensors stay Frames (no copy)
                    frame = router.recv(copy=False)
                    frames.append(frame)
                    more = frame.more
                batch.append((identity.bytes, frames))
                if len(batch) >= _RECV_BATCH:  # then completions and deadlines get their turn
                    return batch, True
        return batch, False

    def _handle(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        op = request_id = None
        started = time.monotonic()
        try:
            if len(frames) > 1 + MAX_TENSOR_FRAMES:
                raise ProtocolError(f"{len(frames) - 1} tensor frames; at most {MAX_TENSOR_FRAMES}")
            head, refs = frames[0], []
            header = unpack_header(head.buffer if isinstance(head, zmq.Frame) else head, self._max_header, refs)
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
            self._metrics.on_request(op)
            client = self._shm.get(identity)
            if client is not None:
                client.last_seen = started
            if op == "submit":
                self._op_submit(identity, request_id, header, frames[1:], client, bool(refs))
            else:
                getattr(self, f"_op_{op}")(identity, request_id, header, frames[1:], client)
        except ProtocolError as exc:
            self._note_rejected(exc)
            self._metrics.on_reply(False, "InvalidRequest", time.monotonic() - started, op=op or "other")
            self._reply_error(identity, op, request_id, "InvalidRequest", clip(str(exc)))
        except Rejected as exc:
            self._metrics.on_reply(False, exc.type, time.monotonic() - started, op=op or "other")
            self._reply_error(identity, op, request_id, exc.type, clip(str(exc)))

    # -- ops ----------------------------------------------------------------------------

    def _op_submit(self, identity: bytes, request_id: Any, header: dict, frames: list, client: ClientShm | None,
                   tensors: bool = True) -> None:
        """``tensors``: the header holds tensor references (False: the payload is plain data).

        The result blocks a submit's ``release`` gives back are freed once the request is
        answered or handed to the engine: a request run here waits for nothing but its run."""
        timeout_s, shm_results = submit_options(header)
        released = None
        if "release" in header:
            released = release_blocks(header["release"])
            if released is None:
                raise ProtocolError("release must be a list of at most 4096 [segment, offset] blocks")
        try:
            self._submit(identity, request_id, header, frames, client, tensors, timeout_s, shm_results)
        finally:
            if released and client is not None:
                client.release(released, mapped=True)

    def _submit(self, identity: bytes, request_id: Any, header: dict, frames: list, client: ClientShm | None,
                tensors: bool, timeout_s: float | None, shm_results: bool) -> None:
        if not self._accepting:
            raise Rejected("EngineUnavailable", "the server is shutting down")
        if len(self._requests) >= self._max_inflight:
            raise Rejected("Overloaded", f"{len(self._requests)} requests in flight, the server's limit "
                                         f"(--max-inflight {self._max_inflight}); retry later")
        if (identity, request_id) in self._requests:
            raise ProtocolError(f"request id {request_id!r} is already in flight on this connection"[:300])
        if tensors or frames:
            resolver = TensorResolver(frames, request_tensor, client.view if client is not None else None)
            payload = resolver.resolve(header["payload"])
            resolver.finish()
            holds_inputs = bool(resolver.shm_blocks) and self._cancellable
        else:
            payload, holds_inputs = header["payload"], False
        req = Request(identity, request_id, None, timeout_s, client, shm_results and client is not None,
                      holds_inputs)
        if self._may_run_here and self._run_here_now(req, payload):
            return
        try:
            future = self._engine.submit(payload)
        except EngineUnavailableError as exc:
            raise Rejected("EngineUnavailable", str(exc)) from None
        except Exception as exc:  # the plugin's validate_request (or encoding for local ranks) refused it
            raise Rejected("InvalidRequest", f"{type(exc).__name__}: {exc}") from None
        req.future = future
        self._requests.add(req)
        future.add_done_callback(functools.partial(self._on_done, req))

    def _run_here_now(self, req: Request, payload: Any) -> bool:
        """Run ``req`` in this thread if the engine is idle (True: answered or failing like a
        submitted request would); the loop is given up first (``_hand_over``)."""
        running = RunningHere()

        def before() -> None:
            req.future = running
            self._requests.add(req)
            self._hand_over()

        try:
            ran, result, error = self._engine.run_if_idle(payload, before)
        except Exception as exc:  # the plugin's validate_request refused it
            raise Rejected("InvalidRequest", f"{type(exc).__name__}: {exc}") from None
        if ran:
            running.finished = True
            self._finish(req, outcome_of_result(req, result, error))  # sends the reply
            self._take_back()
        return ran

    def _op_cancel(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        target = header.get("target")
        if not is_request_id(target):
            raise ProtocolError(f"cancel needs the target id of a submit, got {target!r}"[:300])
        req = self._requests.get((identity, target))
        if req is None or req.replied:
            outcome = {"cancelled": False, "detail": f"request {target!r} is not in flight"}
        elif not self._cancellable:
            outcome = {"cancelled": False, "detail": "requests on local replicas go to their ranks at once "
                                                     "and cannot be cancelled"}
        elif req.future.cancel():  # its Cancelled reply follows from the done callback
            outcome = {"cancelled": True, "detail": "cancelled while queued"}
        else:
            outcome = {"cancelled": False, "detail": "already running"}
        self._reply_ok(identity, "cancel", request_id, outcome)

    def _op_ping(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        self._reply_ok(identity, "ping", request_id, {"server_id": self.server_id, "time": time.time()})

    def _op_info(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        no_frames(frames)
        self._reply_ok(identity, "info", request_id, self.info())

    def _op_register(self, identity: bytes, request_id: Any, header: dict, frames: list,
                     client: ClientShm | None) -> None:
        no_frames(frames)
        if not self._ipc:
            raise ProtocolError("shared memory is offered over ipc:// only")
        run_id, segments, pid = register_fields(header)
        try:
            client = self._shm.register(identity, run_id, segments, pid)
        except ShmClientsFull as exc:
            raise Rejected("Overloaded", str(exc)) from None
        self._reply_ok(identity, "register", request_id,
                       {"run_id": client.run_id, "result_run_id": client.result_run_id, "mapped": segments})

    def _op_release(self, identity: bytes, request_id: Any, header: dict, frames: list,
                    client: ClientShm | None) -> None:
        keys = release_blocks(header.get("blocks"))
        if frames or client is None or keys is None:
            return  # nothing to answer: a bad release only fails to free its sender's own blocks
        client.release(keys, mapped=True)

    def info(self) -> dict[str, Any]:
        """What ``info`` answers: plugin, topology, replicas, versions, limits."""
        engine = self._engine
        return {
            "server_id": self.server_id,
            "address": self.address,
            "plugin": engine.args.plugin,
            "mode": engine.mode,
            "replica_count": len(engine.replicas),
            "ranks_per_replica": engine.ranks_per_replica,
            "replicas": [{"index": r.index, "healthy": r.healthy, "inflight": r.inflight,
                          "devices": list(r.devices), "error": r.error} for r in engine.replicas],
            "inflight": len(self._requests),
            "max_inflight": self._max_inflight,
            "accepting": self._accepting,
            "shm": self._ipc,
            "versions": _versions(),
            **self._extra_info,
        }

    # -- completion (engine threads, then the I/O thread) -----------------------------

    def _on_done(self, req: Request, future: Future) -> None:
        """Runs where the future completed: encode and send the reply here, unless a
        deadline answered first (then the I/O thread finishes it)."""
        self._finish(req, outcome_of(req, future))

    def _finish(self, req: Request, outcome: Outcome) -> None:
        if not self._requests.claim_reply(req, outcome):
            self._wake()
            return
        self._reply(req, outcome)
        if not self._accepting:  # the I/O thread notices when the last one is done
            self._wake()

    def _reply(self, req: Request, outcome: Any) -> None:
        """Send ``req``'s reply (any thread; the request has been claimed for it)."""
        self._metrics.on_reply(outcome.error is None, outcome.error[0] if outcome.error else None,
                               time.monotonic() - req.arrived)
        if outcome.error is not None:
            sent = self._reply_error(req.identity, "submit", req.id, *outcome.error)
        else:
            sent = self._send(req.identity, {"v": PROTOCOL_VERSION, "op": "submit", "id": req.id, "ok": True,
                                             "result": outcome.result}, outcome.frames)
        if not sent and outcome.blocks:
            req.client.release(outcome.blocks, mapped=False)

    def _finish_completed(self) -> None:
        for req, outcome in self._requests.completed():
            if outcome.late and not req.replied:
                req.replied = True
                self._metrics.on_reply(False, "DeadlineExceeded", time.monotonic() - req.arrived)
                self._reply_error(req.identity, "submit", req.id, "DeadlineExceeded",
                                  f"no result within timeout_s={req.timeout_s} (the request was still running; "
                                  "its result came too late and was dropped)")
            if req.replied:  # a deadline answered it already
                if outcome.blocks:
                    req.client.release(outcome.blocks, mapped=False)
                if req.notify_inputs:
                    self._send(req.identity, {"v": PROTOCOL_VERSION, "op": "inputs_done", "id": req.id})
                continue
            req.replied = True  # (not reached: claim_reply sends every outcome that is neither late nor answered)
            self._reply(req, outcome)

    def _expire_deadlines(self, now: float) -> None:
        for req in self._requests.expired(now):  # neither answered nor done; marked replied
            self._metrics.on_reply(False, "DeadlineExceeded", now - req.arrived)
            cancelled = self._cancellable and req.future.cancel()
            req.notify_inputs = req.holds_inputs and not cancelled
            state = "cancelled while queued" if cancelled else "still running; its result will be dropped"
            self._reply_error(req.identity, "submit", req.id, "DeadlineExceeded",
                              f"no result within timeout_s={req.timeout_s} (the request was {state})",
                              inputs_held=req.notify_inputs)

    def _housekeeping(self, now: float) -> None:
        self._shm.drop_gone(now, self._client_timeout_s)
        if self._rejected:
            log.warning("rejected %d malformed message(s) in the last %.0f s", self._rejected,
                        now - self._last_reject_log)
            self._rejected = 0
            self._last_reject_log = now

    def _note_rejected(self, exc: Exception) -> None:
        self._rejected += 1
        log.debug("malformed message: %s", exc)

    # -- sending (any thread) -------------------------------------------------------------

    def _reply_ok(self, identity: bytes, op: str, request_id: Any, result: Any) -> bool:
        return self._send(identity, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": True, "result": result})

    def _reply_error(self, identity: bytes, op: Any, request_id: Any, kind: str, message: str,
                     **extra: Any) -> bool:
        return self._send(identity, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": False,
                                     "error": {"type": kind, "message": message}, **extra})

    def _send(self, identity: bytes, header: dict[str, Any], frames: list[Any] = ()) -> bool:
        """Send without ever blocking; False if the peer is gone or does not read its replies."""
        data = pack_header(header)
        sent = waiting = False
        with self._sock_lock:
            if not self._router_open:
                return False
            router = self._router
            try:
                router.send(identity, _NOBLOCK | _SNDMORE)  # EAGAIN or EHOSTUNREACH come here, or never
                if frames:
                    router.send(data, _NOBLOCK | _SNDMORE)
                    router.send_multipart(frames, _NOBLOCK, copy=False)  # below 64 KiB pyzmq copies anyway
                else:
                    router.send(data, _NOBLOCK)
                sent = True
            except zmq.Again:
                log.debug("dropped a reply to %r: its queue is full", identity)
            except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer left
                log.debug("dropped a reply to %r: %s", identity, exc)
            waiting = router.getsockopt(_EVENTS) & _POLLIN
        if waiting:  # this send took the signal of a message that came meanwhile: pass it on
            if threading.get_ident() == self._io_thread_id:
                self._recheck = True
            else:
                self._wake()
        return sent

