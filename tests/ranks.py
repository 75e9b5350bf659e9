"""Running a test file as N gloo rank processes on this machine.

The test side calls ``launch(__file__, world, tmp_path)``: it starts ``world`` copies of
the test file as scripts (``python script *ARGS RANK WORLD PORT OUT_DIR``), waits for
them under one deadline, kills stragglers, fails the test with the log tails of the
failing ranks, and returns each rank's ``OUT_DIR/rank{R}.json``.

The rank side (the test file's ``__main__``) calls ``rank_args`` and ``init_gloo``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free port on 127.0.0.1, below the ephemeral range (see ``free_base_port``)."""
    from tests.conftest import free_base_port

    return free_base_port(1)


def launch(script: str, world: int, out: Path, *, args: list[str] = (), timeout: float = 90.0) -> list:
    """Run ``world`` ranks of ``script``; return each rank's JSON result. Kills stragglers."""
    port, procs = free_port(), []
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    try:
        for rank in range(world):
            with open(out / f"rank{rank}.log", "wb") as log:
                cmd = [sys.executable, script, *args, str(rank), str(world), str(port), str(out)]
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        text = "\n".join(f"--- rank {r} (rc {procs[r].returncode}) ---\n"
                         + (out / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in failed)
        what = " ".join([Path(script).name, *args])
        pytest.fail(f"ranks {failed} of {what!r} failed:\n{text}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def rank_args(n_extra: int = 0) -> tuple[list[str], int, int, int, Path]:
    """Parse a rank's argv: ``EXTRA... RANK WORLD PORT OUT_DIR`` -> (extra, rank, world, port, out)."""
    argv = sys.argv[1:]
    extra, (rank, world, port), out = argv[:n_extra], map(int, argv[n_extra:n_extra + 3]), argv[n_extra + 3]
    return extra, rank, world, port, Path(out)


def init_gloo(rank: int, world: int, port: int) -> None:
    """Single-threaded torch, and a gloo world on 127.0.0.1:``port``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))


def finish(out: Path, rank: int, result: object) -> None:
    """Write this rank's result, meet the other ranks, and leave without interpreter teardown.

    A gloo group left to the interpreter's teardown (or destroyed while a peer is already
    exiting) can abort the process ("terminate called without an active exception") after
    its work is done; the workers in ``workers/main.py`` leave through ``os._exit`` for the
    same reason. The barrier keeps one rank from exiting while another is still inside a
    collective with it.
    """
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
