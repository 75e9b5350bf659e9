"""Which sequences run in the next forward pass, and how many tokens of each (rank 0 only).

``schedule()`` returns the step's sequences, each with ``seq.num_new`` set (the tokens it
computes from ``seq.num_computed`` on), and whether the step is a prefill (False: every
sequence computes exactly its newest token, a pure decode that the static/CUDA-graph path
may run). A waiting sequence is admitted with blocks for all its tokens, sharing the
prefix cache's blocks of its leading full blocks (``BlockManager.lookup``), so it computes
only the rest. Two policies:

- chunked prefill (``chunked_prefill=True``, vLLM v1 / SGLang style): a step carries at most
  ``max_num_batched_tokens`` tokens. Running sequences come first, in order: a decoding one
  takes one token, one that is mid-prefill the next chunk of its prompt; then waiting
  sequences are admitted (while ``max_num_seqs`` allows and the cache has their blocks)
  and take chunks of what budget is left. A long prompt is thus prefilled over several
  steps while the running sequences keep decoding one token every step; it is sampled
  only after its last chunk (``seq.completes_step``).
- whole prompts (``chunked_prefill=False``): a step is either a prefill or a decode, never
  both. Prefill: admit waiting sequences in order while the running set stays within
  ``max_num_seqs``, the step's tokens within ``max_num_batched_tokens`` (a single longer
  sequence still runs, alone) and the KV cache has their blocks. Decode, when nothing was
  admitted: one token for every running sequence.

Preemption (both): when a decoding sequence's next token needs a block and none is free,
the newest running sequence not yet scheduled this step is preempted (or, if none is
left, that sequence itself): its blocks are freed (registered ones stay in the prefix
cache until evicted) and it goes back to the head of the waiting queue, to be prefilled
again over its prompt and the tokens it had generated (its output so far is kept).

``postprocess(seqs, tokens)`` after the forward pass: ``commit``s each sequence's new
tokens (registering the blocks they filled) and appends the sampled tokens to those that
completed the step. A sequence that could not fit the whole cache even alone is refused
by ``add``, so the scheduler never stalls: with the cache empty the first waiting
sequence always fits, and a lone running sequence can always grow.
"""

from __future__ import annotations

import collections

from models.qwen3.block_manager import BlockManager
from models.qwen3.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_ids: frozenset[int] = frozenset(), chunked_prefill: bool = False) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_ids = eos_ids
        self.chunked_prefill = chunked_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0
        self.prompt_tokens = 0  # tokens of the sequences admitted (a preempted one counts again)
        self.cached_prompt_tokens = 0  # of those, served from the prefix cache
        self.prefill_chunks = 0  # prefill pieces run (a prompt in one piece counts one)

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
        """The next step's sequences (each with ``num_new``) and whether it is a prefill; empty only when idle."""
        if self.chunked_prefill:
            return self._schedule_chunked()
        scheduled, num_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.lookup(seq)
            new = len(seq) - len(hits) * self.block_manager.block_size
            if scheduled and num_tokens + new > self.max_num_batched_tokens:
                break
            if not self._admit(seq, hits, new):
                break
            num_tokens += new
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        pending, self.running = self.running, collections.deque()
        scheduled = self._schedule_running(pending, budget=None)
        return scheduled, False

    def _schedule_chunked(self) -> tuple[list[Sequence], bool]:
        budget, preemptions = self.max_num_batched_tokens, self.num_preemptions
        pending, self.running = self.running, collections.deque()
        scheduled = self._schedule_running(pending, budget)
        budget -= sum(seq.num_new for seq in scheduled)
        if self.num_preemptions != preemptions:
            budget = 0  # the cache is full: admit nothing this step (vLLM's rule too)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.lookup(seq)
            if not self._admit(seq, hits, budget):
                break
            budget -= seq.num_new
            scheduled.append(seq)
        return scheduled, any(seq.num_new != 1 or not seq.completes_step for seq in scheduled)

    def _schedule_running(self, pending: collections.deque[Sequence], budget: int | None) -> list[Sequence]:
        """Running sequences in order, within ``budget`` tokens (None: one each, no limit): a
        decode's next block, preempting the newest unscheduled ones when none is free; the rest
        stay running, after the scheduled ones. ``self.running`` must be empty on entry."""
        bm, scheduled = self.block_manager, []
        while pending and (budget is None or budget > 0):
            seq = pending.popleft()
            while not bm.can_append(seq):
                if not pending:
                    self._preempt(seq)
                    break
                self._preempt(pending.pop())
            else:
                bm.append(seq)
                seq.num_new = len(seq) - seq.num_computed
                if budget is not None:
                    seq.num_new = min(seq.num_new, budget)
                    budget -= seq.num_new
                if seq.num_new > 1 or not seq.completes_step:
                    self.prefill_chunks += 1
                scheduled.append(seq)
        self.running.extend(scheduled)
        self.running.extend(pending)
        return scheduled

    def _admit(self, seq: Sequence, hits: list[int], budget: int) -> bool:
        """Move the head of the waiting queue to running with its blocks, ``num_new`` at most
        ``budget``; False (nothing changed) when the cache lacks room."""
        bm = self.block_manager
        if not bm.can_allocate(seq, hits):
            return False
        bm.allocate(seq, hits)
        seq.num_new = min(len(seq) - seq.num_computed, budget)
        self.prompt_tokens += len(seq)
        self.cached_prompt_tokens += seq.num_computed
        self.prefill_chunks += 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(self.waiting.popleft())
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens admitted (0.0 before any)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """After the step's forward pass: its new tokens are in the cache (``commit``); each sequence
        that completed the step (``seq.completes_step``, in order) gets its sampled token from
        ``tokens``. Frees and returns the ones that finished."""
        sampled = [seq for seq in seqs if seq.completes_step]
        for seq in seqs:
            self.block_manager.commit(seq, seq.num_computed + seq.num_new)
            seq.num_new = 0
        finished = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.append(token, self.eos_ids)
            if seq.is_finished:
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
