"""runtime.link.reader.ReaderRole: who reads, handing the reading on, waking, closing.

A fake channel stands in for a socket: answers are written to a pipe as the future's
index, and ``read`` polls that pipe and the role's wake-up fd, as the client and the
supervisor poll their sockets.
"""

from __future__ import annotations

import gc
import os
import select
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from runtime.link.reader import ReaderRole

pytestmark = pytest.mark.timeout(30)


class Channel:
    """Answers arrive on a pipe; whoever reads completes the futures and records its thread."""

    def __init__(self) -> None:
        self.futures: dict[int, Future] = {}
        self.readers: list[str] = []  # the thread name of every read answer
        self.fallback_wakes = self.leaves = 0
        self.fallback = threading.Event()
        self.role = ReaderRole(self.awaiting, self.on_leave)
        self._r, self._w = os.pipe()
        self._count = threading.Lock()
        self.inside = self.most_inside = 0  # threads inside read() at once

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
        self.role.dispose()

    def awaiting(self) -> bool:
        return any(not f.done() for f in self.futures.values())

    def on_leave(self, hand_on: bool) -> None:
        self.leaves += 1
        if hand_on:  # answers due and nobody reads: the fallback reader is woken
            self.fallback_wakes += 1
            self.fallback.set()

    def submit(self) -> tuple[int, Future]:
        index = len(self.futures)
        future: Future = Future()
        self.futures[index] = future
        return index, future

    def answer(self, index: int) -> None:
        os.write(self._w, bytes((index,)))

    def read(self, future: Future, deadline: float | None) -> None:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self._read(future, deadline)
        finally:
            with self._count:
                self.inside -= 1

    def _read(self, future: Future, deadline: float | None) -> None:
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        poller.register(self.role.fd, select.POLLIN)
        while not future.done() and not self.role.closed:
            wait_ms = 1000 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            if self.role.fd in events:
                self.role.drain()
                return  # woken: let the caller look again
            if self._r in events:
                index = os.read(self._r, 1)[0]
                self.readers.append(threading.current_thread().name)
                self.futures[index].set_result(index)
            elif deadline is not None and time.monotonic() >= deadline:
                return


@pytest.fixture
def channel():
    ch = Channel()
    yield ch
    ch.close()


def _waiter(channel: Channel, future: Future, name: str, timeout: float | None = 10.0) -> threading.Thread:
    thread = threading.Thread(target=channel.role.wait, args=(future, timeout, channel.read), name=name)
    thread.start()
    return thread


def asleep(ident: int | None) -> bool:
    """Whether thread ``ident`` is inside ``ReaderRole.wait`` and blocked there in a ``threading``
    wait (an Event's or a Condition's, as ``Slot.wait`` and ``concurrent.futures.wait`` are), rather
    than polling, spinning or reading."""
    # with the collector off: on Python 3.11 a collection that starts inside _current_frames (which
    # holds the interpreter's thread-list lock) can deadlock (CPython gh-106883; it hung a full run)
    collecting = gc.isenabled()
    gc.disable()
    try:
        frame = sys._current_frames().get(ident)
    finally:
        if collecting:
            gc.enable()
    if frame is None or frame.f_code.co_name != "wait" or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None and frame.f_code is not ReaderRole.wait.__code__:
        frame = frame.f_back
    return frame is not None


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the state the test waits for never came"
        time.sleep(0.001)


def test_a_lone_waiter_reads_its_own_answer_and_wakes_nobody(channel):
    index, future = channel.submit()
    threading.Timer(0.05, channel.answer, (index,)).start()
    assert channel.role.wait(future, 5.0, channel.read)
    assert future.result() == index
    assert channel.readers == [threading.current_thread().name]
    assert channel.fallback_wakes == 0
    assert channel.role.holder is None


