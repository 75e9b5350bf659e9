"""runtime.transport.spin: the short poll before sleeping, and its budget."""

from __future__ import annotations

import pathlib
import re
import time

import pytest

from runtime.transport import spin as spin_module
from runtime.core import env
from runtime.transport.spin import BUDGETS_US, budget_ns, spin

pytestmark = pytest.mark.timeout(30)


def test_budget_from_the_environment_or_the_side_default(monkeypatch):
    monkeypatch.setattr(spin_module, "usable_cores", lambda: 4)
    monkeypatch.delenv("PHYRT_SPIN_US", raising=False)
    assert {side: budget_ns(side) for side in BUDGETS_US} == {s: us * 1000 for s, us in BUDGETS_US.items()}
    monkeypatch.setenv("PHYRT_SPIN_US", "50")
    assert {budget_ns(side) for side in BUDGETS_US} == {50_000}
    monkeypatch.setenv("PHYRT_SPIN_US", "0")
    assert {budget_ns(side) for side in BUDGETS_US} == {0}
    for bad in ("fast", "-1", "nan", "inf"):
        monkeypatch.setenv("PHYRT_SPIN_US", bad)
        with pytest.raises(ValueError, match="PHYRT_SPIN_US must be a number of microseconds >= 0"):
            budget_ns("client")


def test_no_spinning_on_a_single_core(monkeypatch):
    monkeypatch.setattr(spin_module, "usable_cores", lambda: 1)
    monkeypatch.setenv("PHYRT_SPIN_US", "500")
    assert {budget_ns(side) for side in BUDGETS_US} == {0}
    monkeypatch.delenv("PHYRT_SPIN_US")
    assert {budget_ns(side) for side in BUDGETS_US} == {0}


def test_every_knob_is_read_in_one_module_and_documented():
    """No PHYRT_* variable is read outside runtime.core.env, and docs/environment.md lists each one."""
    root = pathlib.Path(__file__).resolve().parent.parent
    readers = []
    for package in ("runtime", "supervisor", "workers", "models"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            if re.search(r"os\.environ|getenv\(", text) and "PHYRT_" in text and path.name != "env.py":
                readers.append(str(path.relative_to(root)))
    assert readers == []
    listed = (root / "docs" / "environment.md").read_text()
    assert [knob for knob in env.KNOBS if f"`{knob}`" not in listed] == []


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


def test_a_spinner_spins_only_while_the_last_wait_ended_within_its_budget():
    from runtime.transport.spin import Spinner

    spinner = Spinner(budget=50_000_000)  # 50 ms: a busy VM may stall a short wait for milliseconds

    def wait(sleep_s: float, found_by_spin: bool = False) -> bool:
        """One wait whose message the spin finds at once (``found_by_spin``), or that a sleep of
        ``sleep_s`` ends; True if it spun."""
        looks: list[int] = []

        def poll_now() -> list:
            looks.append(1)
            return ["spun"] if found_by_spin else []

        def sleep(s: float) -> list:
            time.sleep(s)
            return ["slept"]

        assert spinner.wait(poll_now, sleep, sleep_s) == (["spun"] if found_by_spin else ["slept"])
        return bool(looks)

    assert wait(0.0, found_by_spin=True)  # it starts spinning; the spin found the message at once
    assert wait(0.0, found_by_spin=True)  # a short wait: it goes on spinning
    assert wait(0.0)  # the spin found nothing: the wait outlasted the budget ...
    assert not wait(0.2)  # ... so straight to sleep (a long wait, again)
    assert not wait(0.0)  # straight to sleep; a short wait ...
    assert wait(0.0, found_by_spin=True)  # ... so it spins again


def test_a_spinner_without_a_budget_only_sleeps():
    from runtime.transport.spin import Spinner

    spinner = Spinner(budget=0)
    assert spinner.wait(lambda: pytest.fail("no spin with no budget"), lambda: "slept") == "slept"


def test_a_spin_that_failed_puts_spinning_off_for_twice_as_many_waits_each_time():
    from runtime.transport.spin import Spinner

    spinner = Spinner(budget=5_000_000)  # 5 ms: a wait that its poll answers at once ends well within it
    spun = []

    def wait(found_by_spin: bool) -> None:
        looks: list[int] = []

        def poll_now() -> list:
            looks.append(1)
            return ["spun"] if found_by_spin else []

        spinner.wait(poll_now, lambda: ["slept"])  # the sleep returns at once: every wait is short
        spun.append(bool(looks))

    for _ in range(3):
        wait(found_by_spin=True)
    assert spun == [True] * 3  # a lone caller with a quick peer spins every time
    spun.clear()
    for _ in range(1 + 1 + 1 + 2 + 1 + 4 + 1):  # every spin fails: off for 1, then 2, then 4 waits
        wait(found_by_spin=False)
    assert spun == [True, False, True, False, False, True, False, False, False, False, True]
    spun.clear()
    for _ in range(Spinner.MAX_SKIP * 4):  # the back-off stops doubling at MAX_SKIP ...
        wait(found_by_spin=False)
    assert spun.count(True) <= 3 + 4
    spins = [i for i, did in enumerate(spun) if did]
    gaps = [later - earlier for earlier, later in zip(spins, spins[1:])]
    assert max(gaps) == gaps[-1] == gaps[-2] == Spinner.MAX_SKIP + 1  # ... one spin in MAX_SKIP + 1 waits goes on
    waits = 0
    while not spun[-1]:
        wait(found_by_spin=True)  # waits out the back-off; the spin then finds the message ...
        waits += 1
    assert waits <= Spinner.MAX_SKIP + 1  # a peer that got quick again is seen within MAX_SKIP + 1 waits
    spun.clear()
    for _ in range(3):
        wait(found_by_spin=True)
    assert spun == [True] * 3  # ... which ends the back-off
