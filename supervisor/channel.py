"""The request channel: a request goes to every inbox of its group, and its answer comes back
to the thread that waits for it.

    caller: submit(replica, request, future)                  (Engine.submit: a plain Future)
      encode (tensors -> the group's request arena)
      under role.lock: register pending, then send on each rank's inbox PUSH --> PULL (every rank)
        nobody reading: wake the watch thread (the fallback reader), which completes the future
    caller: start_call(replica, request) -> Slot               (Engine.step)
      take the reader role if it is free, then submit as above (nobody else is woken)
    caller: finish_call(slot, timeout) -> role.wait(slot, timeout, read)
      the reader: poll ctl ROUTER + role.fd, AnswerReader.take/after_poll, until its slot is done
      not the reader: sleeps on the slot; the reader completes it

Reader role. Handing every answer from the I/O thread to the waiting caller costs a thread
switch and a fight for the GIL per round trip, so ``runtime.transport.reader.ReaderRole``
decides who reads the ROUTER: a caller of ``start_call`` waiting on its own slot when the
role is free, else the watch thread (``supervisor.watch``). Its ``lock`` is the submit lock too, so the
pending requests (``answers_due``) and the holder change together. When the ranks leave
this process a core, the reading caller polls for ``budget_ns("caller")`` before it sleeps.

Streams: a request submitted with a ``StreamCall`` goes out as a "request" with ``stream:
true`` (each rank admits it through its runner's ``add_stream``); the output rank's "partial"
chunks reach the call (``supervisor.answers``). Its cancel hook sends "cancel" {id} down
every inbox of the group, behind the request itself (one PUSH per rank keeps the order),
while the request is still pending; an inbox that cannot take it belongs to a dying rank.

Invariants:
- A request is registered as pending before it is sent, so its "done" can never arrive
  first; its clock starts at submission (``execution_timeout_s``); a deadline earlier than
  the watch thread's next wake-up wakes it.
- A request goes to every rank or to none: a rank's inbox PUSH without a peer (its rank
  died; libzmq dropped the connection) would block, so a submit to several ranks first
  checks that every inbox can take it (POLLOUT), and every submit sends with NOBLOCK (one
  inbox needs no check: its send goes out or raises); a rank found unreachable fails the
  group from the caller, blamed on its exit status, its futures failed off this thread.
"""

from __future__ import annotations

import functools
import itertools
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from runtime.core.config import WorkerSupervisorConfig
from runtime.core.errors import EngineUnavailableError
from runtime.core.futures import Slot
from runtime.link import rank_protocol as rp
from runtime.transport import wire
from runtime.transport.reader import ReaderRole
from runtime.transport.spin import Spinner
from supervisor.answers import AnswerReader
from supervisor.failure import Failures
from supervisor.groups import GroupState, LockedArena, PendingRequest, free_blocks

#: how long a submit waits for a rank's inbox to be connected (it is, from "ready" on,
#: unless the rank died) before the group fails
INBOX_GRACE_S = 2.0
# plain ints: ``getsockopt(EVENTS) & zmq.POLLOUT`` would build an enum member on every call
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


