"""examples/ros_policy_node.py against a real ROS 1 master; examples/ros2_policy_node.py compiles.

    rosmaster --core -p PORT        (Debian's ROS 1, system Python)
    python -m runtime.launch --address ipc://... --device cpu   (this venv: the policy demo, inline)
    /usr/bin/python3 examples/ros_policy_node.py   (rospy + the torch-free client, PYTHONPATH=repo)
    /usr/bin/python3 <publisher script>            (publishes observations, records the actions)

rospy lives in the system Python, not in this venv, so the ROS side runs as
separate ``/usr/bin/python3`` processes; the reference actions come from an inline
``Engine`` in this process, on the CPU as the server (wherever CUDA is visible too).
Skipped when ``/usr/bin/python3`` cannot import rospy (``.ci/run`` installs Debian's
packages: python3-rospy python3-rosmaster python3-std-msgs python3-zmq python3-msgpack
python3-numpy).
"""

from __future__ import annotations

import ast
import json
import os
import py_compile
import re
import shutil
import signal
import subprocess
import xmlrpc.client
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.test_launch import Launched, free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
ROS_PYTHON = "/usr/bin/python3"
OBS_DIM, HORIZON, ACT_DIM = 32, 8, 7

# Runs under /usr/bin/python3 with rospy: publishes one malformed observation, then
# OBS in lock-step (each waits for its action), then BURST back to back; writes
# every action it received, in order, as JSON.
PUBLISHER = r'''
import json, sys, threading, time
import numpy as np
import rospy
from std_msgs.msg import Float32MultiArray

obs_path, burst_path, out_path, obs_topic, action_topic = sys.argv[1:6]
obs, burst = np.load(obs_path), np.load(burst_path)
rospy.init_node("phyrt_test_publisher", disable_signals=True)
received, cond = [], threading.Condition()

def on_action(msg):
    with cond:
        received.append({"data": list(msg.data), "offset": msg.layout.data_offset,
                         "dims": [[d.label, d.size, d.stride] for d in msg.layout.dim]})
        cond.notify_all()

def wait_for(n, timeout):
    with cond:
        return cond.wait_for(lambda: len(received) >= n, timeout)

sub = rospy.Subscriber(action_topic, Float32MultiArray, on_action, queue_size=1000)
pub = rospy.Publisher(obs_topic, Float32MultiArray, queue_size=1000)
deadline = time.monotonic() + 30
while pub.get_num_connections() < 1 or sub.get_num_connections() < 1:  # the master tells both ends
    if time.monotonic() > deadline:
        sys.exit("the policy node did not connect to both topics within 30 s")
    time.sleep(0.05)
pub.publish(Float32MultiArray(data=[0.5] * 31))  # malformed: the node must ignore it
time.sleep(0.5)  # no reply to wait for; keeps it apart from the next one in the node's 1-deep queue
for i, row in enumerate(obs):
    pub.publish(Float32MultiArray(data=row.tolist()))
    if not wait_for(i + 1, 20):
        sys.exit(f"no action for observation {i} within 20 s")
for row in burst:
    pub.publish(Float32MultiArray(data=row.tolist()))
deadline, seen = time.monotonic() + 20, -1
while len(received) != seen and time.monotonic() < deadline:  # until 1 s passes with no new action
    seen = len(received)
    wait_for(seen + 1, 1.0)
with open(out_path, "w") as f:
    json.dump({"lockstep": received[:len(obs)], "burst": received[len(obs):]}, f)
rospy.signal_shutdown("done")
'''


