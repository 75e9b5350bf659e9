"""The C++ client (cpp/include/phyrt) and examples/cpp against real ``runtime.launch`` servers.

    cmake -S examples/cpp -B BUILD; cmake --build BUILD      once per session (cpp_build), BUILD in
                                                           the session's temporary directory
    build/client_call --address ADDR   vs runtime.client.Client on the same server, same input
    build/ros_policy_node              vs a real rosmaster, driven from /usr/bin/python3 (rospy)

Skipped, with the reason, where the Debian packages are missing (``.ci/run`` installs them:
libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libroscpp-dev libstd-msgs-dev, cmake, g++).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.client import Client
from tests.conftest import pid_alive
from tests.test_launch import Launched, free_port, shm_names_of, wait_until
from tests.test_ros_example import PUBLISHER, ROS_PYTHON, _master_up, _ros_missing, _stop, _system_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = "apt-get install cmake g++ pkg-config libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libroscpp-dev libstd-msgs-dev"
OBS_DIM, HORIZON, ACT_DIM = 32, 8, 7
#: client_call's exit codes (examples/cpp/client_call.cpp)
INVALID_REQUEST, DEADLINE_EXCEEDED, SERVER_UNAVAILABLE, CONNECTION_LOST = 3, 4, 7, 8


# Compiled by the test session (roundtrip fixture) against cpp/include: one tensor of each wire dtype,
# a scalar, an empty tensor and plain values to an echo plugin; exit 0 when all come back the same.
ROUNDTRIP = r'''
// Sends one tensor of each wire dtype (and plain values) to an echo plugin; checks what comes back.
#include <phyrt/client.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::vector<std::uint8_t> bytes(64);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(i * 37 % 2 ? 1 : 0);
  std::vector<std::uint8_t> raw(64);
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<std::uint8_t>(i * 37 + 11);
  phyrt::Value::Map tensors;
  for (const auto& info : phyrt::kDTypes) {
    const std::uint8_t* data = info.dtype == phyrt::DType::boolean ? bytes.data() : raw.data();
    std::vector<std::uint64_t> shape{2, 2, 8 / info.itemsize};  // 32 bytes each
    tensors.push_back({info.name, phyrt::TensorView{info.dtype, shape, data, 32}});
  }
  tensors.push_back({"scalar", phyrt::TensorView{phyrt::DType::int64, {}, raw.data(), 8}});
  tensors.push_back({"empty", phyrt::TensorView{phyrt::DType::float32, {0, 3}, raw.data(), 0}});
  phyrt::Value payload = phyrt::Value::map(
      {{"tensors", tensors}, {"n", std::int64_t{-5}}, {"big", std::uint64_t{1} << 63}, {"x", 0.25},
       {"s", "text"}, {"flag", true}, {"none", nullptr}, {"blob", phyrt::Binary{{1, 2, 3}}},
       {"list", phyrt::Value::Array{1, "two", 3.5}}});
  phyrt::Client client(argv[1]);
  phyrt::Value echo = client.call(payload, 30.0);
  int bad = 0;
  for (const auto& sent : tensors) {
    const auto& view = std::get<phyrt::TensorView>(sent.value.v);
    const phyrt::Tensor& got = echo["tensors"][sent.key].tensor();
    bool same = got.dtype() == view.dtype && got.shape() == view.shape && got.nbytes() == view.nbytes &&
                std::memcmp(got.data(), view.data, view.nbytes) == 0;
    std::printf("%s %s %s\n", sent.key.c_str(), phyrt::dtype_name(got.dtype()), same ? "same" : "DIFFERENT");
    bad += !same;
  }
  const auto& list = echo["list"].as_array();
  bool plain = echo["n"].as_int() == -5 && std::get<std::uint64_t>(echo["big"].v) == (std::uint64_t{1} << 63) &&
               echo["x"].as_double() == 0.25 && echo["s"].as_string() == "text" && echo["flag"].as_bool() &&
               echo["none"].is_nil() && std::get<phyrt::Binary>(echo["blob"].v).bytes == std::vector<std::uint8_t>{1, 2, 3} &&
               list.size() == 3 && list[0].as_int() == 1 && list[1].as_string() == "two" && list[2].as_double() == 3.5;
  std::printf("plain values %s\n", plain ? "same" : "DIFFERENT");
  auto f32 = echo["tensors"]["float32"].tensor().to_vector<float>();
  std::printf("float32 elements %zu\n", f32.size());
  return bad || !plain;
}
'''


def _cpp_missing() -> str | None:
    for tool in ("cmake", "g++", "pkg-config"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH ({PACKAGES})"
    if subprocess.run(["pkg-config", "--exists", "libzmq"]).returncode != 0:
        return f"pkg-config finds no libzmq ({PACKAGES})"
    for header in ("zmq.hpp", "msgpack.hpp"):
        if not Path("/usr/include", header).exists():
            return f"/usr/include/{header} is missing ({PACKAGES})"
    return None


@pytest.fixture(scope="session")
def cpp_build(tmp_path_factory) -> Path:
    """The examples, built once per session (about 15 s on 2 cores) in the session's temporary
    directory, which pytest removes with its other old ones: nothing is left in /tmp for good."""
    reason = _cpp_missing()
    if reason is not None:
        pytest.skip(reason)
    for old in Path(tempfile.gettempdir()).glob("phyrt-cpp-examples-*"):  # where earlier versions built, for good
        shutil.rmtree(old, ignore_errors=True)
    build = tmp_path_factory.mktemp("cpp-examples")
    for step in (["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                 ["cmake", "--build", str(build), "-j2"]):
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (build / "client_call").exists()
    return build


@pytest.fixture(scope="session")
def roundtrip(cpp_build) -> Path:
    """ROUNDTRIP, built (unoptimized: it only checks) beside the examples."""
    source, binary = cpp_build / "roundtrip.cpp", cpp_build / "roundtrip"
    if not (binary.exists() and source.exists() and source.read_text() == ROUNDTRIP):
        source.write_text(ROUNDTRIP)
        done = subprocess.run(["g++", "-std=c++17", "-O0", f"-I{ROOT / 'cpp' / 'include'}", str(source), "-o",
                               str(binary), "-lzmq", "-pthread"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    return binary


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    """The policy demo, inline, on an ipc:// socket in a private directory."""
    tmp = tmp_path_factory.mktemp("cpp-policy")
    private = tmp / "srv"
    private.mkdir(mode=0o700)
    server = Launched("--address", f"ipc://{private}/phyrt.sock", log_dir=tmp)
    yield server
    assert server.stop() == 0, server.log()


