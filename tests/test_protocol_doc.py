"""docs/protocol.md's examples are the bytes the Python client and server send and read, and its
tables are the messages ``runtime.link.client_protocol`` defines.

Each ```` ```golden NAME ```` block of docs/protocol.md is parsed here (hex, ``#`` comments, ``frame N:``
lines) and checked both ways: the encoders of ``runtime.client`` and ``runtime.serving`` produce
exactly those frames, and the decoders read them back as the values the page states. A server
(``MessageHandler`` over a stand-in engine) answers the page's submit with the page's reply.

The page's op table (section 3: each op's fields, required or "(optional)", and the keys of its
reply's result) and its reply table (section 4) are parsed too, and must equal ``REQUESTS`` and
``REPLIES``; the builders of both sides make exactly those fields.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from runtime.client.server_errors import InvalidRequestError
from runtime.client import server_errors
from runtime.link.awaited import Awaited, Request
from runtime.link.current_session import CurrentSession
from runtime.link import client_protocol as cp
from runtime.link.client_protocol import (HEADER_FIELDS, HEARTBEAT, PROTOCOL_VERSION, SUBMIT_REPLY_PREFIX,
                                          control_header, submit_message)
from runtime.link.listener import Responder
from runtime.serving.handlers import MessageHandler
from runtime.transport.protocol import PayloadEncoder, pack_header

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
    args = SimpleNamespace(plugin="stand-in")
    replicas: list = []
    ranks_per_replica = 1

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
    handler = MessageHandler(engine, Responder("ipc:///nonexistent/phyrt.sock", send))
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
    replies = Awaited("ipc:///nonexistent/phyrt.sock", "numpy", CurrentSession(False, 0, list.append), server_errors)
    future: Future = Future()
    replies.table.add(Request(8, future, "submit", time.monotonic()))
    done: list = []
    replies.handle(frames[0], frames[1:], done)
    replies.complete(done)
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


# --------------------------------------------------------------------------- the page's tables


def _section(number: int) -> str:
    text = DOC.read_text()
    match = re.search(rf"^## {number}\. [^\n]*\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"docs/protocol.md has no section {number}"
    return match.group(1)


def _rows(section: str, head: str) -> dict[str, list[str]]:
    """The rows of the table in ``section`` whose head's first cell is ``head``: name -> the other cells."""
    tables: list[list[list[str]]] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            tables.append([])
        elif not re.fullmatch(r"\|[-|: ]+\|", line.strip()):  # (not the line under the head)
            tables[-1].append([cell.strip() for cell in line.strip().strip("|").split("|")])
    [table] = [t for t in tables if t and t[0][0] == head]
    return {cells[0].strip("`"): cells[1:] for cells in table[1:]}


def _fields(cell: str) -> tuple[set[str], set[str]]:
    """A fields cell, "`name`: text; `other` (optional): text; ...": (required, optional)."""
    found = re.findall(r"(?:^|; )`(\w+)`( \(optional\))?:", cell)
    assert found or cell == "none", f"no fields read from {cell!r}"
    return {name for name, optional in found if not optional}, {name for name, optional in found if optional}


def _result_keys(cell: str) -> set[str] | None:
    """The keys of a reply ``result`` cell that states a map (a literal, or "a map: `a`, `b`, ..."); else None."""
    if cell.startswith("`{"):
        return set(re.findall(r'"(\w+)"', cell.split("`")[1]))
    if cell.startswith("a map:"):  # the names at the top level, before the server's own extras
        return set(re.findall(r"`(\w+)`", re.sub(r"\([^()]*\)", "", cell.split("and launch extras")[0])))
    return None


def test_the_pages_op_table_is_the_ops_client_protocol_defines():
    rows = _rows(_section(3), "op")
    assert list(rows) == [op.name for op in cp.REQUESTS] == list(cp.OPS)
    page = {name: (*_fields(fields), _result_keys(result)) for name, (fields, result) in rows.items()}
    code = {op.name: (set(op.required), set(op.optional), None if op.result is None else set(op.result))
            for op in cp.REQUESTS}
    assert page == code
    assert cp.OP_FIELDS == {name: required | optional for name, (required, optional, _) in page.items()}


def test_the_pages_reply_table_is_the_replies_client_protocol_defines():
    rows = _rows(_section(4), "message")
    page = {name: _fields(cells[0]) for name, cells in rows.items()}
    assert page == {reply.name: (set(reply.required), set(reply.optional)) for reply in cp.REPLIES}


def _keys(data: bytes) -> set[str]:
    return set(msgpack.unpackb(data))


def _op(name: str) -> cp.Op:
    return next(op for op in cp.REQUESTS if op.name == name)


def test_the_clients_headers_carry_their_ops_fields():
    for op in ("ping", "info"):
        assert _keys(control_header(op, 1)) == HEADER_FIELDS
    assert _keys(HEARTBEAT) == HEADER_FIELDS
    assert _keys(control_header("cancel", "cancel", target=3)) == HEADER_FIELDS | _op("cancel").fields
    assert _keys(cp.register_header("abcd", [], pid=5)) == HEADER_FIELDS | _op("register").fields
    assert _keys(cp.register_header("abcd", ["s"])) == HEADER_FIELDS | set(_op("register").required)
    assert _keys(cp.release_header([["s", 0]])) == HEADER_FIELDS | _op("release").fields
    for stream in (False, True):
        op = _op("stream" if stream else "submit")
        least = cp.plain_submit(1, None, False, {"x": 1}, stream=stream)
        most = submit_message(PayloadEncoder(copy=True), 1, 2.0, True, {"obs": OBS}, [["s", 0]], stream, -3)
        assert msgpack.unpackb(least)["op"] == op.name and _keys(least) == HEADER_FIELDS | set(op.required)
        assert _keys(most) == HEADER_FIELDS | op.fields
        # priority 0, the default, is not sent: the header is the one it was before the field existed
        assert cp.plain_submit(1, None, False, {"x": 1}, stream, 0) == least
        assert msgpack.unpackb(cp.plain_submit(1, None, False, {"x": 1}, stream, 7))["priority"] == 7


def test_the_servers_replies_carry_their_fields(server):
    replies = {reply.name: reply for reply in cp.REPLIES}

    def check(name: str, header: dict, optional: bool) -> None:
        reply = replies[name]
        assert set(header) == set(reply.required) | (set(reply.optional) if optional else set()), (name, header)

    check("result", cp.ok_reply("ping", 1, {}), False)
    check("result", cp.submit_reply(1, None), False)
    assert pack_header(cp.submit_reply(8, 0)).startswith(SUBMIT_REPLY_PREFIX)
    check("error", cp.error_reply("submit", 1, "Overloaded", "m"), False)
    check("error", cp.error_reply("submit", 1, "DeadlineExceeded", "m", inputs_held=True), True)
    check("chunk", cp.stream_chunk(1, {}, 0), False)
    check("chunk", cp.stream_end(1, {}, 1), True)
    check("inputs_done", cp.inputs_done(1), False)
    assert set(cp.cancel_result(True, "d")) == set(_op("cancel").result)
    assert set(cp.ping_result("id", 1.0)) == set(_op("ping").result)
    assert set(cp.register_result("a", "b", [])) == set(_op("register").result)
    handler, _, _ = server
    assert set(handler.info()) == set(_op("info").result)  # no launch extras here
