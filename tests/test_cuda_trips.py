"""CUDA tensors make any number of trips (skipped where torch sees no CUDA device; run by
``python tests/gpu/run_all.py`` on a GPU machine).

A tensor that arrived by CUDA IPC cannot be shared again by torch; the encoder sends one device
copy of it instead (``runtime.transport.cuda_ipc``). So: a rank returns (a view of) the tensor it
received; the caller sends that result back; inline engines never copy; a served client's CUDA
tensor crosses as bytes and comes back equal.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PLUGIN = "tests.plugins:TPProbe"  # op "echo" returns request["x"] itself


def _local_engine():
    """One local rank on cuda:0."""
    from runtime import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, WorkerSupervisorConfig
    from tests.conftest import free_base_port

    args = EngineArgs(PLUGIN, None, EngineConfig(device=DeviceConfig(target="cuda")))
    return Engine(args, DeploymentConfig.local(devices=(0,), process_config=WorkerSupervisorConfig(
        base_port=free_base_port(), heartbeat_timeout_s=30.0)))


@pytest.fixture(scope="module")
def local():
    with _local_engine() as engine:
        yield engine


def test_a_rank_returns_the_cuda_tensor_it_received_and_its_views(local):
    x = torch.arange(24.0, device="cuda:0").reshape(4, 6)
    back = local.step({"op": "echo", "x": x}, timeout=60)  # in by IPC, out as one copy
    assert back.is_cuda and back.device == x.device and torch.equal(back, x)
    assert back.data_ptr() != x.data_ptr()  # a copy: writing it does not touch ours
    view = local.step({"op": "echo", "x": x[:, 1::2]}, timeout=60)  # a strided view, both ways
    assert torch.equal(view, x[:, 1::2])
    nested = local.step({"op": "echo", "x": {"a": x, "b": [x[0], torch.ones(2)]}}, timeout=60)
    assert torch.equal(nested["a"], x) and torch.equal(nested["b"][0], x[0]) and nested["b"][1].device.type == "cpu"
    assert local.replicas[0].healthy


def test_the_caller_sends_back_a_cuda_result_it_got_many_times(local):
    x = torch.randn(3, 5, device="cuda:0")
    current = x
    for _ in range(4):  # each trip in is a tensor this process received from the rank
        current = local.step({"op": "echo", "x": current}, timeout=60)
        assert torch.equal(current, x)
    view = local.step({"op": "echo", "x": current[1:, ::2]}, timeout=60)  # a view of a received tensor
    assert torch.equal(view, x[1:, ::2])
    assert local.replicas[0].healthy


def test_inline_on_cuda_returns_the_tensor_itself():
    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig

    x = torch.randn(4, device="cuda:0")
    with Engine(EngineArgs(PLUGIN, None, EngineConfig(device=DeviceConfig(target="cuda")))) as inline:
        assert inline.step({"op": "echo", "x": x}, timeout=60) is x  # no process boundary: no copy


def test_a_served_client_sends_cuda_tensors_and_gets_cuda_results_as_arrays(tmp_path):
    """The client's CUDA tensor crosses as bytes; the rank's CUDA result reaches the server by IPC
    and the client as an array; the server forwards both trips any number of times."""
    from runtime.client import Client
    from runtime.serving.server import Server

    x = torch.randn(2, 7, device="cuda:0")
    server = Server(_local_engine(), f"ipc://{tmp_path}/s.sock").start()  # its close closes the engine
    try:
        with Client(server.address) as client:
            for _ in range(3):
                back = client.call({"op": "echo", "x": x}, timeout=60)
                assert torch.equal(torch.as_tensor(back), x.cpu())
    finally:
        server.close()