def test_a_second_waiter_sleeps_and_the_reader_completes_its_future(channel):
    a, fa = channel.submit()
    b, fb = channel.submit()
    first = _waiter(channel, fa, "waiter-a")
    _until(lambda: channel.role.holder == first.ident)
    second = _waiter(channel, fb, "waiter-b")
    _until(lambda: asleep(second.ident))  # b sleeps on its future: it neither reads nor polls
    assert channel.role.holder == first.ident
    channel.answer(b)  # b's answer comes first: a reads it for b
    _until(fb.done)
    second.join(5)
    assert not second.is_alive() and fb.result() == b  # woken by a's completing its future
    channel.answer(a)
    first.join(5)
    assert not first.is_alive()
    assert channel.readers == ["waiter-a", "waiter-a"]
    assert channel.fallback_wakes == 0  # nothing was due when a left


def test_a_reader_that_leaves_with_answers_due_hands_the_reading_to_the_fallback(channel):
    a, fa = channel.submit()
    b, fb = channel.submit()
    first = _waiter(channel, fa, "waiter-a")
    _until(lambda: channel.role.holder == first.ident)
    second = _waiter(channel, fb, "waiter-b")
    channel.answer(a)
    first.join(5)
    assert channel.fallback.wait(5)  # b's answer is still due: the fallback is woken to read it
    assert channel.fallback_wakes == 1
    assert channel.role.holder is None
    # the fallback (here: this thread) takes the role and reads b's answer for the sleeping waiter
    assert channel.role.take()
    channel.answer(b)
    channel.read(fb, time.monotonic() + 5)
    channel.role.leave(hand_on=False)
    second.join(5)
    assert fb.result() == b
    assert channel.readers == ["waiter-a", threading.current_thread().name]


def test_a_wait_that_times_out_returns_false_and_gives_the_role_up(channel):
    _, future = channel.submit()
    started = time.monotonic()
    assert channel.role.wait(future, 0.1, channel.read) is False
    assert 0.1 <= time.monotonic() - started < 2.0
    assert not future.done()
    assert channel.role.holder is None
    assert channel.fallback_wakes == 1  # the answer is still due: handed on


def test_a_callback_of_the_reader_that_waits_reads_nested_and_keeps_the_role(channel):
    a, fa = channel.submit()
    b, fb = channel.submit()
    seen = {}

    def on_a(_future):  # runs in the reader's thread, inside read()
        seen["holder_inside"] = channel.role.held_here()
        channel.answer(b)
        seen["nested"] = channel.role.wait(fb, 5.0, channel.read)
        seen["holder_after_nested"] = channel.role.held_here()

    fa.add_done_callback(on_a)
    channel.answer(a)
    assert channel.role.wait(fa, 5.0, channel.read)
    assert seen == {"holder_inside": True, "nested": True, "holder_after_nested": True}
    assert fb.result() == b
    assert channel.role.holder is None


def test_a_role_taken_before_the_send_is_kept_and_given_up_by_the_wait(channel):
    """As ``WorkerSupervisor.start_call`` does: the caller takes the free role, then sends."""
    owned = channel.role.take_free()
    assert owned == 1
    assert not channel.role.take_free()  # held (by this very thread: its wait re-enters)
    assert channel.role.held_here()
    # another thread cannot take a held role
    other = threading.Thread(target=lambda: seen.append(channel.role.take()))
    seen: list[bool] = []
    other.start()
    other.join(5)
    assert seen == [0]
    # the future failed before its waiter came: the wait gives the role up all the same
    _, future = channel.submit()
    future.set_exception(RuntimeError("failed elsewhere"))
    assert channel.role.wait(future, 1.0, channel.read, owned)
    assert channel.role.holder is None
    assert channel.leaves == 1


