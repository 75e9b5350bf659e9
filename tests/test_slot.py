"""runtime.core.futures.Slot: the light future of a caller that waits for its own answer.

First completion wins (a reader, a heartbeat and close() may race to complete one); a
thread sleeping on it wakes when another completes it; results, errors, cancellation
and time-outs come out of ``result`` as they do from a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from runtime.core.futures import Slot, resolve
from runtime.link.reader import ReaderRole
from tests.conftest import wait_until
from tests.test_reader import asleep

pytestmark = pytest.mark.timeout(30)


def test_the_first_completion_wins_and_the_others_are_no_ops():
    slot = Slot()
    assert not slot.done() and slot.set_result(1) and slot.done()
    assert not slot.set_result(2) and not slot.set_exception(ValueError()) and not slot.cancel()
    resolve(slot, 3)
    assert slot.result() == 1 and not slot.cancelled()


def test_errors_cancellation_and_time_outs_come_out_of_result():
    failed = Slot()
    resolve(failed, error=KeyError("gone"))
    with pytest.raises(KeyError, match="gone"):
        failed.result()
    cancelled = Slot()
    assert cancelled.cancel() and cancelled.cancelled() and cancelled.done()
    with pytest.raises(CancelledError):
        cancelled.result()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        Slot().result(timeout=0.05)
    assert time.monotonic() - started < 1.0


def test_a_thread_sleeping_on_it_wakes_when_another_completes_it():
    for _ in range(200):  # races between wait() making its event and the completion
        slot = Slot()
        done = threading.Event()
        threading.Thread(target=lambda s=slot: (s.wait(5.0), done.set())).start()
        threading.Thread(target=slot.set_result, args=(7,)).start()
        assert done.wait(5.0) and slot.result() == 7


def test_a_caller_that_is_not_the_reader_sleeps_on_its_slot_until_the_reader_completes_it():
    role = ReaderRole(lambda: False, lambda hand_on: None)
    slot, read, caller = Slot(), threading.Event(), threading.get_ident()
    saw_asleep = []

    def reader(future, deadline):  # holds the role until the other caller sleeps, then completes its slot
        read.set()
        saw_asleep.append(wait_until(lambda: asleep(caller), 5.0))
        slot.set_result("answer")
        future.set_result("own")  # and its own: the holder leaves

    holder = threading.Thread(target=role.wait, args=(Slot(), 10.0, reader))
    holder.start()
    assert read.wait(5.0)
    assert role.wait(slot, 10.0, lambda f, d: pytest.fail("a second reader")) and slot.result() == "answer"
    assert saw_asleep == [True]  # it slept on its slot (no polling, no spinning) until the reader woke it
    holder.join(5.0)
    assert not holder.is_alive()
    role.dispose()
