"""``Replies.own``: a lone caller answers its own plain reply at once, and leaves every other reply
to ``Replies.handle`` untouched (runtime.client.connection's ``exchange`` relies on both)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from runtime.client.errors import InvalidRequestError
from runtime.client.replies import Pending, Replies, complete
from runtime.core.futures import Slot
from runtime.link.client_protocol import PROTOCOL_VERSION, SUBMIT_REPLY_PREFIX
from runtime.transport.protocol import PayloadEncoder, pack_header

pytestmark = pytest.mark.timeout(30)

RESULT = {"actions": [0.5, -1.0], "note": "ok"}


def _waiting(request_id: int = 8) -> tuple[Replies, Slot]:
    replies = Replies("ipc:///nonexistent/phyrt.sock", "numpy", shm=False)
    slot = Slot()
    slot.request_id = request_id
    replies.add(request_id, Pending(slot, "submit", time.monotonic()))
    return replies, slot


def _reply(request_id: int = 8, result=RESULT, **extra) -> bytes:
    header = {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "ok": True, "result": result, **extra}
    return PayloadEncoder(copy=True).pack_message(header, "result")


def test_its_own_plain_reply_answers_the_slot_and_leaves_nothing_pending():
    replies, slot = _waiting()
    before = replies.last_heard
    assert replies.own(_reply(), slot)
    assert slot.done() and slot.result(0) == RESULT
    assert not replies.pending and not replies.awaiting()
    assert replies.last_heard >= before


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
def test_any_other_reply_is_left_to_handle_untouched(reply):
    replies, slot = _waiting()
    assert not replies.own(reply, slot)
    assert not slot.done() and 8 in replies.pending


def test_a_reply_carrying_a_tensor_is_left_to_handle_which_answers_it():
    replies, slot = _waiting()
    encoder = PayloadEncoder(copy=True)
    head = encoder.pack_message({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": True,
                                 "result": {"x": np.arange(4, dtype=np.float32)}}, "result")
    assert not replies.own(head, slot) and 8 in replies.pending
    done: list = []
    replies.handle(head, encoder.frames, done)
    complete(done)
    assert np.array_equal(slot.result(0)["x"], np.arange(4, dtype=np.float32))


def test_a_reply_to_a_request_failed_here_already_goes_to_handle():
    replies, slot = _waiting()
    with replies.lock:
        del replies.pending[8]  # as a heartbeat time-out does: handle() frees what the server held
    assert not replies.own(_reply(), slot)
    assert not slot.done()


def test_an_error_reply_declined_by_own_fails_the_call_through_handle():
    replies, slot = _waiting()
    head = pack_header({"v": PROTOCOL_VERSION, "op": "submit", "id": 8, "ok": False,
                        "error": {"type": "InvalidRequest", "message": "bad"}})
    assert not replies.own(head, slot)
    done: list = []
    replies.handle(head, [], done)
    complete(done)
    with pytest.raises(InvalidRequestError, match="^bad$"):
        slot.result(0)
