"""``RoutingClient``: one client over several servers, what ``Client([address, ...])`` returns.

Torch-free, like ``Client``: it holds one single-address ``Client`` per server and sends
each request whole to one of them, chosen as the engine's dispatcher chooses replicas
(``runtime.client.rotation``: fewest in flight, ties round-robin). Nothing is relayed:
the request and its reply go straight between the caller and that server.

    caller: submit(p) / call(p) / stream(p) / ping()
      Rotation.choose() -> server (its in flight +1) -> server.client.submit / call / ping,
                           or a stream started on it (in flight until its final reply)
      <- the server's future; its done callback: Rotation.release (in flight -1; a
         ServerUnavailableError, ConnectionLostError included, takes the server out)
    info(): every server's ``info`` at once (a server not UP: a ping first), with its state in the
      rotation; an answer that shows a server serving puts it in the rotation, as a probe would
    each server's link thread: its ``on_failure`` (lost, restarted, refused, no word for
      heartbeat_timeout_s) -> Rotation.failed: out of the rotation at once
    a LinkThread "phyrt-routing", its one end ``Timers`` ticking every
    ``min(0.1, heartbeat_interval_s / 2)`` s: Rotation.check(); a server out (or not yet
      answered) due for a probe: ping, then info (accepting, a healthy replica) -> back in
      the rotation, else the next probe after a longer wait; ``refresh`` given: every
      ``refresh_interval_s`` its addresses replace the list

Invariants:
- A request is never retried once sent: a server's failure fails its own in-flight
  requests with the typed error (``ConnectionLostError`` for a lost connection), which
  names the server. A ``submit`` that a server's client refused before sending it (closed,
  handshake refused) goes to the next server.
- With no server in the rotation a request fails at once with ``ServerUnavailableError``,
  whose ``causes`` name each server's last cause.
- Every future it returns is its server's own (``request_id``), with ``server`` (the address).
- ``close()`` stops the timers' thread, then closes every server's client (what is in flight fails
  with ``ConnectionLostError``). A server dropped from the list by ``set_addresses`` is closed
  the same way at once.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Sequence

from runtime.client.server_errors import ServerUnavailableError
from runtime.client.rotation import UP, Rotation, Server, Timers
from runtime.core.futures import resolve
from runtime.core.priority import check_priority
from runtime.link.link_thread import LinkThread

__all__ = ["RoutingClient"]

log = logging.getLogger("phyrt.client")
_NO_EXTRA: dict[str, Any] = {}


class RoutingClient:
    """One client over several phyrt servers, with ``Client``'s verbs; ``Client([address, ...])``.

    ``client_class`` makes the single-address client of each server, with
    ``client_kwargs`` (``Client``'s keyword arguments: CURVE keys, heartbeats, ...).
    ``refresh``, if given, returns the current address list; it is called every
    ``refresh_interval_s`` from the routing thread (it should answer within a second).
    """

    def __init__(self, addresses: Sequence[str], client_class: Callable[..., Any], *,
                 refresh: Callable[[], Sequence[str]] | None = None, refresh_interval_s: float = 1.0,
                 **client_kwargs: Any) -> None:
        check_addresses(addresses)
        if refresh is not None and not callable(refresh):
            raise TypeError(f"refresh must be a callable returning addresses, got {refresh!r}")
        if not refresh_interval_s > 0:
            raise ValueError(f"refresh_interval_s must be > 0, got {refresh_interval_s!r}")
        interval = client_kwargs.get("heartbeat_interval_s", 1.0)
        timeout = client_kwargs.get("heartbeat_timeout_s", 5.0)
        self._rotation = Rotation(functools.partial(client_class, **client_kwargs), timeout)
        self._stream_type = getattr(client_class, "stream_type", None)  # Client's: its ClientStream
        self._refresh, self._refresh_interval = refresh, refresh_interval_s
        self._close_lock = threading.Lock()
        self._closed = False
        try:
            self._rotation.set_addresses(addresses)
        except BaseException:
            self._close_servers(self._rotation.servers)
            raise
        self._thread = LinkThread("phyrt-routing")
        self._thread.add(Timers(self._rotation, min(0.1, interval / 2), refresh and self._refresh_now,
                                refresh_interval_s))
        self._thread.start()

    @property
    def addresses(self) -> list[str]:
        """The servers' addresses, in the order they were listed."""
        return [s["address"] for s in self._rotation.report()]

    # -- the verbs ---------------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None, priority: int = 0) -> Future:
        """Send one request to the chosen server; its Future (with ``server``, the address).

        ``ServerUnavailableError`` at once when no server is in the rotation. ``priority``: as
        ``Client.submit``'s (checked before a server is chosen), for the chosen server's queue."""
        extra = _priority_keyword(priority)
        tried: set[str] = set()
        while True:
            server, epoch = self._choose(tried)
            try:
                future = server.client.submit(payload, timeout=timeout, **extra)
            except ServerUnavailableError as exc:  # refused before it was sent (closed, handshake refused)
                self._rotation.release(server, epoch, exc)
                tried.add(server.address)
                continue
            except BaseException:
                self._rotation.release(server, epoch)
                raise
            future.server = server.address  # type: ignore[attr-defined]
            future.add_done_callback(functools.partial(self._finished, server, epoch))
            return future

    def call(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> Any:
        """``Client.call`` on the chosen server (the caller reads its own answer)."""
        extra = _priority_keyword(priority)
        server, epoch = self._choose()
        error: BaseException | None = None
        try:
            return server.client.call(payload, timeout, **extra)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._rotation.release(server, epoch, error)

    def stream(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> Any:
        """``Client.stream`` on the chosen server: the whole stream goes to that one server (a ``ClientStream``)."""
        return self._start_stream(payload, timeout, lambda address: self._stream_type(address, timeout), priority)

    def empty(self, shape: Any, dtype: Any = None) -> Any:
        """An ordinary numpy array (``Client.empty`` lends one server's shared memory; a request
        here may go to any server, so it is sent as a copy)."""
        import numpy as np

        return np.empty(shape, np.float32 if dtype is None else dtype)

    def cancel(self, future: Future, timeout: float = 5.0) -> bool:
        """Ask the future's server to cancel it; True if it was still queued and is dropped."""
        server = self._rotation.by_address(getattr(future, "server", None))
        if server is None:
            raise ValueError("not a future returned by this client's submit() (or its server was removed)")
        return server.client.cancel(future, timeout)

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to the server the next request would go to, in seconds."""
        server, epoch = self._choose()
        error: BaseException | None = None
        try:
            return server.client.ping(timeout)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._rotation.release(server, epoch, error)

    def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """Every server: ``address``, ``state`` ("up", "starting" or "down"), ``in_rotation``,
        ``inflight`` (this client's), ``served``, ``cause`` (why it last left), and ``info`` (the
        server's own answer) or ``error`` (why there is none); ``in_rotation``, the count. A server
        whose answer shows it serving is "up" (in the rotation from then on, as after a probe)."""
        gathered, futures = self._gather_info()
        wait_futures(list(futures.values()), timeout)
        if not gathered.done():
            resolve(gathered, self._rotation.report_with(futures))
        return gathered.result()

    def close(self) -> None:
        """Stop probing, close every server's client (what is in flight fails). Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.stop():
            self._thread.dispose()
        self._close_servers(self._rotation.servers)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Replace the list: new servers join (probed at once), dropped ones are closed."""
        check_addresses(addresses)
        with self._close_lock:  # not while close() runs: a server added then would never be closed
            if self._closed:
                raise ServerUnavailableError("this routing client is closed")
            removed = self._rotation.set_addresses(addresses)
        self._close_servers(removed)

    def __enter__(self) -> "RoutingClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- for AsyncClient ---------------------------------------------------------------

    def _control_async(self, op: str) -> Future:
        """``ping`` to the chosen server, or ``info`` of every server; a future nobody here waits on."""
        if op == "info":
            return self._gather_info()[0]
        if op != "ping":
            raise ValueError(f"a routing client sends ping or info, not {op!r}")
        server, epoch = self._choose()
        try:
            future = server.client._control_async(op)
        except BaseException as exc:
            self._rotation.release(server, epoch, exc)
            raise
        future.add_done_callback(functools.partial(self._finished, server, epoch))
        return future

    def _start_stream(self, payload: Any, timeout: float | None, make: Callable[[str], Any], priority: int = 0) -> Any:
        """A stream (``make(address)``: a ``ClientStream`` or ``AsyncClientStream``) started on the
        chosen server, as that server's ``Client.stream`` starts one; in flight until it ends."""
        check_priority(priority)
        server, epoch = self._choose()
        client = server.client
        try:
            stream = make(server.address)
            future = client._submit(payload, timeout, stream.state, priority)
        except BaseException as exc:
            self._rotation.release(server, epoch, exc)
            raise
        future.server = server.address  # type: ignore[attr-defined]
        future.add_done_callback(functools.partial(self._finished, server, epoch))
        return stream.start(future, client._canceller(future.request_id))  # type: ignore[attr-defined]

    # -- internals ---------------------------------------------------------------------

    def _choose(self, tried: set[str] | None = None) -> tuple[Server, int]:
        if self._closed:
            raise ServerUnavailableError("this routing client is closed")
        return self._rotation.choose(tried)

    def _finished(self, server: Server, epoch: int, future: Future) -> None:
        self._rotation.release(server, epoch, None if future.cancelled() else future.exception())

    def _gather_info(self) -> tuple[Future, dict[str, Future]]:
        """A future for the report, resolved once every server's ``info`` answered or failed."""
        if self._closed:
            raise ServerUnavailableError("this routing client is closed")
        futures: dict[str, Future] = {}
        for server in list(self._rotation.servers):
            try:
                if server.state != UP:  # answered before the info: its client then knows the server
                    server.client._control_async("ping").add_done_callback(
                        functools.partial(self._pinged, server))
                futures[server.address] = server.client._control_async("info")
            except Exception as exc:
                futures[server.address] = failed = Future()
                failed.set_exception(exc)
        gathered: Future = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                resolve(gathered, self._rotation.report_with(futures))

        for future in futures.values():
            future.add_done_callback(one_done)
        return gathered, futures

    def _pinged(self, server: Server, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._rotation.heard(server)

    def _refresh_now(self) -> None:
        try:
            addresses = list(self._refresh())  # type: ignore[misc]
            check_addresses(addresses)
        except Exception as exc:  # keep the list we have
            log.warning("refresh of the server list failed, keeping %d server(s): %s",
                        len(self._rotation.servers), exc)
            return
        with self._close_lock:
            if self._closed:
                return
            removed = self._rotation.set_addresses(addresses)
        self._close_servers(removed)

    def _close_servers(self, servers: list[Server]) -> None:
        for server in servers:
            try:
                server.client.close()
            except Exception:  # close the others regardless
                log.exception("closing the client of %s failed", server.address)


def _priority_keyword(priority: Any) -> dict[str, Any]:
    """``priority=`` for a server's client, checked; none for 0 (a ``client_class`` without the
    keyword serves those as before)."""
    if type(priority) is int and not priority:
        return _NO_EXTRA
    return {"priority": check_priority(priority)}


def check_addresses(addresses: Any) -> None:
    """A non-empty list or tuple of distinct ``ipc://`` or ``tcp://`` address strings."""
    if not isinstance(addresses, (list, tuple)) or not addresses:
        raise ValueError(f"need a non-empty list of server addresses, got {addresses!r}")
    bad = [a for a in addresses if not isinstance(a, str) or "://" not in a]
    if bad:
        raise ValueError(f"addresses must look like ipc:///path or tcp://host:port, got {bad!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"each server may be listed once, got {list(addresses)!r}")
