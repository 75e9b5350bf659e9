"""The openpi door (runtime.serving.openpi) as openpi's own client sees it.

The real ``openpi_client`` (WebsocketClientPolicy, ActionChunkBroker) talks to an
in-process ``OpenpiDoor`` over inline engines of the ``policy`` demo and of
``tests.plugins:Echo``; hand-made messages check what the door refuses. One launched
server (``--openpi-port 0``) checks the ready line, the same answer as runtime.client,
and a clean SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import torch

pytest.importorskip("openpi_client")

from openpi_client.action_chunk_broker import ActionChunkBroker  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from runtime import Engine, EngineArgs  # noqa: E402
from runtime.serving.openpi import OpenpiDoor  # noqa: E402
from tests import plugins  # noqa: E402
from tests.test_launch import ROOT, Launched, run_launch  # noqa: E402

pytestmark = pytest.mark.timeout(60)

OBS_DIM = 32


@pytest.fixture(scope="module")
def policy_engine():
    with Engine(EngineArgs(plugin="policy", plugin_args={"obs_dim": OBS_DIM})) as engine:
        yield engine


@pytest.fixture(scope="module")
def echo_engine():
    with Engine(EngineArgs(plugin="tests.plugins:Echo")) as engine:
        yield engine


@pytest.fixture(scope="module")
def door(policy_engine):
    with OpenpiDoor(policy_engine, metadata={"robot": "arm"}).start() as door:
        yield door


@pytest.fixture()
def client(door):
    policy = WebsocketClientPolicy(door.url)
    yield policy
    policy._ws.close()


def _obs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(OBS_DIM).astype(np.float32)


def _actions(engine, obs: np.ndarray) -> np.ndarray:
    """The engine's own actions for a batch ``obs``, as numpy: read on the CPU, since the policy
    engine runs where DeviceConfig "auto" puts it (CUDA when visible), as the door's results do."""
    return engine.step({"obs": torch.from_numpy(obs)})["actions"].cpu().numpy()


def _array(data: bytes, dtype: str, shape: list) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def test_metadata_names_the_server_plugin_replicas_and_the_callers_own(client):
    assert client.get_server_metadata() == {"server": "phyrt", "version": client.get_server_metadata()["version"],
                                            "plugin": "policy", "replicas": 1, "batch_dim": True, "robot": "arm"}


def test_infer_gives_the_engines_actions_for_one_unbatched_observation(client, policy_engine):
    obs = _obs(1)
    result = client.infer({"obs": obs})
    expected = _actions(policy_engine, obs[None])[0]
    assert result["actions"].shape == (8, 7) and result["actions"].dtype == np.float32
    np.testing.assert_array_equal(result["actions"], expected)


def test_action_chunk_broker_steps_through_a_chunk_then_asks_again(client, policy_engine):
    broker = ActionChunkBroker(client, action_horizon=8)
    first, second = _obs(2), _obs(3)
    chunk = _actions(policy_engine, first[None])[0]
    steps = [broker.infer({"obs": first})["actions"] for _ in range(8)]
    np.testing.assert_array_equal(np.stack(steps), chunk)
    after = broker.infer({"obs": second})["actions"]  # the chunk is used up: a new inference
    np.testing.assert_array_equal(after, _actions(policy_engine, second[None])[0, 0])


@pytest.mark.parametrize("obs, expected", [
    ({"ob": _obs()}, "exactly the key 'obs'"),
    ({"obs": _obs()[:5]}, "shape [B, 32]"),
])
def test_a_refused_observation_raises_invalid_request_and_the_next_call_works(client, obs, expected):
    with pytest.raises(RuntimeError, match="InvalidRequest") as info:
        client.infer(obs)
    assert expected in str(info.value) and "Traceback" not in str(info.value)
    assert client.infer({"obs": _obs()})["actions"].shape == (8, 7)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


GOOD = msgpack.packb({"obs": _array(_obs().tobytes(), "<f4", [OBS_DIM])})


