"""runtime.transport.bulk_copy: large copies split with a helper thread land every byte, whatever the timing."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from runtime.transport import bulk_copy
from runtime.transport.bulk_copy import CHUNK_BYTES, SPLIT_MIN_BYTES, BulkCopier

pytestmark = pytest.mark.timeout(60)


def _random(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [0, 1, SPLIT_MIN_BYTES - 1, SPLIT_MIN_BYTES, 5 * CHUNK_BYTES + 17,
                                    1080 * 1620 * 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_byte_arrives_whatever_the_size_and_thread_count(nbytes: int, threads: int) -> None:
    copier = BulkCopier(threads)
    try:
        for seed in range(3):  # the helpers are reused from one copy to the next
            src = _random(nbytes, seed)
            dst = np.zeros(nbytes, np.uint8)
            copier.copy(dst, src)
            assert np.array_equal(dst, src)
    finally:
        copier.close()


def test_a_large_copy_is_shared_with_a_helper_thread() -> None:
    copier = BulkCopier(2)
    seen: set[str] = set()
    real = np.copyto

    def spy(dst: np.ndarray, src: np.ndarray) -> None:
        seen.add(threading.current_thread().name)
        time.sleep(0.002)  # long enough for the helper to wake and take chunks
        real(dst, src)

    src = _random(64 * CHUNK_BYTES, 1)
    dst = np.zeros_like(src)
    try:
        bulk_copy.np.copyto = spy
        copier.copy(dst, src)
    finally:
        bulk_copy.np.copyto = real
        copier.close()
    assert np.array_equal(dst, src)
    assert seen == {threading.current_thread().name, "phyrt-copy"}


def test_a_helper_that_never_wakes_costs_the_caller_nothing_but_time() -> None:
    """The caller copies every chunk itself when the helper is busy elsewhere."""
    copier = BulkCopier(2)
    blocker = threading.Event()
    try:
        jobs = copier._queue()

        class Stuck:
            def work(self) -> None:
                blocker.wait(10)

        jobs.put(Stuck())  # the only helper is held by this job
        src = _random(8 * CHUNK_BYTES, 2)
        dst = np.zeros_like(src)
        start = time.monotonic()
        copier.copy(dst, src)
        assert time.monotonic() - start < 5
        assert np.array_equal(dst, src)
    finally:
        blocker.set()
        copier.close()


def test_an_error_in_a_chunk_reaches_the_caller() -> None:
    copier = BulkCopier(2)
    try:
        src = _random(4 * CHUNK_BYTES, 3)
        with pytest.raises(ValueError):
            copier.copy(np.zeros(4 * CHUNK_BYTES, np.float32)[: 4 * CHUNK_BYTES // 4], src)  # sizes differ
        readonly = np.zeros(4 * CHUNK_BYTES, np.uint8)
        readonly.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            copier.copy(readonly, src)
    finally:
        copier.close()


def test_close_stops_the_helpers_and_a_later_copy_starts_them_again() -> None:
    copier = BulkCopier(2)
    src = _random(SPLIT_MIN_BYTES, 4)
    dst = np.zeros_like(src)
    copier.copy(dst, src)
    helpers = [t for t in threading.enumerate() if t.name == "phyrt-copy" and t in copier._helpers]
    assert len(helpers) == 1
    copier.close()
    assert not helpers[0].is_alive()
    copier.close()  # idempotent
    dst[:] = 0
    copier.copy(dst, src)
    assert np.array_equal(dst, src)
    copier.close()


def test_thread_count_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bulk_copy.ENV, "3")
    assert bulk_copy.threads_from_env() == 3
    monkeypatch.setenv(bulk_copy.ENV, "1")
    assert bulk_copy.threads_from_env() == 1
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv(bulk_copy.ENV, bad)
        with pytest.raises(ValueError, match=bulk_copy.ENV):
            bulk_copy.threads_from_env()
    monkeypatch.delenv(bulk_copy.ENV)
    monkeypatch.setattr(bulk_copy.spin, "usable_cores", lambda: 1)
    assert bulk_copy.threads_from_env() == 1  # no helper where it would only take the caller's core
    monkeypatch.setattr(bulk_copy.spin, "usable_cores", lambda: 16)
    assert bulk_copy.threads_from_env() == bulk_copy.DEFAULT_THREADS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_helper() -> None:
    copier = BulkCopier(2)
    src = _random(2 * SPLIT_MIN_BYTES, 5)
    dst = np.zeros_like(src)
    copier.copy(dst, src)  # the parent's helper exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = False
        try:
            out = np.zeros_like(src)
            copier.copy(out, src)
            ok = bool(np.array_equal(out, src)) and copier._helpers[0].is_alive()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        copier.close()
