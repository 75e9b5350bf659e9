"""``qwen3`` prefix caching and chunked prefill end to end, against ``transformers``.

Prompts share a 37-token prefix (9 full blocks of 4, then a partial one); one shares only
22 tokens of it (5 full blocks and half of the sixth). Greedy ids equal those of
``transformers.generate`` with caching on (cold, then warm), off, with whole-prompt
prefill, with a KV cache small enough that cached blocks are evicted, and at tp=2 (local
engine, 2 gloo ranks). A runner driven step by step: a request cancelled, or whose forward
pass fails, half-way through a chunked prefill leaves no block that a later request with
the same prompt reads wrongly.
"""

from __future__ import annotations

import pytest
import torch

from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
from tests.conftest import close_engine, start_engine, tp_parallel
from tests.test_qwen3_plugin import SHAPES, hf_greedy, make_checkpoint, runner_of

pytestmark = pytest.mark.timeout(240)

PREFIX = [(7 * i + 3) % 380 for i in range(37)]
PROMPTS = [
    PREFIX,
    PREFIX + [11],
    PREFIX + [(5 * i + 1) % 380 for i in range(11)],
    PREFIX[:22] + [(3 * i + 2) % 380 for i in range(9)],  # shares part of block 5: 5 full blocks only
    [(13 * i + 5) % 380 for i in range(70)],  # its own
]
MAX_TOKENS = 12
CPU = EngineConfig(device=DeviceConfig(target="cpu"))
BASE = {"block_size": 4, "max_num_batched_tokens": 16}  # prompts of 37+ tokens take several chunks
CONFIGS = {
    "on": {},
    "off": {"prefix_caching": False, "chunked_prefill": False},
    "whole": {"chunked_prefill": False},  # prefix caching with whole-prompt prefill steps
    "nocache-chunked": {"prefix_caching": False},
    # 24 blocks of 4: one sequence of 81 tokens needs 21 of them, so cached blocks are evicted
    "evict": {"kv_cache_blocks": 24},
    # the CUDA-graph path's static decode buffers (run eagerly on the CPU), over shared blocks
    "static": {"static_decode": True},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-prefix") / "gqa", 0, **SHAPES["gqa"])


@pytest.fixture(scope="module")
def reference(ckpt) -> list[list[int]]:
    return hf_greedy(ckpt, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def engines(ckpt):
    built = {name: Engine(EngineArgs("qwen3", {"model": str(ckpt), **BASE, **extra}, CPU))
             for name, extra in CONFIGS.items()}
    yield built
    for engine in built.values():
        engine.close()


def greedy(engine: Engine, prompt, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return engine.step({"prompt_token_ids": prompt, "max_tokens": max_tokens}, timeout=120)["token_ids"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_ids_equal_transformers_cold_warm_and_together(engines, reference, name):
    engine = engines[name]
    runner = runner_of(engine)
    for prompt, want in zip(PROMPTS, reference):  # the first is cold; the others share its prefix
        assert greedy(engine, prompt) == [want]
    for prompt, want in zip(PROMPTS, reference):  # every prompt seen before: a warm cache
        assert greedy(engine, prompt) == [want]
    futures = [engine.submit({"prompt_token_ids": p, "max_tokens": MAX_TOKENS}) for p in PROMPTS * 2]
    assert [f.result(120)["token_ids"][0] for f in futures] == reference * 2
    assert greedy(engine, PROMPTS) == reference  # one request of five prompts
    info = runner.info()
    assert info["prefix_caching"] == (name not in ("off", "nocache-chunked"))
    assert info["chunked_prefill"] == (name not in ("off", "whole"))
    if not info["prefix_caching"]:
        assert info["cached_prompt_tokens"] == 0 and info["cached_blocks"] == 0
        assert info["prefix_cache_hit_rate"] == 0.0
    else:
        assert info["cached_prompt_tokens"] > 0 and info["cached_blocks"] > 0
        assert 0.3 < info["prefix_cache_hit_rate"] < 1.0
    if info["chunked_prefill"]:
        assert info["prefill_chunks"] > 4 * len(PROMPTS)  # long prompts went in pieces of 16 tokens
    if name == "evict":
        assert info["cache_evictions"] > 0 and info["kv_cache_blocks"] == 24
    assert info["free_blocks"] == info["kv_cache_blocks"]  # every sequence gave its blocks back


def test_hits_are_full_blocks_only_and_counted(ckpt, reference):
    with Engine(EngineArgs("qwen3", {"model": str(ckpt), **BASE}, CPU)) as engine:
        hits_are_counted(engine, runner_of(engine), reference)


def hits_are_counted(engine, runner, reference):
    assert greedy(engine, PROMPTS[0]) == [reference[0]]  # the prefix's 9 full blocks are in the cache
    before = runner.info()
    assert greedy(engine, PROMPTS[3]) == [reference[3]]
    after = runner.info()
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(PROMPTS[3])
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 20  # 5 blocks of 4, not 22 tokens
    assert greedy(engine, PROMPTS[0]) == [reference[0]]  # all cached but the last token: 1 token computed
    again = runner.info()
    assert again["cached_prompt_tokens"] - after["cached_prompt_tokens"] == 36


def test_greedy_ids_equal_transformers_tp2(ckpt, reference):
    engine = start_engine("qwen3", parallel=tp_parallel(2), plugin_args={"model": str(ckpt), **BASE})
    try:
        for prompt, want in zip(PROMPTS, reference):
            assert greedy(engine, prompt) == [want]
        futures = [engine.submit({"prompt_token_ids": p, "max_tokens": MAX_TOKENS}) for p in PROMPTS * 2]
        assert [f.result(120)["token_ids"][0] for f in futures] == reference * 2
        off = {"prompt_token_ids": PROMPTS, "max_tokens": MAX_TOKENS}
        assert engine.step(off, timeout=120)["token_ids"] == reference
    finally:
        close_engine(engine)


# --------------------------------------------------------------------------- a runner driven step by step


def direct_runner(ckpt, **extra):
    from models.qwen3.request import Qwen3Args
    from models.qwen3.runner import Qwen3Runner
    from runtime.execution.engine_core import make_context

    return Qwen3Runner(make_context(CPU), Qwen3Args.parse({"model": str(ckpt), **BASE, **extra}))


def run_to_end(runner, request_id) -> dict:
    for _ in range(500):
        for rid, result in runner.step():
            if rid == request_id:
                return result
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_sequence_stopped_mid_prefill_leaves_no_half_written_block(ckpt, reference, how):
    runner = direct_runner(ckpt)
    prompt, want = PROMPTS[4], reference[4]  # 70 tokens: chunks of 16
    runner.add("a", {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS})
    runner.step()
    runner.step()  # 32 tokens written: 8 full blocks registered
    bm = runner.scheduler.block_manager
    assert bm.num_cached_blocks == 8
    if how == "failed":  # the third chunk's forward pass writes (garbage) and then fails
        forward = runner.forward

        def broken(batch):
            forward(batch)
            slots = torch.from_numpy(batch.slot_mapping)
            runner.kv_cache[:, :, slots // 4, slots % 4] = torch.nan
            raise RuntimeError("the forward pass failed")

        runner.forward = broken
        with pytest.raises(RuntimeError, match="failed"):
            runner.step()
        runner.forward = forward
    runner.cancel("a")
    assert runner.step() == [("a", None)]
    assert bm.num_cached_blocks == 8 and bm.num_free == bm.num_blocks
    runner.add("b", {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS})
    assert run_to_end(runner, "b")["token_ids"] == [want]
    assert runner.info()["cached_prompt_tokens"] == 32  # the two chunks written, nothing after


def test_chunked_prefill_keeps_a_decode_going_while_a_long_prompt_arrives(ckpt, reference):
    """With chunks the decoding sequence gets a token in every step of the long prefill; without,
    the prefill runs alone. Either way the ids are transformers'."""
    for chunked in (True, False):
        runner = direct_runner(ckpt, chunked_prefill=chunked, prefix_caching=False)
        runner.add("short", {"prompt_token_ids": PROMPTS[1], "max_tokens": MAX_TOKENS})
        runner.step()
        runner.step()
        runner.add("long", {"prompt_token_ids": PROMPTS[4], "max_tokens": MAX_TOKENS})
        short, long = runner._requests["short"][0], runner._requests["long"][0]
        results, grew, steps = {}, 0, 0
        while long.num_outputs == 0:  # until the long prompt's first token
            before = short.num_outputs
            results.update(runner.step())
            grew, steps = grew + (short.num_outputs > before), steps + 1
        # 70 tokens in steps of 15 (beside the decode's one): 5 steps; else one prefill step alone
        assert (steps, grew) == ((5, 5) if chunked else (1, 0))
        while len(results) < 2:
            results.update(runner.step())
        assert results["short"]["token_ids"] == [reference[1]] and results["long"]["token_ids"] == [reference[4]]


@pytest.mark.parametrize("key, value", [("prefix_caching", "yes"), ("chunked_prefill", 1),
                                        ("prefix_caching", None)])
def test_bad_prefix_and_chunk_args_are_refused_clearly(ckpt, key, value):
    from models.qwen3.request import Qwen3Args

    with pytest.raises(TypeError, match=f"plugin_args\\['{key}'\\] must be a bool, got {value!r}"):
        Qwen3Args.parse({"model": str(ckpt), key: value})
    args = Qwen3Args.parse({"model": str(ckpt)})
    assert args.prefix_caching and args.chunked_prefill  # both on by default
