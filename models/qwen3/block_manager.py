"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. Token ``p`` of
a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
A sequence of ``n`` tokens has every token but the newest in the cache after a step
and the newest written by the next step, so it needs ``ceil(n / block_size)`` blocks
while it runs. Blocks are handed out lowest id first (deterministic). No prefix
caching: blocks are never shared.
"""

from __future__ import annotations

import heapq

from models.qwen3.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap: lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, seq: Sequence) -> int:
        return max(0, self.blocks_for(len(seq)) - len(seq.block_table))

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for all of ``seq``'s tokens: a whole prefill, or a decode step's newest token."""
        return self._missing(seq) <= len(self._free)

    can_append = can_allocate

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` the blocks its tokens need (both prefill and decode go through here)."""
        missing = self._missing(seq)
        if missing > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id} needs {missing} more KV blocks, {len(self._free)} are free")
        seq.block_table.extend(heapq.heappop(self._free) for _ in range(missing))

    append = allocate

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            heapq.heappush(self._free, block)
        seq.block_table.clear()

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of ``seq``'s tokens ``start..end-1`` (blocks must be allocated)."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
