"""``Engine.empty``: a tensor placed where the engine's transport reads it, sent without a copy,
its memory back in the pool once the caller dropped it and every request carrying it was answered."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
from runtime.core.errors import EngineUnavailableError
from tests.conftest import close_engine, start_engine

pytestmark = pytest.mark.timeout(120)

PLUGIN = "tests.lending_plugins:Peek"
N = 1 << 16  # 256 KiB of float32: well above the inline threshold, so it would go to shared memory


@pytest.fixture(scope="module")
def local(no_leaks_at_module_end):
    engine = start_engine(PLUGIN)
    yield engine
    close_engine(engine)


@pytest.fixture(scope="module")
def inline():
    engine = Engine(EngineArgs(PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu"))))
    yield engine
    engine.close()


def read_after_write(engine, x, tmp_path, value: float) -> float:
    """Submit ``x``, write ``value`` into it, then let the plugin read: what it read first."""
    gate = tmp_path / f"gate-{os.urandom(4).hex()}"
    future = engine.submit({"x": x, "gate": str(gate)})
    x.view(-1)[0] = value
    gate.touch()
    return future.result(30)["first"]


def test_a_local_replica_reads_the_callers_very_memory(local, tmp_path):
    x = local.empty((4, N // 4))
    assert x.shape == (4, N // 4) and x.dtype == torch.float32
    x.fill_(1.0)
    assert local.step({"x": x, "gate": None}) == {"first": 1.0, "sum": float(N)}
    assert read_after_write(local, x, tmp_path, 5.0) == 5.0  # no copy was made at submit


def test_an_ordinary_tensor_is_copied_at_submit(local, tmp_path):
    x = torch.ones(N)
    assert read_after_write(local, x, tmp_path, 5.0) == 1.0


def test_slices_and_other_dtypes_cross_too(local, tmp_path):
    x = local.empty((8, N // 8), dtype=torch.float64)
    x.copy_(torch.arange(N, dtype=torch.float64).view(8, -1))
    row = x[3]
    assert local.step({"x": row, "gate": None})["sum"] == float(row.sum())
    assert read_after_write(local, row, tmp_path, -2.0) == -2.0
    ints = local.empty(N, dtype=torch.int32)
    ints.fill_(2)
    assert local.step({"x": ints, "gate": None})["sum"] == 2.0 * N


def test_the_memory_is_reused_once_dropped_and_answered(local):
    x = local.empty(N)
    x.fill_(1.0)
    local.step({"x": x, "gate": None})
    where = x.data_ptr()
    del x
    gc.collect()
    y = local.empty(N)
    assert y.data_ptr() == where  # the block went back to the pool and was taken again


def test_a_tensor_held_by_a_running_request_is_not_reused(local, tmp_path):
    x = local.empty(N)
    x.fill_(3.0)
    where = x.data_ptr()
    gate = tmp_path / "gate"
    future = local.submit({"x": x, "gate": str(gate)})
    del x
    gc.collect()  # the caller let go, the request still holds it
    y = local.empty(N)
    y.fill_(0.0)
    assert y.data_ptr() != where
    gate.touch()
    assert future.result(30) == {"first": 3.0, "sum": 3.0 * N}  # never overwritten while it ran


def test_a_tensor_of_another_or_a_closed_engine_is_copied(local, tmp_path):
    other = start_engine(PLUGIN)
    try:
        foreign = other.empty(N)
        foreign.fill_(1.0)
        assert read_after_write(local, foreign, tmp_path, 9.0) == 1.0  # copied at submit
    finally:
        close_engine(other)
    with pytest.raises(EngineUnavailableError, match="closed"):
        other.empty(N)
    foreign.fill_(4.0)  # still valid memory after its engine closed
    assert local.step({"x": foreign, "gate": None})["sum"] == 4.0 * N


def test_inline_gives_an_ordinary_tensor_that_is_read_as_it_is(inline, tmp_path):
    x = inline.empty((2, 3), dtype=torch.bfloat16)
    assert x.shape == (2, 3) and x.dtype == torch.bfloat16
    y = inline.empty(N)
    y.fill_(1.0)
    assert read_after_write(inline, y, tmp_path, 7.0) == 7.0


def test_an_empty_shape_gives_an_empty_tensor(local):
    assert local.empty((0, 5)).shape == (0, 5)


@pytest.mark.parametrize("shape, dtype, error", [
    ((-1, 2), None, ValueError), ("12", None, ValueError), ((2.0,), None, ValueError), ((True,), None, ValueError),
    ((2,), "float32", TypeError), ((2,), torch.complex64, TypeError),
])
def test_bad_arguments_are_refused(inline, shape, dtype, error):
    with pytest.raises(error):
        inline.empty(shape, dtype)


# --------------------------------------------------------------------------- Client.empty


@pytest.fixture(scope="module")
def peek_server(tmp_path_factory):
    from tests.test_launch import Launched

    launched = Launched("--plugin", PLUGIN, "--device", "cpu", "--log-level", "warning",
                        log_dir=tmp_path_factory.mktemp("peek"))
    yield launched
    if launched.proc.returncode is None:
        assert launched.stop() == 0, launched.log()


def client_read_after_write(client, x, tmp_path, value: float) -> float:
    gate = tmp_path / f"gate-{os.urandom(4).hex()}"
    future = client.submit({"x": x, "gate": str(gate)})
    x.reshape(-1)[0] = value
    gate.touch()
    return client._result(future, 30)["first"]


def test_a_same_host_client_sends_its_empty_array_without_a_copy(peek_server, tmp_path):
    import numpy as np

    from runtime.client import Client
    from runtime.transport.arena import SHM_DIR

    with Client(peek_server.address) as client:
        x = client.empty((4, N // 4))
        assert x.shape == (4, N // 4) and x.dtype == np.float32
        x.fill(1.0)
        assert client.call({"x": x, "gate": None}) == {"first": 1.0, "sum": float(N)}
        assert client_read_after_write(client, x, tmp_path, 5.0) == 5.0  # the server read our memory
        assert client_read_after_write(client, np.ones(N, np.float32), tmp_path, 5.0) == 1.0  # copied
        where = x.ctypes.data
        del x
        gc.collect()
        assert client.empty(N).ctypes.data == where  # reused once dropped and answered
        run_id = client._link.session.run_id
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"phyrt-{run_id}-")]


def test_without_shared_memory_empty_is_an_ordinary_array(peek_server):
    import numpy as np

    from runtime.client import Client

    with Client(peek_server.address, shm=False) as client:
        x = client.empty((3, 5), dtype=np.int64)
        assert x.base is None and x.shape == (3, 5) and x.dtype == np.int64
        x.fill(2)
        assert client.call({"x": x, "gate": None})["sum"] == 30.0
        with pytest.raises(TypeError):
            client.empty(3, dtype=np.complex64)
        with pytest.raises(ValueError):
            client.empty((-1,))
