"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns, and the prefix cache.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. Token ``p`` of
a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
A sequence of ``n`` tokens needs ``ceil(n / block_size)`` blocks while it runs (a decoding
sequence has every token but the newest in the cache, the next step writes the newest).

Prefix caching (``prefix_caching=True``, vLLM's automatic prefix caching, nano-vllm's
hashed blocks): a FULL block is identified by a hash chained over its tokens and the
blocks before it::

    hash(block i) = sha256(hash(block i-1) | the block's block_size token ids, int64)

so equal hashes mean equal prefixes, whatever the sequence. Per block: a reference count
(the sequences whose table holds it) and its hash once registered (``hash_to_block``).

- ``lookup(seq)``: the longest run of ``seq``'s leading full blocks already registered,
  within its first ``len(seq) - 1`` tokens (the last token is always computed, so that
  there are logits to sample). ``allocate(seq, hits)`` shares those blocks (ref + 1) and
  sets ``seq.num_computed`` past them; new blocks cover the rest.
- ``commit(seq, upto)``: after the forward pass that wrote tokens ``..upto-1``, each block
  they filled is registered (when no other block holds that hash already). A block is
  therefore registered only once it is full AND its KV has been written: a sequence that
  fails or is cancelled before that leaves nothing half-written for others to read.
- ``free(seq)``: ref - 1 on each of its blocks (last block first). A block nobody holds
  returns to the free pool; a registered one keeps its hash and can still be hit, until it
  is needed: new blocks come first from blocks that hold no hash (lowest id first), then by
  evicting the least recently freed registered block (its hash is dropped).

A shared block is never written: a sequence writes only from ``num_computed`` on, past
its hit blocks. Everything is deterministic (rank 0 alone decides; the plan carries the
block tables to the other ranks).
"""

from __future__ import annotations

import collections
import hashlib
import heapq

import numpy as np

from models.qwen3.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._empty = list(range(num_blocks))  # a heap of free blocks without a hash: lowest id first
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held by a sequence or free)."""
        return len(self.hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """The chained hash of ``seq``'s full block ``index`` (computed once per sequence)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            tokens = np.asarray(seq.token_ids[i * bs:(i + 1) * bs], dtype=np.int64)
            if len(tokens) < bs:
                raise ValueError(f"block {i} of sequence {seq.seq_id} is not full")
            hashes.append(hashlib.sha256((hashes[-1] if hashes else b"") + tokens.tobytes()).digest())
        return hashes[index]

    def lookup(self, seq: Sequence) -> list[int]:
        """The registered blocks that hold ``seq``'s leading full blocks (its last token excluded)."""
        hits: list[int] = []
        if not self.prefix_caching:
            return hits
        for i in range((len(seq) - 1) // self.block_size):
            block = self.hash_to_block.get(self.block_hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------------------ allocation

    def _missing(self, seq: Sequence, hits: int = 0) -> int:
        return max(0, self.blocks_for(len(seq)) - len(seq.block_table) - hits)

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Room for all of ``seq``'s tokens (a whole prompt beyond its ``hits``, or a decode's newest token)."""
        hits = hits or []
        reused_free = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits that leave the free pool
        return self._missing(seq, len(hits)) + reused_free <= self.num_free

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq)

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        """Give ``seq`` the blocks its tokens need: first its prefix ``hits`` (a sequence with no
        blocks yet; ``seq.num_computed`` then starts past them), then new ones. Prefill and decode
        both come through here."""
        hits = hits or []
        if not self.can_allocate(seq, hits):
            raise RuntimeError(f"sequence {seq.seq_id} needs {self._missing(seq, len(hits))} more KV blocks, "
                               f"{self.num_free} are free")
        if not seq.block_table:
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self._cached_free[block]
                self.ref_counts[block] += 1
            seq.block_table.extend(hits)
            seq.num_committed = len(hits)
            seq.num_computed = len(hits) * self.block_size
        for _ in range(self._missing(seq)):
            block = self._take()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    append = allocate

    def _take(self) -> int:
        if self._empty:
            return heapq.heappop(self._empty)
        block, _ = self._cached_free.popitem(last=False)  # the least recently freed cached block
        del self.hash_to_block[self.hashes[block]]
        self.hashes[block] = None
        self.num_evictions += 1
        return block

    def commit(self, seq: Sequence, upto: int) -> None:
        """Tokens ``..upto-1`` of ``seq`` are in the cache now (a forward pass wrote them): register
        the blocks they filled."""
        seq.num_computed = upto
        if not self.prefix_caching:
            return
        for i in range(seq.num_committed, upto // self.block_size):
            digest, block = self.block_hash(seq, i), seq.block_table[i]
            if digest not in self.hash_to_block and self.hashes[block] is None:
                self.hash_to_block[digest] = block
                self.hashes[block] = digest
        seq.num_committed = max(seq.num_committed, upto // self.block_size)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (last first, so that a prefix outlives its tails in the cache)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            if self.hashes[block] is None:
                heapq.heappush(self._empty, block)
            else:
                self._cached_free[block] = None
        seq.block_table.clear()
        seq.num_computed = seq.num_committed = 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of ``seq``'s tokens ``start..end-1`` (blocks must be allocated)."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
