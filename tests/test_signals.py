"""runtime.core.signals: a stop signal is acted on even when it lands while the main thread
holds the very lock the action takes (the SIGTERM hang of ``runtime.launch``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.test_launch import ROOT

#: the main thread spins in Event.wait(0), holding the Event's lock most of the time: a
#: handler that called stop.set() itself would hang there in most runs
WAITER = textwrap.dedent("""
    import sys, threading
    from runtime.core.signals import SignalRelay

    stop, seen = threading.Event(), []
    def on_signal(signum):
        seen.append(signum)
        if len(seen) == int(sys.argv[1]):
            stop.set()
    SignalRelay(on_signal)
    print("ready", flush=True)
    while not stop.wait(0.0):
        pass
    print(" ".join(map(str, seen)), flush=True)
""")


def run_waiter(signals: list[int]) -> str:
    proc = subprocess.Popen([sys.executable, "-c", WAITER, str(len(signals))], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for signum in signals:
            proc.send_signal(signum)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    return out.strip()


@pytest.mark.timeout(90)
def test_a_stop_signal_ends_a_busy_waiting_main_thread_every_time():
    for _ in range(8):
        assert run_waiter([signal.SIGTERM]) == str(int(signal.SIGTERM))


@pytest.mark.timeout(30)
def test_a_second_signal_reaches_the_action_too():
    """(The second one is what makes a draining server stop waiting.)"""
    seen = run_waiter([signal.SIGINT, signal.SIGTERM]).split()
    assert sorted(map(int, seen)) == sorted([int(signal.SIGINT), int(signal.SIGTERM)])
