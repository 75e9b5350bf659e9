"""docs/protocol.md's examples are the bytes the Python client and server send and read.

Each ```` ```golden NAME ```` block of docs/protocol.md is parsed here (hex, ``#`` comments, ``frame N:``
lines) and checked both ways: the encoders of ``runtime.client`` and ``runtime.serving`` produce
exactly those frames, and the decoders read them back as the values the page states. A server
(``MessageHandler`` over a stand-in engine) answers the page's submit with the page's reply.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from runtime.client.errors import InvalidRequestError
from runtime.client.headers import HEARTBEAT, control_header, submit_message
from runtime.client.replies import Pending, Replies, complete
from runtime.serving.handlers import MessageHandler
from runtime.transport.protocol import PROTOCOL_VERSION, SUBMIT_REPLY_PREFIX, PayloadEncoder, pack_header

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
OBS = np.array([[0.0, 0.5, 1.0, -2.0]], dtype=np.float32)
RESULT = {"actions": np.array([[1, 2], [3, 4]], dtype=np.int64), "note": "ok"}
VERSION_MESSAGE = "protocol version 2 is not 1, the one this side speaks"


def golden() -> dict[str, list[bytes]]:
    """Every golden block of docs/protocol.md: name -> frames."""
    blocks = {}
    for name, body in re.findall(r"^```golden ([\w-]+)\n(.*?)^```", DOC.read_text(), re.M | re.S):
        frames: list[list[str]] = [[]]
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if re.fullmatch(r"frame \d+:", line):
                if int(line[6:-1]) != len(frames) - 1 or (frames[-1] or len(frames) > 1):
                    frames.append([])
                continue
            frames[-1] += line.split()
        assert name not in blocks, f"two golden blocks named {name}"
        blocks[name] = [bytes.fromhex("".join(tokens)) for tokens in frames]
    return blocks


GOLDEN = golden()


def test_the_page_has_every_example_this_file_checks():
    assert set(GOLDEN) == {"heartbeat", "ping-request", "cancel-request", "submit-request", "submit-reply",
                           "error-reply", "version-reply"}
    assert [len(frames) for frames in GOLDEN.values()] == [1, 1, 1, 2, 2, 1, 1]


def test_the_clients_control_headers_are_the_pages_bytes():
    assert GOLDEN["heartbeat"] == [HEARTBEAT]
    assert GOLDEN["ping-request"] == [control_header("ping", 7)]
    assert GOLDEN["cancel-request"] == [control_header("cancel", 9, target=8)]


def test_the_clients_submit_is_the_pages_bytes():
    encoder = PayloadEncoder(copy=True)
    assert [submit_message(encoder, 8, 2.5, False, {"obs": OBS}), *encoder.frames] == GOLDEN["submit-request"]
    encoder = PayloadEncoder(copy=True)
    packed = encoder.pack({"obs": OBS})
    # the one-step encoder of the other ops gives the same bytes
    assert pack_header({"v": 1, "op": "submit", "id": 8, "timeout_s": 2.5, "payload": packed}) == \
        GOLDEN["submit-request"][0]


class StandInEngine:
    """What ``MessageHandler`` needs of an engine: records payloads, answers RESULT at once."""

    mode = "local"

    def __init__(self) -> None:
        self.payloads: list[Any] = []

    def inline_runner(self) -> None:
        return None

    def submit(self, payload: Any) -> Future:
        self.payloads.append(payload)
        future: Future = Future()
        future.set_result(RESULT)
        return future


@pytest.fixture
def server():
    """A MessageHandler over StandInEngine; ``sent`` gets (identity, header bytes, frames) of each reply."""
    sent: list[tuple[bytes, bytes, list[bytes]]] = []

    def send(identity: bytes, header: dict | bytes, frames: Any = ()) -> bool:
        packed = header if isinstance(header, bytes) else pack_header(header)  # bytes: a submit's packed reply
        sent.append((identity, packed, [bytes(memoryview(f)) for f in frames]))
        return True

    engine = StandInEngine()
    handler = MessageHandler(engine, "ipc:///nonexistent/phyrt.sock", send)
    try:
        yield handler, engine, sent
    finally:
        handler.close()


def test_a_server_reads_the_pages_submit_and_sends_the_pages_reply(server):
    handler, engine, sent = server
    handler.handle(b"peer", list(GOLDEN["submit-request"]))
    assert len(engine.payloads) == 1 and set(engine.payloads[0]) == {"obs"}
    obs = engine.payloads[0]["obs"]
    assert obs.dtype == torch.float32 and torch.equal(obs, torch.from_numpy(OBS))
    assert sent == [(b"peer", GOLDEN["submit-reply"][0], GOLDEN["submit-reply"][1:])]


def test_a_server_answers_an_unknown_version_with_the_pages_reply(server):
    handler, engine, sent = server
    handler.handle(b"peer", [msgpack.packb({"v": 2, "op": "ping", "id": 7})])
    assert sent == [(b"peer", GOLDEN["version-reply"][0], [])] and engine.payloads == []
    assert msgpack.unpackb(GOLDEN["version-reply"][0])["error"]["message"] == VERSION_MESSAGE


def test_the_servers_error_reply_is_the_pages_bytes(server):
    handler, _, sent = server
    handler.replies.error(b"peer", "submit", 8, "InvalidRequest", "bad")
    assert sent == [(b"peer", GOLDEN["error-reply"][0], [])]


def _client_reads(frames: list[bytes]) -> Future:
    """The Python client's reply handling, given the reply to its submit 8."""
    replies = Replies("ipc:///nonexistent/phyrt.sock", "numpy", shm=False)
    future: Future = Future()
    replies.add(8, Pending(future, "submit", time.monotonic()))
    done: list = []
    replies.handle(frames[0], frames[1:], done)
    complete(done)
    return future


def test_the_client_reads_the_pages_replies():
    result = _client_reads(GOLDEN["submit-reply"]).result(0)
    assert set(result) == {"actions", "note"} and result["note"] == "ok"
    assert result["actions"].dtype == np.int64 and np.array_equal(result["actions"], RESULT["actions"])
    with pytest.raises(InvalidRequestError, match="^bad$"):
        _client_reads(GOLDEN["error-reply"]).result(0)


@pytest.mark.parametrize("request_id", [0, 7, 2**40, "job-1", "x" * 40])
def test_a_submit_reply_packed_in_one_go_is_the_header_packed(request_id):
    """A successful submit's reply, packed with its result in one msgpack call (the server's
    ``PayloadEncoder.pack_message``), is the bytes ``pack_header`` makes of the same header,
    and starts as the client expects (``SUBMIT_REPLY_PREFIX``)."""
    value = {"actions": [1.5, -2], "note": "ok"}
    reply = PayloadEncoder(copy=False).pack_message(
        {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "ok": True, "result": value}, "result")
    result = PayloadEncoder(copy=False).pack(value, "result")
    assert reply == pack_header({"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "ok": True, "result": result})
    assert reply.startswith(SUBMIT_REPLY_PREFIX)