@pytest.mark.parametrize("message, expected", [
    (msgpack.packb({"obs": _array(b"\0" * 8 * OBS_DIM, "|O", [OBS_DIM])}), "dtype '|O' is not allowed"),
    (msgpack.packb({"obs": _array(b"\0" * 4, "<f4", [OBS_DIM])}), "needs 128 bytes, got 4"),
    (msgpack.packb({"obs": _array(b"", "<f4", [-1])}), "shape entries must be ints"),
    (msgpack.packb({"obs": _array(b"\2", "|b1", [1])}), "bytes other than 0 and 1"),
    (msgpack.packb({"obs": {b"__ndarray__": True, b"data": b""}}), "exactly the keys"),
    (msgpack.packb({b"obs": 1}), "map keys must be str"),
    (msgpack.packb({"obs": msgpack.ExtType(5, b"x")}), "extension types"),
    (msgpack.packb({"obs": {b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}}), "not a value of dtype uint8"),
    (msgpack.packb({"obs": _nested(40)}), "nested deeper"),
    (b"\xc1garbage", "not a msgpack message"),
    ("text", "binary msgpack message, not text"),
])
def test_malformed_messages_get_an_invalid_request_text_frame_and_the_connection_serves_on(door, message, expected):
    with connect(door.url, max_size=None) as ws:
        ws.recv()  # the metadata
        ws.send(message)
        reply = ws.recv()
        assert isinstance(reply, str) and reply.startswith("InvalidRequest: ") and expected in reply, reply
        ws.send(GOOD)
        assert msgpack.unpackb(ws.recv())["actions"][b"shape"] == [8, 7]


def test_healthz_answers_200_ok_on_the_same_port(door):
    with urllib.request.urlopen(door.url.replace("ws://", "http://") + "/healthz", timeout=10) as response:
        assert response.status == 200 and response.read() == b"OK\n"


def test_api_key_refuses_a_client_without_it_and_serves_one_with_it(policy_engine, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    with OpenpiDoor(policy_engine, api_key=str(key_file)).start() as door:
        for wrong in (None, "other"):
            with pytest.raises(InvalidStatus, match="401"):
                WebsocketClientPolicy(door.url, api_key=wrong)
        policy = WebsocketClientPolicy(door.url, api_key="s3cret")
        try:
            assert policy.infer({"obs": _obs()})["actions"].shape == (8, 7)
        finally:
            policy._ws.close()


def test_a_host_other_than_loopback_needs_an_api_key(policy_engine):
    with pytest.raises(ValueError, match="needs an API key"):
        OpenpiDoor(policy_engine, host="0.0.0.0")


def test_without_batch_dim_arrays_pass_unchanged(policy_engine):
    with OpenpiDoor(policy_engine, batch_dim=False).start() as door:
        policy = WebsocketClientPolicy(door.url)
        try:
            assert policy.get_server_metadata()["batch_dim"] is False
            obs = np.stack([_obs(4), _obs(5)])
            result = policy.infer({"obs": obs})
            np.testing.assert_array_equal(result["actions"], _actions(policy_engine, obs))
        finally:
            policy._ws.close()


def test_echo_round_trips_dtypes_scalars_and_plain_values(echo_engine):
    obs = {"image": np.arange(24, dtype=np.uint8).reshape(2, 3, 4), "mask": np.array([True, False]),
           "state": np.float32(1.5), "prompt": "pick up the cube", "nested": {"joints": np.zeros(0, np.int64)}}
    with OpenpiDoor(echo_engine).start() as door:
        policy = WebsocketClientPolicy(door.url)
        try:
            result = policy.infer(obs)
        finally:
            policy._ws.close()
    for key in ("image", "mask"):
        np.testing.assert_array_equal(result[key], obs[key])
        assert result[key].dtype == obs[key].dtype
    # a numpy scalar becomes a tensor of shape [1] for the plugin, and comes back a 0-d array
    assert result["state"].shape == () and result["state"].dtype == np.float32 and result["state"] == 1.5
    assert result["prompt"] == "pick up the cube" and result["nested"]["joints"].shape == (0,)


def test_plugin_errors_and_overload_are_text_frames_across_connections(echo_engine):
    plugins.gate.clear()
    with OpenpiDoor(echo_engine, max_inflight=1).start() as door:
        held, other = WebsocketClientPolicy(door.url), WebsocketClientPolicy(door.url)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(held.infer, {"wait_gate": True, "x": np.ones(3, np.float32)})
                assert _until(lambda: door.inflight == 1)
                with pytest.raises(RuntimeError, match="Overloaded"):
                    other.infer({"x": np.ones(3, np.float32)})
                plugins.gate.set()
                np.testing.assert_array_equal(waiting.result(30)["x"], np.ones(3, np.float32))
            with pytest.raises(RuntimeError, match="PluginError: KeyError"):
                other.infer({"raise": "KeyError"})
            with pytest.raises(RuntimeError, match="InvalidRequest: ValueError: request marked invalid"):
                other.infer({"invalid": True})
            assert other.infer({"ok": np.int32(3)})["ok"] == 3
        finally:
            plugins.gate.set()
            held._ws.close()
            other._ws.close()


def test_many_connections_at_once_each_get_their_own_answers(door, policy_engine):
    def run(seed: int) -> None:
        policy = WebsocketClientPolicy(door.url)
        try:
            for i in range(5):
                obs = _obs(seed * 100 + i)
                expected = _actions(policy_engine, obs[None])[0]
                np.testing.assert_array_equal(policy.infer({"obs": obs})["actions"], expected)
        finally:
            policy._ws.close()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(run, seed) for seed in range(8)]:
            future.result(50)


