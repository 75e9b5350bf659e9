"""Which sequences run in the next forward pass (rank 0 only).

Each step is either a prefill or a decode, never both:

- prefill: admit waiting sequences in order while the running set stays within
  ``max_num_seqs``, the step's tokens within ``max_num_batched_tokens`` (a single
  longer sequence still runs, alone) and the KV cache has their blocks;
- decode, when nothing was admitted: one token for every running sequence. When
  a sequence's next token needs a block and none is free, the newest running
  sequence is preempted: its blocks are freed and it goes back to the head of
  the waiting queue, to be prefilled again over its prompt and the tokens it had
  generated (recomputation; its output so far is kept).

A sequence that could not fit the whole cache even alone is refused by ``add``,
so the scheduler never stalls: with the cache empty, the first waiting sequence
always fits, and a lone running sequence can always grow.
"""

from __future__ import annotations

import collections

from models.qwen3.block_manager import BlockManager
from models.qwen3.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_ids: frozenset[int] = frozenset()) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_ids = eos_ids
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences; ValueError, queuing none, if one could never fit the cache."""
        bm = self.block_manager
        for seq in seqs:
            longest = seq.num_prompt_tokens + seq.params.max_tokens - 1  # the last token is never cached
            if bm.blocks_for(longest) > bm.num_blocks:
                raise ValueError(
                    f"a sequence of up to {longest} cached tokens needs {bm.blocks_for(longest)} KV blocks of "
                    f"{bm.block_size} tokens, but the cache has {bm.num_blocks}; shorten the prompt or "
                    "max_tokens, or raise kv_cache_blocks")
        self.waiting.extend(seqs)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences and whether it is a prefill; empty only when idle."""
        bm, scheduled, num_tokens = self.block_manager, [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if scheduled and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            num_tokens += len(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if not self.running:
                    self._preempt(seq)
                    break
                self._preempt(self.running.pop())
            else:
                bm.append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sequence's sampled token; free and return the ones that finished."""
        finished = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token, self.eos_ids)
            if seq.is_finished:
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
