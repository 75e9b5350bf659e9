"""The ranks' answers: what the thread holding the reader role does with the ctl ROUTER.

    output rank DEALER "c-R-0" --"done" {id, ok, result | error}--> ctl ROUTER --take()--> AnswerReader
      its result       -> taken (completed in after_poll, after the bookkeeping); the request's
                          request-arena blocks retired: freed, their names unlinked, once every
                          rank released the request on the ring (``groups.reclaim``)
      its "partial" {id, chunk} of a stream -> chunks taken (delivered in after_poll, before the
                          results: a stream's chunks come before its last one)
    any rank's "done" {ok: false} (a plugin exception) -> the group fails (a dead peer, if any, is blamed)
    "ready" / "startup_error" -> Startup
    result views garbage-collected -> group.frees -> "free" {blocks} on the ring --> the output rank

Non-output ranks answer nothing per request (``workers.main``): only their failures come here.

Invariants:
- Only the reader calls ``take``, ``after_poll``, ``send_frees`` and ``send_shutdown`` (the
  last once nobody reads, at close): the ROUTER is used by one thread at a time.
- One ROUTER message per ``take`` (the poll is level-triggered). Taken results complete their
  futures in ``after_poll``; any failure of a group (``fail``) first completes the answers
  taken, as if each had been completed on arrival.
- Result segments are unlinked as soon as this process has mapped them.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from typing import Any

import zmq

from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import FLAG_CONTROL
from runtime.transport import wire
from runtime.transport.reader import ReaderRole
from runtime.transport.arena import ShmMapper
from runtime.transport.shm_names import unlink_quiet
from supervisor.boot import Startup
from supervisor.failure import Failures
from supervisor.groups import GroupState, PendingRequest, RankState, flush_rings, reclaim, recv_from_rank, retire

log = logging.getLogger("phyrt.supervisor")

#: result blocks per "free" message (each fits a ring slot with room to spare)
FREES_PER_MESSAGE = 128
#: how long a rank's error that reads like a lost peer waits for a peer's death to show
PEER_DEATH_GRACE_S = 0.2
_PEER_LOSS = re.compile(r"connection (?:reset|closed|refused|aborted)|by peer|broken pipe|econnreset|epipe"
                        r"|remote process|gloo|nccl|socket|timed? ?out", re.IGNORECASE)


def answers_due(groups: list[GroupState], startup: Startup) -> bool:
    """Under the channel's lock: whether answers are due on the ctl ROUTER (``ReaderRole.awaiting``)."""
    return not startup.done or any(g.pending for g in groups if g.failed is None)