class _EchoWithMetadata(plugins.Echo):
    openpi_metadata = {"action_horizon": 4, "robot": "from the plugin"}


def test_a_plugins_openpi_metadata_is_sent_and_the_callers_own_comes_last():
    from runtime import register_plugin

    register_plugin("openpi-test-echo")(_EchoWithMetadata)
    with Engine(EngineArgs(plugin="openpi-test-echo")) as engine:
        with OpenpiDoor(engine, metadata={"robot": "from the caller"}).start() as door:
            policy = WebsocketClientPolicy(door.url)
            policy._ws.close()
    metadata = policy.get_server_metadata()
    assert metadata["action_horizon"] == 4 and metadata["robot"] == "from the caller"
    assert metadata["plugin"] == "openpi-test-echo"


def test_a_result_without_the_batch_dimension_cannot_be_sent():
    from runtime.serving.openpi_codec import encode_result

    with pytest.raises(TypeError, match=r"result.actions: shape \[3, 2\] has no leading batch dimension of 1"):
        encode_result({"actions": torch.zeros(3, 2)}, batch_dim=True)
    with pytest.raises(TypeError, match="result.x: a value of type object cannot be sent"):
        encode_result({"x": object()}, batch_dim=True)
    assert msgpack.unpackb(encode_result({"a": torch.ones(1, 2, dtype=torch.bfloat16)}, True))["a"][b"dtype"] == "<f4"


DECODE_WARNS_NOTHING = r"""
import warnings
import numpy as np
from openpi_client import msgpack_numpy
from runtime.serving.openpi_codec import decode_observation
message = msgpack_numpy.packb({"image": np.zeros((2, 3), np.uint8), "gripper": np.array([5], np.uint8)})
warnings.simplefilter("error")  # torch's "The given buffer is not writable" would raise here
obs = decode_observation(message, batch_dim=True)
obs["gripper"] += 1  # a plugin that normalizes in place
obs["image"][0, 0, 0] = 7
assert obs["gripper"].tolist() == [[6]] and obs["image"].sum() == 7
assert bytes([5])[0] == 5, bytes([5])  # the interpreter's shared one-byte object is untouched
print("ok")
"""


