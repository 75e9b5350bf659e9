"""Peers that ``python -m bench`` measures next to phyrt: Ray actors and a msgpack-numpy websocket server.

    WebsocketPeer   websockets.sync client  ==ws://127.0.0.1==>  asyncio websockets server (spawned
                    msgpack-numpy encode/decode                   process): decode, re-encode, send back
    RayPeer         ray.get(actor.echo.remote(x))  ==========>   a Ray actor (its own worker process)
                    numpy arrays go through Ray's shared-memory object store

The websocket pair is the style many robot-policy servers use: every message is one
msgpack document in which a numpy array is a map ``{"__ndarray__": True, "dtype":
"<f4", "shape": [...], "data": <bytes>}`` (``tobytes`` to send, ``np.ndarray(buffer=...)``
to receive); ``max_size=None`` and ``compression=None`` on both ends, as those servers set.

Both peers echo what they get. Neither is imported by phyrt; each is optional: a peer
whose package is missing or that does not start raises ``PeerUnavailable`` with the
reason, and its rows say "not available: <reason>". No pickle crosses a phyrt socket:
Ray pickles inside Ray, which is the point of comparing against it.

The module imports no torch and no ray at its top level: the websocket server is a
spawned child and starts in a fraction of a second.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np

from bench.common import exit_with_parent, join_or_kill

REPLY_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why."""


# --------------------------------------------------------------------------- msgpack-numpy


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "VOc":
            raise TypeError(f"msgpack-numpy does not carry dtype {obj.dtype}")
        return {"__ndarray__": True, "data": obj.tobytes(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {"__npgeneric__": True, "data": obj.item(), "dtype": obj.dtype.str}
    raise TypeError(f"cannot msgpack {type(obj).__name__}")


def _unpack_hook(obj: dict) -> Any:
    if "__ndarray__" in obj:
        return np.ndarray(buffer=obj["data"], dtype=np.dtype(obj["dtype"]), shape=tuple(obj["shape"]))
    if "__npgeneric__" in obj:
        return np.dtype(obj["dtype"]).type(obj["data"])
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False)


# --------------------------------------------------------------------------- websocket server (child process)


def _websocket_echo_server(conn: Any) -> None:
    """An asyncio websockets server on 127.0.0.1 (a free port, sent back on ``conn``) that
    decodes each message with msgpack-numpy and sends its re-encoding back."""
    exit_with_parent()

    async def handler(ws: Any) -> None:
        async for message in ws:
            await ws.send(packb(unpackb(message)))

    serve_websocket(handler, conn)


def serve_websocket(handler: Any, conn: Any) -> None:
    """Serve ``handler`` with asyncio websockets on 127.0.0.1, a free port sent on ``conn``,
    until the process is terminated (no compression, no size limit)."""
    import asyncio

    from websockets.asyncio.server import serve

    async def main() -> None:
        async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None) as server:
            conn.send(server.sockets[0].getsockname()[1])
            conn.close()
            await asyncio.Future()  # until terminated

    asyncio.run(main())


class WebsocketPeer:
    label = "msgpack-numpy over websocket ws://127.0.0.1 (peer)"

    def __init__(self, mp: Any) -> None:
        try:
            from websockets.sync.client import connect
        except ImportError as exc:
            raise PeerUnavailable(f"the websockets package does not import ({exc}); pip install -e '.[bench]'")
        here, there = mp.Pipe(duplex=False)
        self.process = mp.Process(target=_websocket_echo_server, args=(there,), name="bench-websocket-echo",
                                  daemon=True)
        self.process.start()
        there.close()
        try:
            if not here.poll(START_TIMEOUT_S):
                raise PeerUnavailable(f"the websocket server did not start in {START_TIMEOUT_S:g} s "
                                      f"(exit code {self.process.exitcode})")
            port = here.recv()
        except EOFError:
            self.process.join(5)
            raise PeerUnavailable(f"the websocket server exited at start (exit code {self.process.exitcode})") \
                from None
        finally:
            here.close()
        self._ws = connect(f"ws://127.0.0.1:{port}", max_size=None, compression=None, open_timeout=START_TIMEOUT_S)

    def call(self, request: Any) -> Any:
        self._ws.send(packb(request))
        return unpackb(self._ws.recv(REPLY_TIMEOUT_S))

    def close(self) -> None:
        self._ws.close()
        self.process.terminate()
        join_or_kill(self.process)


# --------------------------------------------------------------------------- Ray


class RayPeer:
    """A Ray actor that returns its argument; ``call`` is ``ray.get(actor.echo.remote(x))``."""

    label = "Ray actor, ray.get(actor.echo.remote(x)) (peer)"

    def __init__(self, object_store_mib: int = 1024) -> None:
        try:
            import ray
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
            raise PeerUnavailable(f"ray does not import ({type(exc).__name__}: {exc}); "
                                  "pip install -e '.[bench]'") from None
        self._ray = ray
        try:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                     object_store_memory=object_store_mib * (1 << 20), logging_level="ERROR")

            class Echo:  # defined here, so that Ray ships it by value (workers need not import bench)
                def echo(self, x: Any) -> Any:
                    return x

            self._actor = ray.remote(num_cpus=0)(Echo).remote()
            ray.get(self._actor.echo.remote(None), timeout=START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise PeerUnavailable(f"ray did not start ({type(exc).__name__}: {str(exc)[:200]})") from None

    def call(self, request: Any) -> Any:
        return self._ray.get(self._actor.echo.remote(request), timeout=REPLY_TIMEOUT_S)

    def close(self) -> None:
        try:
            self._ray.shutdown()
        except Exception:  # noqa: BLE001 - shutting down a half-started Ray
            pass
