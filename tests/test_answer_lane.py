"""A local replica's answer lane (``runtime.link.lane.AnswerReader``/``answer_writer``): the output
rank's "done" goes through a ring in the replica's broadcast segment and a pipe, past libzmq; a
stream's answers, an answer that does not fit and every answer with ``PHYRT_LANE=0`` keep the
ctl socket. Nothing is lost either way, and the lane leaves no descriptor behind."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from runtime.link.lane import ANSWERS_BYTES, MAX_UNREAD_REPLIES, RING_BYTES, AnswerReader, answer_writer
from tests.conftest import close_engine, start_engine, supervisor_of, tp_parallel

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def _module_end(no_leaks_at_module_end):
    yield


def _pair() -> tuple[AnswerReader, object]:
    area = memoryview(bytearray(ANSWERS_BYTES))
    reader = AnswerReader(area)
    return reader, answer_writer(area, os.getpid(), reader.writer)


def test_answers_come_out_in_order_across_wraps_and_a_refused_one_says_so():
    reader, writer = _pair()
    try:
        sent = []
        for i in range(3000):  # ~10 rings' worth: it wraps many times
            frame = bytes([i % 251]) * (i % 900 + 1)
            assert writer.put((frame,))
            sent.append(frame)
            if i % 7 == 6:
                assert reader.take() == sent
                sent = []
        assert reader.take() == sent
        assert reader.take() == []
        assert not writer.put((b"x" * (RING_BYTES // 4),))  # too large: the rank sends it by ZeroMQ
        for _ in range(MAX_UNREAD_REPLIES):
            assert writer.put((b"a",))
        assert not writer.put((b"a",))  # as many unread as the pipe always holds: by ZeroMQ
        assert len(reader.take()) == MAX_UNREAD_REPLIES
    finally:
        writer.close()
        reader.close()


def test_an_engine_gone_makes_the_rank_s_put_fail_instead_of_blocking():
    reader, writer = _pair()
    reader.close()  # every read end of the pipe closed: EPIPE
    assert not writer.put((b"done",))
    assert writer.fd == -1  # closed for good: the rank's answers go by ZeroMQ from here


def test_a_corrupt_ring_is_an_error_not_a_read_past_the_area():
    area = memoryview(bytearray(ANSWERS_BYTES))
    reader = AnswerReader(area)
    try:
        struct.pack_into("<QQ", area, 16, 64, 1)  # one message of 64 bytes "written"...
        struct.pack_into("<II", area, 64, 60, 1000)  # ... claiming 1000 parts
        os.write(reader.writer, b"\x01")
        with pytest.raises(ValueError):
            reader.take()
    finally:
        reader.close()


# --------------------------------------------------------------------------- served


def _answers_put(engine) -> int:
    """Answers rank 0 put in its replica's answer ring (the ring's own counter, in shared memory)."""
    area = supervisor_of(engine)._replicas[0].ring.answers
    return int.from_bytes(area[24:32], "little")


@pytest.fixture(scope="module")
def tp2():
    engine = start_engine("tests.plugins:TPProbe", parallel=tp_parallel(2))
    yield engine
    close_engine(engine)


def test_a_tp2_replica_answers_by_its_lane_and_what_does_not_fit_by_zeromq(tp2):
    before = _answers_put(tp2)
    for i in range(50):
        assert tp2.step({"op": "echo", "x": {"i": i}}) == {"i": i}
    futures = [tp2.submit({"op": "echo", "x": j}) for j in range(300)]  # more than a window in flight
    assert [f.result(30) for f in futures] == list(range(300))
    assert _answers_put(tp2) - before == 350
    # two inline tensors of 60 KiB each: an answer past the lane's largest message goes by ZeroMQ
    big = {"a": torch.arange(15 << 10, dtype=torch.float32), "b": torch.ones(15 << 10)}
    before = _answers_put(tp2)
    got = tp2.step({"op": "echo", "x": big})
    assert torch.equal(got["a"], big["a"]) and torch.equal(got["b"], big["b"])
    assert _answers_put(tp2) == before


def test_a_stream_s_chunks_and_its_end_keep_their_order_on_zeromq():
    engine = start_engine("tests.stream_plugins:Ticker", parallel=tp_parallel(2))
    try:
        before = _answers_put(engine)
        for _ in range(5):
            chunks = list(engine.stream({"n": 6}))
            assert chunks == [{"items": [k]} for k in range(5)] + [{"items": [5], "done": True}]
        assert _answers_put(engine) == before  # a stream's end never goes by the lane
        assert engine.step({"n": 3}) == {"items": [0, 1, 2], "done": True}
        assert _answers_put(engine) == before + 1  # a plain request of the same plugin does
    finally:
        close_engine(engine)


def test_without_the_lane_every_answer_goes_by_zeromq_and_no_descriptor_is_left(monkeypatch):
    fds = set(os.listdir("/proc/self/fd"))
    engine = start_engine("tests.plugins:Echo")
    try:
        assert supervisor_of(engine)._replicas[0].answers is not None
        assert [engine.step({"k": k}) for k in range(20)] == [{"k": k} for k in range(20)]
    finally:
        close_engine(engine)
    monkeypatch.setenv("PHYRT_LANE", "0")
    engine = start_engine("tests.plugins:Echo")
    try:
        assert supervisor_of(engine)._replicas[0].answers is None
        assert [engine.step({"k": k}) for k in range(20)] == [{"k": k} for k in range(20)]
    finally:
        close_engine(engine)
    assert set(os.listdir("/proc/self/fd")) <= fds  # the pipes went with their engines
