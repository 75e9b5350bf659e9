"""``Dealer._own``: a lone caller answers its own plain reply at once, and leaves every other reply
to ``Awaited.handle`` untouched (runtime.link.dealer's ``read`` relies on both)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from runtime.client import server_errors
from runtime.client.server_errors import InvalidRequestError
from runtime.core.futures import Slot
from runtime.link.awaited import Request
from runtime.link.link import Link, LinkOptions
from runtime.link.link_thread import LinkThread
from runtime.link.client_protocol import PROTOCOL_VERSION, SUBMIT_REPLY_PREFIX
from runtime.transport.protocol import PayloadEncoder, pack_header

pytestmark = pytest.mark.timeout(30)

RESULT = {"actions": [0.5, -1.0], "note": "ok"}


class _Own:
    """A link (to no server) with one submit in flight, answered by hand: ``own`` and ``handle``."""

    def __init__(self, link: Link) -> None:
        self.link, self.awaited = link, link.awaited
        self.pending = link.awaited.table.table
        self.last_heard = link.awaited.last_heard

    def own(self, head: bytes, slot: Slot) -> bool:
        return self.link.dealer._own(head, slot, leave=False)

    def handle(self, head: bytes, frames: list, done: list) -> None:
        self.awaited.handle(head, frames, done)


@pytest.fixture
def _waiting():
    links: list[Link] = []

    def waiting(request_id: int = 8) -> tuple[_Own, Slot]:
        links.append(Link("ipc:///nonexistent/phyrt.sock", LinkOptions(), server_errors, LinkThread("test-link")))
        slot = Slot()
        slot.request_id = request_id
        links[-1].awaited.table.add(Request(request_id, slot, "submit", time.monotonic()))
        return _Own(links[-1]), slot

    yield waiting
    for link in links:
        link.close()


def _reply(request_id: int = 8, result=RESULT, **extra) -> bytes:
    header = {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "ok": True, "result": result, **extra}
    return PayloadEncoder(copy=True).pack_message(header, "result")


def test_its_own_plain_reply_answers_the_slot_and_leaves_nothing_pending(_waiting):
    replies, slot = _waiting()
    before = replies.last_heard
    assert replies.own(_reply(), slot)
    assert slot.done() and slot.result(0) == RESULT
    assert not replies.pending and not replies.awaited.table.table
    assert replies.awaited.last_heard >= before


@pytest.mark.parametrize("reply", [
    pack_header({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": False,
                 "error": {"type": "InvalidRequest", "message": "bad"}}),  # an error
    _reply(inputs_held=True),  # more than the five fields
    _reply(request_id=9),  # another request's
    SUBMIT_REPLY_PREFIX + b"\x08\xa2ok",  # cut short
    pack_header({"v": PROTOCOL_VERSION, "op": "ping", "id": 8, "ok": True, "result": {}}),
    pack_header({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": True,
                 "result": {"t": msgpack.Timestamp(1, 0)}}),  # handle() refuses Timestamps
    SUBMIT_REPLY_PREFIX + b"\x08\xa2ok\xc3\xa2ok\xc3",  # five fields, a key twice, no result
], ids=["error", "inputs-held", "other-id", "truncated", "not-a-submit", "timestamp", "duplicate-key"])
def test_any_other_reply_is_left_to_handle_untouched(_waiting, reply):
    replies, slot = _waiting()
    assert not replies.own(reply, slot)
    assert not slot.done() and 8 in replies.pending


def test_a_reply_carrying_a_tensor_is_left_to_handle_which_answers_it(_waiting):
    replies, slot = _waiting()
    encoder = PayloadEncoder(copy=True)
    head = encoder.pack_message({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": True,
                                 "result": {"x": np.arange(4, dtype=np.float32)}}, "result")
    assert not replies.own(head, slot) and 8 in replies.pending
    done: list = []
    replies.handle(head, encoder.frames, done)
    replies.awaited.complete(done)
    assert np.array_equal(slot.result(0)["x"], np.arange(4, dtype=np.float32))


def test_a_reply_to_a_request_failed_here_already_goes_to_handle(_waiting):
    replies, slot = _waiting()
    assert replies.awaited.table.claim(8) is not None  # as a heartbeat time-out does: handle() frees what the server held
    assert not replies.own(_reply(), slot)
    assert not slot.done()


def test_an_error_reply_declined_by_own_fails_the_call_through_handle(_waiting):
    replies, slot = _waiting()
    head = pack_header({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": False,
                        "error": {"type": "InvalidRequest", "message": "bad"}})
    assert not replies.own(head, slot)
    done: list = []
    replies.handle(head, [], done)
    replies.awaited.complete(done)
    with pytest.raises(InvalidRequestError, match="^bad$"):
        slot.result(0)
