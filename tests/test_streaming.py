"""runtime.client.gate.ObservationGate with a client whose futures the test completes by hand."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from runtime.client.server_errors import DeadlineExceededError
from runtime.client.gate import ObservationGate

pytestmark = pytest.mark.timeout(30)

OBS_DIM = 4


class HandClient:
    """Records each submit; the test decides when and how each future ends.

    ``inflight_at_submit``: at each submit, how many of its futures were not done yet, the new
    one included. A gate increments its count before it submits and decrements it only after
    the future is done, so for a correct gate this never exceeds ``max_inflight``."""

    def __init__(self, refuse: BaseException | None = None) -> None:
        self.submitted: list[tuple[dict, float | None, Future]] = []
        self.refuse = refuse
        self.inflight_at_submit: list[int] = []
        self._lock = threading.Lock()

    def submit(self, payload: dict, timeout: float | None = None) -> Future:
        if self.refuse is not None:
            raise self.refuse
        future: Future = Future()
        with self._lock:
            self.submitted.append((payload, timeout, future))
            self.inflight_at_submit.append(sum(not f.done() for _, _, f in self.submitted))
        return future

    def pending(self) -> list[Future]:
        with self._lock:
            return [f for _, _, f in self.submitted if not f.done()]


def actions_for(obs: np.ndarray) -> dict:
    return {"actions": np.tile(obs.reshape(1, 1, -1), (1, 3, 1))}  # [1, horizon 3, OBS_DIM]


def make(client: HandClient, **kwargs) -> tuple[ObservationGate, list[np.ndarray], list[str]]:
    published: list[np.ndarray] = []
    warnings: list[str] = []
    gate = ObservationGate(client, published.append, obs_dim=OBS_DIM, warn=warnings.append, **kwargs)
    return gate, published, warnings


def balanced(counts: dict[str, int]) -> bool:
    ends = counts["published"] + counts["dropped_stale"] + counts["dropped_closed"] + counts["failed"]
    return (counts["received"] == counts["dropped_malformed"] + counts["dropped_busy"] + counts["submitted"]
            and counts["submitted"] == ends)


def test_an_observation_is_submitted_and_its_first_chunk_published():
    client = HandClient()
    gate, published, warnings = make(client, timeout_s=2.5)
    obs = np.arange(OBS_DIM, dtype=np.float64)  # any real numbers; sent as float32 [1, OBS_DIM]
    gate.offer(obs)
    payload, timeout, future = client.submitted[0]
    assert payload["obs"].shape == (1, OBS_DIM) and payload["obs"].dtype == np.float32 and timeout == 2.5
    future.set_result(actions_for(payload["obs"]))
    assert len(published) == 1 and published[0].shape == (3, OBS_DIM)
    np.testing.assert_array_equal(published[0][0], obs.astype(np.float32))
    assert warnings == [] and gate.counts["published"] == 1 and balanced(gate.counts)


def test_observations_beyond_max_inflight_are_dropped_not_queued():
    client = HandClient()
    gate, published, warnings = make(client, max_inflight=2)
    for i in range(5):
        gate.offer(np.full(OBS_DIM, i))
    assert len(client.submitted) == 2 and gate.counts["dropped_busy"] == 3
    assert "2 request(s) still in flight" in warnings[0]
    client.submitted[0][2].set_result(actions_for(client.submitted[0][0]["obs"]))
    gate.offer(np.full(OBS_DIM, 9))  # a slot is free again: the newest observation goes
    assert len(client.submitted) == 3 and client.submitted[2][0]["obs"][0, 0] == 9
    for _, _, future in client.submitted[1:]:
        future.set_result(actions_for(np.zeros(OBS_DIM)))
    assert len(published) == 3 and balanced(gate.counts)


@pytest.mark.parametrize("bad", [np.zeros(OBS_DIM - 1), np.zeros(OBS_DIM + 1), [0.0, np.nan, 0.0, 0.0],
                                 [np.inf] * OBS_DIM, np.zeros((2, OBS_DIM))])
def test_a_malformed_observation_is_counted_and_never_sent(bad):
    client = HandClient()
    gate, _, warnings = make(client)
    gate.offer(bad)
    assert client.submitted == [] and gate.counts["dropped_malformed"] == 1
    assert warnings and f"expected {OBS_DIM} finite floats" in warnings[0]


def test_an_answer_older_than_max_age_is_not_published():
    client = HandClient()
    gate, published, warnings = make(client, max_age_s=0.05)
    gate.offer(np.zeros(OBS_DIM))
    time.sleep(0.1)
    client.submitted[0][2].set_result(actions_for(np.zeros(OBS_DIM)))
    assert published == [] and gate.counts["dropped_stale"] == 1 and "after its observation" in warnings[0]
    assert balanced(gate.counts)


def test_failures_are_counted_and_the_gate_keeps_serving():
    client = HandClient()
    gate, published, warnings = make(client, max_inflight=3)
    for _ in range(3):
        gate.offer(np.zeros(OBS_DIM))
    client.submitted[0][2].set_exception(DeadlineExceededError("no answer within 5.0 s"))
    client.submitted[1][2].cancel()
    client.submitted[2][2].set_result({"no actions": 1})  # an answer of the wrong shape
    assert gate.counts["failed"] == 3 and published == []
    assert any("DeadlineExceededError" in w for w in warnings) and any("cancelled" in w for w in warnings)
    client.refuse = ConnectionError("server gone")
    gate.offer(np.zeros(OBS_DIM))
    assert gate.counts["failed"] == 4 and "could not submit" in warnings[-1] and balanced(gate.counts)


def test_after_close_nothing_is_taken_or_published():
    client = HandClient()
    gate, published, warnings = make(client)
    gate.offer(np.zeros(OBS_DIM))
    counts = gate.close()
    assert counts["submitted"] == 1 and gate.close() == counts  # idempotent
    gate.offer(np.zeros(OBS_DIM))
    client.submitted[0][2].set_result(actions_for(np.zeros(OBS_DIM)))
    assert published == [] and len(client.submitted) == 1
    assert gate.counts["dropped_closed"] == 1 and gate.counts["received"] == 1 and balanced(gate.counts)


def test_offers_from_many_threads_never_exceed_max_inflight():
    """8 threads offer at once and each answers the oldest pending request only after an offer of
    its own found the gate busy, so the gate reaches its limit before anything is answered and is
    kept there: the requests in flight at any submit never exceed it."""
    client = HandClient()
    gate, _, _ = make(client, max_inflight=2)
    start = threading.Barrier(8)

    def offer() -> None:
        start.wait()
        for _ in range(200):
            busy = gate.counts["dropped_busy"]
            gate.offer(np.zeros(OBS_DIM))
            if gate.counts["dropped_busy"] == busy:  # not (known to be) at the limit yet: answer nothing
                continue
            for future in client.pending()[:1]:
                try:
                    future.set_result(actions_for(np.zeros(OBS_DIM)))
                except Exception:  # another thread completed it first
                    pass

    threads = [threading.Thread(target=offer) for _ in range(8)]
    # switch threads often, so that offers and answers of different threads interleave (answering
    # after every offer instead, a thread could offer and answer in one slice and the limit was
    # sometimes never reached: 1 in flight at most, about 1 run in 20)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    for future in client.pending():  # the last ones, left by the threads
        future.set_result(actions_for(np.zeros(OBS_DIM)))
    most = max(client.inflight_at_submit)
    assert most <= gate.max_inflight, f"{most} requests in flight at once, max_inflight {gate.max_inflight}"
    assert most == gate.max_inflight and gate.counts["dropped_busy"] > 0  # the limit was reached and held
    assert gate.counts["received"] == 1600 and balanced(gate.counts) and gate.counts["submitted"] == len(client.submitted)
    assert client.pending() == []


@pytest.mark.parametrize("bad", [{"obs_dim": 0}, {"obs_dim": OBS_DIM, "max_inflight": 0},
                                 {"obs_dim": OBS_DIM, "max_age_s": 0}, {"obs_dim": OBS_DIM, "timeout_s": -1}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        ObservationGate(HandClient(), print, **bad)


def test_the_gate_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import runtime.client.gate, runtime.client; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
