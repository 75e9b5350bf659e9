"""External mode: ``DeploymentConfig.external()`` in processes that torchrun starts.

Every launch here is real: ``python -m torch.distributed.run`` (torchrun) agents on
loopback, one node (``--standalone --nproc-per-node 2``) or two (two agents with
``--nnodes 2 --node-rank 0/1 --nproc-per-node 1`` and a static rendezvous on
127.0.0.1). The qwen3 example is compared with ``transformers`` greedy output; small
scenario scripts written to ``tmp_path`` drive the failure cases: ranks that
disagree on a request, a plugin exception on every rank, a rank killed and a rank
hung mid-request. Each launch kills whatever it started (agents and their
workers, which torchrun puts in sessions of their own) and proves it is gone.

The in-process tests need no launcher: the fingerprint, the errors raised before
anything is built, and a one-rank world in the test process itself.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from runtime import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, EngineUnavailableError
from runtime.execution.external import RequestMismatchError, request_fingerprint
from tests.ranks import free_port
from tests.test_qwen3_plugin import SHAPES, TP2, hf_greedy, make_checkpoint

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchrun_engine.py"
PROMPTS = [[3, 1, 4, 1, 5], [(5 * i + 2) % 250 for i in range(20)]]
MAX_TOKENS = 12
#: one launch (agents, rendezvous, torch imports on a loaded machine) must end within this
LAUNCH_DEADLINE_S = 180.0


# --------------------------------------------------------------------------- launching torchrun agents


class Agents:
    """torchrun agents started by one test; ``stop()`` kills them and every worker they made.

    Workers run in sessions of their own (torchrun's choice), so they are found by
    walking each agent's children while it runs, and killed by pid.
    """

    def __init__(self, tmp_path: Path, commands: list[list[str]]) -> None:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        self.logs = [tmp_path / f"agent{i}.log" for i in range(len(commands))]
        self.procs: list[subprocess.Popen] = []
        self.seen: dict[int, psutil.Process] = {}
        self.started = time.monotonic()
        for i, (command, log) in enumerate(zip(commands, self.logs)):
            # torchrun's own log directory: in the test's, not a torchelastic_* directory of /tmp left behind
            command = ["--log-dir", str(tmp_path / f"torchrun{i}"), *command]
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command],
                                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))

    def _collect(self) -> None:
        for proc in self.procs:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    def wait(self, until=None, timeout: float = LAUNCH_DEADLINE_S) -> float:
        """Wait for every agent to exit (or for ``until()`` to hold); the seconds it took."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            self._collect()
            if until is not None and until():
                break
            if all(p.poll() is not None for p in self.procs):
                break
            try:  # wake when an agent exits, or in 0.1 s to look for new workers
                next(p for p in self.procs if p.poll() is None).wait(timeout=0.1)
            except (subprocess.TimeoutExpired, StopIteration):
                pass
        else:
            self.stop()
            pytest.fail(f"torchrun launch still running after {timeout} s:\n{self.text()[-4000:]}")
        return time.monotonic() - self.started

    def has_workers(self, agent: int) -> bool:
        """Whether agent ``agent`` got through its rendezvous and started its workers."""
        try:
            return bool(psutil.Process(self.procs[agent].pid).children())
        except psutil.NoSuchProcess:
            return False

    def worker(self, pid: int) -> psutil.Process:
        self._collect()
        return self.seen[pid]

    @property
    def returncodes(self) -> list[int | None]:
        return [p.returncode for p in self.procs]

    def text(self, i: int | None = None) -> str:
        logs = self.logs if i is None else [self.logs[i]]
        return "\n".join(log.read_text(errors="replace") for log in logs)

    def stop(self) -> None:
        self._collect()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for child in self.seen.values():
            try:
                child.kill()  # psutil checks the pid still names the process it found
            except psutil.NoSuchProcess:
                pass
        gone, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        assert not alive, f"workers left behind: {alive}"


@pytest.fixture
def agents(tmp_path):
    """Start agents with ``agents(command, ...)``; all are stopped (and checked gone) afterwards."""
    started: list[Agents] = []

    def start(*commands: list[str]) -> Agents:
        launch = Agents(tmp_path, list(commands))
        started.append(launch)
        return launch

    yield start
    for launch in started:
        launch.stop()


def standalone(*args: str) -> list[str]:
    return ["--standalone", "--nproc-per-node", "2", *args]


def master_port() -> int:
    """A free port below the kernel's ephemeral range.

    A port inside it can be taken as the local end of the node-1 agent's own
    connection to it (loopback self-connect while node 0 is not listening yet),
    and node 0 then fails to listen with EADDRINUSE.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, ephemeral))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def two_nodes(port: int, node: int, *args: str) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "static",
            "--master-addr", "127.0.0.1", "--master-port", str(port), *args]


def start_two_nodes(agents, args: list[str], args_node1: list[str] | None = None) -> "Agents":
    """Two agents with a static rendezvous on 127.0.0.1; a new port if another process took it."""
    for attempt in range(3):
        port = master_port()
        launch = agents(two_nodes(port, 0, *args), two_nodes(port, 1, *(args_node1 or args)))
        launch.wait(until=lambda: launch.procs[0].poll() is not None or launch.has_workers(0))
        if launch.procs[0].poll() is None or "EADDRINUSE" not in launch.text(0) or attempt == 2:
            return launch
        launch.stop()
    raise AssertionError("unreachable")


def results(text: str) -> list[dict]:
    """The example's rank-0 results, in order."""
    return [json.loads(line[len("result "):]) for line in text.splitlines() if line.startswith("result ")]


# --------------------------------------------------------------------------- the qwen3 example


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3") / "gqa", 0, **SHAPES["gqa"])


@pytest.fixture(scope="module")
def reference(ckpt) -> list[dict]:
    """What the example's rank 0 must print for PROMPTS: transformers' greedy tokens."""
    return [{"token_ids": [tokens], "finish_reasons": ["length"]} for tokens in hf_greedy(ckpt, PROMPTS, MAX_TOKENS)]


def example_args(ckpt: Path, prompts: list[list[int]] = PROMPTS) -> list[str]:
    args = [str(EXAMPLE), "--model", str(ckpt), "--device", "cpu", "--max-tokens", str(MAX_TOKENS)]
    for prompt in prompts:  # one request each, stepped one after the other
        args += ["--prompt", ",".join(map(str, prompt))]
    return args


def test_example_tp2_under_torchrun_matches_transformers(agents, ckpt, reference):
    launch = agents(standalone(*example_args(ckpt)))
    seconds = launch.wait()
    text = launch.text()
    assert launch.returncodes == [0], text[-4000:]
    assert results(text) == reference, text[-4000:]
    assert text.count("rank 1: step returned None") == len(PROMPTS)
    print(f"torchrun --standalone --nproc-per-node 2: {seconds:.1f} s")


def test_example_on_two_nodes_over_loopback(agents, ckpt, reference):
    launch = start_two_nodes(agents, example_args(ckpt))
    seconds = launch.wait()
    assert launch.returncodes == [0, 0], launch.text()[-4000:]
    assert results(launch.text(0)) == reference
    assert launch.text(1).count("rank 1: step returned None") == len(PROMPTS) and not results(launch.text(1))
    print(f"two torchrun agents, --nnodes 2: {seconds:.1f} s")


def test_ranks_given_different_prompts_fail_on_every_rank(agents, ckpt):
    launch = start_two_nodes(agents, example_args(ckpt, [[3, 1, 4]]), example_args(ckpt, [[2, 7, 1]]))
    launch.wait()  # fails the test past LAUNCH_DEADLINE_S: it ends by itself, nobody hangs in a collective
    assert all(rc not in (0, None) for rc in launch.returncodes), launch.text()[-4000:]
    for node in (0, 1):
        text = launch.text(node)
        assert f"rank {node}: RequestMismatchError: rank {node}: request #0 differs between ranks: " \
               "ranks [1] have a different request fingerprint than rank 0" in text, text[-4000:]
        assert "result " not in text


# --------------------------------------------------------------------------- failure scenarios

SCENARIO = r'''
"""One rank of a test_external scenario: python SCRIPT SCENARIO OUT_DIR COLLECTIVE_TIMEOUT_S."""
import json
import os
import sys
import time
from pathlib import Path

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                     EngineArgs, EngineConfig, Entry, ParallelConfig, register_plugin)
from runtime import parallel as P

scenario, out, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
rank = int(os.environ["RANK"])


@register_plugin("stall")
class Stall(Entry):
    """Rank 1 stays inside the request (killed or hung there) while rank 0 waits in a barrier."""

    parallel_domains = frozenset({"dense", "attention"})

    def build(self, ctx, plugin_args):
        class Runner:
            def execute(self, request):
                (out / f"in-request-{ctx.rank}").write_text(str(os.getpid()))
                if ctx.rank == 1:
                    time.sleep(request["sleep"])
                P.barrier("world")
                return "unreachable"
        return Runner()


tp2 = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
plugin = "tests.plugins:TPProbe" if scenario == "errors" else "stall"
engine = Engine(EngineArgs(plugin, None, EngineConfig(device=DeviceConfig(target="cpu"), parallel=tp2)),
                DeploymentConfig.external(collective_timeout_s=timeout))
log = []


def step(name, request):
    started = time.monotonic()
    entry = {"name": name}
    try:
        entry["result"] = engine.step(request)
        entry["ok"] = True
    except Exception as exc:
        entry.update(ok=False, error_type=type(exc).__name__, message=str(exc))
    entry.update(seconds=time.monotonic() - started, at=time.time(), healthy=engine.replicas[0].healthy)
    log.append(entry)


if scenario == "errors":
    step("raise", {"op": "raise", "message": "on purpose"})
    step("mismatch", {"op": "echo", "x": rank})
    step("after", {"op": "all_reduce", "group": "dense_tp"})
    future = engine.submit({"op": "echo", "x": [1, 2]})
    log.append({"name": "submit", "done": future.done(), "result": future.result()})
else:
    step("stalled", {"op": "stall", "sleep": 300})
    step("next", {"op": "stall", "sleep": 0})
engine.close()
(out / f"rank{rank}.json").write_text(json.dumps(log))
# a rank whose engine failed exits non-zero, as a real one would (and torchrun's
# agent then skips its exit barrier, which waits for the agent of the dead rank)
sys.exit(0 if all(e.get("healthy", True) for e in log) else 3)
'''


def scenario(tmp_path: Path, name: str, timeout_s: float) -> list[str]:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    return [str(script), name, str(tmp_path), str(timeout_s)]


def rank_log(tmp_path: Path, rank: int) -> dict[str, dict]:
    return {entry["name"]: entry for entry in json.loads((tmp_path / f"rank{rank}.json").read_text())}


def test_plugin_exception_and_mismatch_are_request_local(agents, tmp_path):
    """On every rank: the plugin's own ZeroDivisionError, then RequestMismatchError; the next request runs."""
    launch = agents(standalone(*scenario(tmp_path, "errors", 30)))
    launch.wait()
    assert launch.returncodes == [0], launch.text()[-4000:]
    for rank in (0, 1):
        log = rank_log(tmp_path, rank)
        assert log["raise"]["error_type"] == "ZeroDivisionError" and log["raise"]["message"] == "on purpose"
        assert log["mismatch"]["error_type"] == "RequestMismatchError"
        assert f"rank {rank}: request #1 differs between ranks: ranks [1]" in log["mismatch"]["message"]
        assert all(log[name]["healthy"] for name in ("raise", "mismatch", "after"))
        assert log["after"]["ok"]
        # only the output rank answers; the submit future is complete when submit returns
        assert log["after"]["result"] == ([3.0, 3.0] if rank == 0 else None)  # (1 + 2) on each rank, gathered
        assert log["submit"] == {"name": "submit", "done": True, "result": [1, 2] if rank == 0 else None}


def _wait_for_files(launch: Agents, *paths: Path) -> None:
    launch.wait(until=lambda: all(p.exists() for p in paths) or
                any(p.poll() is not None for p in launch.procs))
    assert all(p.exists() for p in paths), launch.text()[-4000:]


def test_rank_killed_mid_request_fails_the_other_fast(agents, tmp_path):
    """Two nodes; node 1's rank is SIGKILLed inside a request while rank 0 waits in a barrier."""
    launch = start_two_nodes(agents, scenario(tmp_path, "kill", 10))
    _wait_for_files(launch, tmp_path / "in-request-0", tmp_path / "in-request-1")
    victim = launch.worker(int((tmp_path / "in-request-1").read_text()))
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    launch.wait(until=lambda: (tmp_path / "rank0.json").exists())
    log = rank_log(tmp_path, 0)
    stalled = log["stalled"]
    assert stalled["error_type"] == "EngineUnavailableError", stalled
    assert "request #0 failed on rank 0: a peer rank closed its connection (it died)" in stalled["message"]
    assert stalled["at"] - killed_at < 10.0  # well within the collective timeout: the peer's socket closed
    assert not stalled["healthy"]
    # unhealthy for good: the next request fails at once, without a collective
    assert log["next"]["error_type"] == "EngineUnavailableError" and log["next"]["seconds"] < 1.0
    launch.wait()
    assert launch.returncodes[0] != 0 and "exitcode  : 3" in launch.text(0), launch.text(0)[-4000:]
    print(f"killed rank: rank 0 failed {stalled['at'] - killed_at:.2f} s after the kill")


def test_hung_rank_fails_the_other_at_the_collective_timeout(agents, tmp_path):
    """One node; rank 1 stays inside a request: rank 0 fails once collective_timeout_s (3 s) passed."""
    launch = agents(standalone(*scenario(tmp_path, "hang", 3)))
    launch.wait(until=lambda: (tmp_path / "rank0.json").exists())
    assert (tmp_path / "rank0.json").exists(), launch.text()[-4000:]
    stalled = rank_log(tmp_path, 0)["stalled"]
    assert stalled["error_type"] == "EngineUnavailableError", stalled
    assert "no answer within collective_timeout_s=3 s (a peer rank hung" in stalled["message"]
    assert 2.5 <= stalled["seconds"] < 30.0  # the timeout, not torch's 30 minutes
    assert rank_log(tmp_path, 0)["next"]["error_type"] == "EngineUnavailableError"


# --------------------------------------------------------------------------- in process: no launcher


def test_fingerprint_covers_structure_values_shapes_and_sampled_bytes():
    fp = request_fingerprint
    base = {"prompt_token_ids": [3, 1, 4], "max_tokens": 8, "x": torch.arange(12.0).reshape(3, 4)}
    assert fp(base) == fp({"x": torch.arange(12.0).reshape(3, 4), "max_tokens": 8, "prompt_token_ids": (3, 1, 4)})
    for changed in ({**base, "max_tokens": 9}, {**base, "prompt_token_ids": [3, 1, 5]},
                    {**base, "x": torch.arange(12.0).reshape(4, 3)}, {**base, "x": torch.arange(12).reshape(3, 4)},
                    {**base, "x": torch.arange(12.0).reshape(3, 4) + 1}, {**base, "extra": None},
                    {**base, "max_tokens": 8.0}, {**base, "prompt_token_ids": [[3, 1, 4]]}):
        assert fp(changed) != fp(base), changed
    big = torch.zeros(1 << 20)  # 4 MiB: sampled
    poked = big.clone()
    poked[-1] = 1.0  # the last element is always sampled
    assert fp(big) != fp(poked) and fp(big) == fp(big.clone())
    unsampled = big.clone()
    unsampled[1] = 1.0  # between two samples: documented as not covered
    assert fp(big) == fp(unsampled)
    assert fp(big.numpy()) == fp(big.numpy().copy()) and fp(2**80) != fp(2**80 + 1)
    assert fp(b"a" * 10_000) != fp(b"a" * 9_999 + b"b")


LAUNCHER = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def probe_args(parallel=None) -> EngineArgs:
    """TPProbe that raises KeyError in build: a ValueError instead proves nothing was built."""
    return EngineArgs("tests.plugins:TPProbe", {"fail_build_rank": "all"},
                      EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel or TP2))


