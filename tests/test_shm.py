"""Shared-memory arenas: allocator properties, growth, unlinking, and no leaks after kill -9."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.core.errors import ProtocolError
from runtime.transport.arena import ALIGNMENT, SHM_DIR, ShmArena, ShmMapper, new_run_id, sweep_run, sweep_stale

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
_issued: list[str] = []


def fresh_run_id() -> str:
    run_id = new_run_id()
    _issued.append(run_id)
    return run_id


def _phyrt_entries() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("phyrt-")}


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Snapshot /dev/shm around each test; entries of this test's runs must all be gone.

    Only this test's run ids count: other suites may run concurrently on the host.
    """
    _issued.clear()
    before = _phyrt_entries()
    yield
    ours = tuple(f"phyrt-{r}-" for r in _issued)
    leaked = sorted(n for n in _phyrt_entries() - before if n.startswith(ours))
    for name in leaked:  # clean up so that one failure does not cascade
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"leaked shared-memory segments: {leaked}"


def _size(name: str) -> int:
    return os.path.getsize(os.path.join(SHM_DIR, name))


def _reserved(nbytes: int) -> int:
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


_ops = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(0, 6000)), st.tuples(st.just("free"), st.integers(0, 1000))),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_ops)
def test_random_alloc_free_never_overlaps_and_coalesces(ops):
    with ShmArena(fresh_run_id(), 4096, prefault=False) as arena:
        live: dict[tuple[str, int], tuple[int, int, memoryview]] = {}
        for step, (op, arg) in enumerate(ops):
            if op == "alloc":
                seg, off, view = arena.place(arg)
                assert len(view) == arg and off % ALIGNMENT == 0
                assert off + _reserved(arg) <= _size(seg)  # inside its segment
                assert (seg, off) not in live
                pattern = step % 251 + 1
                view[:] = bytes([pattern]) * arg
                live[(seg, off)] = (arg, pattern, view)
            elif live:
                key = sorted(live)[arg % len(live)]
                live.pop(key)[2].release()
                arena.free(*key)
            # an overlap would have overwritten another block's pattern
            for n, pattern, view in live.values():
                assert view.tobytes() == bytes([pattern]) * n
        blocks = sorted((seg, off, _reserved(n)) for (seg, off), (n, _, _) in live.items())
        for (s1, o1, n1), (s2, o2, _) in zip(blocks, blocks[1:]):
            assert s1 != s2 or o1 + n1 <= o2
        for key in list(live):
            live.pop(key)[2].release()
            arena.free(*key)
        # everything freed, in any order, coalesces back into one block per segment
        for name in arena.segments:
            seg, off, view = arena.place(_size(name))
            assert (seg, off) == (name, 0)
            view.release()


def test_freed_blocks_are_reused_before_growing():
    with ShmArena(fresh_run_id(), 4096, prefault=False) as arena:
        blocks = [arena.place(1024)[:2] for _ in range(4)]
        for seg, off in (blocks[2], blocks[0], blocks[3], blocks[1]):
            arena.free(seg, off)
        assert arena.place(4096)[:2] == (arena.segments[0], 0)
        assert len(arena.segments) == 1


def test_growth_doubles_and_fits_the_request():
    with ShmArena(fresh_run_id(), 4096) as arena:
        arena.place(3000)
        seg, off, _ = arena.place(3000)
        assert len(arena.segments) == 2 and seg == arena.segments[1] and off == 0
        assert _size(seg) == 8192
        seg, _, view = arena.place(100_000)
        assert len(view) == 100_000 and _size(seg) >= 100_000
        assert arena.capacity == sum(_size(n) for n in arena.segments)


def test_close_removes_every_entry_and_is_idempotent():
    run_id = fresh_run_id()
    arena = ShmArena(run_id, 1 << 20)
    arena.place(3 << 20)
    names = arena.segments
    assert len(names) == 2 and all(_exists(n) for n in names)
    arena.close()
    arena.close()
    assert not any(n.startswith(f"phyrt-{run_id}-") for n in os.listdir(SHM_DIR))
    with pytest.raises(ValueError, match="closed"):
        arena.place(10)
    arena.free(names[0], 0)  # a no-op after close: teardown order does not matter


def test_close_with_live_view_keeps_the_view_usable():
    arena = ShmArena(fresh_run_id(), 4096)
    seg, _, view = arena.place(128)
    arena.close()
    assert not _exists(seg)
    view[:4] = b"abcd"  # still mapped: close() leaves the unmapping to the last view
    assert view[:4].tobytes() == b"abcd"
    view.release()


def test_dropped_arena_is_unlinked_by_its_finalizer():
    arena = ShmArena(fresh_run_id(), 4096)
    names = arena.segments
    del arena
    gc.collect()
    assert not any(_exists(n) for n in names)


def test_unlink_after_map_keeps_the_mapping_usable():
    run_id = fresh_run_id()
    with ShmArena(run_id, 4096) as arena, ShmMapper(run_id) as mapper:
        seg, off, src = arena.place(256)
        src[:] = bytes(range(256))
        dst = mapper.view(seg, off, 256)
        arena.unlink_all()
        assert not _exists(seg)
        assert dst.tobytes() == bytes(range(256))
        src[0] = 99  # still the same memory in both mappings
        assert dst[0] == 99
        with ShmMapper(run_id) as late, pytest.raises(ProtocolError, match="does not exist"):
            late.view(seg, off, 256)  # a peer that had not mapped it yet is too late
        src.release()
        dst.release()


