"""The supervisor's heartbeats, without ranks: ``runtime.link.rank_answers.Answers.take_beats`` on a
real hb ROUTER fed by fake ranks' DEALERs. A beat is HB {id: count}; rank 0's may carry its runner's
info (kept per replica, ``Replica.info``, which the executor reads); anything else fails the replica."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from runtime.link import rank_protocol as rp
from runtime.link.rank_answers import Answers
from runtime.transport import wire
from supervisor.processes import RankState
from supervisor.replica import Replica

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def beats(tmp_path: Any):
    ctx = zmq.Context()
    hb = ctx.socket(zmq.ROUTER)
    hb.bind(f"ipc://{tmp_path}/hb")
    replica = Replica(0, 3, None, None)
    replica.ranks = [RankState(0, rank, rank, None) for rank in range(2)]
    failed: list[str] = []
    answers = Answers(None, (replica,), None, lambda group, reason, *rest: failed.append(reason))
    ranks = []
    for rank in range(2):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"h-0-{rank}".encode())
        sock.connect(f"ipc://{tmp_path}/hb")
        ranks.append(sock)

    def send(rank: int, *frames: bytes) -> None:
        ranks[rank].send_multipart(list(frames))
        deadline = time.monotonic() + 5
        while not hb.poll(10) and time.monotonic() < deadline:
            pass
        answers.take_beats(hb)

    yield replica, send, failed
    ctx.destroy(linger=0)


def test_a_plain_beat_and_rank_0s_beat_with_info_are_taken(beats):
    replica, send, failed = beats
    send(1, wire.pack_message(rp.HB, 0))
    send(0, wire.pack_message(rp.HB, 0))
    assert replica.info is None and failed == []
    send(0, wire.pack_message(rp.HB, 1, info={"requests": 2}))
    assert replica.info == {"requests": 2}
    send(0, wire.pack_message(rp.HB, 2))  # info rides only when it changed: the last one stays
    assert replica.info == {"requests": 2} and failed == []
    assert all(r.last_beat > 0 for r in replica.ranks)


@pytest.mark.parametrize("rank,frames", [
    (0, [b"garbage"]),
    (0, [wire.pack_message(rp.HB, 0), b"more"]),
    (0, [wire.pack_message(rp.DONE, 0, ok=True)]),
    (0, [wire.pack_message(rp.HB, 0, info=[1, 2])]),
    (1, [wire.pack_message(rp.HB, 0, info={"x": 1})]),  # only rank 0 reports info
])
def test_a_malformed_beat_fails_the_replica(beats, rank, frames):
    replica, send, failed = beats
    send(rank, *frames)
    assert len(failed) == 1 and f"rank {rank} sent a malformed heartbeat" in failed[0], failed
    assert replica.info is None
