"""The headers a client sends, as msgpack bytes: ``submit_header`` built by hand, the others by ``pack_header``.

Imports only ``runtime.transport.protocol`` of the project (and msgpack); no torch.

    Client.submit/call   submit_header(id, timeout, shm_results, payload, release)  --> server
    Client.ping/info/cancel, heartbeats, a submit future cancelled: control_header(op, id, ...)
    a new shm segment / session: register_header(run_id, segments)
    collected result blocks with no submit to ride on: release_header(blocks)

Invariant: ``submit_header`` returns exactly the bytes ``pack_header`` makes of the same
header (tests/test_client.py checks it), a few microseconds sooner: the server cannot
tell them apart. Its field order is the order of ``pack_header``'s dict.
"""

from __future__ import annotations

from typing import Any

import msgpack

from runtime.transport.protocol import PROTOCOL_VERSION, pack_header

#: a submit header up to its id, and its other fields, as msgpack
_SUBMIT_HEAD = b"\xa1v" + msgpack.packb(PROTOCOL_VERSION) + b"\xa2op\xa6submit\xa2id"
_STREAM_HEAD = b"\xa1v" + msgpack.packb(PROTOCOL_VERSION) + b"\xa2op\xa6stream\xa2id"
_TIMEOUT_KEY = msgpack.packb("timeout_s")
_SHM_RESULTS = msgpack.packb("shm_results") + b"\xc3"
_PAYLOAD_KEY = msgpack.packb("payload")
_RELEASE_KEY = msgpack.packb("release")


def submit_header(request_id: int, timeout: float | None, shm_results: bool, payload: bytes,
                  release: list[list[Any]] | None = None, stream: bool = False) -> bytes:
    """``pack_header`` of a submit (a ``stream`` op with ``stream``) whose payload is already
    packed (``Packed.data``)."""
    fields = 4 + (timeout is not None) + shm_results + bool(release)
    parts = [bytes((0x80 | fields,)), _STREAM_HEAD if stream else _SUBMIT_HEAD, msgpack.packb(request_id)]
    if timeout is not None:
        parts += (_TIMEOUT_KEY, msgpack.packb(float(timeout)))
    if shm_results:
        parts.append(_SHM_RESULTS)
    if release:
        parts += (_RELEASE_KEY, msgpack.packb(release))
    parts += (_PAYLOAD_KEY, payload)
    return b"".join(parts)


def control_header(op: str, request_id: int | str, **fields: Any) -> bytes:
    """A ``ping``, ``info`` or ``cancel`` (``target=``): the id is a request id, or a name whose
    reply needs no future ("heartbeat", "cancel")."""
    return pack_header({"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})


def register_header(run_id: str, segments: list[str], **extra: Any) -> bytes:
    """Registers a shm session (``pid=``) or new segments of its arena with the server."""
    return pack_header({"v": PROTOCOL_VERSION, "op": "register", "id": "register", "run_id": run_id,
                        "segments": segments, **extra})


def release_header(blocks: list[list[Any]]) -> bytes:
    return pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release", "blocks": blocks})


#: the I/O thread's heartbeat, the same bytes every time
HEARTBEAT = control_header("ping", "heartbeat")