def _ros_missing() -> str | None:
    """Why the ROS test cannot run here, or None."""
    if not os.path.exists(ROS_PYTHON):
        return f"{ROS_PYTHON} does not exist"
    probe = subprocess.run([ROS_PYTHON, "-c", "import rospy, std_msgs.msg, zmq, msgpack, numpy"],
                           capture_output=True, text=True, timeout=60, env=_system_env())
    if probe.returncode != 0:
        return (f"{ROS_PYTHON} cannot import rospy, std_msgs, zmq, msgpack and numpy "
                f"(apt-get install python3-rospy python3-rosmaster python3-std-msgs python3-zmq "
                f"python3-msgpack python3-numpy): {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    if shutil.which("rosmaster") is None:
        return "rosmaster is not on PATH (apt-get install python3-rosmaster)"
    return None


def _system_env(**extra: str) -> dict[str, str]:
    """The environment for /usr/bin/python3: nothing of this venv, no ROS settings from outside."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("ROS_")}
    return env | extra


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree(proc: subprocess.Popen) -> set[int]:
    try:
        return {proc.pid} | {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {proc.pid}


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
    """Signal and wait; SIGKILL if it does not exit in time (the caller then fails on the code)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return -9


def _master_up(uri: str) -> bool:
    try:
        code, _, _ = xmlrpc.client.ServerProxy(uri).getSystemState("/phyrt_test")
        return code == 1
    except OSError:
        return False


def _reference(obs: np.ndarray) -> np.ndarray:
    """The policy's actions for each row, one request each (as the node sends them), on the CPU
    as the test's server runs it."""
    import torch

    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig

    engine = Engine(EngineArgs(plugin="policy", config=EngineConfig(device=DeviceConfig(target="cpu"))))
    try:
        return np.stack([engine.step({"obs": torch.from_numpy(row[None])})["actions"][0].numpy() for row in obs])
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_ros_policy_node_publishes_the_policy_actions(tmp_path):
    reason = _ros_missing()
    if reason is not None:
        pytest.skip(reason)
    rng = np.random.default_rng(7)
    obs = rng.standard_normal((4, OBS_DIM), dtype=np.float32)
    burst = rng.standard_normal((20, OBS_DIM), dtype=np.float32)
    np.save(tmp_path / "obs.npy", obs)
    np.save(tmp_path / "burst.npy", burst)
    (tmp_path / "publisher.py").write_text(PUBLISHER)
    ros_home = tmp_path / "ros"
    ros_home.mkdir()
    port = free_port()
    ros = {"ROS_MASTER_URI": f"http://127.0.0.1:{port}", "ROS_HOSTNAME": "127.0.0.1",
           "ROS_HOME": str(ros_home), "ROS_LOG_DIR": str(ros_home / "log")}
    private = tmp_path / "srv"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    topics = ["/phyrt_test/obs", "/phyrt_test/actions"]

    pids: set[int] = set()
    master = node = server = None
    master_log = open(tmp_path / "rosmaster.log", "w")
    node_log_path = tmp_path / "node.log"
    node_log = open(node_log_path, "w")
    try:
        master = subprocess.Popen(["rosmaster", "--core", "-p", str(port)], stdout=master_log,
                                  stderr=subprocess.STDOUT, env=_system_env(**ros), start_new_session=True)
        server = Launched("--address", f"ipc://{private}/phyrt.sock", "--device", "cpu", log_dir=tmp_path)
        assert server.fields["plugin"] == "policy" and server.fields["mode"] == "inline"
        assert server.fields["device"] == "cpu"
        assert wait_until(lambda: _master_up(ros["ROS_MASTER_URI"]), 30), (tmp_path / "rosmaster.log").read_text()
        pids |= _tree(master)

        node = subprocess.Popen([ROS_PYTHON, "examples/ros_policy_node.py", "--address", server.address,
                                 "--obs-topic", topics[0], "--action-topic", topics[1]],
                                cwd=ROOT, stdout=node_log, stderr=subprocess.STDOUT,
                                env=_system_env(PYTHONPATH=str(ROOT), **ros))
        pids |= _tree(node)
        assert wait_until(lambda: "phyrt ros node ready" in node_log_path.read_text() or node.poll() is not None,
                          60), node_log_path.read_text()
        assert node.poll() is None, node_log_path.read_text()

        published = subprocess.run([ROS_PYTHON, str(tmp_path / "publisher.py"), str(tmp_path / "obs.npy"),
                                    str(tmp_path / "burst.npy"), str(tmp_path / "actions.json"), *topics],
                                   capture_output=True, text=True, timeout=70, env=_system_env(**ros))
        assert published.returncode == 0, published.stdout + published.stderr + node_log_path.read_text()
        received = json.loads((tmp_path / "actions.json").read_text())

        expected = _reference(np.concatenate([obs, burst]))
        # lock-step: one action chunk per observation, in order, equal to the policy's
        assert len(received["lockstep"]) == len(obs)
        for i, msg in enumerate(received["lockstep"]):
            assert msg["dims"] == [["horizon", HORIZON, HORIZON * ACT_DIM], ["act_dim", ACT_DIM, ACT_DIM]]
            assert msg["offset"] == 0 and len(msg["data"]) == HORIZON * ACT_DIM
            got = np.asarray(msg["data"], np.float32).reshape(HORIZON, ACT_DIM)
            np.testing.assert_allclose(got, expected[i], atol=1e-5, err_msg=f"observation {i}")
        # burst: at most one request in flight, so some observations are dropped; every chunk
        # published is the policy's answer to one of them, each at most once, in order
        burst_refs = expected[len(obs):].reshape(len(burst), -1)
        matched = []
        for msg in received["burst"]:
            diffs = np.abs(burst_refs - np.asarray(msg["data"], np.float32)).max(axis=1)
            assert diffs.min() < 1e-5, f"a burst action matches no burst observation (closest {diffs.min()})"
            matched.append(int(diffs.argmin()))
        assert 1 <= len(matched) <= len(burst) and matched == sorted(set(matched)), matched

        assert _stop(node) == 0, node_log_path.read_text()
        text = node_log_path.read_text()
        assert "ignored an observation of 31 values" in text, text
        assert "Traceback" not in text, text
        counts = ast.literal_eval(re.search(r"phyrt policy node closed: (\{.*?\})", text).group(1))
        # the subscriber's 1-deep queue lets rospy drop part of the burst before the callback sees it
        assert 1 + len(obs) < counts["received"] <= 1 + len(obs) + len(burst), counts
        assert counts["dropped_malformed"] == 1 and counts["failed"] == 0 and counts["dropped_stale"] == 0, counts
        assert counts["published"] == len(obs) + len(matched), counts
        assert counts["submitted"] + counts["dropped_busy"] + counts["dropped_malformed"] == counts["received"]
        print(f"\nROS node: {len(obs)} lock-step chunks equal to the policy's; burst of {len(burst)}: "
              f"{counts['received'] - 1 - len(obs)} reached the callback, {len(matched)} published, "
              f"{counts['dropped_busy']} dropped while busy; counts {counts}")
    finally:
        for proc in (node, master):
            if proc is not None:
                pids |= _tree(proc) if proc.poll() is None else set()
                _stop(proc)
        code = server.stop() if server is not None else 0
        master_log.close()
        node_log.close()
    assert code == 0, server.log()
    assert wait_until(lambda: not [p for p in pids if _alive(p)], 15), [p for p in pids if _alive(p)]


@pytest.mark.timeout(60)
def test_ros2_example_compiles(tmp_path):
    """rclpy is not installable here: the ROS 2 node is only compiled, never run."""
    py_compile.compile(str(ROOT / "examples" / "ros2_policy_node.py"), cfile=str(tmp_path / "ros2.pyc"),
                       doraise=True)
