"""A rank's serving loop: the broadcast ring in, the output rank's answers out (``serve``).

    BroadcastReader (every rank, in the ring's order)     answer lane (runtime.link.lane): DONE
      REQUEST -> EngineCore.run | add (stepped) ------>    ctl DEALER "c-R-r": PARTIAL, a stream's
      BATCH {count} + its REQUESTs -> run_batch            DONE, one too large (the output rank
                                                           only; another: a failed DONE only)
      CANCEL -> the runner's cancel (stepped)
      FREE -> the output rank's result blocks; SHUTDOWN -> return

Serve: every rank of the replica reads every message of its replica from the one broadcast
ring, in the same order, so all ranks enter the plugin's collectives together. Only the output
rank (rank 0) answers: "done" for each request (with its result, or its error) and "partial" for
each stream chunk. The other ranks send nothing per request but "done" {ok: false} when their
plugin raises; because ranks that share collectives cannot resume mid-request, the supervisor
then takes the group down. Non-output ranks have no result arena.

Answers: the output rank sends a "done" by its replica's answer lane (a ring in the broadcast
segment and a pipe, past libzmq's I/O threads on both sides) unless the request streamed (its
chunks went by the DEALER, and its end must follow them) or the lane refuses it (too large, no
room, the engine gone); then by the DEALER. Answers of different requests need no order.

Release: a rank tells the ring it is done with a message (``BroadcastReader.release``, in
order): an executing runner after ``run``, a stepped one after ``add``, a control message at
once. The engine frees a request's arena blocks once the output rank answered and every rank
released it, so a stepped plugin must not keep request tensors on a non-output rank past the
output rank's answer.

Executing runners stay in lock step by construction (same requests, same order,
one at a time). A stepped runner admits whatever has arrived before each step,
which may differ between ranks by a message, so a stepped plugin that runs
collectives must agree on each step's batch itself (rank 0 decides and
broadcasts it on ``P.cpu_group()``).

Streams: a "request" with ``stream: true`` is admitted as a stream (``EngineCore.add``); a
"cancel" {id} behind it on the ring reaches the runner's ``cancel``. The output rank sends each
``Partial`` chunk as "partial" {id, chunk} before the request's "done"; the other ranks drop
theirs. An executing runner runs one request at a time: a "cancel" it reads is dropped (the
request it names ran already).

Shutdown: "shutdown" is the ring's last message, and the engine closes the ring with it; a
rank sees the ring closed ahead of any request still queued in it, and stops.

Batches (``runtime.core.config.BatchingConfig``): the engine writes a BATCH header and its
requests together, so every rank reads the same batch and calls ``execute_batch`` once with it;
the header is released at once, its requests after the batch ran (releases go in order).
"""

from __future__ import annotations

from typing import Any

import zmq

from runtime.core.errors import ProtocolError
from runtime.core.plugins import Partial
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import CLOSED, FLAG_CONTROL, BroadcastReader
from runtime.transport import wire
from runtime.transport.arena import ShmArena

#: inline tensors up to this size; larger CPU tensors go through shared memory
INLINE_LIMIT = 64 * 1024


