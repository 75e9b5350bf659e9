"""Server: an Engine behind a ZeroMQ ROUTER socket (the wire is described in runtime.client).

    clients (DEALER)                  I/O thread (owns the ROUTER)                       engine
    [header, *tensor frames] ----->  recv (no copy), decode, check, engine.submit ---->  Future
                                     ping, info, cancel, register, release;
                                     deadlines from a heap
                                                          completions deque + wake pipe
                                     send (never blocks)  <----------  done callback: encodes the
    <----- [header, *tensor frames]                                    result on the engine's thread

Invariants:
- Only the I/O thread touches the ROUTER (ZMQ sockets are not thread-safe). Engine
  calls made there return at once (``Engine.submit`` validates and queues); the
  engine's completion callbacks only encode and hand the reply over.
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
  failure, whichever comes first; a result that comes later is dropped.
- ``max_inflight`` counts requests the engine still holds, answered or not.
- Shared memory (ipc:// only) is per connection: inputs from segments that the
  client registered (mapped, then unlinked at once), results into an arena the
  server keeps for that client, each name unlinked once the client has mapped it.
  A client silent for ``client_timeout_s`` loses this state.
- Same-host trust: ipc:// sockets live in an owner-only directory, so a peer is a
  process of the same user; such a process can also signal or ptrace the server,
  so shared memory does not try to defend against it (it could, say, truncate a
  segment it registered).

The server owns the engine it serves: ``close()`` stops accepting, drains, and closes both.
"""

from __future__ import annotations

import collections
import functools
import heapq
import ipaddress
import itertools
import logging
import math
import os
import platform
import secrets
import stat
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from runtime.client import (MAX_TENSOR_FRAMES, PROTOCOL_VERSION, PayloadEncoder, TensorResolver,
                            is_request_id, pack_header, unpack_header)
from runtime.errors import EngineUnavailableError, ProtocolError, RemoteError
from runtime.shm import ShmArena, ShmMapper, new_run_id, sweep_stale

log = logging.getLogger("phyrt.server")

DEFAULT_MAX_INFLIGHT = 256
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_SEGMENTS_PER_CLIENT = 64
MAX_SHM_CLIENTS = 1024
#: results at least this large go into the client's result arena when it asked for shm
RESULT_SHM_THRESHOLD = 64 * 1024
#: a client's unreleased result blocks may hold at most this much; beyond, frames
RESULT_SHM_LIMIT = 512 << 20
_RESULT_ARENA_BYTES = 8 << 20
_MAX_MESSAGE_CHARS = 2000
_RECV_BATCH = 256
_HOUSEKEEPING_S = 1.0

_FIELDS = {
    "submit": frozenset({"payload", "timeout_s", "shm_results"}),
    "cancel": frozenset({"target"}),
    "ping": frozenset(),
    "info": frozenset(),
    "register": frozenset({"run_id", "segments", "pid"}),
    "release": frozenset({"blocks"}),
}
_HEADER = frozenset({"v", "op", "id"})


