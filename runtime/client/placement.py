"""Where a client's request tensors go: ``Placement`` makes each request's encoder and lends blocks.

Torch-free: imports the client's replies and shm session, ``runtime.link.client_protocol`` (the
register header) and the transport's protocol.

    Client._prepare:  encoder(session) -> PayloadEncoder: a tensor of >= shm_threshold bytes
                        lies in a block Client.empty lent? borrow(): sent where it lies
                        else place(): copied into a block of the session's arena
                        (no usable session: frames)
    Client.empty:     lend(nbytes) -> an array over a lent block of the arena

Invariant: a segment new to the arena is registered with the server before any request
that uses it: its ``register`` goes into the connection's outbox under ``shm_lock``, ahead
of every request that could carry a tensor in it (the outbox is FIFO).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from runtime.client.replies import Replies
from runtime.client.shm import ShmSession
from runtime.link.client_protocol import register_header
from runtime.transport.protocol import PayloadEncoder


class Placement:
    """The shared memory a client's requests use: ``replies.session``, if any, and its arena."""

    def __init__(self, replies: Replies, outbox: Any, shm_threshold: int) -> None:
        self._replies = replies
        self._outbox = outbox  # the connection's: registrations go out before what uses them
        self.shm_threshold = shm_threshold
        self._bound: tuple[Any, Any, Any] = (None, None, None)  # (session, place, borrow), made once a session

    def encoder(self, session: ShmSession | None) -> PayloadEncoder:
        """An encoder for one request over ``session`` (None: frames only). Its frames view the
        caller's arrays: Connection.send has zmq copy them at once, or snapshots them."""
        if session is None:
            return PayloadEncoder(copy=False, shm_threshold=self.shm_threshold)
        bound, place, borrow = self._bound
        if bound is not session or (borrow is None and session.arena is not None):
            place = functools.partial(self._place, session)
            borrow = functools.partial(self._borrow, session) if session.arena is not None else None
            self._bound = (session, place, borrow)  # one tuple: threads racing here build the same
        return PayloadEncoder(copy=False, place=place, shm_threshold=self.shm_threshold, borrow=borrow)

    def lend(self, nbytes: int) -> np.ndarray | None:
        """A lent block of the current session's arena (``Client.empty``); None without a usable session."""
        with self._replies.shm_lock:
            session = self._replies.session
            if session is None or not session.usable:
                return None
            segment, offset, holder, new = session.lend(nbytes)
            if new:
                self._outbox.append((None, [register_header(session.run_id, [segment])]))
        return holder

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of the arena for a request tensor."""
        with self._replies.shm_lock:
            if session is not self._replies.session or not session.usable:
                return None
            segment, offset, view, new = session.place(nbytes)
            if new:
                self._outbox.append((None, [register_header(session.run_id, [segment])]))
            return segment, offset, view

    def _borrow(self, session: ShmSession, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block (``Client.empty``) a request tensor lies in, held by the request until its reply."""
        with self._replies.shm_lock:
            if session is not self._replies.session or not session.usable:
                return None
            return session.arena.borrow(address, nbytes)
