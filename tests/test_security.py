"""Security properties beyond what test_server, test_launch and test_client check.

    property                                  here                                  already elsewhere
    no pickle anywhere                        no runtime module imports a pickle     -
                                              codec; a pickle (whose loading would
                                              make a directory) is refused by the
                                              server socket, a rank's inbox and
                                              control decoding, the supervisor and
                                              the wire, and is never loaded
    owner-only ipc                            the engine's run directory is 0700;    launch's default dir
                                              a path escaping a private dir by       is 0700; a 0755 dir
                                              "..", a symlink, another owner, an     is refused
                                              abstract or relative name is refused
    tcp on loopback by default                tcp://:PORT listens on 127.0.0.1 only; 0.0.0.0 without
                                              every listening socket of a local      CURVE is refused
                                              engine's ranks is loopback (the
                                              rendezvous store and gloo's pairs)
    non-loopback without CURVE refused        *, ::, an interface name, a host name, 0.0.0.0 by launch
                                              a public address; by Server() too
    CURVE with a wrong key refused            a client unknown to the server's       a plain client is
                                              authorized keys, and one with the     refused
                                              wrong server key, get no service
    a refused CURVE handshake is named        no keys, a wrong server key, an        -
                                              unknown client key: HandshakeError
                                              (a ConnectionLostError) with the
                                              cause, in under a second
    oversized message refused                 its sender loses its connection (a     5 oversized sends in
                                              typed ConnectionLostError) and gets    test_server's fuzz
                                              service again; other clients' calls
                                              all succeed meanwhile
    no traceback in client-visible errors     every error of many failing requests,  InvalidRequest replies
                                              inline and local, carries no           of the fuzz
                                              "Traceback", no 'File "', no path of
                                              this machine

One inline Echo server (``tcp://:PORT``, --max-message-bytes 1 MiB) serves most tests; the
local-replica, CURVE and run-directory tests start their own.
"""

from __future__ import annotations

import ast
import os
import pickle
import site
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from runtime import EngineUnavailableError, ProtocolError
from runtime.transport import protocol, wire
from runtime.client import (AsyncClient, Client, ConnectionLostError, DeadlineExceededError, HandshakeError,
                            PluginError, ServerError, ServerUnavailableError)
from runtime.transport.endpoints import check_address
from tests.conftest import close_engine, start_engine, supervisor_of, tp_parallel, wait_until
from tests.test_launch import ROOT, Launched, free_port

pytestmark = [pytest.mark.timeout(180)]
MAX_MESSAGE_BYTES = 1 << 20
#: module directories whose code runs in the engine, its ranks, the server or the client
RUNTIME_PACKAGES = ("runtime", "supervisor", "workers", "models")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "copyreg", "jsonpickle"}
MP_PICKLING = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Manager", "Listener", "Client"}


class _Canary:
    """Unpickling this makes a directory: proof that somebody loaded the pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "unpickled"
    yield path, pickle.dumps(_Canary(str(path)), protocol=pickle.HIGHEST_PROTOCOL)
    assert not path.exists(), "a pickle was loaded"


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """An inline Echo server on tcp://:PORT (loopback by default), 1 MiB message limit."""
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", f"tcp://:{free_port()}",
                      "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--log-level", "warning",
                      log_dir=tmp_path_factory.mktemp("echo"))
    yield server
    assert server.stop() == 0, server.log()


