"""A client's I/O thread: the fallback reader, heartbeats and the socket monitor.

Torch-free. One daemon thread per ``Client``, named "phyrt-client":

    loop until the client closes:
      every heartbeat_interval_s: "ping" (id "heartbeat") -> outbox; a request with no word
        from the server for heartbeat_timeout_s fails with ConnectionLostError
      replies due and nobody reads (ReaderRole.take): hold the socket, poll it until the next
        beat or a wake-up, read one message; leave(hand_on=False); complete its futures
      otherwise: sleep on the wake pipe (``wake``: the role's wake_fallback, submit())
        and on the monitor (Connection.watch_monitor): a connection lost after its handshake,
        or a handshake the server refused -> everything in flight fails
    on exit: wait until the last reader left the role, then close the socket

Invariants:
- The thread reads only when no caller does and replies are due (submit() futures,
  heartbeats, registers, held inputs): a lone caller's ``call()`` never involves it.
- It gives the role up after each message, so a caller that comes to wait takes it.
- No heartbeat goes out while the server refuses the handshake (nothing would carry it).
- Failing requests here wakes the reader (``role.wake``): its caller's future may be one.
- If the loop fails (a bug), the client is *broken*: every request in flight fails with
  the cause, later ones fail at once, and the role is closed.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from runtime.client.connection import Connection
from runtime.client.replies import Replies, complete
from runtime.link.client_protocol import HEARTBEAT
from runtime.transport.reader import ReaderRole
from runtime.transport.wake_pipe import WakePipe

log = logging.getLogger("phyrt.client")


class IOThread:
    """The thread that reads when no caller does, sends heartbeats and watches the connection."""

    def __init__(self, conn: Connection, replies: Replies, role: ReaderRole, pipe: WakePipe,
                 heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
        self._conn, self._replies, self._role, self._pipe = conn, replies, role, pipe
        self._interval, self._timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.thread = threading.Thread(target=self._run, name="phyrt-client", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Look again (replies are due and nobody reads them); a no-op once disposed."""
        self._pipe.wake()

    def stop(self) -> bool:
        """After the client closed: wake the thread and wait for it; whether it has ended."""
        self._pipe.wake()
        if self.thread is not threading.current_thread():
            self.thread.join(10)
        return not self.thread.is_alive()

    def dispose(self) -> None:
        self._pipe.close()

    def _run(self) -> None:
        conn, replies, pipe = self._conn, self._replies, self._pipe
        idle = zmq.Poller()
        reading = zmq.Poller()
        reading.register(conn.sock, zmq.POLLIN)
        reading.register(self._role.fd, zmq.POLLIN)
        for poller in (idle, reading):
            poller.register(pipe.fd, zmq.POLLIN)
            poller.register(conn.monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not replies.closed:
                now = time.monotonic()
                if now >= next_beat:
                    if not replies.refused:
                        self._heartbeat(now)
                    next_beat = now + self._interval
                wait = max(0.0, next_beat - time.monotonic())
                events = self._read(reading, wait) if self._take() else dict(idle.poll(int(wait * 1000) + 1))
                if pipe.fd in events:
                    pipe.drain()
                if conn.outbox:
                    conn.kick()
                if conn.monitor in events:
                    self._drain_monitor()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("the client's I/O thread failed")
            self._break(exc)
        finally:
            self._role.wait_released(2.0)  # a caller still reading lets go at once (it was woken)
            conn.shut()

    def _take(self) -> bool:
        """The reader role, if replies are due and nobody reads them."""
        with self._replies.lock:
            return self._replies.awaiting() and self._role.take_locked()

    def _read(self, poller: zmq.Poller, wait: float) -> dict:
        """As the reader: one poll of the socket (and the wake-ups), then the role goes back."""
        done: list = []
        try:
            with self._conn.lock:
                events = dict(self._conn.poll(poller, wait, done)) if self._conn.open else {}
        finally:
            self._role.leave(hand_on=False)
        complete(done)
        return events

    def _heartbeat(self, now: float) -> None:
        silent = self._replies.heartbeat(now, self._timeout)
        self._conn.send(None, [HEARTBEAT])
        self._fail(silent)

    def _drain_monitor(self) -> None:
        done: list = []
        self._conn.watch_monitor(done)
        self._fail(done)

    def _fail(self, done: list) -> None:
        if done:
            complete(done)
            self._role.wake()  # a reading caller's own future may be among them

    def _break(self, exc: BaseException) -> None:
        self._replies.broken = f"the client's I/O thread failed: {exc!r}"
        done: list = []
        self._replies.connection_lost(self._replies.broken, done)
        self._role.close()
        self._fail(done)
