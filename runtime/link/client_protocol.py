"""The client<->server messages, defined once: the ops and their fields, the replies, and the
functions that build and check them (docs/protocol.md sections 3 and 4; tests/test_protocol_doc.py
checks that page's tables against ``REQUESTS`` and ``REPLIES``, and its examples against the bytes).

Torch-free; imports only ``runtime.core`` (errors, priority) and ``runtime.transport.protocol`` (the
frame codec under it: headers, tensor references, ``pack_header``) of the project.

    client (runtime.client)                           server (runtime.serving)
    plain_submit / submit_message -> header bytes ->  HEADER_FIELDS | OP_FIELDS[op]: others refused
    control_header, register_header, release_header   submit_options, register_fields,
    HEARTBEAT (the same bytes every time)               release_blocks, no_frames: each op's checks
                                                  <-  ok_reply, error_reply, submit_reply,
    SUBMIT_REPLY_PREFIX: a plain submit's reply         stream_chunk, stream_end, inputs_done
      is recognised before msgpack reads it             (cancel_result, ping_result, register_result)

Every header is ``{"v": PROTOCOL_VERSION, "op": OP, "id": ID, ...}`` (``ID``: an int in [0, 2**64)
or a str of 1 to 128 characters, chosen by the client; ``protocol.is_request_id``):

    submit    payload, [timeout_s], [shm_results], [release],    -> the plugin's result
              [priority] (an int, larger is sooner; 0 is never sent)
    stream    the fields of a submit                             -> chunks, then a final chunk
    cancel    target: the id of a submit or a stream            -> {cancelled, detail}
    ping      -                                                  -> {server_id, time}
    info      -                                                  -> plugin, topology, versions, ...
    register  run_id, segments, [pid]   (ipc:// only)            -> {run_id, result_run_id, mapped}
    release   blocks: [[segment, offset], ...]                   (no reply)
    lane      segment, offset, fd   (after register; ipc://)    -> {pid, fd, lane}

Replies: ``{"v", "op", "id", "ok": true, "result"}`` or ``{"v", "op", "id", "ok": false, "error":
{"type": T, "message": M}}`` (T one of ``ERROR_TYPES``; ``inputs_held`` when a deadline fired while
the plugin still read the request's shared memory); a stream's chunks ``{..., "ok": true, "result",
"seq"}`` and its last one with ``"final": true``; unasked, ``{"v", "op": "inputs_done", "id"}``.

Speed: nothing here is made per message. The builders are plain functions that return a dict
(a reply, for ``ServerSocket.send``) or the packed bytes (a request): a submit's header and a
plain payload go out in one msgpack call (``pack_plain``); the server packs a submit's whole
reply in one call too, in ``SUBMIT_REPLY_PREFIX``'s field order, which the client reads
without msgpack. ``REQUESTS`` and ``REPLIES`` are read once, at import (``OP_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from runtime.core.errors import ProtocolError
from runtime.core.priority import check_priority
from runtime.transport.protocol import PROTOCOL_VERSION, PayloadEncoder, pack_header, pack_plain

__all__ = ["PROTOCOL_VERSION", "Op", "Reply", "REQUESTS", "REPLIES", "OPS", "OP_FIELDS", "HEADER_FIELDS",
           "ERROR_TYPES", "SUBMIT_REPLY_PREFIX", "HEARTBEAT", "submit_message", "plain_submit", "control_header",
           "register_header", "lane_header", "release_header", "submit_options", "register_fields", "lane_fields",
           "release_blocks", "no_frames", "ok_reply", "error_reply", "submit_reply", "stream_chunk", "stream_end",
           "inputs_done", "cancel_result", "ping_result", "register_result", "lane_result"]


@dataclass(frozen=True, slots=True)
class Op:
    """A request op: the fields its header carries besides ``HEADER_FIELDS``; ``result``, the
    keys of its reply's result map (None: the plugin's value, or no reply); ``frames``: whether
    tensor frames may follow the header; ``replied``: whether a reply is sent."""

    name: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    result: tuple[str, ...] | None = None
    frames: bool = False
    replied: bool = True

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(self.required + self.optional)


@dataclass(frozen=True, slots=True)
class Reply:
    """A message the server sends: every field of its header (``v``, ``op`` and ``id`` included)."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


_SUBMIT_FIELDS = (("payload",), ("timeout_s", "shm_results", "release", "priority"))
#: what ``info`` answers (and the server's launch extras besides)
INFO_RESULT = ("server_id", "address", "plugin", "mode", "replica_count", "ranks_per_replica", "replicas",
               "inflight", "max_inflight", "accepting", "shm", "versions")
