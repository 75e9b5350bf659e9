"""runtime.parallel's shared-memory collectives (``runtime.parallel.shm_collectives``) between
real rank processes of this host.

The test starts N copies of this file as ranks (``python this_file SCENARIO RANK WORLD PORT
OUT_DIR``, see ``tests.ranks``); each makes a gloo world, initializes ``runtime.parallel``
and runs a scenario; the test asserts on what the ranks wrote. Every scenario compares the
shared-memory path with gloo's on the same inputs, in the same processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from runtime import parallel as P
from runtime.core.config import DenseParallelConfig, ParallelConfig
from runtime.parallel import shm_setup
from runtime.parallel.shm_collectives import SLOT_BYTES, PeerExitedError
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(180)

RUN_ID = "5eed0b0e"
#: a late peer keeps the other rank waiting this long in one all-reduce
LATE_S = 1.0
_GLOO_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}


def tp(world: int) -> ParallelConfig:
    return ParallelConfig(dense=DenseParallelConfig(tp_size=world))


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def own_names() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"phyrt-{RUN_ID}-"))


def mapped_segments() -> int:
    """This process's mappings of phyrt segments (deleted or not)."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/phyrt-" in line for line in f)


# --------------------------------------------------------------------------- rank side


def gloo_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, op=_GLOO_OPS[op])
    return y.div_(dist.get_world_size()) if op == "avg" else y