def client_call(build: Path, address: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / "client_call"), "--address", address, *args], capture_output=True,
                          text=True, timeout=timeout)


def demo_obs(obs_dim: int = OBS_DIM) -> np.ndarray:
    """The demo's observation: element i is 0.01 * i (float32 arithmetic, as client_call computes it)."""
    return (np.float32(0.01) * np.arange(obs_dim, dtype=np.float32))[None]


@pytest.mark.timeout(900)  # the first test builds the examples (a minute or two on 2 busy cores)
def test_client_call_prints_the_actions_the_python_client_gets(cpp_build, policy_server):
    out = client_call(cpp_build, policy_server.address)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    with Client(policy_server.address) as client:
        expected = client.call({"obs": demo_obs()}, timeout=30)["actions"]
    assert printed["shape"] == [1, HORIZON, ACT_DIM] == list(expected.shape)
    got = np.asarray(printed["data"], dtype=np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(got, expected)  # the same server, the same input: the same bits


@pytest.mark.timeout(900)
def test_a_call_with_a_priority_gets_the_same_answer(cpp_build, policy_server):
    plain = client_call(cpp_build, policy_server.address)
    for priority in ("5", "-2147483648", "2147483647"):
        out = client_call(cpp_build, policy_server.address, "--priority", priority, "--calls", "2")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == json.loads(plain.stdout)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("args, sent", [(("--priority", "7"), 7), (("--priority", "-2147483648"), -2**31),
                                        ((), None), (("--priority", "0"), None)])
def test_the_priority_goes_in_the_submit_header_and_0_stays_out(cpp_build, tmp_path, args, sent):
    """What client_call sends, read by a bare ROUTER; its answer (an error) ends the call."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/r.sock"
    router.bind(address)
    proc = subprocess.Popen([str(cpp_build / "client_call"), "--address", address, "--timeout-s", "30", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        header = None
        while header is None:
            assert router.poll(30_000, zmq.POLLIN), "client_call sent no submit"
            identity, head, *frames = router.recv_multipart()
            decoded = msgpack.unpackb(head, raw=False)
            if decoded.get("op") == "submit":
                header = decoded
        assert header.get("priority", None) == sent and ("priority" in header) == (sent is not None), header
        assert list(header) == ["v", "op", "id", "timeout_s", *(["priority"] if sent is not None else []), "payload"]
        router.send_multipart([identity, msgpack.packb({"v": 1, "op": "submit", "id": header["id"], "ok": False,
                                                        "error": {"type": "InvalidRequest", "message": "seen"}})])
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        router.close()
        ctx.term()
    assert proc.returncode == INVALID_REQUEST and "InvalidRequestError: seen" in err, err


@pytest.mark.timeout(900)
def test_a_bad_request_comes_back_as_invalid_request_error(cpp_build, policy_server):
    out = client_call(cpp_build, policy_server.address, "--obs-dim", "31")
    assert out.returncode == INVALID_REQUEST, out.stdout + out.stderr
    assert out.stdout == ""
    assert "phyrt error: InvalidRequestError: ValueError: policy obs must have shape [B, 32], got [1, 31]" \
        in out.stderr, out.stderr


@pytest.mark.timeout(900)
def test_help_prints_the_options_and_exits_0(cpp_build):
    out = subprocess.run([str(cpp_build / "client_call"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: client_call --address ADDRESS") and out.stderr == ""
    assert re.search(r"--latency-out PATH .*round trip in\s+nanoseconds", out.stdout), out.stdout


@pytest.mark.timeout(900)
def test_calls_write_their_round_trips_in_nanoseconds(cpp_build, policy_server, tmp_path):
    out = client_call(cpp_build, policy_server.address, "--calls", "3", "--latency-out", str(tmp_path / "rt.json"))
    assert out.returncode == 0, out.stderr
    round_trips = json.loads((tmp_path / "rt.json").read_text())["round_trip_ns"]
    assert len(round_trips) == 3 and all(1_000 < ns < 30 * 10**9 for ns in round_trips), round_trips  # 1 µs .. 30 s


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind, why", [("missing", "no socket at {path}"), ("file", "{path} is not a socket"),
                                       ("stale", "nothing listens at {path} (connection refused")])
def test_a_wrong_ipc_address_fails_at_once_naming_the_path(cpp_build, tmp_path, kind, why):
    path = tmp_path / "phyrt.sock"
    if kind == "file":
        path.write_text("not a socket")
    elif kind == "stale":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(path))  # a socket file nobody listens on, as a killed server leaves its own
    # the old behaviour waited for heartbeat_timeout_s (20 s here, past this timeout), then "no word"
    out = client_call(cpp_build, f"ipc://{path}", "--heartbeat-timeout-s", "20", timeout=10)
    assert out.returncode == SERVER_UNAVAILABLE, out.stderr
    assert f"phyrt error: ServerUnavailableError: {why.format(path=path)}" in out.stderr, out.stderr


def _inflight(address: str) -> int:
    with Client(address) as client:
        return client.info(timeout=10)["inflight"]


def _start_held_call(build: Path, address: str, beat: tuple[str, str]) -> subprocess.Popen:
    """A client_call whose request sleeps 30 s in tests.plugins:Echo, once the server holds it."""
    before = _inflight(address)
    proc = subprocess.Popen([str(build / "client_call"), "--address", address, "--sleep-s", "30",
                             "--heartbeat-interval-s", beat[0], "--heartbeat-timeout-s", beat[1]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: _inflight(address) > before or proc.poll() is not None, 30), "never in flight"
    assert proc.poll() is None, proc.communicate()
    return proc


@pytest.mark.timeout(900)
def test_every_dtype_and_value_kind_comes_back_from_an_echo_and_errors_are_typed(cpp_build, roundtrip, tmp_path):
    private = tmp_path / "srv"
    private.mkdir(mode=0o700)
    server = Launched("--plugin", "tests.plugins:Echo", "--address", f"ipc://{private}/echo.sock", log_dir=tmp_path)
    interval, bound = 0.5, 2.0  # heartbeat_interval_s, heartbeat_timeout_s of the held calls
    try:
        echoed = subprocess.run([str(roundtrip), server.address], capture_output=True, text=True, timeout=60)
        assert echoed.returncode == 0, echoed.stdout + echoed.stderr
        for name in ("float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
                     "scalar", "empty", "plain values"):
            assert re.search(rf"^{name} (\w+ )?same$", echoed.stdout, re.M), echoed.stdout

        late = client_call(cpp_build, server.address, "--sleep-s", "2", "--timeout-s", "0.3")
        assert late.returncode == DEADLINE_EXCEEDED, late.stderr
        assert "phyrt error: DeadlineExceededError:" in late.stderr, late.stderr
        assert wait_until(lambda: _inflight(server.address) == 0, 30)

        # a stopped server: the connection stays up, so silence is what tells (the heartbeat bound)
        held = _start_held_call(cpp_build, server.address, (str(interval), str(bound)))
        server.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _, err = held.communicate(timeout=bound + interval + 20)
            waited = time.monotonic() - stopped
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert held.returncode == CONNECTION_LOST, err
        assert "phyrt error: ConnectionLostError: no word from the server" in err, err
        assert waited < bound + interval + 10, waited  # 10 s of slack for a busy 2-core machine

        # a killed server: the connection drops, and the request in flight fails at once
        held = _start_held_call(cpp_build, server.address, (str(interval), str(bound)))
        server.kill()
        killed = time.monotonic()
        _, err = held.communicate(timeout=bound + interval + 20)
        assert held.returncode == CONNECTION_LOST, err
        assert re.search(r"phyrt error: ConnectionLostError: the connection to the server at \S+ was lost", err), err
        assert time.monotonic() - killed < bound + interval + 10
    finally:
        if server.proc.poll() is None:
            server.kill()
    server.proc.stdout.close()
    # a SIGKILLed server leaves its socket file (in tmp_path); no process and no segment
    assert wait_until(lambda: not [p for p in server.pids if pid_alive(p)], 15)
    assert shm_names_of(server.pids) == []


@pytest.mark.timeout(900)
def test_ros_policy_node_publishes_the_policy_actions(cpp_build, policy_server, tmp_path):
    reason = _ros_missing()
    if reason is not None:
        pytest.skip(reason)
    if not (cpp_build / "ros_policy_node").exists():
        pytest.skip(f"ros_policy_node was not built: roscpp or std_msgs is missing ({PACKAGES})")
    rng = np.random.default_rng(11)
    obs = rng.standard_normal((3, OBS_DIM), dtype=np.float32)
    burst = rng.standard_normal((12, OBS_DIM), dtype=np.float32)
    np.save(tmp_path / "obs.npy", obs)
    np.save(tmp_path / "burst.npy", burst)
    (tmp_path / "publisher.py").write_text(PUBLISHER)
    (tmp_path / "ros").mkdir()
    ros = {"ROS_MASTER_URI": f"http://127.0.0.1:{free_port()}", "ROS_HOSTNAME": "127.0.0.1",
           "ROS_HOME": str(tmp_path / "ros"), "ROS_LOG_DIR": str(tmp_path / "ros" / "log")}
    topics = ["/phyrt_cpp_test/obs", "/phyrt_cpp_test/actions"]
    node_log = tmp_path / "node.log"
    master = node = None
    with open(tmp_path / "rosmaster.log", "w") as master_out, open(node_log, "w") as node_out:
        try:
            master = subprocess.Popen(["rosmaster", "--core", "-p", ros["ROS_MASTER_URI"].rsplit(":", 1)[1]],
                                      stdout=master_out, stderr=subprocess.STDOUT, env=_system_env(**ros),
                                      start_new_session=True)
            assert wait_until(lambda: _master_up(ros["ROS_MASTER_URI"]), 30), (tmp_path / "rosmaster.log").read_text()
            node = subprocess.Popen([str(cpp_build / "ros_policy_node"), "--address", policy_server.address,
                                     "--obs-topic", topics[0], "--action-topic", topics[1]],
                                    stdout=node_out, stderr=subprocess.STDOUT, env=_system_env(**ros))
            assert wait_until(lambda: "phyrt ros node ready" in node_log.read_text() or node.poll() is not None, 60)
            assert node.poll() is None, node_log.read_text()
            published = subprocess.run([ROS_PYTHON, str(tmp_path / "publisher.py"), str(tmp_path / "obs.npy"),
                                        str(tmp_path / "burst.npy"), str(tmp_path / "actions.json"), *topics],
                                       capture_output=True, text=True, timeout=70, env=_system_env(**ros))
            assert published.returncode == 0, published.stdout + published.stderr + node_log.read_text()
            assert _stop(node) == 0, node_log.read_text()
        finally:
            for proc in (node, master):
                if proc is not None:
                    _stop(proc)
    received = json.loads((tmp_path / "actions.json").read_text())
    with Client(policy_server.address) as client:
        expected = np.stack([client.call({"obs": row[None]}, timeout=30)["actions"][0]
                             for row in np.concatenate([obs, burst])])
    assert len(received["lockstep"]) == len(obs)
    for i, msg in enumerate(received["lockstep"]):
        assert msg["dims"] == [["horizon", HORIZON, HORIZON * ACT_DIM], ["act_dim", ACT_DIM, ACT_DIM]]
        assert msg["offset"] == 0
        np.testing.assert_array_equal(np.asarray(msg["data"], np.float32).reshape(HORIZON, ACT_DIM), expected[i])
    burst_refs = expected[len(obs):].reshape(len(burst), -1)
    matched = [int(np.abs(burst_refs - np.asarray(m["data"], np.float32)).max(axis=1).argmin())
               for m in received["burst"]]
    for m, i in zip(received["burst"], matched):
        np.testing.assert_array_equal(np.asarray(m["data"], np.float32), burst_refs[i])
    assert 1 <= len(matched) <= len(burst) and matched == sorted(set(matched)), matched
    text = node_log.read_text()
    assert "ignored an observation of 31 values" in text, text
    counts = ast.literal_eval(re.search(r"phyrt policy node closed: (\{.*?\})", text).group(1))
    assert counts["dropped_malformed"] == 1 and counts["failed"] == 0 and counts["dropped_stale"] == 0, counts
    assert counts["published"] == len(obs) + len(matched), counts
    assert counts["submitted"] + counts["dropped_busy"] + counts["dropped_malformed"] == counts["received"], counts


@pytest.mark.timeout(900)
def test_curve_the_right_server_key_is_served_a_wrong_one_is_a_handshake_error(cpp_build, tmp_path):
    import zmq

    server_public, server_secret = (key.decode() for key in zmq.curve_keypair())
    client_public, client_secret = (key.decode() for key in zmq.curve_keypair())
    server = Launched("--address", f"tcp://127.0.0.1:{free_port()}", f"--curve-secret-key={server_secret}",
                      log_dir=tmp_path)
    try:
        served = client_call(cpp_build, server.address, "--server-public-key", server_public,
                             "--secret-key", client_secret)  # the public key derived from the secret
        assert served.returncode == 0, served.stderr
        assert json.loads(served.stdout)["shape"] == [1, HORIZON, ACT_DIM]
        wrong = client_call(cpp_build, server.address, "--server-public-key", client_public,
                            "--secret-key", client_secret, "--timeout-s", "60")
        assert wrong.returncode == 9, wrong.stderr  # HandshakeError, long before the 60 s deadline
        assert "phyrt error: HandshakeError: the CURVE handshake with" in wrong.stderr, wrong.stderr
        assert "is server_public_key this server's public key?" in wrong.stderr, wrong.stderr
    finally:
        code = server.stop()
    assert code == 0, server.log()
