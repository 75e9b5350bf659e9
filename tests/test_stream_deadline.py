"""What a stream's ``timeout`` means (issue 32, item 5), with a plugin whose pace the test sets.

The rule (``runtime.core.chunk_stream``): ``timeout`` bounds the whole stream from its submission;
what arrived before the deadline (chunks, and the end of a stream that ended in time) is
handed out even when read after it; ``next()`` raises only where it would wait past the
deadline (or reach a chunk that came after it), and the request is then cancelled in the
runner. ``tests.stream_plugins:Paced`` makes a chunk only when the test releases it, so
nothing here depends on how fast the machine is: a stream either ended long before its
deadline, or its producer is held until well after it.

Paths: ``Engine.stream`` (inline), ``Client.stream`` and ``AsyncClient.stream`` through a
``Server`` over the same inline engine; and the client's stream fed by hand.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import pytest

from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
from runtime.client import AsyncClient, Client
from runtime.client.server_errors import DeadlineExceededError
from runtime.serving.server import Server
from tests.conftest import wait_until
from tests.stream_plugins import Pace

pytestmark = pytest.mark.timeout(60)

#: a deadline that a stream of a few released chunks meets with a wide margin on any machine
IN_TIME = 1.0
#: a deadline a held producer passes (the test holds it until well after)
STALL = 0.4
#: how long after the deadline the error may come: "promptly", on a busy 2-core machine
PROMPT = 0.5


def chunks(n: int) -> list[dict]:
    return [{"items": [i]} for i in range(n - 1)] + [{"items": [n - 1], "done": True}]


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineArgs(plugin="tests.stream_plugins:Paced",
                               config=EngineConfig(device=DeviceConfig(target="cpu"))))  # about time, not devices
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """The inline engine behind a server (the plugin's paces live in this process)."""
    server = Server(engine, f"ipc://{tmp_path_factory.mktemp('deadline')}/s.sock").start()
    yield server
    server.close()


def sleep_past(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.1)


def keeps_serving(stream_of) -> None:
    """A new stream of the same engine runs to its end (``stream_of(request)`` iterates it)."""
    pace = Pace()
    pace.release(3)
    assert stream_of(pace.request(3)) == chunks(3)


# -- Engine.stream ------------------------------------------------------------------------------------


def test_engine_stream_that_ended_in_time_is_read_whole_after_its_deadline(engine):
    pace = Pace()
    start = time.monotonic()
    stream = engine.stream(pace.request(4), timeout=IN_TIME)
    pace.release(4)
    assert wait_until(stream.call.future.done, IN_TIME / 2, 0.005), "4 chunks were not made in time"
    assert time.monotonic() < start + IN_TIME
    sleep_past(start + IN_TIME)
    assert list(stream) == chunks(4)  # no TimeoutError: every chunk and the end came in time
    assert not pace.cancelled.is_set()


def test_engine_stream_whose_producer_stalls_raises_at_the_deadline_and_is_cancelled(engine):
    pace = Pace()
    start = time.monotonic()
    stream = engine.stream(pace.request(5), timeout=STALL)
    pace.release(2)
    assert [next(stream), next(stream)] == chunks(5)[:2]
    with pytest.raises(TimeoutError, match="did not end within"):
        next(stream)
    raised = time.monotonic() - start
    assert STALL - 0.01 <= raised <= STALL + PROMPT, raised
    assert pace.cancelled.wait(5)  # the runner was told, and let go of the request
    assert wait_until(lambda: engine.replicas[0].inflight == 0, 5)
    pace.release(3)  # too late: nothing more comes out of the stream
    assert list(stream) == []
    keeps_serving(lambda request: list(engine.stream(request, timeout=30)))


def test_engine_stream_a_chunk_after_the_deadline_cancels_it_while_nobody_reads(engine):
    """Read late: the chunk that came in time is handed out, the one made after the deadline is
    not, and the request was cancelled as soon as that late chunk came (not when read)."""
    pace = Pace()
    start = time.monotonic()
    stream = engine.stream(pace.request(10), timeout=STALL)
    pace.release(1)
    assert wait_until(lambda: len(pace.made) == 1, STALL / 2, 0.005)
    sleep_past(start + STALL)
    pace.release(1)  # the producer goes on past the deadline: its next chunk ends the stream
    assert pace.cancelled.wait(5)
    assert wait_until(lambda: engine.replicas[0].inflight == 0, 5)
    assert next(stream) == {"items": [0]}
    with pytest.raises(TimeoutError):
        next(stream)
    keeps_serving(lambda request: list(engine.stream(request, timeout=30)))


# -- Client.stream and AsyncClient.stream through a server -------------------------------------------------


def test_client_stream_that_ended_in_time_is_read_whole_after_its_deadline(served):
    pace = Pace()
    with Client(served.address) as client:
        start = time.monotonic()
        stream = client.stream(pace.request(4), timeout=IN_TIME)
        pace.release(4)
        assert wait_until(lambda: len(pace.made) == 4 and served.inflight == 0, IN_TIME / 2, 0.005)
        sleep_past(start + IN_TIME)
        assert list(stream) == chunks(4)
    assert not pace.cancelled.is_set()


def test_client_stream_whose_producer_stalls_raises_at_the_deadline_and_is_cancelled(served):
    pace = Pace()
    with Client(served.address) as client:
        start = time.monotonic()
        stream = client.stream(pace.request(5), timeout=STALL)
        pace.release(2)
        assert [next(stream), next(stream)] == chunks(5)[:2]
        with pytest.raises(DeadlineExceededError, match="did not end within"):
            next(stream)
        raised = time.monotonic() - start
        assert STALL - 0.01 <= raised <= STALL + PROMPT, raised
        assert pace.cancelled.wait(5)
        assert wait_until(lambda: served.inflight == 0, 5)
        keeps_serving(lambda request: list(client.stream(request, timeout=30)))


def test_async_client_stream_that_ended_in_time_is_read_whole_after_its_deadline(served):
    pace = Pace()

    async def main() -> list:
        async with AsyncClient(served.address) as client:
            start = time.monotonic()
            stream = client.stream(pace.request(4), timeout=IN_TIME)
            pace.release(4)
            while not (len(pace.made) == 4 and served.inflight == 0):
                assert time.monotonic() < start + IN_TIME / 2, "4 chunks were not made in time"
                await asyncio.sleep(0.005)
            await asyncio.sleep(start + IN_TIME + 0.1 - time.monotonic())
            return [chunk async for chunk in stream]

    assert asyncio.run(main()) == chunks(4)
    assert not pace.cancelled.is_set()


def test_async_client_stream_whose_producer_stalls_raises_at_the_deadline_and_is_cancelled(served):
    pace = Pace()

    async def main() -> tuple[list, float, list]:
        async with AsyncClient(served.address) as client:
            start = time.monotonic()
            stream = client.stream(pace.request(5), timeout=STALL)
            pace.release(2)
            got = [await stream.__anext__(), await stream.__anext__()]
            with pytest.raises(DeadlineExceededError, match="did not end within"):
                await stream.__anext__()
            raised = time.monotonic() - start
            after = Pace()
            after.release(3)
            return got, raised, [c async for c in client.stream(after.request(3), timeout=30)]

    got, raised, after = asyncio.run(main())
    assert got == chunks(5)[:2] and after == chunks(3)
    assert STALL - 0.01 <= raised <= STALL + PROMPT, raised
    assert pace.cancelled.wait(5)
    assert wait_until(lambda: served.inflight == 0, 5)


# -- the client's stream, fed by hand -------------------------------------------------------------------------


def test_client_stream_fed_by_hand_keeps_what_came_in_time_and_cancels_at_a_late_chunk():
    from runtime.client.client import ClientStream

    cancels: list[str] = []
    ended = ClientStream("ipc:///nonexistent", 0.2)
    future: Future = Future()
    ended.start(future, lambda: cancels.append("ended"))
    ended.state.deliver({"x": 0})
    future.set_result({"x": 1})
    late = ClientStream("ipc:///nonexistent", 0.2)
    late.start(Future(), lambda: cancels.append("late"))
    late.state.deliver({"x": 0})
    time.sleep(0.3)
    assert list(ended) == [{"x": 0}, {"x": 1}]
    late.state.deliver({"x": 1})  # made after the deadline: dropped, and the request cancelled
    assert cancels == ["late"]
    assert next(late) == {"x": 0}
    with pytest.raises(DeadlineExceededError):
        next(late)
    assert cancels == ["late"]  # once