def scenario_agree(rank: int, world: int) -> dict:
    """Every op and dtype, a chunked size, gathers and broadcasts: hashes and gloo's verdict."""
    P.initialize(tp(world), rank, run_id=RUN_ID)
    out = {"shm": P.uses_shared_memory("world"), "names_after_init": own_names(), "reduce": {}, "move": {}}
    gen = torch.Generator().manual_seed(rank)
    big = SLOT_BYTES // 4 * 2 + 1000  # float32 elements: three chunks
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for numel in (1, 1000, big):
            x = (torch.randn(numel, generator=gen) * 10).to(dtype)
            for op in ("sum", "max", "min", "prod", "avg"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                got = P.all_reduce(x.clone(), "world", op=op)
                want = gloo_reduce(x, op)
                # bf16 rounds each partial sum to 8 bits: ~0.1 on values of tens, whatever the order
                rtol, atol = (2e-2, 0.5) if dtype == torch.bfloat16 else (1e-6, 1e-5)
                close = torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)
                out["reduce"][f"{dtype} {numel} {op}"] = {"hash": digest(got), "gloo_close": close}
    x = torch.randn(3, big // 3 + 7, generator=gen)
    strided = torch.randn(8, 6, generator=gen).t()  # a strided view, reduced in place
    want_strided = gloo_reduce(strided.contiguous(), "sum")
    out["move"]["strided"] = torch.allclose(P.all_reduce(strided, "world"), want_strided) and not strided.is_contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    out["move"]["all_gather0"] = torch.equal(P.all_gather(x, "world"), torch.cat(parts, 0))
    out["move"]["all_gather1"] = torch.equal(P.all_gather(x, "world", dim=1), torch.cat(parts, 1))
    got = P.gather(x, "world", dst=world - 1)
    out["move"]["gather"] = torch.equal(got, torch.cat(parts, 0)) if rank == world - 1 else got is None
    mine = torch.full((5, 1 << 18), float(rank))  # 5 MiB: chunked
    out["move"]["broadcast"] = torch.equal(P.broadcast(mine, "world", src=world - 1),
                                           torch.full((5, 1 << 18), float(world - 1)))
    plan = torch.tensor(list(b"plan of rank 0"), dtype=torch.uint8) if rank == 0 else torch.zeros(14, dtype=torch.uint8)
    out["move"]["cpu_broadcast"] = bytes(P.cpu_broadcast(plan).tolist()) == b"plan of rank 0"
    out["move"]["bool_gather"] = P.all_gather(torch.tensor([rank % 2 == 0]), "world").tolist()
    P.barrier("world")
    # a peer that comes late: this rank sleeps in the semaphore, it does not spin
    if rank == 1:
        time.sleep(LATE_S)
    cpu, wall = time.process_time(), time.monotonic()
    P.all_reduce(torch.ones(16), "world")
    out["late"] = {"cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall}
    out["mapped_before_destroy"] = mapped_segments()
    P.destroy()
    out["mapped_after_destroy"] = mapped_segments()
    return out


def scenario_fallback(rank: int, world: int) -> dict:
    """Ranks that cannot share memory (another identity on rank 1) all take gloo, and say so."""
    out = {}
    P.initialize(tp(world), rank, shared_memory=False)
    out["off"] = P.uses_shared_memory("world")
    P.destroy()
    if rank == 1:
        shm_setup._identity = lambda: 12345  # as a rank of another host or container would be
    P.initialize(tp(world), rank)
    out["mismatch"] = P.uses_shared_memory("world")
    out["sum"] = P.all_reduce(torch.tensor([float(rank + 1)]), "world").tolist()
    out["names"] = own_names()
    P.destroy()
    return out


def rank_main() -> None:
    (scenario,), rank, world, port, out = rank_args(1)
    init_gloo(rank, world, port)
    if scenario == "dead_peer":
        dead_peer(rank, world, out)
    try:
        result = {"agree": scenario_agree, "fallback": scenario_fallback}[scenario](rank, world)
        dist.barrier()
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, result)


def dead_peer(rank: int, world: int, out) -> None:
    """Rank 1 exits without entering the all-reduce; rank 0 must raise, not hang."""
    P.initialize(tp(world), rank, run_id=RUN_ID)
    result = {"shm": P.uses_shared_memory("world")}
    P.barrier("world")
    if rank == 0:
        try:
            P.all_reduce(torch.ones(1 << 16), "world")
            result["raised"] = None
        except PeerExitedError as exc:
            result["raised"] = str(exc)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no teardown: the peer's gloo pairs are gone


# --------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    return launch(__file__, 3, tmp_path_factory.mktemp("agree"), args=["agree"], timeout=150)


def test_results_are_bitwise_the_same_on_every_rank_and_match_gloo(agree):
    assert all(r["shm"] for r in agree), "3 ranks of this host did not get a shared-memory group"
    for case in agree[0]["reduce"]:
        assert len({r["reduce"][case]["hash"] for r in agree}) == 1, f"ranks differ: {case}"
        assert all(r["reduce"][case]["gloo_close"] for r in agree), f"not gloo's result: {case}"


def test_gathers_and_broadcasts_equal_gloo_in_chunks(agree):
    for r, result in enumerate(agree):
        assert result["move"] == {"strided": True, "all_gather0": True, "all_gather1": True, "gather": True,
                                  "broadcast": True, "cpu_broadcast": True, "bool_gather": [True, False, True]}, r


def test_a_rank_waiting_for_a_late_peer_sleeps_and_nothing_is_left(agree):
    waiting = agree[0]["late"]
    assert waiting["wall_s"] >= LATE_S / 2, waiting  # it did wait for the late peer
    assert waiting["cpu_s"] < 0.25 * waiting["wall_s"], f"busy wait: {waiting}"
    for result in agree:
        assert result["names_after_init"] == []  # unlinked as soon as every rank mapped it
        assert result["mapped_before_destroy"] >= 1 and result["mapped_after_destroy"] == 0, result


def test_ranks_that_cannot_share_memory_all_fall_back_to_gloo(tmp_path):
    results = launch(__file__, 2, tmp_path, args=["fallback"])
    assert [r["off"] for r in results] == [False, False]
    assert [r["mismatch"] for r in results] == [False, False]
    assert [r["sum"] for r in results] == [[3.0], [3.0]]
    assert [r["names"] for r in results] == [[], []]


def test_a_peer_that_exits_fails_the_collective_instead_of_hanging(tmp_path):
    results = launch(__file__, 2, tmp_path, args=["dead_peer"], timeout=60)
    assert results[0]["shm"] and results[1]["shm"]
    assert results[0]["raised"] is not None and "group rank 1" in results[0]["raised"], results[0]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"phyrt-{RUN_ID}-")]


if __name__ == "__main__":
    rank_main()