def test_decoding_an_observation_warns_nothing_and_its_tensors_are_the_plugins_to_write():
    # a fresh interpreter: torch warns of a non-writable buffer once per process, so an earlier
    # test of this session may have used that warning up
    out = subprocess.run([sys.executable, "-c", DECODE_WARNS_NOTHING], cwd=ROOT, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def test_a_lone_connection_s_observation_runs_in_the_door_and_others_keep_the_engine_s_thread(echo_engine):
    """With one connection and an idle inline engine, an observation runs in the door's event loop
    (no thread hand-off, as openpi's own server does); with two, each goes to the engine's runner,
    so one connection's observation never holds another's messages."""
    with OpenpiDoor(echo_engine).start() as door:
        first = WebsocketClientPolicy(door.url)
        try:
            assert first.infer({"thread": True})["thread"] == "phyrt-openpi"
            second = WebsocketClientPolicy(door.url)
            try:
                assert _until(lambda: len(door._handlers) == 2)
                assert first.infer({"thread": True})["thread"].startswith("phyrt-inline-")
                assert second.infer({"thread": True})["thread"].startswith("phyrt-inline-")
            finally:
                second._ws.close()
            assert _until(lambda: len(door._handlers) == 1)
            assert first.infer({"thread": True})["thread"] == "phyrt-openpi"
            with pytest.raises(RuntimeError, match="PluginError: ZeroDivisionError: boom"):  # typed, here too
                first.infer({"raise": "ZeroDivisionError"})
            assert first.infer({"n": 1}) == {"n": 1}  # and the connection goes on
        finally:
            first._ws.close()


def test_close_drains_then_disconnects_and_frees_the_port(echo_engine):
    plugins.gate.clear()
    door = OpenpiDoor(echo_engine).start()
    policy = WebsocketClientPolicy(door.url)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(policy.infer, {"wait_gate": True})
            assert _until(lambda: door.inflight == 1)
            threading.Timer(0.3, plugins.gate.set).start()
            door.close(drain_timeout_s=20)  # the held request finishes within the drain
            assert waiting.result(10) == {"wait_gate": True}
        with pytest.raises(Exception):
            policy.infer({})
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(door.url.replace("ws://", "http://") + "/healthz", timeout=5)
    finally:
        plugins.gate.set()
        policy._ws.close()
        door.close()


def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# --------------------------------------------------------------------------- python -m runtime.launch


@pytest.mark.timeout(240)
def test_launched_openpi_door_answers_as_runtime_client_does_and_stops_cleanly(tmp_path):
    from runtime.client import Client

    server = Launched("--device", "cpu", "--openpi-port", "0", log_dir=tmp_path)
    try:
        url = server.fields["openpi"]
        assert url.startswith("ws://127.0.0.1:")
        obs = _obs(7)
        policy = WebsocketClientPolicy(url)
        try:
            via_openpi = policy.infer({"obs": obs})["actions"]
        finally:
            policy._ws.close()
        with Client(server.address) as client:
            via_zmq = client.submit({"obs": obs[None]}, timeout=30).result()["actions"]
        np.testing.assert_array_equal(via_openpi, via_zmq[0])
    finally:
        code = server.stop()
    assert code == 0, server.log()


@pytest.mark.timeout(60)
def test_help_lists_the_openpi_options_and_says_the_protocol_has_no_encryption():
    out = run_launch("--help", timeout=50)
    text = " ".join(out.stdout.split())
    for option in ("--openpi-port", "--openpi-host", "--openpi-api-key", "--openpi-no-batch-dim"):
        assert option in text
    assert "NO encryption" in text


@pytest.mark.timeout(120)
def test_launch_refuses_a_non_loopback_openpi_host_without_an_api_key():
    out = run_launch("--device", "cpu", "--openpi-port", "0", "--openpi-host", "0.0.0.0")
    assert out.returncode == 1, out.stderr
    assert "needs an API key" in out.stderr and "--openpi-api-key" in out.stderr
    assert "phyrt ready" not in out.stdout