class Rejected(Exception):
    """A request answered with an error reply of ``type``."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type


# --------------------------------------------------------------------------- per-client state


class _ClientShm:
    """The shared memory of one connection: its registered segments and our result arena."""

    def __init__(self, identity: bytes, run_id: str, pid: int | None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.pid = pid  # the client's process, as it says: its state goes as soon as that is gone
        self.mapper = ShmMapper(run_id)  # raises ValueError for a malformed run id
        self.segments: set[str] = set()
        self.result_run_id = new_run_id()
        self.last_seen = time.monotonic()
        self.requests = 0
        self._lock = threading.Lock()  # the arena is used by completion threads and the I/O thread
        self._arena: ShmArena | None = None
        self._outstanding: dict[tuple[str, int], int] = {}
        self._outstanding_bytes = 0
        self._unlinked: set[str] = set()
        self._closed = False

    def register(self, segment: str) -> None:
        self.mapper.view(segment, 0, 0)  # checks the name, its run, its owner; maps it
        self.segments.add(segment)
        try:  # mapped now: the name is not needed any more, and a crash cannot leak it
            os.unlink(os.path.join("/dev/shm", segment))
        except FileNotFoundError:
            pass

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        if segment not in self.segments:
            raise ProtocolError(f"segment {segment!r} was not registered by this connection"[:300])
        return self.mapper.view(segment, offset, nbytes)

    def place_result(self, nbytes: int) -> tuple[str, int, memoryview] | None:
        with self._lock:
            if self._closed or self._outstanding_bytes + nbytes > RESULT_SHM_LIMIT:
                return None
            if self._arena is None:
                self._arena = ShmArena(self.result_run_id, max(_RESULT_ARENA_BYTES, 2 * nbytes))
            segment, offset, view = self._arena.place(nbytes)
            self._outstanding[(segment, offset)] = nbytes
            self._outstanding_bytes += nbytes
            return segment, offset, view

    def release(self, blocks: list[tuple[str, int]], mapped: bool) -> None:
        """Free result blocks; ``mapped``: the client has mapped their segments (so unlink them)."""
        with self._lock:
            for key in blocks:
                nbytes = self._outstanding.pop(key, None)
                if nbytes is None or self._arena is None:
                    continue
                self._outstanding_bytes -= nbytes
                self._arena.free(*key)
                if mapped and key[0] not in self._unlinked:
                    self._unlinked.add(key[0])
                    self._arena.unlink(key[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._arena is not None:
                self._arena.close()
        self.mapper.close()


@dataclass
class _Request:
    identity: bytes
    id: Any
    future: Future | None = None
    timeout_s: float | None = None
    client: _ClientShm | None = None
    shm_results: bool = False
    holds_inputs: bool = False  # the plugin may still read the client's shared memory
    replied: bool = False
    notify_inputs: bool = False  # tell the client when the engine lets go of its inputs

    @property
    def key(self) -> tuple[bytes, Any]:
        return self.identity, self.id


@dataclass
class _Outcome:
    result: Any = None
    frames: list[Any] = field(default_factory=list)
    blocks: list[tuple[str, int]] = field(default_factory=list)
    error: tuple[str, str] | None = None


@dataclass(frozen=True)
class CurveKeys:
    """The server's CURVE pair (z85) and, optionally, a directory of allowed client public keys."""

    public: bytes
    secret: bytes
    authorized_clients: str | None = None


# --------------------------------------------------------------------------- addresses


