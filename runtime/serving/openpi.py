"""OpenpiDoor: an engine behind openpi's websocket policy protocol, for openpi clients as they are.

openpi's protocol (``openpi_client.WebsocketClientPolicy``): a client opens a websocket
(with the header ``Authorization: Api-Key KEY`` when the server asks for one); the server
first sends its metadata, a msgpack map; then every binary message from the client is one
observation, and the server answers each with one binary message, the result, or with a
text frame on error (the client raises ``RuntimeError`` with its text). Arrays travel in
``openpi_client.msgpack_numpy``'s format (``runtime.serving.openpi_codec``).

    door = OpenpiDoor(engine, port=8000).start()   binds, serves from a daemon thread
    door.url                                       "ws://127.0.0.1:8000"
    door.stop_accepting()                          observations get EngineUnavailable
    door.close(drain_timeout_s=10.0)               drain, close every connection, stop

Each observation becomes one ``engine.submit``, or, while its connection is the door's only one and
an inline engine holds nothing else, runs in the door's event loop at once (``Engine.inline_runner``:
as openpi's own server runs its policy, no thread hand-off either way; another connection's
observation meanwhile waits for it, as the engine's one runner would make it wait). With
``batch_dim`` (openpi's convention:
one unbatched observation in, one action chunk out) every array gains a leading
dimension of 1 and every tensor or array of the result loses it. A connection runs its
observations one after the other; connections run side by side, and ``max_inflight``
counts the observations the engine holds across all of them. An error is a text frame
``"TypeName: message"`` with phyrt's wire error types (``InvalidRequest`` for a malformed
message or one the plugin's ``validate_request`` refuses, ``Overloaded``, ``PluginError``,
``EngineUnavailable``), never a traceback; the connection goes on serving. ``GET
/healthz`` answers 200 "OK" on the same port (503 once stopping), without the key.

Metadata sent on connect: ``{"server": "phyrt", "version", "plugin", "replicas",
"batch_dim"}``, then the plugin's own when its Entry class declares a class attribute
``openpi_metadata`` (a dict of plain data, e.g. ``{"action_horizon": 8}``), then the
``metadata`` argument.

openpi's protocol has no encryption: a host other than loopback needs ``api_key``, and
then the key crosses the network in clear; put a TLS proxy in front across untrusted
networks. The door does not own the engine: close the door before the engine. Request
tensors are read-only views of the received bytes: plugins must not write into their inputs.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
import threading
from concurrent.futures import Future
from http import HTTPStatus
from typing import Any

from runtime.core.errors import EngineUnavailableError, ProtocolError, RemoteError
from runtime.serving.openpi_codec import decode_observation, encode_result, pack_metadata
from runtime.serving.outcomes import clip

try:
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.exceptions import ConnectionClosed
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("phyrt's openpi door needs websockets 13 or later: pip install 'phyrt[openpi]'") from exc

__all__ = ["OpenpiDoor", "check_openpi_host", "load_api_key"]

log = logging.getLogger("phyrt.openpi")

#: how long close() waits for the serving thread once the drain is over
_STOP_TIMEOUT_S = 10.0


def check_openpi_host(host: str, api_key: str | None) -> None:
    """ValueError for a host other than loopback without an API key (openpi's protocol has no encryption)."""
    if api_key is None and not _is_loopback(host):
        raise ValueError(f"openpi door on {host}: an interface other than loopback needs an API key "
                         "(--openpi-api-key KEY_OR_FILE); openpi's protocol has no encryption, so the key and "
                         "every observation cross the network in clear; or use --openpi-host 127.0.0.1")


def load_api_key(value: str | None) -> str | None:
    """The API key itself, or the contents (stripped) of the file that ``value`` names."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read().strip()
    if not value or any(c.isspace() for c in value):
        raise ValueError("the openpi API key must be non-empty text without whitespace")
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name or an interface: not provably loopback
        return False


class OpenpiDoor:
    """Serves ``engine`` to openpi clients on ``host:port`` (``start()`` binds; port 0: a free one)."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None,
                 batch_dim: bool = True, max_message_bytes: int = 64 << 20, max_inflight: int = 256,
                 metadata: dict[str, Any] | None = None) -> None:
        if max_inflight < 1 or max_message_bytes < 1:
            raise ValueError("max_inflight and max_message_bytes must be >= 1")
        api_key = load_api_key(api_key)
        check_openpi_host(host, api_key)
        self._engine = engine
        self._runner = engine.inline_runner()  # runs an observation here when idle; None: always submit
        self._host, self._requested_port = host, port
        self._api_key = api_key.encode() if api_key is not None else None
        self._batch_dim = bool(batch_dim)
        self._max_message_bytes = max_message_bytes
        self._max_inflight = max_inflight
        self._metadata = pack_metadata({**_engine_metadata(engine, self._batch_dim), **(metadata or {})})
        self.port: int | None = None
        self._inflight = 0
        self._accepting = True
        self._skip = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._drain_timeout_s = 0.0
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"ws://{host}:{self.port}"

    @property
    def inflight(self) -> int:
        """Observations the engine holds for this door (what ``max_inflight`` counts)."""
        return self._inflight

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> "OpenpiDoor":
        """Bind (OSError if the port is taken) and serve from a daemon thread; returns self."""
        if self._thread is not None or self._closed:
            raise RuntimeError("an OpenpiDoor starts once")
        family = socket.getaddrinfo(self._host, self._requested_port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self._host, self._requested_port), family=family)
        self.port = sock.getsockname()[1]
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(sock, ready), name="phyrt-openpi", daemon=True)
        self._thread.start()
        try:
            ready.result(_STOP_TIMEOUT_S)
        except BaseException:
            self.close(0.0)
            raise
        log.info("openpi door on %s", self.url)
        return self

    def stop_accepting(self) -> None:
        """Observations get EngineUnavailable from now on (connections stay open)."""
        self._accepting = False

    def skip_drain(self) -> None:
        """Make a ``close()`` that waits for in-flight observations stop waiting now."""
        self._accepting = False
        self._skip = True
        self._call_soon(lambda: self._idle.set())

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight observations finish for up to ``drain_timeout_s``, then
        close every connection and stop the thread (the engine stays open). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._accepting = False
        self._drain_timeout_s = max(0.0, drain_timeout_s)
        if self._thread is None:
            return
        self._call_soon(lambda: self._stop.set())
        self._thread.join(self._drain_timeout_s + _STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the openpi door's thread did not stop in time")

    def __enter__(self) -> "OpenpiDoor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call_soon(self, callback: Any) -> None:
        loop = self._loop
        if loop is not None and self._stop is not None:
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:  # the loop is closed already
                pass

    # -- the serving thread --------------------------------------------------------------

    def _run(self, sock: socket.socket, ready: Future) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock, ready))
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.exception("the openpi door stopped on an error")
        finally:
            sock.close()  # the server closed its own handle; this one is idempotent
            loop.close()

    async def _serve(self, sock: socket.socket, ready: Future) -> None:
        self._stop, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        server = await serve(self._connection, sock=sock, process_request=self._http, compression=None,
                             max_size=self._max_message_bytes)
        try:
            ready.set_result(None)
            if self._closed:  # close() came before the loop could hear it
                self._stop.set()
            await self._stop.wait()
            if self._inflight:
                log.info("openpi door: %d observation(s) in flight, draining for up to %.1f s", self._inflight,
                         self._drain_timeout_s)
                try:
                    await asyncio.wait_for(self._idle.wait(), self._drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("openpi door: %d observation(s) still in flight; dropping them", self._inflight)
        finally:
            for task in list(self._handlers):
                task.cancel()
            server.close()
            await server.wait_closed()

    def _http(self, connection: ServerConnection, request: Any) -> Any:
        """websockets' process_request: /healthz, and the API key on every upgrade."""
        if request.path.split("?", 1)[0] == "/healthz":
            if self._accepting:
                return connection.respond(HTTPStatus.OK, "OK\n")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "stopping\n")
        if self._api_key is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, b"Api-Key " + self._api_key):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "this server needs the header "
                                                                   "'Authorization: Api-Key KEY'\n")
        return None

    async def _connection(self, ws: ServerConnection) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await ws.send(self._metadata)
            async for message in ws:
                await ws.send(await self._answer(message))
        except ConnectionClosed:
            pass
        finally:
            self._handlers.discard(task)

    async def _answer(self, message: bytes | str) -> bytes | str:
        """The reply to one message: the encoded result, or an error text."""
        if isinstance(message, str):
            return "InvalidRequest: an observation is a binary msgpack message, not text"
        if not self._accepting:
            return "EngineUnavailable: the server is shutting down"
        if self._inflight >= self._max_inflight:
            return (f"Overloaded: {self._inflight} observations in flight, the server's limit "
                    f"(max_inflight {self._max_inflight}); retry later")
        try:
            request = decode_observation(message, self._batch_dim)
            if self._runner is not None and len(self._handlers) == 1:  # nobody else's message waits
                self._inflight += 1  # (the loop is busy until it returns: nothing else counts meanwhile)
                try:
                    ran, result, error = self._runner.run(request, _stay)
                finally:
                    self._inflight -= 1
                if ran:
                    return _reply(result, error, self._batch_dim)
            future = self._engine.submit(request)
        except ProtocolError as exc:
            return f"InvalidRequest: {clip(str(exc))}"
        except EngineUnavailableError as exc:
            return f"EngineUnavailable: {clip(str(exc))}"
        except Exception as exc:  # the plugin's validate_request refused it
            return f"InvalidRequest: {clip(f'{type(exc).__name__}: {exc}')}"
        self._inflight += 1
        self._idle.clear()
        try:
            await _completion(future)
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
        if future.cancelled():
            return "EngineUnavailable: the request was cancelled while queued (the engine is closing)"
        exc = future.exception()
        return _reply(None if exc is not None else future.result(), exc, self._batch_dim)


