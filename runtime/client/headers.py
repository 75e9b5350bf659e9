"""The headers a client sends, as msgpack bytes: a submit with its payload in one go, the others by ``pack_header``.

Imports only ``runtime.transport.protocol`` of the project; no torch.

    Client.submit/call   plain_submit(id, timeout, shm_results, payload): plain values, no encoder  --> server
                         submit_message(encoder, id, timeout, shm_results, payload, release): the rest
    Client.ping/info/cancel, heartbeats, a submit future cancelled: control_header(op, id, ...)
    a new shm segment / session: register_header(run_id, segments)
    collected result blocks with no submit to ride on: release_header(blocks)

Invariant: ``submit_message`` returns exactly the bytes ``pack_header`` makes of the same
header with the payload ``encoder.pack``ed (tests/test_client.py checks it): one msgpack
call packs the header and a plain payload together (``PayloadEncoder.pack_message``).
"""

from __future__ import annotations

from typing import Any

from runtime.transport.protocol import PROTOCOL_VERSION, PayloadEncoder, pack_header, pack_plain


def submit_message(encoder: PayloadEncoder, request_id: int, timeout: float | None, shm_results: bool,
                   payload: Any, release: list[list[Any]] | None = None, stream: bool = False) -> bytes:
    """A submit (a ``stream`` op with ``stream``) whose ``payload`` ``encoder`` encodes (its
    tensors go to the encoder's frames or shared memory); TypeError or ValueError, naming
    the path, for a payload the wire cannot carry."""
    return encoder.pack_message(_submit_header(request_id, timeout, shm_results, payload, release, stream))


def plain_submit(request_id: int, timeout: float | None, shm_results: bool, payload: Any,
                 stream: bool = False) -> bytes | None:
    """``submit_message``'s bytes where ``payload`` holds plain values only (``pack_plain``); None
    otherwise (``submit_message`` then encodes it, or names what it refuses)."""
    return pack_plain(_submit_header(request_id, timeout, shm_results, payload, None, stream), "payload")


def _submit_header(request_id: int, timeout: float | None, shm_results: bool, payload: Any,
                   release: list[list[Any]] | None, stream: bool) -> dict[str, Any]:
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "stream" if stream else "submit", "id": request_id}
    if timeout is not None:
        header["timeout_s"] = float(timeout)
    if shm_results:
        header["shm_results"] = True
    if release:
        header["release"] = release
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


def release_header(blocks: list[list[Any]]) -> bytes:
    return pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release", "blocks": blocks})


#: the I/O thread's heartbeat, the same bytes every time
HEARTBEAT = control_header("ping", "heartbeat")
