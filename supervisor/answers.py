"""The ranks' answers: what the thread holding the reader role does with the ctl ROUTER.

    rank DEALER "c-R-r" --"done" {id, ok, result | error}--> ctl ROUTER --take()--> AnswerReader
      output rank's result -> taken (completed in after_poll, after the bookkeeping)
      every rank answered  -> finished: its request-arena blocks are freed, their names unlinked
      a rank's error       -> the group fails (a dead peer, if any, is blamed)
      output rank's "partial" {id, chunk} of a stream -> chunks taken (delivered in after_poll,
                               before the results: a stream's chunks come before its last one)
    "ready" / "startup_error" -> Startup
    result views garbage-collected -> group.frees -> "free" {blocks} --> the rank that placed them

Invariants:
- Only the reader calls ``take``, ``after_poll``, ``send_frees`` and ``send_shutdown`` (the
  last once nobody reads, at close): the ROUTER is used by one thread at a time.
- One ROUTER message per ``take`` (the poll is level-triggered); after an output rank's
  answer, also the other ranks' answers already queued, rather than while the woken caller
  waits for the GIL. Taken results complete their futures in ``after_poll``; any failure
  of a group (``fail``) first completes the answers taken, as if each had been completed
  on arrival.
- Result segments are unlinked as soon as this process has mapped them.
"""

from __future__ import annotations

import collections
import logging
import re
from concurrent.futures import Future
from typing import Any

import zmq

from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.link import rank_protocol as rp
from runtime.transport import wire
from runtime.transport.reader import ReaderRole
from runtime.transport.arena import ShmMapper
from runtime.transport.shm_names import unlink_quiet
from supervisor.boot import Startup
from supervisor.failure import Failures
from supervisor.groups import GroupState, PendingRequest, RankState, recv_from_rank

log = logging.getLogger("phyrt.supervisor")

_POLLIN = int(zmq.POLLIN)
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
        self._finished: list[tuple[GroupState, PendingRequest]] = []  # every rank answered
        self._others_due = False  # the last message taken was an answer that others' answers follow

    def fail(self, group: GroupState, reason: str, cause: BaseException | None = None, *,
             defer: bool = False) -> None:
        """``Failures.fail``, after completing the answers this thread took (if it reads)."""
        if (self._ready or self._finished or self._chunks) and self._role.held_here():
            self.complete()  # answers that came in first win, as they would have unbatched
        self._failures.fail(group, reason, cause, defer=defer)

    def take(self) -> None:
        """Take one message (the poll said there is one), and the answers queued after an
        output rank's."""
        self._recv()
        while self._others_due and self._router.getsockopt(zmq.EVENTS) & _POLLIN:
            self._recv()

    def after_poll(self) -> None:
        """The reader's bookkeeping after each poll: blocks back to the ranks, futures completed."""
        if self.frees_waiting():
            self.send_frees()
        if self._ready or self._finished or self._chunks:
            self.complete()

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
                if pending.blocks:
                    for segment, offset in pending.blocks:
                        group.arena.free(segment, offset)
                    for segment in {s for s, _ in pending.blocks} & set(group.arena.segments):
                        group.arena.unlink(segment)  # every rank has mapped it by now

    def frees_waiting(self) -> bool:
        return any(g.frees for g in self._groups)

    def send_frees(self) -> None:
        for group in self._groups:
            if not group.frees:
                continue
            blocks: dict[int, list] = collections.defaultdict(list)
            while group.frees:
                rank, segment, offset = group.frees.popleft()
                blocks[rank].append([segment, offset])
            if group.failed is not None:
                continue
            for rank, items in blocks.items():
                self._send(group, rank, wire.pack_message(rp.FREE, 0, blocks=items))

    def send_shutdown(self, group: GroupState) -> None:
        for r in group.ranks:
            self._send(group, r.rank, wire.pack_message(rp.SHUTDOWN, 0))

    def _send(self, group: GroupState, rank: int, message: bytes) -> None:
        try:
            self._router.send_multipart([f"c-{group.index}-{rank}".encode(), message])
        except zmq.ZMQError:
            pass  # the rank is gone; its arena went with it

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
        pending = group.pending.get(msg["id"])
        if pending is None:
            raise ProtocolError(f"answer to unknown request {msg['id']!r}")
        if not msg.get("ok"):
            self._request_failed(group, r, msg)
            return
        if r.rank == 0:
            # completed after this poll's bookkeeping, before anything fails this group
            self._ready.append((pending.future, msg.get("result")))
        pending.ranks_done.add(r.rank)
        if len(pending.ranks_done) == len(group.ranks):
            del group.pending[msg["id"]]
            self._finished.append((group, pending))  # its blocks go back right after that
        else:
            self._others_due = 0 in pending.ranks_done  # its caller is about to be woken

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