async def _completion(future: Future) -> None:
    """Wait for ``future`` without taking it over: a cancelled wait cancels a queued request."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: Any) -> None:
        try:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    future.add_done_callback(wake)
    try:
        await waiter
    except asyncio.CancelledError:
        future.cancel()
        raise


def _stay() -> None:
    """An event loop cannot hand its socket over while it runs an observation (``IdleRunner.run``)."""


def _reply(result: Any, exc: BaseException | None, batch_dim: bool) -> bytes | str:
    """The reply to a done request: its encoded result, or the error text (never a traceback)."""
    if exc is None:
        try:
            return encode_result(result, batch_dim)
        except Exception as error:  # TypeError, ValueError: a result openpi's format cannot carry
            return f"PluginError: {clip(f'the result cannot be sent: {error}')}"
    if isinstance(exc, EngineUnavailableError):
        if isinstance(exc.__cause__, RemoteError):  # the plugin raised inside a local rank
            return f"PluginError: {clip(f'{exc} (that replica is out of service now)')}"
        return f"EngineUnavailable: {clip(str(exc))}"
    return f"PluginError: {clip(f'{type(exc).__name__}: {exc}')}"


def _engine_metadata(engine: Any, batch_dim: bool) -> dict[str, Any]:
    """What every client gets on connect, before the plugin's and the caller's own."""
    from importlib import metadata

    from runtime.core.plugins import resolve_plugin

    try:
        version = metadata.version("phyrt")
    except metadata.PackageNotFoundError:
        version = "unknown"
    plugin = engine.args.plugin
    own = getattr(resolve_plugin(plugin), "openpi_metadata", None) or {}
    if not isinstance(own, dict):
        raise TypeError(f"plugin {plugin}: openpi_metadata must be a dict of plain data, got {type(own).__name__}")
    return {"server": "phyrt", "version": version, "plugin": plugin, "replicas": len(engine.replicas),
            "batch_dim": batch_dim, **own}
