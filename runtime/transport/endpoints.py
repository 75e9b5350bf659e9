"""Where a server may listen, the CURVE keys that guard it, and whether one listens at an ipc:// path.

Leaf module: imports nothing from the project, and pyzmq's ``zmq.auth`` only
when a key file is read, so that the torch-free client loads its keys from here too.

Policy (``check_address``), see also ``python -m runtime.launch --help``:
- ipc:///path: an absolute path in a directory of this user with mode 0700
  (abstract sockets have no permission check, so they are refused);
- tcp://HOST:PORT: a loopback HOST, or any HOST with the server's CURVE secret key.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class CurveKeys:
    """The server's CURVE pair (z85) and, optionally, a directory of allowed client public keys."""

    public: bytes
    secret: bytes
    authorized_clients: str | None = None


def load_key(value: str | bytes | None, secret: bool) -> bytes | None:
    """A CURVE key: 40 z85 characters, or a key file of ``zmq.auth.create_certificates``
    (a file wins: its path may be 40 characters long too)."""
    if value is None:
        return None
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) == 40 and not os.path.isfile(raw):
        return raw
    import zmq.auth

    public, secret_key = zmq.auth.load_certificate(os.fsdecode(raw))
    key = secret_key if secret else public
    if key is None:
        raise ValueError(f"{os.fsdecode(raw)} holds no secret key")
    return key


def check_address(address: str, curve: bool) -> None:
    """Refuse endpoints that would expose the server: see the module docstring of runtime.launch."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if path.startswith("@") or not path.startswith("/"):
            raise ValueError(f"{address}: use an absolute ipc:// path (abstract sockets have no permission check)")
        parent = os.path.dirname(path)
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            raise ValueError(f"{address}: the directory {parent} does not exist") from None
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{address}: the directory {parent} must belong to this user and be private "
                             f"(mode 0700, it is {stat.S_IMODE(st.st_mode):o}); mkdir -m 700 one")
        return
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
        if not _is_loopback(host) and not curve:
            raise ValueError(f"{address}: binding a non-loopback interface needs the server's CURVE secret key, "
                             "--curve-secret-key (the public key is derived from it; make a pair with python -c "
                             "\"import zmq.auth; zmq.auth.create_certificates('.', 'server')\"); "
                             "or use tcp://127.0.0.1:PORT for this host only")
        return
    raise ValueError(f"address must be ipc:///path or tcp://host:port, got {address!r}")


def ipc_unreachable(address: str) -> str | None:
    """Why no server can answer at an ``ipc://`` address: no socket file at its path, a file that
    is not a socket, or a socket nobody listens on (left by a server that is gone); None when one
    listens, or for another transport. libzmq retries such a connect silently, so without this a
    request would wait for the heartbeat timeout; a plain AF_UNIX connect tells at once."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    if path.startswith("@"):  # abstract: no file to look at, the connect alone tells
        target = "\0" + path[1:]
    else:
        target = path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"no socket at {path}"
        except OSError as exc:
            return f"cannot look at {path}: {exc.strerror}"
        if not stat.S_ISSOCK(st.st_mode):
            return f"{path} is not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a listener with a full backlog answers EAGAIN: it listens
        try:
            probe.connect(target)
        except BlockingIOError:
            return None
        except ConnectionRefusedError:
            return f"nothing listens at {path} (connection refused: a socket file left by a server that is gone?)"
        except OSError as exc:
            return f"cannot connect to {path}: {exc.strerror or exc}"
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or host name: not provably loopback
        return False