class RequestChannel:
    def __init__(self, groups: list[GroupState], role: ReaderRole, answers: AnswerReader, failures: Failures,
                 router: zmq.Socket, config: WorkerSupervisorConfig, spin_ns: int,
                 wake_watch: Callable[[], None]) -> None:
        self._groups, self.role, self._answers, self._failures = groups, role, answers, failures
        self._router, self._spinner, self._wake_watch = router, Spinner(spin_ns), wake_watch
        self._timeout_s = config.execution_timeout_s
        self._poll_ms = int(config.heartbeat_interval_s * 1000) + 1
        self._ids = itertools.count()
        self.wake_at = 0.0  # when the watch thread next wakes by itself (monotonic; it sets this)

    def start_call(self, replica: int, request: Any, then: Callable[[], None] | None = None) -> Slot:
        """``Engine.step``: ``request`` sent with a ``Slot`` for its answer (``then()`` once it is
        answered or failed), the calling thread made the socket's reader first when nobody is (so
        nobody else is woken to read it)."""
        slot = Slot(then)
        reading = self.role.take_free()
        try:
            self.submit(replica, request, slot)
        except BaseException:
            if reading:
                self.role.leave()
            raise
        return slot

    def finish_call(self, slot: Slot, timeout: float | None) -> Any:
        """``start_call``'s answer: read here while this thread is (or can become) the reader, else
        slept for; the role is given up at the end."""
        if not self.role.wait(slot, timeout, self.read):
            raise TimeoutError(f"no result within {timeout} s (the request was still running; its result is dropped)")
        return slot.result()

    def submit(self, replica: int, request: Any, future: Future | Slot, stream: Any = None) -> None:
        """Send ``request`` to every rank of ``replica``; ``future`` gets the output rank's answer,
        ``stream`` (a ``StreamCall``, for a streamed request) its chunks before that."""
        group = self._groups[replica]
        if group.failed is not None:
            raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed}")
        request_id = next(self._ids)
        payload, placed = self._encode(group, request_id, request, stream is not None)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        pending = PendingRequest(future, deadline, placed, stream)
        give_up = time.monotonic() + INBOX_GRACE_S
        while True:
            unreachable, sent = self._send(group, request_id, pending, payload)
            if not unreachable:
                if stream is not None:
                    stream.bind_cancel(functools.partial(self.cancel, replica, request_id))
                return
            # outside the lock: the watch thread may need it to fail this group meanwhile
            wait_s = max(0.0, give_up - time.monotonic())
            # sent to some: a peer was dropped, its rank is dying; else it may still be connecting
            reason = self._failures.dead_rank([group.ranks[i] for i in unreachable],
                                              wait_s if sent else min(wait_s, 0.05))
            if reason is None and not sent and wait_s > 0:
                continue
            if reason is None:
                reason = f"rank {unreachable[0]} stopped taking requests (its inbox has no connection)"
            # futures are failed off this thread: the caller may hold locks their callbacks take
            self._answers.fail(group, reason, defer=True)
            if sent:
                return  # the future is pending in the failed group: the reaper fails it
            free_blocks(group, placed)
            raise EngineUnavailableError(f"replica {replica} is not serving: {group.failed or reason}")

    def cancel(self, replica: int, request_id: int) -> None:
        """A stream's cancel hook: "cancel" to every rank of ``replica`` while the request is pending."""
        group = self._groups[replica]
        message = wire.pack_message(rp.CANCEL, request_id)
        with self.role.lock:
            if self.role.closed or group.failed is not None or request_id not in group.pending:
                return
            for inbox in group.inboxes:
                try:
                    inbox.send(message, _NOBLOCK)
                except zmq.Again:  # its rank just died: the group fails, and the request with it
                    pass

    def _encode(self, group: GroupState, request_id: int, request: Any,
                stream: bool = False) -> tuple[Any, list[tuple[str, int]]]:
        try:  # an idle encoder of this group; each concurrent caller makes one the first time
            allocator, encoder = group.encoders.pop()
        except IndexError:
            allocator = LockedArena(group)
            encoder = wire.TensorEncoder(allocator=allocator)
        try:
            if stream:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, stream=True,
                                            tensor_encoder=encoder)
            else:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, tensor_encoder=encoder)
        except Exception:
            if group.failed is None:
                raise
            # the group failed meanwhile and its arena is closed (pack_message freed what it placed)
            raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed}") from None
        finally:
            placed, allocator.placed = allocator.placed, []
            group.encoders.append((allocator, encoder))
        return payload, placed

    def _send(self, group: GroupState, request_id: int, pending: PendingRequest,
              payload: Any) -> tuple[list[int], bool]:
        """Under the lock, all or nothing: ([], True) when every inbox took it; else the
        unreachable inboxes, and whether some took it (then it stays pending in the group)."""
        inboxes = group.inboxes
        with self.role.lock:
            if self.role.closed or group.failed is not None:
                free_blocks(group, pending.blocks)
                raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed or 'closed'}")
            # a PUSH without a peer blocks (or, NOBLOCK, raises zmq.Again); a single inbox
            # needs no check, as its NOBLOCK send goes out whole or not at all
            if len(inboxes) > 1:
                unreachable = [i for i, inbox in enumerate(inboxes) if not inbox.getsockopt(zmq.EVENTS) & _POLLOUT]
                if unreachable:
                    return unreachable, False
            group.pending[request_id] = pending
            for i, inbox in enumerate(inboxes):
                try:
                    inbox.send(payload, _NOBLOCK, copy=False)
                except zmq.Again:  # its peer went (since the check): the rank just died
                    if i == 0:  # nothing went out: as if the check had found it unreachable
                        del group.pending[request_id]
                    return [i], i > 0
            # the watch thread reads when nobody else does (or sleeps past this deadline)
            wake = self.role.holder is None or (pending.deadline is not None and pending.deadline < self.wake_at)
        if wake:
            self._wake_watch()
        return [], True

    def read(self, future: Future, deadline: float | None) -> None:
        """As the reader (``ReaderRole.wait``): take answers until ``future`` is done, ``deadline``
        passed or the role is closed; woken through ``role.fd`` (a failure, close)."""
        role, router = self.role, self._router
        items = [(router, _POLLIN), (role.fd, _POLLIN)]
        while not future.done() and not role.closed:
            wait_ms = self._poll_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait_ms = min(wait_ms, int(left * 1000) + 1)
            # with a core to spare, look for the answer a moment before sleeping
            for item, _ in self._spinner.wait(functools.partial(zmq.zmq_poll, items, 0), zmq.zmq_poll, items, wait_ms):
                if item is router:
                    self._answers.take()
                else:
                    role.drain()
            self._answers.after_poll()
