"""qwen3's prefix cache and chunked prefill without a model: block manager and scheduler.

The workload test runs the scheduler against a fake KV cache in which each slot holds the
prefix whose last token was written there: every slot a sequence reads (its first
``num_computed`` tokens) must hold exactly its own prefix, whatever was shared, evicted,
preempted, cancelled or failed half-way.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.qwen3.block_manager import BlockManager
from models.qwen3.scheduler import Scheduler
from models.qwen3.sequence import SamplingParams, Sequence, SequenceStatus
from models.qwen3.token_streams import drop_sequences

pytestmark = pytest.mark.timeout(120)


def seq(tokens: list[int], max_tokens: int = 4, request_id: object = 0) -> Sequence:
    return Sequence(request_id, 0, list(tokens), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token: int = 7) -> list[Sequence]:
    """One step: schedule, then pretend the forward pass ran; the scheduled sequences."""
    batch, _ = s.schedule()
    s.postprocess(batch, [token] * sum(x.completes_step for x in batch))
    return batch


# --------------------------------------------------------------------------- block manager


def test_full_blocks_are_shared_and_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    a = seq(range(10))  # blocks [0..3] [4..7] [8 9]
    assert bm.lookup(a) == []
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_computed == 0
    bm.commit(a, 10)  # the forward pass wrote tokens 0..9: two full blocks registered
    assert bm.num_cached_blocks == 2 and a.num_committed == 2
    b = seq([*range(8), 99])  # shares both full blocks, then its own
    assert bm.lookup(b) == [0, 1]
    bm.allocate(b, bm.lookup(b))
    assert b.block_table == [0, 1, 3] and b.num_computed == 8 and bm.ref_counts[:4] == [2, 2, 1, 1]
    c = seq(range(8))  # exactly two full blocks: the second holds its last token, so only one is hit
    assert bm.lookup(c) == [0]
    d = seq([*range(5), 50, 6, 7, 8])  # differs inside block 1: block 0 only
    assert bm.lookup(d) == [0]
    e = seq([1, *range(1, 9)])  # differs in block 0: the chained hash misses block 1 too
    assert bm.lookup(e) == []


def test_a_block_is_registered_only_once_full_and_written():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    a = seq(range(10))
    bm.allocate(a)
    bm.commit(a, 6)  # a first chunk of 6 tokens: block 0 only
    assert bm.num_cached_blocks == 1 and bm.lookup(seq(range(10))) == [0]
    bm.free(a)  # cancelled before the rest: block 1 (half-written) is not in the cache
    assert bm.lookup(seq(range(10))) == [0] and bm.num_free == 8 and a.num_computed == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    a, b = seq([1, 2, 3]), seq([5, 6, 7])
    for x in (a, b):
        bm.allocate(x)
        bm.commit(x, 3)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 4 and bm.num_cached_blocks == 2  # blocks 0 and 2 keep their hash
    again = seq([1, 2, 9])
    assert bm.lookup(again) == [0]
    bm.allocate(again, [0])  # the hit leaves the free pool, the new block comes from the hashless ones
    assert again.block_table == [0, 1] and bm.num_free == 2
    c = seq([8, 8, 8, 8, 8])  # 3 blocks: the hashless 1 and 3, then evicts block 2 (b's prefix, older)
    assert not bm.can_allocate(c)
    bm.free(again)
    bm.allocate(c)
    assert c.block_table == [1, 3, 2] and bm.num_evictions == 1 and bm.lookup(seq([5, 6, 7])) == []
    assert bm.lookup(seq([1, 2, 3])) == [0]  # a's prefix, freed later, is still there


def test_no_prefix_caching_never_shares():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3])
    bm.allocate(a)
    bm.commit(a, 3)
    assert bm.lookup(seq([1, 2, 3])) == [] and bm.num_cached_blocks == 0


# --------------------------------------------------------------------------- scheduler


def test_chunked_prefill_keeps_decodes_going_and_samples_after_the_last_chunk():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=True)
    short, long = seq(range(3), max_tokens=10, request_id="short"), seq(range(20), request_id="long")
    s.add([short])
    assert run_step(s) == [short] and short.num_computed == 3
    s.add([long])
    batch, prefill = s.schedule()
    assert prefill and batch == [short, long] and (short.num_new, long.num_new) == (1, 7)
    assert short.completes_step and not long.completes_step
    s.postprocess(batch, [9])  # one token: short's
    assert short.output_ids == [7, 9] and long.output_ids == [] and long.num_computed == 7
    batch, _ = s.schedule()
    assert [x.num_new for x in batch] == [1, 7]  # 14 of 20
    s.postprocess(batch, [9])
    batch = run_step(s)
    assert batch == [short, long] and long.num_computed == 20 and long.output_ids == [7]
    batch, prefill = s.schedule()
    assert not prefill and [x.num_new for x in batch] == [1, 1]  # a pure decode again
    assert s.prefill_chunks == 1 + 3  # short in one piece, long in three


def test_whole_prompt_mode_prefills_only_the_uncached_part():
    bm = BlockManager(64, 4, prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = seq(range(13), max_tokens=1)
    s.add([first])
    assert run_step(s) == [first] and first.is_finished
    second = seq([*range(12), 40, 41], max_tokens=2)
    s.add([second])
    batch, prefill = s.schedule()
    assert prefill and batch == [second] and (second.num_computed, second.num_new) == (12, 2)
    assert s.prompt_tokens == 27 and s.cached_prompt_tokens == 12
    assert s.prefix_cache_hit_rate == pytest.approx(12 / 27)


def test_a_failed_step_registers_nothing():
    bm = BlockManager(16, 4, prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=True)
    a = seq(range(20), request_id="a")
    s.add([a])
    run_step(s)  # first chunk: 8 tokens, blocks 0 and 1 registered
    assert bm.num_cached_blocks == 2
    s.schedule()  # the second chunk's forward pass fails: no postprocess, the request is dropped
    drop_sequences(s, [a])
    assert bm.num_cached_blocks == 2 and bm.num_free == 16 and not s.has_unfinished()
    b = seq(range(20), request_id="b")
    assert bm.lookup(b) == [0, 1]  # the first chunk's blocks only
    s.add([b])
    batch, _ = s.schedule()
    assert batch == [b] and (b.num_computed, b.num_new) == (8, 8)


# --------------------------------------------------------------------------- any workload


def _next_token(tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on the whole history."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % 50


def _check_and_write(bm: BlockManager, kv: dict[int, tuple], batch: list[Sequence], rng: random.Random,
                     fail: bool) -> None:
    """Every slot a sequence attends to holds its own prefix; write this step's tokens (garbage when
    the step fails). Shared blocks are never written."""
    for x in batch:
        end = x.num_computed + x.num_new
        for p, slot in enumerate(bm.slots(x, 0, end)):
            if p < x.num_computed:
                assert kv.get(slot) == tuple(x.token_ids[:p + 1]), (x.seq_id, p)
            else:
                assert bm.ref_counts[slot // bm.block_size] == 1, "a shared block is written"
                kv[slot] = ("garbage", rng.random()) if fail else tuple(x.token_ids[:p + 1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=10),
    num_blocks=st.integers(8, 30), block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 40), chunked=st.booleans(), caching=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_any_workload_reads_only_its_own_prefix_and_finishes_right(
        lens, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, chunked, caching, seed):
    rng = random.Random(seed)
    prefixes = [[(7 * j + k) % 50 for j in range(rng.randint(0, 14))] for k in range(4)]
    bm = BlockManager(num_blocks, block_size, prefix_caching=caching)
    s = Scheduler(bm, max_num_seqs, max_num_batched_tokens, frozenset({49}), chunked_prefill=chunked)
    seqs, dropped, kv = [], set(), {}
    for i, (prefix, suffix_len, max_tokens) in enumerate(lens):
        x = seq(prefixes[prefix] + [(i * 13 + j) % 50 for j in range(suffix_len)], max_tokens, request_id=i)
        if bm.blocks_for(len(x) + max_tokens - 1) > num_blocks:
            continue
        s.add([x])
        seqs.append(x)
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        batch, _ = s.schedule()
        assert batch, "the scheduler stalled"
        assert len(batch) <= max_num_seqs and len(s.running) <= max_num_seqs
        if chunked:
            assert sum(x.num_new for x in batch) <= max_num_batched_tokens
        held = sum(bm.ref_counts)
        assert held == sum(len(x.block_table) for x in s.running)
        assert sum(1 for r in bm.ref_counts if r == 0) == bm.num_free
        fail = rng.random() < 0.05  # the step's forward pass fails: its requests are dropped unfinished
        _check_and_write(bm, kv, batch, rng, fail)
        if fail:
            drop_sequences(s, batch)
            dropped.update(x.seq_id for x in batch)
            continue
        s.postprocess(batch, [_next_token(x.token_ids) for x in batch if x.completes_step])
        if rng.random() < 0.05 and s.running:  # a stream cancelled between steps, maybe mid-prefill
            victim = rng.choice(list(s.running))
            drop_sequences(s, [victim])
            dropped.add(victim.seq_id)
    assert not s.has_unfinished() and bm.num_free == num_blocks
    for x in seqs:
        if x.seq_id in dropped:
            assert x.status is SequenceStatus.FINISHED and x.finish_reason == "cancelled"
            continue
        want = list(x.token_ids[:x.num_prompt_tokens])
        while True:
            want.append(_next_token(want))
            if want[-1] == 49 or len(want) - x.num_prompt_tokens == x.params.max_tokens:
                break
        assert x.token_ids == want
