"""The broadcast ring (``runtime.link.broadcast``): every reader gets every message in the order
written, a full ring never blocks the writer, a message larger than a slot travels through an
arena, closing wakes and overtakes, and a killed writer leaves no name in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from runtime.core.errors import ProtocolError
from runtime.link.broadcast import CLOSED, FLAG_CONTROL, FLAG_SPILL, BroadcastReader, BroadcastWriter, spill_ref
from runtime.transport.arena import SHM_DIR, ShmArena, ShmMapper, new_run_id, sweep_stale

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ring():
    run_id = new_run_id()
    writer = BroadcastWriter(run_id, 2, slots=4, slot_bytes=64)
    readers = [BroadcastReader(run_id, writer.name, i, writer.nonce) for i in range(2)]
    writer.unlink()  # every reader mapped it
    yield writer, readers
    writer.close()
    for reader in readers:
        reader.close()


def take(reader: BroadcastReader, timeout: float | None = 5.0) -> tuple[int, int, bytes]:
    got = reader.recv(timeout)
    assert got is not None and got != CLOSED, got
    reader.release(got[0])
    return got


def test_every_reader_gets_every_message_in_order_across_wrap_arounds(ring):
    writer, readers = ring
    for n in range(10):  # 4 slots: wraps twice
        seq = writer.write(b"message %d" % n, FLAG_CONTROL if n % 3 == 0 else 0)
        assert seq == n + 1
        for reader in readers:
            assert take(reader) == (n + 1, FLAG_CONTROL if n % 3 == 0 else 0, b"message %d" % n)
    assert all(reader.recv(0) is None for reader in readers)
    assert writer.released() == 10


def test_a_full_ring_does_not_block_the_writer_and_the_rest_follows_in_order(ring):
    writer, readers = ring
    started = time.monotonic()
    seqs = [writer.write(b"%d" % n) for n in range(12)]  # nobody reads: 4 fit, 8 wait here
    assert time.monotonic() - started < 1.0 and seqs == list(range(1, 13))
    assert writer.queued == 8 and writer.flush() == 8
    got: dict[int, list[bytes]] = {0: [], 1: []}
    while len(got[1]) < 12:  # reader 0 runs ahead as far as the ring lets it, reader 1 lags
        while (message := readers[0].recv(0)) is not None:
            readers[0].release(message[0])
            got[0].append(message[2])
        assert len(got[0]) <= len(got[1]) + 4  # a slot is reused only once every reader released it
        got[1].append(take(readers[1])[2])
        writer.flush()  # what the engine does at each answer and each tick
    assert got[0] == got[1] == [b"%d" % n for n in range(12)]
    assert writer.queued == 0 and writer.released() == 12


def test_released_counts_what_every_reader_released(ring):
    writer, readers = ring
    for n in range(3):
        writer.write(b"x")
    for _ in range(3):
        take(readers[0])
    first = readers[1].recv(5)
    assert writer.released() == 0  # reader 1 holds message 1
    readers[1].release(first[0])
    assert writer.released() == 1
    with pytest.raises(ValueError, match="out of order"):
        readers[1].release(3)


def test_a_message_larger_than_a_slot_travels_through_an_arena(ring):
    writer, readers = ring
    large = bytes(range(256)) * 40
    with pytest.raises(ValueError, match="spill it"):
        writer.write(large)
    with ShmArena(new_run_id(), 1 << 16) as arena:
        mapper = ShmMapper(arena.run_id)
        for reader in readers:
            reader._mapper = mapper  # what a rank passes: its ShmMapper of the run
        segment, offset, view = arena.place(len(large))
        view[:] = large
        writer.write(spill_ref(segment, offset, len(large)), FLAG_SPILL)
        for reader in readers:
            assert take(reader) == (1, FLAG_SPILL, large)
        mapper.close()


def test_closing_wakes_a_waiting_reader_and_overtakes_queued_messages(ring):
    writer, readers = ring
    results = []
    waiter = threading.Thread(target=lambda: results.append(readers[0].recv(None)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # asleep in the ring, as an idle rank is
    writer.close()
    waiter.join(5)
    assert results == [CLOSED]
    assert readers[1].recv(None) == CLOSED and readers[1].recv(0) == CLOSED
    assert not os.path.exists(os.path.join(SHM_DIR, writer.name))


def test_closing_overtakes_messages_still_in_the_ring(ring):
    writer, readers = ring
    writer.write(b"a request")
    writer.write(b"shutdown", FLAG_CONTROL)
    writer.close()
    assert readers[0].recv(1) == CLOSED


def test_a_reader_times_out_and_refuses_a_ring_it_was_not_given(ring):
    writer, readers = ring
    started = time.monotonic()
    assert readers[0].recv(0.15) is None and time.monotonic() - started >= 0.14
    other = BroadcastWriter(writer.name.split("-")[1], 1, slots=2, slot_bytes=64)
    try:
        with pytest.raises(ProtocolError, match="not the broadcast ring"):
            BroadcastReader(writer.name.split("-")[1], other.name, 0, writer.nonce)
        with pytest.raises(ProtocolError, match="not the broadcast ring"):
            BroadcastReader(writer.name.split("-")[1], other.name, 1, other.nonce)  # no reader 1
    finally:
        other.close()


_OWNER = textwrap.dedent("""
    import sys, time
    from runtime.link.broadcast import BroadcastWriter
    writer = BroadcastWriter(sys.argv[1], 1, slots=4, slot_bytes=64)
    print(writer.name, writer.nonce.hex(), flush=True)
    if sys.stdin.readline().strip() == "ready":
        writer.unlink()
    writer.write(b"hello")
    print("written", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("ready", [True, False], ids=["after-ready", "before-ready"])
def test_no_segment_is_left_after_the_owner_is_sigkilled(ready):
    run_id = new_run_id()
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        name, nonce = owner.stdout.readline().split()
        reader = BroadcastReader(run_id, name, 0, bytes.fromhex(nonce))
        owner.stdin.write("ready\n" if ready else "wait\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "written"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        if not ready:  # killed before every reader was ready: the sweeps remove its name
            assert name in sweep_stale(f"phyrt-{run_id}-")
        assert [n for n in os.listdir(SHM_DIR) if n.startswith(f"phyrt-{run_id}-")] == []
        assert reader.recv(5)[2] == b"hello"  # the mapping outlives the name and the writer
        reader.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdin.close()
        owner.stdout.close()
