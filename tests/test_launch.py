"""python -m runtime.launch as a user runs it: a subprocess, its ready line, its signals.

``Launched`` (used by test_server and test_client too) starts the command from the
repository root (so that ``tests.plugins:Echo`` imports), waits for the ready line,
and on ``stop()`` proves that the process, its ranks, its socket file and every
segment a process of that tree created are gone.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import free_base_port

ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = "/dev/shm"
#: how long a launch may take to print its ready line on a busy 2-core machine
START_TIMEOUT_S = 120.0


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 are free on 127.0.0.1 now (below the ephemeral range)."""
    return free_base_port(count)


def shm_names_of(pids: set[int]) -> list[str]:
    """/dev/shm names created by any of ``pids`` (phyrt-RUN-PID-SEQ)."""
    found = []
    for name in os.listdir(SHM_DIR):
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == "phyrt" and parts[2].isdigit() and int(parts[2]) in pids:
            found.append(name)
    return sorted(found)


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


class Launched:
    """One ``python -m runtime.launch ...`` process."""

    def __init__(self, *args: str, log_dir: Path, name: str = "launch", new_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_dir / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # a file, never a pipe nobody reads
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     start_new_session=new_session,
                                     env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
        self.pids: set[int] = {self.proc.pid}
        self.own_directory = "--address" not in args  # the server makes (and must remove) its socket's directory
        self.fields: dict[str, str] = {}
        self.ready_line = self._read_ready_line()

    def _read_ready_line(self) -> str:
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if selector.select(timeout=0.5):
                    line = self.proc.stdout.readline()
                    if line:
                        self.fields = dict(kv.split("=", 1) for kv in line.split()[2:])
                        self.remember_children()
                        return line
                    break  # EOF: the process exited
                if self.proc.poll() is not None:
                    break
        finally:
            selector.close()
        self.kill()
        raise AssertionError(f"no ready line; exit code {self.proc.poll()}; log:\n{self.log()}")

    @property
    def address(self) -> str:
        return self.fields["address"]

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def remember_children(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal it (unless it exited already), wait for its exit code, then check that
        nothing of it is left."""
        self.remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill()
            raise AssertionError(f"launch did not exit within {timeout} s of {sig}; log:\n{self.log()}")
        finally:
            self.proc.stdout.close()
            self._log.close()
        self.check_nothing_left()
        return code

    def check_nothing_left(self) -> None:
        alive = lambda: [p for p in self.pids if _alive(p)]  # noqa: E731
        assert wait_until(lambda: not alive(), 15.0), f"processes left: {alive()}"
        assert shm_names_of(self.pids) == [], f"segments left: {shm_names_of(self.pids)}"
        if self.fields.get("address", "").startswith("ipc://"):
            path = self.address[len("ipc://"):]
            assert not os.path.exists(path), f"socket file left: {path}"
            if self.own_directory:
                assert not os.path.exists(os.path.dirname(path)), f"private directory left: {os.path.dirname(path)}"

    def dump_stacks(self) -> None:
        """A hung server writes every thread's stack into its log (faulthandler on SIGABRT)."""
        try:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

    def kill(self) -> None:
        self.remember_children()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_launch(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
def test_help_lists_the_options_states_each_default_once_and_the_exit_statuses():
    out = subprocess.run([sys.executable, "-m", "runtime.launch", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    for option in ("--devices", "--replicas", "--plugin", "--plugin-args", "--model", "--device", "--address",
                   "--execution-timeout-s", "--heartbeat-interval-s", "--heartbeat-timeout-s", "--max-inflight",
                   "--log-level", "--curve-secret-key", "--curve-public-key", "--base-port", "--replica-restarts",
                   "--restart-backoff-s", "--keep-serving-unhealthy", "--metrics-port"):
        assert option in out.stdout
    text = " ".join(out.stdout.split())  # help lines are wrapped at the terminal's width
    assert not re.search(r"\(default: [^)]*\) \(default:", text), text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: no limit)" in text and "(default: 10.0)" in text  # the help's own words, the formatter's
    assert re.search(r"--log-level \{[^}]*\} \w+", text), "--log-level has no help"
    assert "/healthz" in text and "/readyz" in text
    # how to make CURVE keys, and what the exit statuses mean
    assert 'python -c "import zmq.auth; zmq.auth.create_certificates(\'.\', \'server\')"' in out.stdout
    assert "server.key_secret" in text
    assert "3 no replica can serve" in text and "2 bad arguments" in text and "1 start-up failure" in text


@pytest.mark.timeout(60)
def test_restart_and_rendezvous_options_reach_the_deployment():
    from runtime.launch import build_parser
    from runtime.serving.plan import build_engine_config

    parse = build_parser().parse_args
    args, deployment = build_engine_config(parse(["--devices", "0,1"]))
    assert deployment.replica_restarts == 0 and deployment.restart_backoff_s == 1.0
    assert deployment.process_config.base_port is None  # a free rendezvous: no port chosen
    args, deployment = build_engine_config(parse(["--devices", "0,1", "--replicas", "2", "--replica-restarts", "3",
                                                  "--restart-backoff-s", "0.5", "--base-port", "29600"]))
    assert deployment.replica_restarts == 3 and deployment.restart_backoff_s == 0.5
    assert deployment.process_config.base_port == 29600
    assert parse(["--keep-serving-unhealthy"]).keep_serving_unhealthy and not parse([]).keep_serving_unhealthy


@pytest.mark.timeout(150)
def test_no_arguments_serves_the_policy_inline_and_sigint_cleans_up(tmp_path):
    import numpy as np
    import torch

    from runtime.client import Client

    server = Launched(log_dir=tmp_path)
    try:
        assert server.fields["mode"] == "inline"
        # no --device is "auto": CUDA wherever torch sees a device, else the CPU
        assert server.fields["device"] == ("cuda" if torch.cuda.is_available() else "cpu"), server.ready_line
        assert server.fields["plugin"] == "policy"
        assert server.fields["replicas"] == "1" and server.fields["ranks_per_replica"] == "1"
        path = server.address[len("ipc://"):]
        private = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
        with Client(server.address) as client:
            actions = client.call({"obs": np.ones((2, 32), np.float32)}, timeout=30)["actions"]
            assert actions.shape == (2, 8, 7) and actions.dtype == np.float32
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.log()
    assert not os.path.exists(private)
    assert "phyrt ready" not in server.log()  # the ready line goes to stdout only


@pytest.mark.timeout(120)
def test_unknown_plugin_is_a_bad_argument_with_the_cause():
    for bad, named in ((["--plugin", "no_such_plugin_xyz"], "no_such_plugin_xyz"),
                       (["--plugin-args", '{"obs_dim": -1}'], "obs_dim"),
                       (["--model", "/no/such/checkpoint"], "/no/such/checkpoint")):
        out = run_launch(*bad, "--device", "cpu")
        assert out.returncode == 2, (bad, out.stderr)  # not 1: a process manager must not restart it
        assert out.stdout == ""
        assert out.stderr.startswith("python -m runtime.launch: error: ") and out.stderr.count("\n") == 1, out.stderr
        assert named in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_bad_arguments_exit_2():
    out = run_launch("--plugin-args", "{not json")
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    for bad in (["--replica-restarts", "-1"], ["--restart-backoff-s", "0"], ["--base-port", "70000"]):
        out = run_launch(*bad)
        assert out.returncode == 2 and bad[0] in out.stderr, (bad, out.stderr)
    out = run_launch("--devices", "0,1,2", "--replicas", "2")
    assert out.returncode == 2 and "cannot share evenly" in out.stderr
    out = run_launch("--dtype", "float8")
    assert out.returncode == 2 and "--dtype" in out.stderr


@pytest.mark.timeout(60)
def test_devices_beyond_the_visible_cuda_devices_exit_2_in_one_line():
    """Checked before any rank is spawned: the line says how many entries were asked for, how many
    devices torch sees, and that --device cpu runs the same layout."""
    import torch

    seen = torch.cuda.device_count()
    asked = ",".join(str(i) for i in range(seen + 2))  # two more entries than this machine has
    for device in ("cuda", "auto") if seen else ("cuda",):
        out = run_launch("--devices", asked, "--replicas", "2" if (seen + 2) % 2 == 0 else "1", "--device", device)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"needs {seen + 2} CUDA device entries" in out.stderr and f"torch sees {seen} CUDA" in out.stderr
        assert "--device cpu runs the same layout on CPU ranks" in out.stderr
        assert "phyrt-serve-" not in out.stderr  # nothing was made


@pytest.mark.timeout(120)
def test_non_loopback_tcp_without_curve_is_refused():
    out = run_launch("--address", f"tcp://0.0.0.0:{free_port()}", "--device", "cpu")
    assert out.returncode == 1
    assert "CURVE" in out.stderr and "--curve-secret-key" in out.stderr
    assert "--curve-public-key" not in out.stderr  # the public key is derived: only the secret is asked for
    assert "create_certificates" in out.stderr


@pytest.mark.timeout(120)
def test_ipc_path_outside_a_private_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    out = run_launch("--address", f"ipc://{shared}/s.sock", "--device", "cpu")
    assert out.returncode == 1 and "private" in out.stderr
    assert not (shared / "s.sock").exists()


@pytest.mark.timeout(180)
def test_curve_on_all_interfaces_serves_only_clients_with_keys(tmp_path):
    import zmq.auth

    from runtime.client import Client, ConnectionLostError

    server_public, server_secret = zmq.auth.create_certificates(str(tmp_path), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(tmp_path), "client")
    port = free_port()
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", f"tcp://0.0.0.0:{port}",
                      f"--curve-secret-key={server_secret}", f"--curve-public-key={server_public}", log_dir=tmp_path)
    try:
        address = f"tcp://127.0.0.1:{port}"
        with Client(address, server_public_key=server_public, public_key=client_public,
                    secret_key=client_secret) as client:
            assert client.call({"x": 1}, timeout=30) == {"x": 1}
        with Client(address, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5) as plain:
            with pytest.raises((ConnectionLostError, TimeoutError)):
                plain.call({"x": 1}, timeout=3)
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.timeout(240)
def test_ctrl_c_drains_in_flight_requests_then_leaves_nothing(tmp_path):
    """Local replicas (2 x 1 rank of Echo). Ctrl-C in a terminal signals the whole process
    group: the ranks must not die of it, so that the request running then still gets its answer."""
    from runtime.client import Client, ServerUnavailableError

    server = Launched("--plugin", "tests.plugins:Echo", "--devices", "0,1", "--replicas", "2", "--device", "cpu",
                      "--base-port", str(free_port(2)), log_dir=tmp_path, new_session=True)
    client = Client(server.address)
    try:
        assert server.fields["mode"] == "local" and server.fields["backend"] == "gloo"
        assert len(server.pids) >= 3  # launch and two ranks
        client.call({"warm": True}, timeout=60)
        running = client.submit({"sleep": 1.5, "tag": "drained"})
        assert wait_until(lambda: client.info()["inflight"] == 1, 10)  # the engine holds it
        os.killpg(server.proc.pid, signal.SIGINT)
        assert running.result(30) == {"sleep": 1.5, "tag": "drained"}
        with pytest.raises((ServerUnavailableError, TimeoutError)):
            client.call({"late": True}, timeout=10)  # shutting down, then gone
    finally:
        client.close()
        code = server.stop()
    assert code == 0, server.log()
    assert "stopped" in server.log()
    assert "failed" not in server.log()  # no replica went down on the way


@pytest.mark.timeout(60)
def test_model_is_shorthand_for_the_qwen3_plugin():
    from runtime.launch import build_parser
    from runtime.serving.plan import plugin_and_args

    parse = build_parser().parse_args
    assert plugin_and_args(parse(["--model", "/m"])) == ("qwen3", {"model": "/m"})
    assert plugin_and_args(parse(["--model", "/m", "--plugin-args", '{"dtype": "float32"}'])) == \
        ("qwen3", {"dtype": "float32", "model": "/m"})
    with pytest.raises(ValueError, match="cannot go with"):
        plugin_and_args(parse(["--model", "/m", "--plugin", "other"]))


@pytest.mark.timeout(60)
def test_the_plan_says_when_cpu_ranks_run_with_gloo(caplog):
    from runtime.launch import _log_plan, build_parser
    from runtime.serving.plan import build_engine_config

    opts = build_parser().parse_args(["--devices", "0,1,2,3", "--replicas", "2", "--device", "cpu"])
    args, deployment = build_engine_config(opts)
    assert args.config.parallel.dense.tp_size == 2 and args.config.parallel.attention.tp_size == 2
    assert deployment.replica_count == 2 and deployment.devices == (0, 1, 2, 3)
    with caplog.at_level("INFO", logger="phyrt.launch"):
        _log_plan(args, deployment)
    assert "running 4 CPU ranks with gloo" in caplog.text


@pytest.mark.timeout(60)
def test_dtype_auto_follows_the_device_and_the_checkpoint(tmp_path):
    import json

    from runtime.serving.plan import choose_dtype

    for key, named in (("torch_dtype", "float16"), ("dtype", "bfloat16"), ("torch_dtype", "float32")):
        model = tmp_path / f"{key}-{named}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({key: named}))
        assert choose_dtype("auto", "cuda", "qwen3", {"model": str(model)}) == named
        assert choose_dtype("auto", "cpu", "qwen3", {"model": str(model)}) == "float32"
    assert choose_dtype("auto", "cuda", "qwen3", {"model": str(tmp_path / "missing")}) == "bfloat16"
    assert choose_dtype("auto", "cuda", "policy", {"model": str(model)}) == "bfloat16"  # not a checkpoint's plugin
    assert choose_dtype("float16", "cpu", "policy", None) == "float16"


@pytest.mark.timeout(180)
def test_dtype_reaches_the_plugin_the_ready_line_and_info(tmp_path):
    import numpy as np
    import torch

    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
    from runtime.client import Client

    obs = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    reference = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(device=DeviceConfig(target="cpu", params_dtype=dtype))
        with Engine(EngineArgs("policy", None, config)) as engine:
            reference[dtype] = engine.step({"obs": torch.from_numpy(obs)})["actions"].numpy()
    server = Launched("--device", "cpu", "--dtype", "bfloat16", log_dir=tmp_path)
    try:
        assert server.fields["dtype"] == "bfloat16" and server.fields["device"] == "cpu", server.ready_line
        with Client(server.address) as client:
            assert client.info()["dtype"] == "bfloat16"
            actions = client.call({"obs": obs}, timeout=60)["actions"]
    finally:
        assert server.stop() == 0, server.log()
    off_bf16, off_f32 = (float(np.abs(actions - reference[d]).max()) for d in ("bfloat16", "float32"))
    assert off_bf16 < off_f32 / 4, (off_bf16, off_f32)  # computed in bfloat16, not float32


@pytest.mark.timeout(180)
def test_a_starting_server_removes_the_directory_of_one_killed_with_sigkill(tmp_path):
    env = {"TMPDIR": str(tmp_path)}  # its own temp root: other servers' directories are not this test's
    first = Launched("--device", "cpu", log_dir=tmp_path, env=env)
    left = os.path.dirname(first.address[len("ipc://"):])
    first.kill()  # no cleanup runs
    assert os.path.isdir(left) and os.path.basename(left).startswith(f"phyrt-serve-{first.proc.pid}-")
    second = Launched("--device", "cpu", log_dir=tmp_path, env=env)
    try:
        assert not os.path.exists(left)
        assert os.path.isdir(os.path.dirname(second.address[len("ipc://"):]))
    finally:
        assert second.stop() == 0, second.log()
