"""The request channel: a request goes once to its group's broadcast ring (every rank reads it),
and its answer, the output rank's, comes back to the thread that waits for it.

    caller: submit(replica, request, future)                  (Engine.submit: a plain Future)
      encode (tensors -> the group's request arena; a message larger than a ring slot too)
      under role.lock: register pending, then write it once to the ring (runtime.link.broadcast)
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
chunks reach the call (``supervisor.answers``). Its cancel hook writes "cancel" {id} to the
ring, behind the request itself, while the request is still pending.

Invariants:
- A request is registered as pending before it is written, so its "done" can never arrive
  first; its clock starts at submission (``execution_timeout_s``); a deadline earlier than
  the watch thread's next wake-up wakes it.
- A write never blocks: a ring without a free slot for some rank (a slow, stopped or dead
  rank) keeps the message in this process, in order, until a flush (each poll of the reader,
  each turn of the watch thread) finds room; a dead rank fails its group through its
  sentinel, a stopped one through its heartbeats, and the pending futures with it.
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
from runtime.link.broadcast import FLAG_SPILL, spill_ref
from runtime.transport import wire
from runtime.transport.reader import ReaderRole
from runtime.transport.spin import Spinner
from supervisor.answers import AnswerReader
from supervisor.groups import GroupState, LockedArena, PendingRequest, free_blocks

# a plain int: ``getsockopt(EVENTS) & zmq.POLLIN`` would build an enum member on every call
_POLLIN = int(zmq.POLLIN)


class RequestChannel:
    def __init__(self, groups: list[GroupState], role: ReaderRole, answers: AnswerReader, router: zmq.Socket,
                 config: WorkerSupervisorConfig, spin_ns: int, wake_watch: Callable[[], None]) -> None:
        self._groups, self.role, self._answers = groups, role, answers
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
        """Write ``request`` to the ring of ``replica``; ``future`` gets the output rank's answer,
        ``stream`` (a ``StreamCall``, for a streamed request) its chunks before that."""
        group = self._groups[replica]
        if group.failed is not None:
            raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed}")
        request_id = next(self._ids)
        payload, placed, flags = self._encode(group, request_id, request, stream is not None)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        pending = PendingRequest(future, deadline, placed, stream)
        with self.role.lock:
            if self.role.closed or group.failed is not None:
                free_blocks(group, placed)
                raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed or 'closed'}")
            group.pending[request_id] = pending
            pending.seq = group.ring.write(payload, flags)
            # the watch thread reads when nobody else does (or sleeps past this deadline)
            wake = self.role.holder is None or (pending.deadline is not None and pending.deadline < self.wake_at)
        if wake:
            self._wake_watch()
        if stream is not None:
            stream.bind_cancel(functools.partial(self.cancel, replica, request_id))

    def cancel(self, replica: int, request_id: int) -> None:
        """A stream's cancel hook: "cancel" to every rank of ``replica`` while the request is pending."""
        group = self._groups[replica]
        message = wire.pack_message(rp.CANCEL, request_id)
        with self.role.lock:
            if self.role.closed or group.failed is not None or request_id not in group.pending:
                return
            group.ring.write(message)

    def _encode(self, group: GroupState, request_id: int, request: Any,
                stream: bool = False) -> tuple[Any, list[tuple[str, int]], int]:
        """The request's message (or, larger than a ring slot, a reference to its copy in the
        request arena), the arena blocks it placed, and its ring flags."""
        try:  # an idle encoder of this group; each concurrent caller makes one the first time
            allocator, encoder = group.encoders.pop()
        except IndexError:
            allocator = LockedArena(group)
            encoder = wire.TensorEncoder(allocator=allocator)
        flags, placed = 0, []
        try:
            if stream:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, stream=True,
                                            tensor_encoder=encoder)
            else:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, tensor_encoder=encoder)
            placed, allocator.placed = allocator.placed, []
            if len(payload) > group.ring.max_bytes:  # spilled: the ranks copy it out of the arena
                segment, offset, view = allocator.place(len(payload))
                placed.append((segment, offset))
                view[:] = payload
                payload, flags = spill_ref(segment, offset, len(payload)), FLAG_SPILL
        except Exception:
            free_blocks(group, placed)  # what the message placed (pack_message frees its own when it raises)
            if group.failed is None:
                raise
            # the group failed meanwhile and its arena is closed
            raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed}") from None
        finally:
            allocator.placed = []
            group.encoders.append((allocator, encoder))
        return payload, placed, flags

    def read(self, future: Future, deadline: float | None) -> None:
        """As the reader (``ReaderRole.wait``): take answers until ``future`` is done, ``deadline``
        passed or the role is closed; woken through ``role.fd`` (a failure, close)."""
        role, router = self.role, self._router
        items = [(router, _POLLIN), (role.fd, _POLLIN)]
        while not future.done() and not role.closed:
            # a ring that waits for a rank's credit is flushed after each poll: look again soon
            wait_ms = 2 if self._answers.waiting else self._poll_ms
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
