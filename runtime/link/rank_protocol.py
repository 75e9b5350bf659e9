"""The engine<->ranks messages of a local replica, defined once: their types, who sends each on
which channel, and their fields. ``runtime.transport.wire`` is the codec under them: every message
is ``wire.pack_message(TYPE, id, **fields)``, one msgpack map ``{"v": 1, "type", "id", **fields}``.

Torch-free; imports only ``runtime.core.errors`` of the project.

    engine (supervisor)                                       rank (workers.main)
    BroadcastWriter (runtime.link.broadcast), written once,   BroadcastReader, every rank,
      read by every rank in the same order:                     the main thread
        REQUEST, BATCH, CANCEL ---------------------------->  "ring"          (INBOX)
        FREE, SHUTDOWN (written with FLAG_CONTROL) -------->  "ring-control"  (CONTROL)
    ctl ROUTER ipc://RUN/ctl     <- READY, STARTUP_ERROR,     DEALER "c-R-r", the main thread
                                    DONE, PARTIAL ----------  (ANSWERS; DONE and PARTIAL from
                                                              the output rank, but a failed DONE)
    hb ROUTER ipc://RUN/hb       <- HB --------------------  DEALER "h-R-r"  (heartbeat thread)

The call sites keep calling ``wire.pack_message``/``wire.unpack_message`` themselves, with these
constants (tests replace those two functions inside a rank); nothing here runs per message but
``error_fields`` and ``remote_error``, on the error paths. tests/test_rank_protocol.py checks every
pack site's fields against ``MESSAGES``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from runtime.core.errors import RemoteError

__all__ = ["ORPHAN_EXIT", "REQUEST", "BATCH", "CANCEL", "FREE", "SHUTDOWN", "READY", "STARTUP_ERROR", "DONE", "PARTIAL",
           "HB", "Message",
           "MESSAGES", "INBOX", "CONTROL", "ANSWERS", "BEATS", "ERROR_FIELDS", "error_fields", "remote_error"]

REQUEST = "request"
BATCH = "batch"
CANCEL = "cancel"
FREE = "free"
SHUTDOWN = "shutdown"
READY = "ready"
STARTUP_ERROR = "startup_error"
DONE = "done"
PARTIAL = "partial"
HB = "hb"

#: the exit status of a rank that found its engine gone (``supervisor.processes.die_with_parent``, or
#: where the kernel cannot kill it with its parent, its heartbeat thread)
ORPHAN_EXIT = 70
#: how a rank reports an exception: its type's qualified name, its text and its traceback text
ERROR_FIELDS = ("error_type", "message", "traceback")


@dataclass(frozen=True, slots=True)
class Message:
    """One message type: its sender ("engine" or "rank"), the channel it travels on ("ring",
    "ring-control", "ctl" or "hb"), what its ``id`` is, and its fields besides ``v``, ``type``
    and ``id``."""

    type: str
    sender: str
    socket: str
    id: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(self.required + self.optional)


MESSAGES = {m.type: m for m in (
    # a request for every rank of the replica, in the ring's order; ``stream``: True for a stream
    Message(REQUEST, "engine", "ring", "the request's id", ("payload",), ("stream",)),
    # the engine formed a batch (BatchingConfig): the next ``count`` REQUESTs on the ring are run as
    # one ``execute_batch``, by every rank alike; its id is the first request's
    Message(BATCH, "engine", "ring", "the batch's first request id", ("count",)),
    # a stream's cancel, behind its request on the ring
    Message(CANCEL, "engine", "ring", "the stream's request id"),
    # result blocks the engine is done with, back to the output rank (the only one with a result arena)
    Message(FREE, "engine", "ring-control", "0", ("blocks",)),
    # the ring's last message (the engine closes the ring with it: it overtakes queued requests)
    Message(SHUTDOWN, "engine", "ring-control", "0"),
    # the rank booted; ``segments``: its result arena's segments (none but the output rank's), to map;
    # ``stepped``: its runner forms its own batches (it gets requests as they come, not by credit)
    Message(READY, "rank", "ctl", "the rank", ("segments",), ("stepped",)),
    Message(STARTUP_ERROR, "rank", "ctl", "the rank", ERROR_FIELDS),
    # the output rank's answer to each request (``result``, or ERROR_FIELDS); from another rank
    # only a failure (ok false, ERROR_FIELDS): non-output ranks answer nothing else
    Message(DONE, "rank", "ctl", "the request's id", ("ok",), ("result", *ERROR_FIELDS)),
    # a stream's chunk, from the output rank only, before the stream's DONE
    Message(PARTIAL, "rank", "ctl", "the request's id", ("chunk",)),
    # every heartbeat_interval_s, from each rank's heartbeat thread; the output rank's carries its
    # runner's info snapshot (``EngineCore.info_snapshot``) when it changed since the last one sent
    Message(HB, "rank", "hb", "a count of the beats sent", (), ("info",)),
)}


def _types(sender: str, socket: str) -> frozenset[str]:
    return frozenset(m.type for m in MESSAGES.values() if m.sender == sender and m.socket == socket)


#: what a rank reads from the ring (plain and control messages), and what the engine reads from the ctl ROUTER
INBOX = _types("engine", "ring")
CONTROL = _types("engine", "ring-control")
ANSWERS = _types("rank", "ctl")
#: what the engine reads from the hb ROUTER
BEATS = _types("rank", "hb")


def error_fields(exc: BaseException) -> dict[str, str]:
    """``exc`` as a STARTUP_ERROR's or a failed DONE's fields (``ERROR_FIELDS``)."""
    return {
        "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def remote_error(msg: dict[str, Any]) -> RemoteError:
    """The exception a rank reported in ``msg`` (``error_fields``), as the engine raises it."""
    return RemoteError(str(msg.get("error_type")), str(msg.get("message")), str(msg.get("traceback", "")))
