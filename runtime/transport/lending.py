"""Blocks of a shared-memory arena lent to a caller, who writes a tensor there and sends it as it is.

Imports nothing of the project; no torch. ``runtime.transport.arena.ShmArena`` keeps one
``LentBlocks``; ``Engine.empty`` and ``Client.empty`` are its users (through ``ShmArena.lend``),
the encoder (``runtime.transport.wire``) finds a sent tensor in it (``ShmArena.borrow``).

    ShmArena.lend(n)             a block with one holder: the caller's tensor (its finalizer frees it)
    encoder: ShmArena.borrow     a tensor lying wholly inside a lent block is sent as a reference
               (address, n)        to it, not copied; the message becomes a holder (+1) and lists
                                   the block among those it placed, so the usual free after its
                                   answer drops that holder
    ShmArena.free(segment, off)  a lent block: one holder fewer; the block goes back to the pool
                                   when none is left (the caller's tensor collected, every message
                                   that carried it answered)

Only the owner of the arena lends and borrows: a tensor that lies in another arena (another
engine, another client, a closed one) is not found and is copied as any other tensor.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class _Lent:
    address: int
    nbytes: int
    holders: int = 1


class LentBlocks:
    """The lent blocks of one arena, by (segment, offset) and by address. Not thread-safe: the
    arena's lock guards every call."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int], _Lent] = {}
        self._starts: list[int] = []  # addresses, sorted
        self._keys: list[tuple[str, int]] = []  # the block at each of _starts

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, segment: str, offset: int, address: int, nbytes: int) -> None:
        key = (segment, offset)
        self._blocks[key] = _Lent(address, nbytes)
        i = bisect.bisect_left(self._starts, address)
        self._starts.insert(i, address)
        self._keys.insert(i, key)

    def find(self, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block holding ``nbytes`` from ``address``: (segment, block offset, offset of
        ``address`` within the segment), with one more holder; None when none holds all of them."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        key = self._keys[i]
        lent = self._blocks[key]
        if address + nbytes > lent.address + lent.nbytes:
            return None
        lent.holders += 1
        return key[0], key[1], key[1] + (address - lent.address)

    def drop(self, segment: str, offset: int) -> bool | None:
        """One holder fewer. None: not a lent block; False: still held; True: the last holder
        went (the block is no longer lent: give it back)."""
        lent = self._blocks.get((segment, offset))
        if lent is None:
            return None
        lent.holders -= 1
        if lent.holders > 0:
            return False
        del self._blocks[(segment, offset)]
        i = bisect.bisect_left(self._starts, lent.address)
        while self._keys[i] != (segment, offset):  # equal addresses: only zero-byte blocks share one
            i += 1
        del self._starts[i], self._keys[i]
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self._starts.clear()
        self._keys.clear()
