"""``Answers``: the engine's reading end of the link to a local replica's ranks.

Torch-free; imports only ``runtime.core``, ``runtime.transport`` and ``runtime.link`` of the project.

    ctl ROUTER   <-- DONE (big, failed, or ending a stream), PARTIAL, READY, STARTUP_ERROR  (DEALER "c-R-r")
    answer lane  <-- DONE of the output rank, when it fits                (``runtime.link.lane``)
    hb ROUTER    <-- HB of every rank (rank 0's with its runner's info)   (DEALER "h-R-r")

The ctl ROUTER and the answer lanes are read by whoever holds the reader role
(``runtime.link.reader``): a caller of ``Engine.step`` waiting for its own answer (``read``), else
the supervisor's link thread (``items``); the hb ROUTER by the link thread always. One ROUTER message
per ``take`` (the poll is level-triggered); the answers taken complete their futures in
``after_poll``, a stream's chunks first, and the blocks they used go back to their ranks.

The replicas are the supervisor's (``supervisor.replica.Replica``); this module uses their reading
side: ``done``, ``answered``, ``stream_of``, ``beat``, ``stepped``, ``send_frees``, ``flush``,
``retire``, ``failed``, ``ranks`` and ``answers``. A message that is not what its sender may send
fails the sender's replica (``fail``), with blame: a rank's error that reads like a lost peer waits
``PEER_DEATH_GRACE_S`` for a peer's death to show, and names the dead peer instead.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from typing import Any, Callable

import zmq

from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.link import rank_protocol as rp
from runtime.transport import wire

__all__ = ["Answers", "PEER_DEATH_GRACE_S"]

log = logging.getLogger("phyrt.supervisor")

#: how long a rank's error that reads like a lost peer waits for a peer's death to show
PEER_DEATH_GRACE_S = 0.2
_PEER_LOSS = re.compile(r"connection (?:reset|closed|refused|aborted)|by peer|broken pipe|econnreset|epipe"
                        r"|remote process|gloo|nccl|socket|timed? ?out", re.IGNORECASE)
_POLLIN = int(zmq.POLLIN)


class Answers:
    """What the ranks of ``replicas`` send (see the module)."""

    def __init__(self, router: zmq.Socket, replicas: tuple[Any, ...], startup: Any, fail: Callable[..., None]) -> None:
        """``startup``: READY and STARTUP_ERROR go there; ``fail(replica, reason, cause, suspects, grace_s)``."""
        self._router, self._replicas, self._startup, self._fail = router, replicas, startup, fail
        self._peers = {f"c-{g.index}-{r.rank}".encode(): (g, r) for g in replicas for r in g.ranks}
        self._beats = {f"h-{g.index}-{r.rank}".encode(): (g, r) for g in replicas for r in g.ranks}
        self._ready: list[tuple[Any, Any]] = []  # (future, result) taken, to complete in after_poll
        self._chunks: list[tuple[Any, Any]] = []  # (StreamCall, chunk) taken, to deliver in after_poll
        self._finished: list[tuple[Any, Any]] = []  # answered: their blocks to retire
        self.waiting = False  # after the last after_poll: a ring still waits for a rank (look again soon)
        #: what to poll for the ranks' answers, and what takes them: the ctl ROUTER, and the answer
        #: lane of each replica that has one (``runtime.link.lane.AnswerReader``)
        self.items: list[tuple[Any, Callable[[], None]]] = [(router, self.take)] + [
            (g.answers.fd, functools.partial(self.take_lane, g)) for g in replicas if g.answers is not None]
        self._takes = dict(self.items)  # what a reading caller polls (``read``), and what takes each
        self._polled = [(item, _POLLIN) for item in self._takes]

    def take(self) -> None:
        """Take one ctl message (the poll said there is one)."""
        got = _recv_from_rank(self._router, self._peers, "message")
        if got is None:
            return
        group, r, payload, count = got
        if group.failed is not None:
            return
        if count != 1:
            self._fail(group, f"rank {r.rank} sent a malformed message: {count} frames, not 1")
            return
        self._take(group, r, payload.buffer)

    def take_lane(self, group: Any) -> None:
        """Take the answers ``group``'s output rank sent by its answer lane (the poll saw its pipe)."""
        try:
            answers = group.answers.take()
        except ValueError as exc:
            answers = []
            self._fail(group, f"rank 0 sent a malformed message: {exc}", exc)
        for answer in answers:
            if group.failed is None:
                self._take(group, group.ranks[0], answer)

    def _take(self, group: Any, r: Any, payload: Any) -> None:
        """Decode and handle one answer of rank ``r``."""
        try:
            msg = wire.unpack_message(payload, expected_types=rp.ANSWERS, tensor_decoder=r.decoder)
            self._handle(group, r, msg)
        except (ProtocolError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # well-formed msgpack with fields of the wrong shape is just as malformed
            self._fail(group, f"rank {r.rank} sent a malformed message: {type(exc).__name__}: {exc}", exc)
        self._startup.unlink_mapped()

    def read(self, role: Any, spinner: Any, poll_ms: int, future: Any, deadline: float | None) -> None:
        """As the reader (``ReaderRole.wait``): take answers until ``future`` is done, ``deadline``
        passed or the role is closed; woken through ``role.fd`` (a failure, close)."""
        takes = self._takes
        items = self._polled + [(role.fd, _POLLIN)]
        while not future.done() and not role.closed:
            wait_ms = 2 if self.waiting else poll_ms  # a ring waiting for a rank's credit: look soon
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait_ms = min(wait_ms, int(left * 1000) + 1)
            # with a core to spare, look for the answer a moment before sleeping
            for item, _ in spinner.wait(functools.partial(zmq.zmq_poll, items, 0), zmq.zmq_poll, items, wait_ms):
                take = takes.get(item)
                if take is not None:
                    take()
                else:
                    role.drain()
            self.after_poll()

    def take_beats(self, hb: zmq.Socket) -> None:
        """Take every heartbeat queued on the hb ROUTER (the link thread's)."""
        while hb.getsockopt(zmq.EVENTS) & _POLLIN:
            got = _recv_from_rank(hb, self._beats, "heartbeat")
            if got is None:
                continue
            group, r, payload, count = got
            if group.failed is not None:
                continue
            try:
                if count != 1:
                    raise ProtocolError(f"{count} frames, not 1")
                group.beat(r, payload.buffer)
            except (ProtocolError, TypeError, ValueError, KeyError, AttributeError) as exc:
                self._fail(group, f"rank {r.rank} sent a malformed heartbeat: {exc}", exc)

    def _handle(self, group: Any, r: Any, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == rp.DONE:
            if not msg.get("ok"):  # any rank's: the replica fails (the request may be answered already)
                self._request_failed(group, r, msg)
                return
            entry = group.done(r, msg)
            if entry is not None:  # completed after this poll's bookkeeping, before anything fails it
                group.answered(entry)  # the next batch goes to the ranks now
                self._ready.append((entry.future, msg.get("result")))
                self._finished.append((group, entry))
        elif kind == rp.PARTIAL:
            self._chunks.append((group.stream_of(r, msg), msg.get("chunk")))
        elif kind == rp.READY:
            if r.rank == 0:
                group.stepped(msg.get("stepped"))
            self._startup.rank_ready(r, msg.get("segments"))
        else:  # rp.STARTUP_ERROR
            cause = rp.remote_error(msg)
            self._fail(group, f"rank {r.rank} failed to start: {cause.remote_type}: {cause.remote_message}", cause)

    def _request_failed(self, group: Any, r: Any, msg: dict[str, Any]) -> None:
        cause = rp.remote_error(msg)
        raised = f"rank {r.rank} raised {cause.remote_type}: {cause.remote_message} (request {msg['id']})"
        # a peer that died (inside a collective, say) is to blame, not the rank that lost it;
        # this thread may see the survivor's error before the dead rank's sentinel
        grace = PEER_DEATH_GRACE_S if _PEER_LOSS.search(f"{cause.remote_type}: {cause.remote_message}") else 0.0
        self._fail(group, raised, cause, tuple(x for x in group.ranks if x is not r), grace)

    def after_poll(self) -> None:
        """The reader's bookkeeping after each poll: blocks back to the ranks, futures completed,
        the rings flushed."""
        for group in self._replicas:
            if group.frees:
                group.send_frees()
        if self._ready or self._finished or self._chunks:
            self.complete()
        waiting = False
        for group in self._replicas:
            waiting = group.flush() or waiting
        self.waiting = waiting

    def complete(self) -> None:
        """Deliver the chunks taken, complete the futures of the answers taken, then retire their blocks."""
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            for stream, chunk in chunks:
                stream.put(chunk)
        ready, self._ready = self._ready, []
        for future, result in ready:
            resolve(future, result=result)
        finished, self._finished = self._finished, []
        for group, entry in finished:
            group.retire(entry)


def _recv_from_rank(sock: Any, peers: dict[bytes, tuple[Any, Any]],
                    kind: str) -> tuple[Any, Any, Any, int] | None:
    """Take one message off a ROUTER the ranks' DEALERs talk to: its sender's (replica, rank), its
    first frame and its frame count, the sender's last sign of life noted; None (logged) when the
    sender is unknown."""
    identity = sock.recv()  # a ROUTER puts the sender's identity first, always
    first = last = sock.recv(copy=False)  # a Frame knows whether more follow
    count = 1
    while last.more:  # the rest of a malformed message
        last = sock.recv(copy=False)
        count += 1
    peer = peers.get(identity)
    if peer is None:
        log.warning("%s from an unknown peer %r dropped", kind, identity)
        return None
    group, r = peer
    r.last_beat = time.monotonic()
    return group, r, first, count
