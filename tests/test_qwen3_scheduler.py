"""qwen3's rank-0 bookkeeping without a model: block manager, scheduler (with preemption), sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.qwen3.block_manager import BlockManager
from models.qwen3.sampler import sample
from models.qwen3.scheduler import Scheduler
from models.qwen3.sequence import SamplingParams, Sequence, SequenceStatus

pytestmark = pytest.mark.timeout(60)


def seq(prompt_len: int, max_tokens: int = 4, request_id: object = 0, **params) -> Sequence:
    return Sequence(request_id, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params))


# --------------------------------------------------------------------------- block manager


def test_block_manager_allocates_lowest_first_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(5), seq(3)
    assert bm.can_allocate(a)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2] and bm.num_free == 1
    assert bm.slots(a, 0, 5) == [0, 1, 2, 3, 4]
    assert bm.slots(b, 1, 3) == [9, 10]
    a.token_ids += [7, 7, 7]  # 8 tokens still fit two blocks
    assert bm.can_append(a)
    bm.append(a)
    assert a.block_table == [0, 1]
    a.token_ids.append(7)  # the 9th token needs a third block
    bm.append(a)
    assert a.block_table == [0, 1, 3] and bm.num_free == 0
    b.token_ids += [7, 7]
    assert not bm.can_append(b)
    with pytest.raises(RuntimeError, match="needs 1 more KV blocks, 0 are free"):
        bm.append(b)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 3
    bm.append(b)
    assert b.block_table == [2, 0]  # freed blocks come back lowest first


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


# --------------------------------------------------------------------------- scheduler


def scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, eos=frozenset()):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, eos)


def test_prefill_is_bounded_by_seqs_and_tokens_then_decodes():
    s = scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [seq(4, request_id=i) for i in range(5)]
    s.add(seqs)
    batch, prefill = s.schedule()
    assert prefill and batch == seqs[:2]  # a third 4-token prompt would pass 10 tokens
    batch, prefill = s.schedule()
    assert prefill and batch == seqs[2:3]  # max_num_seqs 3 running
    batch, prefill = s.schedule()
    assert not prefill and batch == seqs[:3]
    assert all(x.status is SequenceStatus.RUNNING for x in batch) and list(s.waiting) == seqs[3:]


def test_a_prompt_longer_than_the_token_budget_runs_alone():
    s = scheduler(max_num_batched_tokens=8)
    long, short = seq(20), seq(2)
    s.add([long, short])
    assert s.schedule() == ([long], True)
    assert s.schedule() == ([short], True)


def test_postprocess_finishes_on_length_stop_and_eos():
    s = scheduler(eos=frozenset({99}))
    a = seq(2, max_tokens=2)
    b = seq(2, max_tokens=5, stop_token_ids=(42,))
    c = seq(2, max_tokens=5)
    d = seq(2, max_tokens=2, ignore_eos=True)
    s.add([a, b, c, d])
    batch, _ = s.schedule()
    assert s.postprocess(batch, [1, 42, 99, 99]) == [b, c]
    assert (b.finish_reason, b.output_ids, c.finish_reason, c.output_ids) == ("stop", [42], "stop", [99])
    batch, _ = s.schedule()
    assert batch == [a, d]
    assert s.postprocess(batch, [3, 99]) == [a, d]
    assert (a.finish_reason, a.output_ids, d.finish_reason, d.output_ids) == ("length", [1, 3], "length", [99, 99])
    assert not s.has_unfinished() and s.block_manager.num_free == 64


def test_preemption_frees_the_newest_and_recomputes_it():
    s = scheduler(num_blocks=3, block_size=4)
    old, new = seq(4, max_tokens=8, request_id="old"), seq(4, max_tokens=8, request_id="new")
    s.add([old, new])
    assert s.schedule() == ([old, new], True)  # one block each
    assert s.postprocess([old, new], [5, 5]) == []
    # 5 tokens each: both need a second block, only one is free -> "new" is preempted
    batch, prefill = s.schedule()
    assert (batch, prefill) == ([old], False)
    assert s.num_preemptions == 1 and new.status is SequenceStatus.WAITING and new.block_table == []
    assert list(s.waiting) == [new] and new.output_ids == [5]  # its output so far is kept
    s.postprocess(batch, [6])
    # "new" comes back as a prefill over prompt + output once blocks are free again
    while new.status is SequenceStatus.WAITING:
        batch, prefill = s.schedule()
        s.postprocess(batch, [7] * len(batch))
    assert prefill and batch == [new] and len(new.block_table) == 2


def test_a_sequence_that_cannot_fit_alone_is_refused_whole():
    s = scheduler(num_blocks=2, block_size=4)
    fits, too_long = seq(4, max_tokens=5), seq(4, max_tokens=6)  # 8 vs 9 cached tokens
    with pytest.raises(ValueError, match="needs 3 KV blocks of 4 tokens, but the cache has 2"):
        s.add([fits, too_long])
    assert not s.has_unfinished()
    s.add([fits])


def _next_token(tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on the whole history."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % 50


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=10),
    num_blocks=st.integers(7, 30), block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6), max_num_batched_tokens=st.integers(1, 40),
)
def test_any_workload_finishes_with_the_tokens_of_each_sequence_alone(
        lens, num_blocks, block_size, max_num_seqs, max_num_batched_tokens):
    bm = BlockManager(num_blocks, block_size)
    s = Scheduler(bm, max_num_seqs, max_num_batched_tokens, frozenset({49}))
    seqs = []
    for i, (prompt_len, max_tokens) in enumerate(lens):
        x = seq(prompt_len, max_tokens, request_id=i)
        x.token_ids = [(i * 13 + j) % 50 for j in range(prompt_len)]
        if bm.blocks_for(prompt_len + max_tokens - 1) > num_blocks:
            with pytest.raises(ValueError):
                s.add([x])
            continue
        s.add([x])
        seqs.append(x)
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        batch, prefill = s.schedule()
        assert batch, "the scheduler stalled"
        assert len(batch) <= max_num_seqs and len(s.running) <= max_num_seqs
        if prefill and len(batch) > 1:
            assert sum(map(len, batch)) <= max_num_batched_tokens
        owned = [b for x in s.running for b in x.block_table]
        assert len(owned) == len(set(owned)) and len(owned) + bm.num_free == num_blocks
        assert all(len(x.block_table) * block_size >= len(x) for x in batch)
        s.postprocess(batch, [_next_token(x.token_ids) for x in batch])
    assert not s.has_unfinished() and bm.num_free == num_blocks
    for x in seqs:
        want = list(x.token_ids[:x.num_prompt_tokens])
        while True:
            want.append(_next_token(want))
            if want[-1] == 49 or len(want) - x.num_prompt_tokens == x.params.max_tokens:
                break
        assert x.token_ids == want
        assert x.finish_reason == ("stop" if want[-1] == 49 else "length")


# --------------------------------------------------------------------------- sampler


def logits_for(batch: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = logits_for(5)
    seqs = [seq(1), seq(1), seq(1, temperature=1.5, top_k=1), seq(1, temperature=0.7, top_p=1e-6), seq(1)]
    assert sample(logits, seqs) == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_as_torch_argmax_does():
    logits = torch.zeros(3, 32000)
    logits[0, [5, 9]] = 2.0
    logits[1, [31999, 7]] = 1.0
    logits[2, :] = -1.0
    assert sample(logits, [seq(1)] * 3) == logits.argmax(-1).tolist() == [5, 7, 0]


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    logits = logits_for(4)

    def draws(seqs, rows, steps=20):
        out = []
        for _ in range(steps):
            out.append(sample(logits[rows], seqs))
        return out

    a = [seq(1, temperature=1.0, seed=7)]
    alone = [step[0] for step in draws(a, [2])]
    mixed_seqs = [seq(1, temperature=1.0), seq(1, temperature=1.0, seed=7), seq(1, temperature=0.9, seed=3)]
    mixed = [step[1] for step in draws(mixed_seqs, [0, 2, 1])]
    assert alone == mixed
    other = [step[0] for step in draws([seq(1, temperature=1.0, seed=8)], [2])]
    assert other != alone
    assert len(set(alone)) > 1  # it is sampling, not argmax


def test_top_k_and_top_p_restrict_the_support():
    logits = logits_for(1, vocab=32, seed=3)
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = int((probs.cumsum(0) < 0.8).sum()) + 1
    top_k = [seq(1, temperature=1.0, top_k=3, seed=i) for i in range(300)]
    top_p = [seq(1, temperature=1.0, top_p=0.8, seed=i) for i in range(300)]
    k_draws = sample(logits.expand(300, -1), top_k)
    p_draws = sample(logits.expand(300, -1), top_p)
    assert set(k_draws) <= set(order[:3]) and len(set(k_draws)) > 1
    assert set(p_draws) <= set(order[:nucleus])


def test_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    draws = sample(logits.expand(n, -1), [seq(1, temperature=1.0, seed=i) for i in range(n)])
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    hot = sample(logits.expand(n, -1), [seq(1, temperature=0.25, seed=i) for i in range(n)])
    assert torch.allclose(torch.bincount(torch.tensor(hot), minlength=4).float() / n,
                          torch.softmax(logits[0] / 0.25, -1), atol=0.03)