class AnswerReader:
    def __init__(self, router: zmq.Socket, groups: list[GroupState], role: ReaderRole, failures: Failures,
                 startup: Startup, mapper: ShmMapper) -> None:
        self._router, self._groups, self._role = router, groups, role
        self._failures, self._startup, self._mapper = failures, startup, mapper
        self._peers = {f"c-{g.index}-{r.rank}".encode(): (g, r) for g in groups for r in g.ranks}
        self._unlinked: set[str] = set()  # result segments whose names are already gone
        self._ready: list[tuple[Future, Any]] = []  # results taken, to complete in after_poll
        self._chunks: list[tuple[Any, Any]] = []  # (StreamCall, chunk) taken, to deliver in after_poll
        self._finished: list[tuple[GroupState, PendingRequest]] = []  # answered by the output rank
        self.waiting = False  # after the last after_poll: a ring still waits for a rank (look again soon)

    def fail(self, group: GroupState, reason: str, cause: BaseException | None = None, *,
             defer: bool = False) -> None:
        """``Failures.fail``, after completing the answers this thread took (if it reads)."""
        if (self._ready or self._finished or self._chunks) and self._role.held_here():
            self.complete()  # answers that came in first win, as they would have unbatched
        self._failures.fail(group, reason, cause, defer=defer)

    def take(self) -> None:
        """Take one message (the poll said there is one)."""
        self._recv()

    def after_poll(self) -> None:
        """The reader's bookkeeping after each poll: blocks back to the ranks, futures completed,
        the rings flushed."""
        if self.frees_waiting():
            self.send_frees()
        if self._ready or self._finished or self._chunks:
            self.complete()
        self.waiting = flush_rings(self._groups)

    def complete(self) -> None:
        """Deliver the stream chunks taken, complete the futures of the answers taken, then free
        the blocks of the requests that every rank answered."""
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            for stream, chunk in chunks:
                stream.put(chunk)
        ready, self._ready = self._ready, []
        for future, result in ready:
            resolve(future, result=result)
        finished, self._finished = self._finished, []
        for group, pending in finished:
            # taken even when the request placed nothing: uncontended it costs next to nothing
            # (and test_kill_matrix stalls this thread through it, to open a race on purpose)
            with group.arena_lock:
                retire(group, pending.seq, pending.blocks)
            if group.retired:
                reclaim(group)

    def frees_waiting(self) -> bool:
        return any(g.frees for g in self._groups)

    def send_frees(self) -> None:
        for group in self._groups:
            if not group.frees:
                continue
            blocks = []
            while group.frees:
                _, segment, offset = group.frees.popleft()  # the output rank's: only it has a result arena
                blocks.append([segment, offset])
            if group.failed is not None:
                continue
            for start in range(0, len(blocks), FREES_PER_MESSAGE):  # each fits a ring slot
                group.ring.write(wire.pack_message(rp.FREE, 0, blocks=blocks[start:start + FREES_PER_MESSAGE]),
                                 FLAG_CONTROL)

    def send_shutdown(self, group: GroupState) -> None:
        """The ring's last message; closing the ring lets it overtake the requests still queued there."""
        if group.ring is None:  # the start failed before the group had one
            return
        group.ring.write(wire.pack_message(rp.SHUTDOWN, 0), FLAG_CONTROL)
        group.ring.close()

    def _recv(self) -> None:
        self._others_due = False
        got = recv_from_rank(self._router, self._peers, "message")
        if got is None:
            return
        group, r, payload, count = got
        if group.failed is not None:
            return
        if count != 1:
            self.fail(group, f"rank {r.rank} sent a malformed message: {count} frames, not 1")
            return
        try:
            msg = wire.unpack_message(payload.buffer, expected_types=rp.ANSWERS, tensor_decoder=r.decoder)
            self._handle(group, r, msg)
        except (ProtocolError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # well-formed msgpack with fields of the wrong shape is just as malformed
            self.fail(group, f"rank {r.rank} sent a malformed message: {type(exc).__name__}: {exc}", exc)
        if len(self._mapper.segments) != len(self._unlinked):
            self.unlink_mapped()

    def _handle(self, group: GroupState, r: RankState, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == rp.DONE:
            self._request_done(group, r, msg)
        elif kind == rp.PARTIAL:
            pending = group.pending.get(msg["id"])
            if r.rank != 0 or pending is None or pending.stream is None:
                raise ProtocolError(f"rank {r.rank} sent a chunk of request {msg['id']!r}, not a stream "
                                    "of its output rank in flight")
            self._chunks.append((pending.stream, msg.get("chunk")))
        elif kind == rp.READY:
            self._startup.rank_ready(r, msg.get("segments"), self.unlink_mapped)
        else:  # rp.STARTUP_ERROR
            cause = rp.remote_error(msg)
            self.fail(group, f"rank {r.rank} failed to start: {cause.remote_type}: {cause.remote_message}", cause)

    def _request_done(self, group: GroupState, r: RankState, msg: dict[str, Any]) -> None:
        if not msg.get("ok"):  # any rank's: the group fails (the request may be answered already)
            self._request_failed(group, r, msg)
            return
        if r.rank != 0:
            raise ProtocolError(f"rank {r.rank} answered request {msg['id']!r}: only the output rank answers")
        pending = group.pending.pop(msg["id"], None)
        if pending is None:
            raise ProtocolError(f"answer to unknown request {msg['id']!r}")
        # completed after this poll's bookkeeping, before anything fails this group
        self._ready.append((pending.future, msg.get("result")))
        self._finished.append((group, pending))  # its blocks go back once every rank released it

    def _request_failed(self, group: GroupState, r: RankState, msg: dict[str, Any]) -> None:
        cause = rp.remote_error(msg)
        raised = f"rank {r.rank} raised {cause.remote_type}: {cause.remote_message} (request {msg['id']})"
        # a peer that died (inside a collective, say) is to blame, not the rank that lost it;
        # this thread may see the survivor's error before the dead rank's sentinel
        grace = PEER_DEATH_GRACE_S if _PEER_LOSS.search(f"{cause.remote_type}: {cause.remote_message}") else 0.0
        dead = self._failures.dead_rank([x for x in group.ranks if x is not r], grace)
        if dead is not None:
            log.info("replica %d: %s, after its peer's death", group.engine_replica, raised)
            self.fail(group, dead)
        else:
            self.fail(group, raised, cause)

    def unlink_mapped(self) -> None:
        for segment in self._mapper.segments:
            if segment not in self._unlinked:
                self._unlinked.add(segment)
                unlink_quiet(segment)