def test_a_wait_nested_in_a_link_threads_turn_leaves_the_role_to_that_thread(channel):
    """A link thread takes the role for a turn (``take_if_due``) and completes futures; a done
    callback that waits for another answer reads there, and must not give the role up under the
    turn that holds it (only the take that answered 1 gives it back)."""
    a, fa = channel.submit()
    b, fb = channel.submit()
    seen = {}

    def on_a(_future):  # on the "link thread", inside its turn
        channel.answer(b)
        seen["nested"] = channel.role.wait(fb, 5.0, channel.read)
        seen["still_held"] = channel.role.held_here()

    fa.add_done_callback(on_a)
    turn = {}

    def link_turn():
        turn["took"] = channel.role.take_if_due()
        channel.answer(a)
        channel.read(fa, time.monotonic() + 5)
        turn["held_at_end"] = channel.role.held_here()
        channel.role.leave(hand_on=False)

    thread = threading.Thread(target=link_turn, name="link")
    thread.start()
    thread.join(10)
    assert turn == {"took": True, "held_at_end": True}
    assert seen == {"nested": True, "still_held": True}
    assert channel.readers == ["link", "link"] and fb.result() == b
    assert channel.role.holder is None and channel.leaves == 1


def test_take_if_due_takes_only_a_free_role_with_answers_due(channel):
    assert channel.role.take_if_due() is False  # nothing due
    channel.submit()
    assert channel.role.take_if_due() is True
    assert channel.role.take_if_due() is True  # held here already
    assert channel.role.leave(hand_on=False) and channel.role.holder is None
    channel.role.close()
    assert channel.role.take_if_due() is False  # closed


def test_a_waiter_holding_a_closed_role_gives_it_up_and_sleeps_until_its_future_fails(channel):
    """``close()`` comes after a caller took the role before sending (as ``start_call`` does): its
    wait reads nothing, gives the role up (so the closer's ``wait_released`` returns) and sleeps on
    its future, which the closer fails."""
    _, future = channel.submit()
    took, closed, result = threading.Event(), threading.Event(), {}

    def caller():
        owned = channel.role.take_free()
        took.set()
        closed.wait(5)
        result["ok"] = channel.role.wait(future, 5.0, lambda f, d: pytest.fail("read after close"), owned)

    thread = threading.Thread(target=caller)
    thread.start()
    assert took.wait(5) and channel.role.holder == thread.ident
    channel.role.close()
    closed.set()
    assert channel.role.wait_released(5.0)
    _until(lambda: asleep(thread.ident))
    future.set_exception(RuntimeError("closed"))
    thread.join(5)
    assert result == {"ok": True} and channel.role.holder is None

def test_wake_interrupts_the_reader_and_close_waits_for_it_to_leave(channel):
    _, future = channel.submit()
    reader = _waiter(channel, future, "waiter", timeout=None)
    _until(lambda: channel.role.holder == reader.ident)
    assert not channel.role.wait_released(0.05)  # still reading
    channel.role.close()  # wakes it; it sees closed and cannot take the role again
    future.set_exception(RuntimeError("closed"))
    assert channel.role.wait_released(5.0)
    reader.join(5)
    assert not reader.is_alive()
    assert not channel.role.take()


def test_many_waiters_each_get_their_own_answer_with_one_reader_at_a_time(channel):
    subs = [channel.submit() for _ in range(20)]
    threads = [_waiter(channel, f, f"w{i}") for i, f in subs]
    for i, _ in reversed(subs):
        channel.answer(i)
    deadline = time.monotonic() + 10
    for thread in threads:  # a waiter left with answers due hands on to the fallback: play it here
        while thread.is_alive() and time.monotonic() < deadline:
            if channel.fallback.is_set() and channel.role.take():
                channel.fallback.clear()
                pending = [f for f in channel.futures.values() if not f.done()]
                if pending:
                    channel.read(pending[0], time.monotonic() + 0.05)
                channel.role.leave(hand_on=False)
            thread.join(0.01)
    assert [f.result(0) for _, f in subs] == [i for i, _ in subs]
    assert len(channel.readers) == 20
    assert channel.role.holder is None
    assert channel.most_inside == 1  # never two readers at once