def raw_request(address: str, frames: list[bytes], timeout: float = 10.0) -> dict | None:
    """Send one message on a fresh DEALER; the decoded reply header, or None if none came."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close(0)
        ctx.term()


# --------------------------------------------------------------------------- no pickle


def _imports_and_calls(path: Path) -> list[str]:
    """Pickle codecs imported, and calls that unpickle (or pickle through multiprocessing), in one file."""
    tree = ast.parse(path.read_text(), str(path))
    imported = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    found += [f"imports {name}" for name in sorted(imported & PICKLE_MODULES)]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name.endswith("torch.load") and keywords.get("weights_only") != "True":
            found.append(f"{name}(...) without weights_only=True")
        if name.endswith(("np.load", "numpy.load")) and keywords.get("allow_pickle") == "True":
            found.append(f"{name}(..., allow_pickle=True)")
        if "multiprocessing" in imported and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MP_PICKLING and not name.startswith("queue."):
            found.append(f"{name}(...): multiprocessing pickles what it carries")
    return [f"{path.relative_to(ROOT)}: {item}" for item in found]


def test_no_runtime_module_imports_a_pickle_codec_or_an_unpickling_loader():
    found = []
    for package in RUNTIME_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _imports_and_calls(path)
    assert found == []


def test_every_decoder_refuses_a_pickle_and_never_loads_it(canary):
    from bench.fuzz import FuzzContext, decode_client, decode_server, decode_supervisor, decode_worker

    path, blob = canary
    as_ext = [msgpack.packb({"v": 1, "type": "request", "id": 1, "op": "submit", "ok": True,
                             "payload": msgpack.ExtType(code, blob), "result": msgpack.ExtType(code, blob)},
                            use_bin_type=True) for code in range(128)]
    context = FuzzContext()
    try:
        for data in [blob, *as_ext]:
            for decode in (decode_worker, decode_supervisor):  # a rank's inbox and control; the supervisor
                with pytest.raises(ProtocolError):
                    decode(context, data)
            with pytest.raises(ProtocolError):
                wire.unpack_message(data)
            with pytest.raises(ProtocolError):
                decode_server(context, [data])
            with pytest.raises(ProtocolError):
                decode_client(context, [data])
        # inside a tensor descriptor, where a codec might look for an object
        for code in (wire.EXT_INLINE, wire.EXT_SHM, wire.EXT_CUDA_IPC):
            data = msgpack.packb({"v": 1, "type": "t", "id": 1, "x": msgpack.ExtType(code, blob)})
            with pytest.raises(ProtocolError):
                wire.unpack_message(data, tensor_decoder=wire.TensorDecoder(allow_cuda_ipc=True))
        # as plain bytes a pickle stays bytes
        assert wire.unpack_message(wire.pack_message("t", 1, x=blob))["x"] == blob
    finally:
        context.close()


def test_the_server_refuses_a_pickle_and_echoes_pickled_bytes_as_bytes(echo, canary):
    path, blob = canary
    for frames in ([blob], [blob, blob],
                   [msgpack.packb({"v": 1, "op": "submit", "id": 1, "payload": msgpack.ExtType(80, blob)})],
                   [msgpack.packb({"v": 1, "op": "submit", "id": 2,
                                   "payload": msgpack.ExtType(protocol.EXT_FRAME, blob)}), blob]):
        reply = raw_request(echo.address, frames)
        assert reply is not None and reply["ok"] is False and reply["error"]["type"] == "InvalidRequest", reply
    with Client(echo.address) as client:
        assert client.call({"x": blob}, timeout=30) == {"x": blob}  # bytes in, the same bytes out
    time.sleep(0.5)


def test_a_pickle_from_a_rank_fails_its_group_and_is_never_loaded(canary):
    path, blob = canary
    engine = start_engine(parallel=tp_parallel(2))
    try:
        future = engine.submit({"op": "send_raw", "ranks": [1], "frames": [blob], "then_sleep": 5.0})
        exc = future.exception(timeout=30)
        assert isinstance(exc, EngineUnavailableError) and "malformed" in str(exc), repr(exc)
        assert isinstance(exc.__cause__, ProtocolError)
    finally:
        close_engine(engine)


# --------------------------------------------------------------------------- owner-only ipc


def test_a_local_engines_run_directory_and_sockets_are_owner_only():
    engine = start_engine()
    try:
        run_dir = supervisor_of(engine).run_dir
        st = os.stat(run_dir)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
        sockets = os.listdir(run_dir)
        assert {"ctl", "hb"} <= set(sockets), sockets  # requests go to the ranks through a shm ring, not a socket
        assert supervisor_of(engine).address == f"ipc://{run_dir}/ctl"
    finally:
        close_engine(engine)


def test_ipc_paths_that_escape_a_private_directory_are_refused(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    (private / "link").symlink_to(shared, target_is_directory=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    check_address(f"ipc://{private}/s.sock", curve=False)  # the good case
    refused = {
        "dot-dot out of the private dir": f"ipc://{private}/../shared/s.sock",
        "symlink to a shared dir": f"ipc://{private}/link/s.sock",
        "abstract": "ipc://@phyrt-test",
        "relative": "ipc://s.sock",
        "relative with dot-dot": f"ipc://../{private.name}/s.sock",
        "missing dir": f"ipc://{private}/nope/s.sock",
    }
    if os.getuid() == 0:  # root can hand the directory to another user
        os.chown(foreign, 65534, 65534)
        refused["another user's 0700 dir"] = f"ipc://{foreign}/s.sock"
    accepted = []
    for name, address in refused.items():
        try:
            check_address(address, curve=False)
        except ValueError:
            continue
        accepted.append(name)
    assert accepted == []
    assert not (shared / "s.sock").exists()


def test_the_server_binds_nothing_for_a_refused_address(tmp_path):
    from runtime import Engine, EngineArgs
    from runtime.serving.server import Server

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    port = free_port()
    engine = Engine(EngineArgs("tests.plugins:Echo"))
    try:
        for address in (f"ipc://{shared}/s.sock", f"tcp://0.0.0.0:{port}", f"tcp://*:{port}"):
            with pytest.raises(ValueError):
                Server(engine, address)
        assert not (shared / "s.sock").exists()
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # nothing holds the port
    finally:
        engine.close()


# --------------------------------------------------------------------------- tcp: loopback, CURVE


def test_tcp_without_a_host_listens_on_loopback_only(echo):
    listening = [c.laddr for c in psutil.Process(echo.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    port = int(echo.address.rsplit(":", 1)[1])
    assert echo.address.startswith("tcp://127.0.0.1:")
    assert [a for a in listening if a.port == port] == [("127.0.0.1", port)], listening
    assert all(_loopback(a.ip) for a in listening), listening


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "[::]", "eth0", "example.com", "192.0.2.2", "[2001:db8::1]", "0"])
def test_a_non_loopback_bind_without_curve_is_refused(host):
    with pytest.raises(ValueError, match="CURVE"):
        check_address(f"tcp://{host}:5555", curve=False)
    check_address(f"tcp://{host}:5555", curve=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "[::1]", "localhost"])
def test_a_loopback_bind_needs_no_curve(host):
    check_address(f"tcp://{host}:5555", curve=False)


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.timeout(240)
def test_every_listening_socket_of_a_local_server_and_its_ranks_is_on_loopback(tmp_path):
    server = Launched("--plugin", "tests.plugins:KillProbe", "--devices", "0,1", "--device", "cpu",
                      "--base-port", str(free_port()), "--log-level", "warning", log_dir=tmp_path)
    try:
        exposed = []
        for pid in sorted(server.pids):
            try:
                for c in psutil.Process(pid).net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN and not _loopback(c.laddr.ip):
                        exposed.append((pid, c.laddr.ip, c.laddr.port))
            except psutil.NoSuchProcess:
                pass
        assert exposed == [], f"listening beyond loopback: {exposed}"
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.timeout(240)
def test_curve_clients_with_a_wrong_key_get_no_service(tmp_path):
    import zmq.auth

    keys, allowed, other = tmp_path / "keys", tmp_path / "allowed", tmp_path / "other"
    for d in (keys, allowed, other):
        d.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    good_public, good_secret = zmq.auth.create_certificates(str(allowed), "good")
    bad_public, bad_secret = zmq.auth.create_certificates(str(other), "bad")
    wrong_server_public, _ = zmq.auth.create_certificates(str(other), "not-the-server")
    port = free_port()
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", f"tcp://127.0.0.1:{port}",
                      f"--curve-secret-key={server_secret}", f"--curve-public-key={server_public}",
                      "--curve-authorized-clients", str(allowed), "--log-level", "warning", log_dir=tmp_path)
    address = f"tcp://127.0.0.1:{port}"
    short = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5}
    try:
        with Client(address, server_public_key=server_public, public_key=good_public, secret_key=good_secret) as good:
            assert good.call({"x": 1}, timeout=30) == {"x": 1}
            for name, kwargs in {
                "a client key the server does not know": dict(server_public_key=server_public, public_key=bad_public,
                                                              secret_key=bad_secret),
                "the wrong server key": dict(server_public_key=wrong_server_public, public_key=good_public,
                                             secret_key=good_secret),
            }.items():
                with Client(address, **kwargs, **short) as intruder:
                    try:
                        answer = intruder.call({"x": "let me in"}, timeout=3)
                    except (ConnectionLostError, DeadlineExceededError):
                        answer = None
                    assert answer is None, f"served with {name}: {answer}"
                assert good.call({"x": 2}, timeout=30) == {"x": 2}
        assert "let me in" not in server.log()
    finally:
        assert server.stop() == 0, server.log()


# --------------------------------------------------------------------------- oversized messages


def test_an_oversized_message_costs_its_sender_its_connection_and_nobody_else_anything(echo):
    calls, failures, stop = [0], [], threading.Event()

    def keep_calling(client: Client) -> None:
        while not stop.is_set():
            try:
                assert client.call({"x": np.arange(1000)}, timeout=30)["x"].sum() == 499500
                calls[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

    with Client(echo.address) as good, Client(echo.address, heartbeat_interval_s=0.2,
                                               heartbeat_timeout_s=2.0) as big:
        threads = [threading.Thread(target=keep_calling, args=(good,)) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(ConnectionLostError):
                    big.call({"x": np.zeros(2 * MAX_MESSAGE_BYTES, np.uint8)}, timeout=30)
                assert time.monotonic() - started < 10
                # the sender reconnects by itself and is served again, under the limit
                assert wait_until(lambda: _served(big, np.zeros(MAX_MESSAGE_BYTES // 2, np.uint8)), 30)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert failures == [] and calls[0] > 0, (calls, failures[:3])
        assert good.info()["inflight"] == 0


def _served(client: Client, x: np.ndarray) -> bool:
    try:
        return client.call({"x": x}, timeout=5)["x"].nbytes == x.nbytes
    except (ConnectionLostError, DeadlineExceededError):
        return False


# --------------------------------------------------------------------------- no traceback in replies


def _machine_paths() -> list[str]:
    paths = {str(ROOT), sys.prefix, sys.base_prefix, tempfile.gettempdir() + "/phyrt-", os.path.expanduser("~")}
    paths |= set(site.getsitepackages())
    return sorted(p for p in paths if p and p != "/")


def assert_no_traceback(messages: list[str]) -> None:
    paths = _machine_paths()
    for message in messages:
        assert "Traceback" not in message and 'File "' not in message and ".py\", line" not in message, message
        assert not [p for p in paths if p in message], (message, paths)


def _failures(client: Client, payloads: list, timeout: float = 30) -> list[str]:
    messages = []
    for payload in payloads:
        with pytest.raises(ServerError) as info:
            client.call(payload, timeout=timeout)
        messages.append(f"{type(info.value).__name__}: {info.value}")
    return messages


def test_no_client_visible_error_of_an_inline_server_carries_a_traceback(echo):
    messages = []
    with Client(echo.address) as client:
        messages += _failures(client, [{"invalid": True}, {"raise": "KeyError", "message": "k"},
                                       {"raise": "ZeroDivisionError"}, *([{"raise": "KeyError"}] * 20)])
        with pytest.raises(DeadlineExceededError) as info:
            client.submit({"sleep": 0.5}, timeout=0.05).result(30)
        messages.append(str(info.value))
    for frames in ([b"\xc1"], [msgpack.packb({"v": 1, "op": "nope", "id": 1})],
                   [msgpack.packb({"v": 1, "op": "submit", "id": 1, "payload": msgpack.ExtType(9, b"")})],
                   [msgpack.packb({"v": 1, "op": "register", "id": 1, "run_id": "abcd", "segments": ["../x"]})]):
        reply = raw_request(echo.address, frames)
        messages.append(reply["error"]["message"])
    assert len(messages) >= 28
    assert_no_traceback(messages)


@pytest.mark.timeout(300)
def test_no_client_visible_error_of_local_replicas_carries_a_traceback(tmp_path):
    server = Launched("--plugin", "tests.plugins:KillProbe", "--devices", "0,1,2,3", "--replicas", "2",
                      "--device", "cpu", "--base-port", str(free_port(2)), "--log-level", "warning", log_dir=tmp_path)
    messages = []
    try:
        with Client(server.address) as client:
            assert client.call({"op": "echo", "x": 1}, timeout=60) == 1
            messages += _failures(client, [{"op": "nope"}, {"x": 1}] * 5)  # refused by validate_request
            with pytest.raises(PluginError) as info:  # the plugin raises on rank 1: its replica goes
                client.call({"op": "raise", "ranks": [1], "message": "on purpose"}, timeout=60)
            messages.append(str(info.value))
            assert "ZeroDivisionError" in str(info.value) and "on purpose" in str(info.value)
            with pytest.raises(PluginError) as info:  # a result the wire cannot carry: the other one goes
                client.call({"op": "unencodable"}, timeout=60)
            messages.append(str(info.value))
            for _ in range(10):  # nothing healthy is left
                with pytest.raises(ServerUnavailableError) as unavailable:
                    client.call({"op": "echo", "x": 1}, timeout=60)
                messages.append(str(unavailable.value))
            assert "no healthy replica" in messages[-1]
    finally:
        assert server.stop() == 0, server.log()
    assert_no_traceback(messages)


# --------------------------------------------------------------------------- a refused CURVE handshake

#: a refused handshake is named well before a request would fail for want of heartbeats
HANDSHAKE_BOUND_S = 5.0
SLOW_HEARTBEATS = {"heartbeat_interval_s": 10.0, "heartbeat_timeout_s": 60.0}


@pytest.fixture(scope="module")
def curve_echo(tmp_path_factory):
    """An inline Echo server on tcp://127.0.0.1:PORT with CURVE; its keys, one authorized client's
    keys, an unknown client's keys and a public key that is not the server's."""
    import zmq.auth

    root = tmp_path_factory.mktemp("curve")
    dirs = {name: root / name for name in ("server", "allowed", "other")}
    for d in dirs.values():
        d.mkdir()
    keys = {"server": zmq.auth.create_certificates(str(dirs["server"]), "server"),
            "good": zmq.auth.create_certificates(str(dirs["allowed"]), "good"),
            "unknown": zmq.auth.create_certificates(str(dirs["other"]), "unknown"),
            "not-the-server": zmq.auth.create_certificates(str(dirs["other"]), "not-the-server")}
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address",
                      f"tcp://127.0.0.1:{free_port()}", f"--curve-secret-key={keys['server'][1]}",
                      f"--curve-public-key={keys['server'][0]}", "--curve-authorized-clients", str(dirs["allowed"]),
                      "--log-level", "warning", log_dir=root)
    yield server, keys
    assert server.stop() == 0, server.log()


def _refused(client: Client, *words: str) -> HandshakeError:
    """A call and a submit both fail quickly with a HandshakeError whose message holds ``words``."""
    started = time.monotonic()
    with pytest.raises(HandshakeError) as info:
        client.call({"x": "let me in"}, timeout=30)
    assert time.monotonic() - started < HANDSHAKE_BOUND_S
    error = info.value
    assert isinstance(error, ConnectionLostError) and isinstance(error, EngineUnavailableError)
    assert client.address in str(error) and "handshake" in str(error)
    for word in words:
        assert word in str(error), str(error)
    started = time.monotonic()
    with pytest.raises(HandshakeError):  # a later request: at once, or through its future
        client.submit({"x": "again"}).result(30)
    assert time.monotonic() - started < HANDSHAKE_BOUND_S
    return error


@pytest.mark.timeout(60)
def test_a_client_without_curve_keys_is_told_the_server_requires_curve(curve_echo):
    server, _ = curve_echo
    with Client(server.address, **SLOW_HEARTBEATS) as client:
        _refused(client, "CURVE", "server_public_key")
    with Client(server.address, **SLOW_HEARTBEATS) as client:  # caught by an old except clause too
        started = time.monotonic()
        try:
            client.call({"x": 1}, timeout=30)
        except ConnectionLostError as exc:
            assert type(exc) is HandshakeError
        else:
            pytest.fail("a client without CURVE keys was served by a server that requires CURVE")
        assert time.monotonic() - started < HANDSHAKE_BOUND_S

    async def through_asyncio() -> None:
        async with AsyncClient(server.address, **SLOW_HEARTBEATS) as client:
            with pytest.raises(HandshakeError, match="CURVE"):
                await client.call({"x": 1}, timeout=30)

    import asyncio
    asyncio.run(asyncio.wait_for(through_asyncio(), HANDSHAKE_BOUND_S * 5))


@pytest.mark.timeout(60)
def test_a_client_with_the_wrong_server_key_is_told_so(curve_echo):
    server, keys = curve_echo
    with Client(server.address, server_public_key=keys["not-the-server"][0], secret_key=keys["good"][1],
                **SLOW_HEARTBEATS) as client:
        _refused(client, "CURVE", "server_public_key")
    assert "let me in" not in server.log()


@pytest.mark.timeout(60)
def test_a_client_whose_key_the_server_does_not_authorize_is_told_so(curve_echo):
    server, keys = curve_echo
    with Client(server.address, server_public_key=keys["server"][0], public_key=keys["unknown"][0],
                secret_key=keys["unknown"][1], **SLOW_HEARTBEATS) as client:
        _refused(client, "authentication refused", "authorized")
    assert "let me in" not in server.log()


@pytest.mark.timeout(60)
def test_a_client_with_the_right_keys_is_served_beside_refused_ones(curve_echo):
    server, keys = curve_echo
    good = dict(server_public_key=keys["server"][0], secret_key=keys["good"][1])
    with Client(server.address, **good) as client, Client(server.address, **SLOW_HEARTBEATS) as refused:
        assert client.call({"x": 1}, timeout=30) == {"x": 1}
        with pytest.raises(HandshakeError):
            refused.call({"x": 2}, timeout=30)
        assert [client.submit({"x": i}) for i in range(20)][-1].result(30) == {"x": 19}
        assert client.ping() < HANDSHAKE_BOUND_S


def test_a_key_file_whose_path_is_40_characters_long_is_read_as_a_file(tmp_path, monkeypatch):
    """A z85 key is 40 characters; so may be a key file's path: the file wins, a key stays a key."""
    import zmq
    import zmq.auth

    from runtime.transport.endpoints import load_key

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "s")
    public, secret = zmq.auth.load_certificate(secret_file)
    monkeypatch.chdir(tmp_path)  # a relative path of exactly 40 characters
    name = "x" * (40 - len(".key_secret")) + ".key_secret"
    os.replace(secret_file, name)
    assert len(name) == 40
    assert load_key(name, secret=True) == secret
    assert load_key(secret.decode(), secret=True) == secret  # a key given as text
    assert zmq.curve_public(load_key(name, secret=True)) == public
