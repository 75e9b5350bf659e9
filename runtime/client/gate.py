"""ObservationGate: a robot loop's bridge to a phyrt client that never waits and never acts late.

A sensor callback hands each observation to ``offer`` and returns at once; the
gate submits it unless ``max_inflight`` requests are already running (then the
observation is dropped: the next one will be fresher than a queued one would be),
and when the answer arrives it calls ``publish(actions)`` from the client's I/O
thread unless the answer is older than ``max_age_s`` (counted from ``offer``),
the request failed, or the gate was closed. Every observation ends in exactly one
of the counters::

    received = dropped_malformed + dropped_busy + submitted
    submitted = published + dropped_stale + dropped_closed + failed   (once nothing is in flight)

Torch-free (numpy only), so it runs in a ROS Python next to ``runtime.client``;
the ROS nodes in ``examples/`` are thin shells around it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np


class ObservationGate:
    """Submits ``{"obs": [1, obs_dim]}`` requests and publishes ``result["actions"][0]``."""

    def __init__(self, client: Any, publish: Callable[[np.ndarray], None], *, obs_dim: int,
                 max_inflight: int = 1, max_age_s: float = 1.0, timeout_s: float = 5.0,
                 warn: Callable[[str], None] | None = None) -> None:
        if not isinstance(obs_dim, int) or obs_dim < 1:
            raise ValueError(f"obs_dim must be a positive int, got {obs_dim!r}")
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if not (max_age_s > 0 and timeout_s > 0):
            raise ValueError(f"max_age_s and timeout_s must be > 0, got {max_age_s} and {timeout_s}")
        self.client = client
        self.obs_dim = obs_dim
        self.max_inflight = max_inflight
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._publish = publish
        self._warn = warn or (lambda message: None)
        self._lock = threading.Lock()  # _inflight, counts, _closed
        self._inflight = 0
        self._closed = False
        self.counts = {"received": 0, "submitted": 0, "published": 0, "dropped_busy": 0, "dropped_malformed": 0,
                       "dropped_stale": 0, "dropped_closed": 0, "failed": 0}

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, values: Any) -> None:
        """Called from a sensor callback: submits or drops, never waits on the server."""
        received = time.monotonic()
        obs = np.asarray(values, dtype=np.float32)
        with self._lock:
            if self._closed:
                return
            self.counts["received"] += 1
            if obs.shape != (self.obs_dim,) or not np.isfinite(obs).all():
                self.counts["dropped_malformed"] += 1
                warning = (f"ignored an observation of {obs.size} values (or NaN/inf): "
                           f"expected {self.obs_dim} finite floats")
            elif self._inflight >= self.max_inflight:
                self.counts["dropped_busy"] += 1
                warning = (f"dropped an observation: {self._inflight} request(s) still in flight "
                           f"(max_inflight {self.max_inflight}); {self.counts['dropped_busy']} dropped so far")
            else:
                warning = None
                self._inflight += 1
                self.counts["submitted"] += 1
        if warning is not None:
            self._warn(warning)
            return
        try:
            future = self.client.submit({"obs": obs.reshape(1, self.obs_dim)}, timeout=self.timeout_s)
        except Exception as exc:  # a closed client or a lost connection: report, keep serving
            self._finish("failed")
            self._warn(f"could not submit an observation: {type(exc).__name__}: {exc}")
            return
        future.add_done_callback(lambda f: self._on_result(f, received))

    def _on_result(self, future: Future, received: float) -> None:
        """The client's I/O thread (or the submitter, if already done): publish, never wait."""
        if future.cancelled() or future.exception() is not None:
            closed = self._finish("failed") is False
            if not closed:
                error = "cancelled" if future.cancelled() else \
                    f"{type(future.exception()).__name__}: {future.exception()}"
                self._warn(f"policy request failed: {error}")
            return
        age = time.monotonic() - received
        if age > self.max_age_s:
            self._finish("dropped_stale")
            self._warn(f"dropped an action chunk {age:.3f} s after its observation (max_age_s {self.max_age_s})")
            return
        try:
            actions = np.asarray(future.result()["actions"], dtype=np.float32)[0]  # [horizon, act_dim]
        except Exception as exc:  # an answer of the wrong shape is this request's failure, not the node's
            self._finish("failed")
            self._warn(f"policy answer without actions[0]: {type(exc).__name__}: {exc}")
            return
        if self._finish("published"):
            self._publish(actions)

    def _finish(self, outcome: str) -> bool:
        """One request is over; False once the gate is closed (publish nothing then)."""
        with self._lock:
            self._inflight -= 1
            if self._closed and outcome == "published":
                outcome = "dropped_closed"
            self.counts[outcome] += 1
            return not self._closed

    def close(self) -> dict[str, int]:
        """Stop taking observations and publishing; returns the counters. Idempotent.

        The client is the caller's to close (in-flight requests then fail and count as failed).
        """
        with self._lock:
            self._closed = True
            return dict(self.counts)