REQUESTS = (
    Op("submit", *_SUBMIT_FIELDS, frames=True),
    Op("stream", *_SUBMIT_FIELDS, frames=True),
    Op("cancel", ("target",), result=("cancelled", "detail")),
    Op("ping", result=("server_id", "time")),
    Op("info", result=INFO_RESULT),
    Op("register", ("run_id", "segments"), ("pid",), result=("run_id", "result_run_id", "mapped")),
    Op("release", ("blocks",), replied=False),
    Op("lane", ("segment", "offset", "fd"), result=("pid", "fd", "lane")),
)
REPLIES = (
    Reply("result", ("v", "op", "id", "ok", "result")),
    Reply("error", ("v", "op", "id", "ok", "error"), ("inputs_held",)),
    Reply("chunk", ("v", "op", "id", "ok", "result", "seq"), ("final",)),
    Reply("inputs_done", ("v", "op", "id")),
)
#: every op, in the order above (the metrics' labels)
OPS = tuple(op.name for op in REQUESTS)
#: the fields each op may carry besides HEADER_FIELDS; anything else is refused
OP_FIELDS = {op.name: op.fields for op in REQUESTS}
HEADER_FIELDS = frozenset({"v", "op", "id"})
#: the ``error.type`` of an error reply (the clients map them to exceptions: ``runtime.client.server_errors``)
ERROR_TYPES = ("InvalidRequest", "DeadlineExceeded", "Overloaded", "EngineUnavailable", "PluginError", "Cancelled")

#: how every successful submit's reply starts, up to its id: a map of five fields, ``v``, ``op``
#: ("submit"), ``id``, ``ok`` (True) and ``result``, in that order (``submit_reply`` packs it so)
SUBMIT_REPLY_PREFIX = b"\x85" + b"".join(map(msgpack.packb, ("v", PROTOCOL_VERSION, "op", "submit", "id")))


# --------------------------------------------------------------------------- requests (the client)


def submit_message(encoder: PayloadEncoder, request_id: int, timeout: float | None, shm_results: bool,
                   payload: Any, release: list[list[Any]] | None = None, stream: bool = False,
                   priority: int = 0) -> bytes:
    """A submit (a ``stream`` op with ``stream``) whose ``payload`` ``encoder`` encodes (its
    tensors go to the encoder's frames or shared memory); TypeError or ValueError, naming
    the path, for a payload the wire cannot carry. ``priority`` (checked by the caller,
    ``runtime.core.priority``) goes in the header unless it is 0.

    Exactly the bytes ``pack_header`` makes of the same header with the payload
    ``encoder.pack``ed (tests/test_client.py checks it), in one msgpack call."""
    return encoder.pack_message(_submit_header(request_id, timeout, shm_results, payload, release, stream,
                                               priority))


def plain_submit(request_id: int, timeout: float | None, shm_results: bool, payload: Any,
                 stream: bool = False, priority: int = 0) -> bytes | None:
    """``submit_message``'s bytes where ``payload`` holds plain values only (``pack_plain``); None
    otherwise (``submit_message`` then encodes it, or names what it refuses)."""
    return pack_plain(_submit_header(request_id, timeout, shm_results, payload, None, stream, priority), "payload")


def _submit_header(request_id: int, timeout: float | None, shm_results: bool, payload: Any,
                   release: list[list[Any]] | None, stream: bool, priority: int) -> dict[str, Any]:
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "stream" if stream else "submit", "id": request_id}
    if timeout is not None:
        header["timeout_s"] = float(timeout)
    if shm_results:
        header["shm_results"] = True
    if release:
        header["release"] = release
    if priority:
        header["priority"] = priority
    header["payload"] = payload
    return header