def serve(ctl: zmq.Socket, ring: BroadcastReader, core: Any, arena: ShmArena | None, decoder: Any,
          lane: Any = None) -> None:
    """Read the ring until it closes (or says "shutdown"): admit, run or step, and answer (by
    ``lane``, the replica's answer lane, where it takes the answer)."""
    encoder = wire.TensorEncoder(allocator=arena, inline_threshold=INLINE_LIMIT) if arena is not None else None
    answers = _Answers(ctl, lane)
    stepped = core.stepped
    served = False  # after an answer: look for the next request a moment before sleeping
    while True:
        # Block for messages only while the runner has nothing to advance (an executing one
        # never has: it runs each request as it is taken).
        stepping = stepped and core.has_unfinished()
        got = ring.recv(0 if stepping else None, spin=served)
        served = False
        done: list = []
        while got is not None:
            if got is CLOSED:
                return
            seq, flags, data = got
            if flags & FLAG_CONTROL:
                if _control(ring, seq, data, arena):
                    return
            elif stepped:  # admit whatever has arrived, then step once
                msg = wire.unpack_message(data, expected_types=rp.INBOX, tensor_decoder=decoder)
                if msg["type"] == rp.CANCEL:
                    core.cancel(msg["id"])
                else:
                    core.add(msg["id"], msg["payload"], msg.get("stream") is True)
                ring.release(seq)  # its tensors stay valid until the output rank answers (the rule)
            else:  # one request (or one batch) at a time: the rest stay in the ring
                msg = wire.unpack_message(data, expected_types=rp.INBOX, tensor_decoder=decoder)
                if msg["type"] == rp.REQUEST:
                    done = core.run(msg["id"], msg["payload"])
                ring.release(seq)  # (a batch's header before its requests: releases go in order)
                if msg["type"] == rp.BATCH:
                    done = _run_batch(ring, core, decoder, msg["count"])
                    if done is None:
                        return
                if done:
                    break
            got = ring.recv(0)
        if stepped:
            done = core.step()
        if done:
            served = answers.send(done, encoder)


def _control(ring: BroadcastReader, seq: int, data: Any, arena: ShmArena | None) -> bool:
    """A control message off the ring: result blocks freed (the output rank's), or "shutdown" (True)."""
    msg = wire.unpack_message(data, expected_types=rp.CONTROL)
    ring.release(seq)
    if msg["type"] == rp.SHUTDOWN:
        return True
    for segment, offset in msg["blocks"] if arena is not None else ():
        arena.free(segment, offset)
    return False


def _run_batch(ring: BroadcastReader, core: Any, decoder: Any, count: int) -> list | None:
    """The ``count`` requests behind a BATCH header (the engine writes them together: nothing else
    comes between), run as one batch; None when the ring closed meanwhile."""
    ids, payloads, seqs = [], [], []
    while len(ids) < count:
        got = ring.recv(None)
        if got is CLOSED or got is None:
            return None
        seq, _, data = got
        msg = wire.unpack_message(data, expected_types=rp.INBOX, tensor_decoder=decoder)
        if msg["type"] != rp.REQUEST:
            raise ProtocolError(f"a batch of {count} holds a {msg['type']!r} message, not only requests")
        ids.append(msg["id"])
        payloads.append(msg["payload"])
        seqs.append(seq)
    done = core.run_batch(ids, payloads)
    for seq in seqs:
        ring.release(seq)
    return done


class _Answers:
    """A rank's answers: "partial" and a streamed request's "done" by ``ctl`` (so that a stream's
    chunks and its end keep their order), any other "done" by ``lane`` when it takes it."""

    def __init__(self, ctl: zmq.Socket, lane: Any) -> None:
        self._ctl, self._lane = ctl, lane
        self._streamed: set = set()  # ids of requests that sent a chunk and are not done

    def send(self, done: list, encoder: wire.TensorEncoder | None) -> bool:
        """From the output rank (``encoder``): "partial" for each stream chunk and "done" for each
        completion, with its result or error; from another rank only "done" {ok: false} for an
        error. True when some request completed."""
        ctl, lane = self._ctl, self._lane
        for request_id, result, error in done:
            if type(result) is Partial:
                if encoder is not None:
                    self._streamed.add(request_id)
                    ctl.send(wire.pack_message(rp.PARTIAL, request_id, chunk=result.chunk, tensor_encoder=encoder))
                continue
            if error is None and encoder is not None:
                try:
                    reply = wire.pack_message(rp.DONE, request_id, ok=True, result=result, tensor_encoder=encoder)
                except Exception as exc:  # a result the wire cannot carry fails like the plugin did
                    error = exc
            if error is not None:
                reply = wire.pack_message(rp.DONE, request_id, ok=False, **rp.error_fields(error))
            elif encoder is None:
                continue  # a non-output rank's completion: nothing to say
            if request_id in self._streamed:
                self._streamed.discard(request_id)
            elif lane is not None and lane.put((reply,)):
                continue
            ctl.send(reply)
        return True