def test_arena_rejects_bad_arguments():
    with pytest.raises(ValueError, match="run_id"):
        ShmArena("../etc", 4096)
    with pytest.raises(ValueError, match="capacity"):
        ShmArena(fresh_run_id(), 0)
    with ShmArena(fresh_run_id(), 4096) as arena:
        with pytest.raises(ValueError):
            arena.place(-1)
        with pytest.raises(ValueError, match="no block"):
            arena.free(arena.segments[0], 64)
        with pytest.raises(ValueError, match="not a segment"):
            arena.unlink("phyrt-0000-1-1")


def test_mapper_rejects_foreign_malformed_and_out_of_bounds_references():
    run_id = fresh_run_id()
    with ShmArena(run_id, 4096) as arena, ShmMapper(run_id) as mapper:
        seg = arena.segments[0]
        other = seg.replace(run_id, "ffff" if run_id != "ffff" else "eeee")
        bad = [
            (other, 0, 8), ("../" + seg, 0, 8), (seg + "/../x", 0, 8), (f"{SHM_DIR}/{seg}", 0, 8),
            ("phyrt-..-1-1", 0, 8), (b"phyrt", 0, 8), (seg, -1, 8), (seg, 0, -8), (seg, True, 8),
            (seg, 4090, 8), (seg, 0, 4097), (f"phyrt-{run_id}-1-999999", 0, 8),
        ]
        for args in bad:
            with pytest.raises(ProtocolError):
                mapper.view(*args)
        mapper.view(seg, 4088, 8).release()  # the last bytes are in bounds
    with pytest.raises(ProtocolError, match="closed"):
        mapper.view(seg, 0, 8)


_CHILD_ARENA = r"""
import subprocess, sys, time
from runtime.transport.arena import ShmArena
arena = ShmArena(sys.argv[1], 1 << 20)
arena.place(3 << 20)  # grow: two segments
names = arena.segments
if len(sys.argv) > 2:  # also start a grandchild with its own arena: a whole tree
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE, text=True)
    names += child.stdout.readline().split()
print(" ".join(names), flush=True)
time.sleep(60)
"""


def _start_child(run_id: str, tree: bool = False) -> tuple[subprocess.Popen, list[str]]:
    args = [sys.executable, "-c", _CHILD_ARENA, run_id] + ([_CHILD_ARENA] if tree else [])
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    names = proc.stdout.readline().split()
    assert names and all(_exists(n) for n in names), names
    return proc, names


def _sweep_until_gone(names: list[str], prefix: str) -> None:
    """Sweep until ``names`` are gone. Existence is checked, not sweep_stale's return
    value: another process sweeping at the same time may remove them first."""
    deadline = time.monotonic() + 10
    while True:
        sweep_stale(prefix)
        if not any(_exists(n) for n in names):
            return
        assert time.monotonic() < deadline, f"never swept: {[n for n in names if _exists(n)]}"
        time.sleep(0.05)  # no event tells us when a SIGKILLed grandchild is gone


def test_sigkilled_owner_leaves_entries_that_sweep_stale_removes():
    run_id = fresh_run_id()
    proc, names = _start_child(run_id)
    with ShmArena(run_id, 4096) as alive:  # same run, live owner: must survive the sweep
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert all(_exists(n) for n in names)  # kill -9 runs no cleanup
        assert set(sweep_stale(f"phyrt-{run_id}-")) <= set(names)
        _sweep_until_gone(names, f"phyrt-{run_id}-")
        assert all(_exists(n) for n in alive.segments)
    proc.stdout.close()


def test_sweep_stale_sees_an_unreaped_zombie_as_dead():
    run_id = fresh_run_id()
    proc, names = _start_child(run_id)
    proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # waitid has no timeout; WNOWAIT keeps the zombie for the sweep
    sweep_stale(f"phyrt-{run_id}-")
    assert not any(_exists(n) for n in names)
    proc.wait(timeout=10)
    proc.stdout.close()


@pytest.mark.parametrize("sweep", ["stale", "run"])
def test_kill_9_of_a_whole_tree_leaks_nothing_after_a_sweep(sweep):
    run_id = fresh_run_id()
    proc, names = _start_child(run_id, tree=True)
    assert len(names) == 4 and len({n.split("-")[2] for n in names}) == 2  # two creator pids
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    if sweep == "stale":
        _sweep_until_gone(names, f"phyrt-{run_id}-")
    else:
        assert set(sweep_run(run_id)) <= set(names)
    assert not any(_exists(n) for n in names)


def test_sweep_run_removes_a_live_arenas_names_and_close_tolerates_it():
    run_id = fresh_run_id()
    arena = ShmArena(run_id, 4096)
    sweep_run(run_id)
    assert not any(_exists(n) for n in arena.segments)
    arena.close()
    with pytest.raises(ValueError):
        sweep_run("not/a/run")


def test_prefault_false_and_true_both_give_zeroed_memory():
    for prefault in (False, True):
        with ShmArena(fresh_run_id(), 1 << 20, prefault=prefault) as arena:
            _, _, view = arena.place(1 << 20)
            assert view.tobytes() == bytes(1 << 20)
            view.release()


def test_a_sweep_removes_odd_entries_under_a_dead_owners_names_and_never_raises():
    """A killed process may leave, under names of ours, what forged-name tests or an attacker
    made: a directory, a symlink, a FIFO. The next start's sweep must not fail on them."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_id = new_run_id()
    base = Path(SHM_DIR)
    names = {f"phyrt-{run_id}-{dead.pid}-{i}" for i in range(4)}
    a, b, c, d = sorted(names)
    (base / a).write_bytes(b"x" * 64)
    (base / b).mkdir(mode=0o700)
    (base / c).symlink_to(base / a)
    os.mkfifo(base / d)
    try:
        swept = set(sweep_stale())
        assert names <= swept, names - swept
        assert not any((base / n).exists() or (base / n).is_symlink() for n in names)
    finally:
        for n in names:
            p = base / n
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            elif p.exists() or p.is_symlink():
                p.unlink()
