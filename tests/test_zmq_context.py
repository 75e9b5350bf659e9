"""runtime.transport.zmq_context: with PHYRT_IO_BATCH=1, clients' and servers' ZeroMQ I/O threads run as
SCHED_BATCH threads on Linux; by default as ordinary threads."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from runtime.transport import zmq_context

pytestmark = pytest.mark.timeout(60)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")


def _io_thread_policies() -> dict[str, int]:
    """The scheduling policy of each ZeroMQ thread of this process, by thread id."""
    found = {}
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("ZMQbg/IO"):
                found[task.name] = os.sched_getscheduler(int(task.name))
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return found


def _wait_for_io_thread(before: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = {tid: policy for tid, policy in _io_thread_policies().items() if tid not in before}
        if new:
            return new
        time.sleep(0.01)
    raise AssertionError("no new ZeroMQ I/O thread started")


@linux_only
def test_with_phyrt_io_batch_1_a_server_io_thread_is_a_batch_thread(monkeypatch, tmp_path):
    from runtime.link.listener import Listener

    monkeypatch.setenv("PHYRT_IO_BATCH", "1")
    assert zmq_context.batch_usable()
    before = _io_thread_policies()
    server = Listener(f"ipc://{tmp_path}/s.sock", 1 << 20, None, lambda: True)
    try:
        assert set(_wait_for_io_thread(before).values()) == {os.SCHED_BATCH}
    finally:
        server.close(0)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the probe ran here and gave the policy back


@linux_only
@pytest.mark.parametrize("value", [None, "0"])
def test_by_default_or_with_phyrt_io_batch_0_a_client_io_thread_is_ordinary(monkeypatch, tmp_path, value):
    from runtime.client import Client

    if value is None:
        monkeypatch.delenv("PHYRT_IO_BATCH", raising=False)
    else:
        monkeypatch.setenv("PHYRT_IO_BATCH", value)
    before = _io_thread_policies()
    client = Client(f"ipc://{tmp_path}/nobody.sock")  # its socket connects (and its I/O thread starts) at once
    try:
        assert set(_wait_for_io_thread(before).values()) == {os.SCHED_OTHER}
    finally:
        client.close()


def test_a_bad_phyrt_io_batch_is_refused(monkeypatch):
    monkeypatch.setenv("PHYRT_IO_BATCH", "yes")
    with pytest.raises(ValueError, match="PHYRT_IO_BATCH must be 0 or 1, got 'yes'"):
        zmq_context.io_context()


def test_no_batch_policy_where_the_kernel_refuses_it(monkeypatch):
    """A kernel (or sandbox) that refuses the policy gets an ordinary context, not an aborted process."""
    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setenv("PHYRT_IO_BATCH", "1")
    monkeypatch.setattr(zmq_context, "_usable", None)
    monkeypatch.setattr(zmq_context.os, "sched_setscheduler", refuse, raising=False)
    assert zmq_context.batch_usable() is False
    before = _io_thread_policies() if sys.platform.startswith("linux") else {}
    ctx = zmq_context.io_context()
    sock = ctx.socket(zmq_context.zmq.DEALER)
    try:
        if sys.platform.startswith("linux"):
            assert set(_wait_for_io_thread(before).values()) == {os.SCHED_OTHER}
    finally:
        sock.close(0)
        ctx.term()


def test_product_code_uses_only_pyzmq_public_names():
    """pyzmq's private ``zmq.backend`` may change between releases: none of phyrt's packages reaches into it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    found = [f"{path.relative_to(root)}:{n}" for package in ("runtime", "supervisor", "workers", "models")
             for path in sorted((root / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "zmq.backend" in line]
    assert found == []