def check_address(address: str, curve: bool) -> None:
    """Refuse endpoints that would expose the server: see the module docstring of runtime.launch."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if path.startswith("@") or not path.startswith("/"):
            raise ValueError(f"{address}: use an absolute ipc:// path (abstract sockets have no permission check)")
        parent = os.path.dirname(path)
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            raise ValueError(f"{address}: the directory {parent} does not exist") from None
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{address}: the directory {parent} must belong to this user and be private "
                             f"(mode 0700, it is {stat.S_IMODE(st.st_mode):o}); mkdir -m 700 one")
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
        if not _is_loopback(host) and not curve:
            raise ValueError(f"{address}: binding a non-loopback interface needs CURVE keys "
                             "(--curve-secret-key and --curve-public-key); use tcp://127.0.0.1:PORT for this host only")
        return
    raise ValueError(f"address must be ipc:///path or tcp://host:port, got {address!r}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or host name: not provably loopback
        return False


def _tensor_view(buf: memoryview, name: str, shape: list[int]) -> torch.Tensor:
    """A tensor over the received bytes, without a copy (read-only for frames)."""
    dtype = getattr(torch, name)
    count = math.prod(shape)
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


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


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def _error_of(exc: BaseException) -> tuple[str, str]:
    """The reply error of an engine failure; text only, never a traceback."""
    if isinstance(exc, EngineUnavailableError):
        if isinstance(exc.__cause__, RemoteError):  # the plugin raised inside a local rank
            return "PluginError", _clip(f"{exc} (that replica is out of service now)")
        return "EngineUnavailable", _clip(str(exc))
    return "PluginError", _clip(f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- the server


class Server:
    """Serves ``engine`` on ``address`` (bound here; ``start()`` runs the I/O thread)."""

    def __init__(self, engine: Any, address: str, *, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, curve: CurveKeys | None = None,
                 client_timeout_s: float = 60.0, info: dict[str, Any] | None = None) -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be an int >= 1024, got {max_message_bytes!r}")
        check_address(address, curve is not None)
        self._engine = engine
        self._max_inflight = max_inflight
        self._max_header = min(MAX_HEADER_BYTES, max_message_bytes)
        self._client_timeout_s = client_timeout_s
        self._extra_info = dict(info or {})
        self._cancellable = engine.mode == "inline"  # local ranks run whatever they were sent
        self.server_id = secrets.token_hex(8)
        self._ipc = address.startswith("ipc://")
        self._requests: dict[tuple[bytes, Any], _Request] = {}
        self._deadlines: list[tuple[float, int, _Request]] = []
        self._seq = itertools.count()
        self._clients: dict[bytes, _ClientShm] = {}
        self._run_ids: dict[str, bytes] = {}
        self._completions: collections.deque[tuple[_Request, _Outcome]] = collections.deque()
        self._inflight = 0
        self._accepting = True
        self._stop = False
        self._idle = threading.Event()  # not accepting, and the engine holds nothing of ours
        self._drained = threading.Event()  # idle, or told not to wait (skip_drain)
        self._wake_lock = threading.Lock()
        self._rejected = 0
        self._last_reject_log = time.monotonic()
        self._thread: threading.Thread | None = None
        self._closed = False
        # request tensors are deliberately read-only views of the received frames
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

        self._ctx = zmq.Context(1)
        self._auth = None
        self._router = None
        self._wake_r = self._wake_w = -1
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
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            success = True
        finally:
            if not success:
                self._release_sockets()

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> "Server":
        sweep_stale()  # names left by phyrt processes that were killed
        self._thread = threading.Thread(target=self._run, name="phyrt-server", daemon=True)
        self._thread.start()
        return self

    @property
    def inflight(self) -> int:
        return self._inflight

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
                log.warning("%d request(s) still in flight after %.1f s; failing them", self._inflight,
                            drain_timeout_s)
        try:
            self._engine.close(timeout=2.0)
        finally:
            if running:
                self._idle.wait(2.0)  # the engine failed what it held: let those replies go out
                self._stop = True
                self._wake()
                self._thread.join(10)
            self._release_sockets()
            for client in self._clients.values():
                client.close()
            self._clients.clear()
            sweep_stale()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _release_sockets(self) -> None:
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
        with self._wake_lock:  # a late callback must never write to a reused descriptor number
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # full: a wake-up is pending anyway
                    pass

    # -- the I/O thread ---------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        try:
            while not self._stop:
                now = time.monotonic()
                wait = next_housekeeping - now
                if self._deadlines:
                    wait = min(wait, self._deadlines[0][0] - now)
                events = dict(poller.poll(max(0.0, wait) * 1000 + 1))
                if self._wake_r in events:
                    _drain_pipe(self._wake_r)
                if self._router in events:
                    self._drain_router()
                self._finish_completed()
                now = time.monotonic()
                self._expire_deadlines(now)
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    next_housekeeping = now + _HOUSEKEEPING_S
                if not self._accepting and self._inflight == 0:
                    self._idle.set()
                    self._drained.set()
        except BaseException:  # a bug: log it, and let close() release what is left
            log.exception("the server's I/O thread failed")
            self._idle.set()
            self._drained.set()

    def _drain_router(self) -> None:
        for _ in range(_RECV_BATCH):  # then completions and deadlines get their turn
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            try:
                self._handle(identity, frames[1:])
            except Exception:  # a server bug must not take the loop down
                log.exception("failed to handle a message from %r", identity)
                self._reply_error(identity, None, None, "InvalidRequest",
                                  "the server could not process this message (see its log)")

    def _handle(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        op = request_id = None
        try:
            if len(frames) > 1 + MAX_TENSOR_FRAMES:
                raise ProtocolError(f"{len(frames) - 1} tensor frames; at most {MAX_TENSOR_FRAMES}")
            header = unpack_header(frames[0].buffer, self._max_header)
            op, request_id = header.get("op"), header.get("id")
            if not isinstance(op, str) or op not in _FIELDS:
                bad_op, op = op, None
                raise ProtocolError(f"unknown op {bad_op!r}; known: {sorted(_FIELDS)}"[:300])
            if not is_request_id(request_id):
                bad_id, request_id = request_id, None
                raise ProtocolError(f"id must be an int in [0, 2**64) or a str of 1 to 128 characters, "
                                    f"got {bad_id!r}"[:300])
            unknown = header.keys() - _HEADER - _FIELDS[op]
            if unknown:
                raise ProtocolError(f"unknown fields {sorted(unknown)} for op {op!r}; "
                                    f"allowed: {sorted(_FIELDS[op])}"[:300])
            client = self._clients.get(identity)
            if client is not None:
                client.last_seen = time.monotonic()
            getattr(self, f"_op_{op}")(identity, request_id, header, frames[1:], client)
        except ProtocolError as exc:
            self._note_rejected(exc)
            self._reply_error(identity, op, request_id, "InvalidRequest", _clip(str(exc)))
        except Rejected as exc:
            self._reply_error(identity, op, request_id, exc.type, _clip(str(exc)))

    # -- ops ----------------------------------------------------------------------------

    def _op_submit(self, identity: bytes, request_id: Any, header: dict, frames: list, client: _ClientShm | None):
        if "payload" not in header:
            raise ProtocolError("submit needs a payload")
        timeout_s = header.get("timeout_s")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not 0 < timeout_s <= 1e7):
            raise ProtocolError(f"timeout_s must be a number of seconds in (0, 1e7], got {timeout_s!r}"[:300])
        shm_results = header.get("shm_results", False)
        if not isinstance(shm_results, bool):
            raise ProtocolError(f"shm_results must be a bool, got {shm_results!r}"[:300])
        if not self._accepting:
            raise Rejected("EngineUnavailable", "the server is shutting down")
        if self._inflight >= self._max_inflight:
            raise Rejected("Overloaded", f"{self._inflight} requests in flight, the server's limit "
                                         f"(--max-inflight {self._max_inflight}); retry later")
        if (identity, request_id) in self._requests:
            raise ProtocolError(f"request id {request_id!r} is already in flight on this connection"[:300])
        resolver = TensorResolver(frames, _tensor_view, client.view if client is not None else None)
        payload = resolver.resolve(header["payload"])
        resolver.finish()
        req = _Request(identity, request_id, timeout_s=timeout_s, client=client,
                       shm_results=shm_results and client is not None,
                       holds_inputs=bool(resolver.shm_blocks) and self._cancellable)
        try:
            future = self._engine.submit(payload)
        except EngineUnavailableError as exc:
            raise Rejected("EngineUnavailable", str(exc)) from None
        except Exception as exc:  # the plugin's validate_request (or encoding for local ranks) refused it
            raise Rejected("InvalidRequest", f"{type(exc).__name__}: {exc}") from None
        req.future = future
        self._requests[req.key] = req
        self._inflight += 1
        if client is not None:
            client.requests += 1
        if timeout_s is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + timeout_s, next(self._seq), req))
        future.add_done_callback(functools.partial(self._on_done, req))

    def _op_cancel(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        self._no_frames(frames)
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
        self._no_frames(frames)
        self._reply_ok(identity, "ping", request_id, {"server_id": self.server_id, "time": time.time()})

    def _op_info(self, identity: bytes, request_id: Any, header: dict, frames: list, client: Any) -> None:
        self._no_frames(frames)
        self._reply_ok(identity, "info", request_id, self.info())

    def _op_register(self, identity: bytes, request_id: Any, header: dict, frames: list,
                     client: _ClientShm | None) -> None:
        self._no_frames(frames)
        if not self._ipc:
            raise ProtocolError("shared memory is offered over ipc:// only")
        run_id, segments, pid = header.get("run_id"), header.get("segments", []), header.get("pid")
        if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments):
            raise ProtocolError("segments must be a list of segment names")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31):
            raise ProtocolError(f"pid must be a process id, got {pid!r}"[:300])
        if client is None:
            owner = self._run_ids.get(run_id) if isinstance(run_id, str) else None
            if owner is not None:
                raise ProtocolError(f"run id {run_id!r} is registered by another connection"[:300])
            if len(self._clients) >= MAX_SHM_CLIENTS:
                raise Rejected("Overloaded", f"{MAX_SHM_CLIENTS} clients already use shared memory")
            try:
                client = _ClientShm(identity, run_id, pid)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            self._clients[identity] = client
            self._run_ids[run_id] = identity
        elif run_id != client.run_id:
            raise ProtocolError(f"this connection registered run id {client.run_id!r}, not {run_id!r}"[:300])
        if len(client.segments) + len(segments) > MAX_SEGMENTS_PER_CLIENT:
            raise ProtocolError(f"at most {MAX_SEGMENTS_PER_CLIENT} segments per connection")
        for segment in segments:
            client.register(segment)  # ProtocolError for a forged, foreign or missing name
        self._reply_ok(identity, "register", request_id,
                       {"run_id": client.run_id, "result_run_id": client.result_run_id, "mapped": segments})

    def _op_release(self, identity: bytes, request_id: Any, header: dict, frames: list,
                    client: _ClientShm | None) -> None:
        blocks = header.get("blocks")
        if frames or client is None or not isinstance(blocks, list) or len(blocks) > 4096:
            return  # nothing to answer: a bad release only fails to free its sender's own blocks
        keys = [(b[0], b[1]) for b in blocks if isinstance(b, list) and len(b) == 2
                and isinstance(b[0], str) and isinstance(b[1], int) and not isinstance(b[1], bool)]
        client.release(keys, mapped=True)

    @staticmethod
    def _no_frames(frames: list) -> None:
        if frames:
            raise ProtocolError(f"this op takes no tensor frames, got {len(frames)}")

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
            "inflight": self._inflight,
            "max_inflight": self._max_inflight,
            "accepting": self._accepting,
            "shm": self._ipc,
            "versions": _versions(),
            **self._extra_info,
        }

    # -- completion (engine threads, then the I/O thread) -----------------------------

    def _on_done(self, req: _Request, future: Future) -> None:
        """Runs where the future completed: encode here, send from the I/O thread."""
        try:
            if future.cancelled():
                outcome = _Outcome(error=("Cancelled", "the request was cancelled while queued"))
            elif future.exception() is not None:
                outcome = _Outcome(error=_error_of(future.exception()))
            else:
                outcome = self._encode_result(req, future.result())
        except BaseException as exc:  # never let a callback lose a reply
            outcome = _Outcome(error=("PluginError", _clip(f"the result could not be sent: {type(exc).__name__}: {exc}")))
        self._completions.append((req, outcome))
        self._wake()

    def _encode_result(self, req: _Request, result: Any) -> _Outcome:
        client = req.client if req.shm_results else None
        encoder = PayloadEncoder(copy=False, place=client.place_result if client is not None else None,
                                 shm_threshold=RESULT_SHM_THRESHOLD)
        try:
            body = encoder.encode(result, "result")
        except (TypeError, ValueError) as exc:
            if client is not None:
                client.release(encoder.blocks, mapped=False)
            return _Outcome(error=("PluginError", _clip(f"the plugin's result cannot be sent: {exc}")))
        return _Outcome(result=body, frames=encoder.frames, blocks=encoder.blocks)

    def _finish_completed(self) -> None:
        while self._completions:
            req, outcome = self._completions.popleft()
            self._inflight -= 1
            self._requests.pop(req.key, None)
            if req.client is not None:
                req.client.requests -= 1
            if req.replied:  # a deadline answered it already
                if outcome.blocks:
                    req.client.release(outcome.blocks, mapped=False)
                if req.notify_inputs:
                    self._send(req.identity, {"v": PROTOCOL_VERSION, "op": "inputs_done", "id": req.id})
                continue
            req.replied = True
            if outcome.error is not None:
                sent = self._reply_error(req.identity, "submit", req.id, *outcome.error)
            else:
                sent = self._send(req.identity, {"v": PROTOCOL_VERSION, "op": "submit", "id": req.id, "ok": True,
                                                 "result": outcome.result}, outcome.frames)
            if not sent and outcome.blocks:
                req.client.release(outcome.blocks, mapped=False)

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.replied or req.future.done():
                continue  # answered, or its result is on the way: the result wins
            req.replied = True
            cancelled = self._cancellable and req.future.cancel()
            req.notify_inputs = req.holds_inputs and not cancelled
            state = "cancelled while queued" if cancelled else "still running; its result will be dropped"
            self._reply_error(req.identity, "submit", req.id, "DeadlineExceeded",
                              f"no result within timeout_s={req.timeout_s} (the request was {state})",
                              inputs_held=req.notify_inputs)

    def _housekeeping(self, now: float) -> None:
        idle = [c for c in self._clients.values()
                if (c.pid is not None and not _pid_alive(c.pid))
                or (c.requests == 0 and now - c.last_seen > self._client_timeout_s)]
        for client in idle:
            log.info("dropping the shared memory of a client that is gone or silent (pid %s, %.0f s)",
                     client.pid, now - client.last_seen)
            del self._clients[client.identity]
            self._run_ids.pop(client.run_id, None)
            client.close()
        if idle:
            sweep_stale()
        if self._rejected:
            log.warning("rejected %d malformed message(s) in the last %.0f s", self._rejected,
                        now - self._last_reject_log)
            self._rejected = 0
            self._last_reject_log = now

    def _note_rejected(self, exc: Exception) -> None:
        self._rejected += 1
        log.debug("malformed message: %s", exc)

    # -- sending (I/O thread only) ------------------------------------------------------

    def _reply_ok(self, identity: bytes, op: str, request_id: Any, result: Any) -> bool:
        return self._send(identity, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": True, "result": result})

    def _reply_error(self, identity: bytes, op: Any, request_id: Any, kind: str, message: str,
                     **extra: Any) -> bool:
        return self._send(identity, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": False,
                                     "error": {"type": kind, "message": message}, **extra})

    def _send(self, identity: bytes, header: dict[str, Any], frames: list[Any] = ()) -> bool:
        """Send without ever blocking; False if the peer is gone or does not read its replies."""
        try:
            self._router.send_multipart([identity, pack_header(header), *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.debug("dropped a reply to %r: its queue is full", identity)
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer left
            log.debug("dropped a reply to %r: %s", identity, exc)
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