def control_header(op: str, request_id: int | str, **fields: Any) -> bytes:
    """A ``ping``, ``info`` or ``cancel`` (``target=``): the id is a request id, or a name whose
    reply needs no future ("heartbeat", "cancel")."""
    return pack_header({"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})


def register_header(run_id: str, segments: list[str], **extra: Any) -> bytes:
    """Registers a shm session (``pid=``) or new segments of its arena with the server."""
    return pack_header({"v": PROTOCOL_VERSION, "op": "register", "id": "register", "run_id": run_id,
                        "segments": segments, **extra})


def lane_header(segment: str, offset: int, fd: int) -> bytes:
    """Asks for a lane (``runtime.link.lane``) over the block at ``segment``/``offset`` of a registered
    segment; ``fd``: the client's reply pipe (its write end, in the client's pid of ``register``)."""
    return pack_header({"v": PROTOCOL_VERSION, "op": "lane", "id": "lane", "segment": segment, "offset": offset,
                        "fd": fd})


def lane_fields(header: dict[str, Any]) -> tuple[str, int, int]:
    """A lane's ``segment``, ``offset`` and ``fd``, checked for type and range."""
    segment, offset, fd = header.get("segment"), header.get("offset"), header.get("fd")
    if not isinstance(segment, str) or not all(_is_int(v) and 0 <= v < 2**40 for v in (offset, fd)):
        raise ProtocolError("a lane needs a segment name, an offset and a descriptor, as an int each")
    return segment, offset, fd


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def release_header(blocks: list[list[Any]]) -> bytes:
    return pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release", "blocks": blocks})


#: the client's heartbeat, the same bytes every time
HEARTBEAT = control_header("ping", "heartbeat")


# --------------------------------------------------------------------------- checks (the server)


def no_frames(frames: list) -> None:
    if frames:
        raise ProtocolError(f"this op takes no tensor frames, got {len(frames)}")


def submit_options(header: dict[str, Any]) -> tuple[float | None, bool, int]:
    """A submit's ``timeout_s``, ``shm_results`` and ``priority`` (0 when absent); ProtocolError if it
    has no payload or bad values (a priority as ``runtime.core.priority.check_priority`` takes it)."""
    if "payload" not in header:
        raise ProtocolError("submit needs a payload")
    timeout_s = header.get("timeout_s")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not 0 < timeout_s <= 1e7):
        raise ProtocolError(f"timeout_s must be a number of seconds in (0, 1e7], got {timeout_s!r}"[:300])
    shm_results = header.get("shm_results", False)
    if not isinstance(shm_results, bool):
        raise ProtocolError(f"shm_results must be a bool, got {shm_results!r}"[:300])
    priority = 0
    if "priority" in header:  # absent: 0, which clients never send
        try:
            priority = check_priority(header["priority"])
        except (TypeError, ValueError) as exc:
            raise ProtocolError(str(exc)) from None
    return timeout_s, shm_results, priority


def register_fields(header: dict[str, Any]) -> tuple[Any, list[str], int | None]:
    """A register's ``run_id`` (checked by ``runtime.link.peer_shm.PeerSessions``), ``segments`` and ``pid``."""
    run_id, segments, pid = header.get("run_id"), header.get("segments"), header.get("pid")
    if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments):
        raise ProtocolError("segments must be a list of segment names")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31):
        raise ProtocolError(f"pid must be a process id, got {pid!r}"[:300])
    return run_id, segments, pid


def release_blocks(blocks: Any) -> list[tuple[str, int]] | None:
    """The well-formed ``[segment, offset]`` pairs of a release's ``blocks`` (or a submit's
    ``release``); None if ``blocks`` is not a list of at most 4096."""
    if not isinstance(blocks, list) or len(blocks) > 4096:
        return None
    return [(b[0], b[1]) for b in blocks if isinstance(b, list) and len(b) == 2
            and isinstance(b[0], str) and isinstance(b[1], int) and not isinstance(b[1], bool)]


# --------------------------------------------------------------------------- replies (the server)
# Each returns the header as a dict, for ``ServerSocket.send`` (or, for a submit's reply, for
# ``pack_plain``/``PayloadEncoder.pack_message``): the dict is what would be built anyway.


def ok_reply(op: str, request_id: Any, result: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": True, "result": result}


def error_reply(op: Any, request_id: Any, kind: str, message: str, inputs_held: bool | None = None) -> dict[str, Any]:
    """``op`` and ``request_id`` None when the message could not be read; ``inputs_held`` (a
    deadline's reply): whether the plugin may still read the request's shared-memory inputs."""
    header = {"v": PROTOCOL_VERSION, "op": op, "id": request_id, "ok": False,
              "error": {"type": kind, "message": message}}
    if inputs_held is not None:
        header["inputs_held"] = inputs_held
    return header


def submit_reply(request_id: Any, result: Any) -> dict[str, Any]:
    """A submit's success, in ``SUBMIT_REPLY_PREFIX``'s field order."""
    return {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "ok": True, "result": result}


def stream_chunk(request_id: Any, result: Any, seq: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "op": "stream", "id": request_id, "ok": True, "result": result, "seq": seq}


def stream_end(request_id: Any, result: Any, seq: int) -> dict[str, Any]:
    """A stream's last chunk (an error reply ends a stream too)."""
    return {"v": PROTOCOL_VERSION, "op": "stream", "id": request_id, "ok": True, "result": result, "seq": seq,
            "final": True}


def inputs_done(request_id: Any) -> dict[str, Any]:
    """Unasked: the server no longer reads the shared-memory inputs of ``request_id`` (whose
    error reply said ``inputs_held``)."""
    return {"v": PROTOCOL_VERSION, "op": "inputs_done", "id": request_id}


def cancel_result(cancelled: bool, detail: str) -> dict[str, Any]:
    return {"cancelled": cancelled, "detail": detail}


def ping_result(server_id: str, now: float) -> dict[str, Any]:
    return {"server_id": server_id, "time": now}


def lane_result(pid: int, fd: int, lane: int) -> dict[str, Any]:
    return {"pid": pid, "fd": fd, "lane": lane}


def register_result(run_id: str, result_run_id: str, mapped: list[str]) -> dict[str, Any]:
    return {"run_id": run_id, "result_run_id": result_run_id, "mapped": mapped}
