"""runtime.transport.spin: the short poll before sleeping, and its budget."""

from __future__ import annotations

import time

import pytest

from runtime.transport import spin as spin_module
from runtime.transport.spin import budget_ns, spin

pytestmark = pytest.mark.timeout(30)


def test_budget_from_the_environment_or_the_default(monkeypatch):
    monkeypatch.setattr(spin_module, "usable_cores", lambda: 4)
    monkeypatch.delenv("PHYRT_TEST_SPIN_US", raising=False)
    assert budget_ns("PHYRT_TEST_SPIN_US", 300) == 300_000
    monkeypatch.setenv("PHYRT_TEST_SPIN_US", "50")
    assert budget_ns("PHYRT_TEST_SPIN_US", 300) == 50_000
    monkeypatch.setenv("PHYRT_TEST_SPIN_US", "0")
    assert budget_ns("PHYRT_TEST_SPIN_US", 300) == 0
    monkeypatch.setenv("PHYRT_TEST_SPIN_US", "fast")
    with pytest.raises(ValueError, match="PHYRT_TEST_SPIN_US must be a number of microseconds"):
        budget_ns("PHYRT_TEST_SPIN_US", 300)


def test_no_spinning_on_a_single_core(monkeypatch):
    monkeypatch.setattr(spin_module, "usable_cores", lambda: 1)
    monkeypatch.setenv("PHYRT_TEST_SPIN_US", "500")
    assert budget_ns("PHYRT_TEST_SPIN_US", 300) == 0


def test_spin_returns_what_the_poll_found_at_once():
    calls = []

    def poll_now():
        calls.append(1)
        return [("fd", 1)] if len(calls) == 3 else []

    assert spin(poll_now, 10**9) == [("fd", 1)]
    assert len(calls) == 3


def test_spin_gives_up_after_its_budget():
    started = time.perf_counter()
    assert spin(lambda: [], 2_000_000) == []  # 2 ms
    assert 0.002 <= time.perf_counter() - started < 0.5