def test_external_outside_a_launcher_says_to_use_torchrun(monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"must run in a process that torchrun started.*missing: WORLD_SIZE, "
                                         r"LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        Engine(probe_args(), DeploymentConfig.external())


def test_world_size_must_equal_the_replica_before_anything_is_built(monkeypatch):
    import torch.distributed as dist

    for name, value in (LAUNCHER | {"WORLD_SIZE": "3"}).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 processes, but the ParallelConfig needs 2 ranks"):
        Engine(probe_args(), DeploymentConfig.external())
    assert not dist.is_initialized()


def test_collective_timeout_is_a_validated_deployment_field():
    assert DeploymentConfig.external().collective_timeout_s == 60.0
    assert DeploymentConfig.external(collective_timeout_s=5).collective_timeout_s == 5
    for bad, error in ((0, ValueError), (-1, ValueError), (float("inf"), ValueError), ("5", TypeError)):
        with pytest.raises(error, match="DeploymentConfig.collective_timeout_s"):
            DeploymentConfig.external(collective_timeout_s=bad)


def test_one_rank_world_in_this_process(monkeypatch):
    """WORLD_SIZE 1: the plugin's own exception, then a working request, then everything released."""
    import torch.distributed as dist

    from runtime import parallel as P

    for name, value in (LAUNCHER | {"WORLD_SIZE": "1", "MASTER_PORT": str(master_port())}).items():
        monkeypatch.setenv(name, value)
    engine = Engine(EngineArgs("tests.plugins:Echo", None, EngineConfig(device=DeviceConfig(target="cpu"))),
                    DeploymentConfig.external(collective_timeout_s=5))
    try:
        assert engine.mode == "external" and dist.get_world_size() == 1 and P.is_initialized()
        with pytest.raises(ZeroDivisionError, match="boom"):
            engine.step({"raise": "ZeroDivisionError"})
        assert engine.step({"x": 1}) == {"x": 1} and engine.replicas[0].healthy
    finally:
        engine.close()
    assert not dist.is_initialized() and not P.is_initialized()
    with pytest.raises(EngineUnavailableError):
        engine.step({"x": 1})


def test_mismatch_error_is_a_value_error_naming_fingerprints():
    error = RequestMismatchError("differs", {0: 1, 1: 2})
    assert isinstance(error, ValueError) and error.fingerprints == {0: 1, 1: 2}
