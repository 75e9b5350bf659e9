"""The ``qwen3`` plugin end to end on tiny random checkpoints, against ``transformers``.

Inline (tp 1) and local (tp 2 over gloo) engines give the greedy tokens of
``transformers.generate``, alone, as one multi-prompt request and as 16 concurrent
requests; seeded sampling, stop tokens, EOS and preemption; requests are checked in
the caller. The inline engines run where DeviceConfig "auto" puts them (CUDA when it is
visible, with CUDA graphs on): their tokens are plain lists, compared with those of
``transformers``; the CPU-only features (oneDNN packing, the KV cache sized from host
memory) are checked on engines pinned to cpu wherever CUDA is visible too, and on CUDA the
KV cache's shape against what graphs make of it there (one more block, the padding block).
The lock-step agreement of ``models/qwen3/runner.py`` is also driven directly: this file
runs as two gloo rank processes (``python this_file CKPT RANK WORLD PORT OUT_DIR``) that
add the same requests in awkward orders.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                     EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

pytestmark = pytest.mark.timeout(180)

TP2 = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
SHAPES = {
    # GQA (4 query heads over 2 kv heads) with head_dim 32 != hidden 64 / 4 heads, untied head
    "gqa": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # plain multi-head attention, tied embeddings
    "tied": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
}
PROMPTS = [[7], [3, 1, 4, 1, 5], [(11 * i) % 250 for i in range(17)], [(5 * i + 2) % 250 for i in range(40)]]
MAX_TOKENS = 24


def make_checkpoint(path: Path, seed: int, **shape) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1, **shape)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """``transformers.generate(do_sample=False)`` one prompt at a time: the generated tokens."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # an explicit mask: generate would take a token equal to pad_token_id for padding
        ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_of(engine: Engine):
    """The inline engine's Qwen3Runner (internal; for its counters)."""
    return engine._dispatcher.executors[0]._core.runner


CPU = EngineConfig(device=DeviceConfig(target="cpu"))


def on_cpu(stack: contextlib.ExitStack, engine: Engine, plugin_args: dict) -> Engine:
    """``engine`` when it runs on the CPU, else an inline engine of ``plugin_args`` pinned to cpu
    (closed with ``stack``): for the CPU-only features."""
    if runner_of(engine).device.type == "cpu":
        return engine
    return stack.enter_context(Engine(EngineArgs("qwen3", plugin_args, CPU)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {name: make_checkpoint(root / name, seed, **shape) for seed, (name, shape) in enumerate(SHAPES.items())}


@pytest.fixture(scope="module")
def reference(ckpt) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, PROMPTS) for name, path in ckpt.items()}


@pytest.fixture(scope="module")
def inline(ckpt):
    engines = {name: Engine(EngineArgs("qwen3", {"model": str(path)})) for name, path in ckpt.items()}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture(scope="module")
def local(ckpt):
    """tp 2 on the GQA checkpoint, with a KV cache small enough that 16 requests preempt."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    args = EngineArgs("qwen3", {"model": str(ckpt["gqa"]), "block_size": 4, "kv_cache_blocks": 48},
                      EngineConfig(device=DeviceConfig(target="cpu"), parallel=TP2))
    for attempt in range(3):
        deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(
            base_port=free_port(), heartbeat_timeout_s=10.0))
        try:
            engine = Engine(args, deployment)
            break
        except Exception as exc:  # a port taken between the check and the rendezvous
            if attempt == 2 or "rendezvous" not in str(exc):
                raise
    yield engine
    engine.close()
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, f"rank processes left behind: {left}"


def greedy(engine: Engine, prompt, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return engine.step({"prompt_token_ids": prompt, "max_tokens": max_tokens, **extra}, timeout=120)


# --------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_matches_transformers_inline(inline, reference, name):
    engine = inline[name]
    for prompt, want in zip(PROMPTS, reference[name]):
        assert greedy(engine, prompt) == {"token_ids": [want], "finish_reasons": ["length"]}
    together = greedy(engine, PROMPTS)  # one request, four sequences batched together
    assert together == {"token_ids": reference[name], "finish_reasons": ["length"] * len(PROMPTS)}


def test_linear_layers_are_packed_on_the_cpu_and_f_linear_gives_the_same_tokens(inline, ckpt, reference):
    """oneDNN packing is a CPU feature: checked on engines pinned to cpu (on CUDA nothing is packed)."""
    if runner_of(inline["gqa"]).device.type != "cpu":
        assert runner_of(inline["gqa"]).packed_layers == 0  # F.linear wherever the model is not on the CPU
    with contextlib.ExitStack() as stack:
        packed = on_cpu(stack, inline["gqa"], {"model": str(ckpt["gqa"])})
        assert runner_of(packed).packed_layers == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the head
        if packed is not inline["gqa"]:  # (the inline engine's tokens are checked above)
            assert greedy(packed, PROMPTS)["token_ids"] == reference["gqa"]
        plain = stack.enter_context(Engine(EngineArgs("qwen3", {"model": str(ckpt["gqa"]), "packed_weights": False},
                                                      CPU)))
        assert runner_of(plain).packed_layers == 0
        assert greedy(plain, PROMPTS)["token_ids"] == reference["gqa"]


def test_greedy_matches_transformers_tp2_local(local, reference):
    for prompt, want in zip(PROMPTS, reference["gqa"]):
        assert greedy(local, prompt)["token_ids"] == [want]
    assert greedy(local, PROMPTS)["token_ids"] == reference["gqa"]


def concurrent(engine: Engine, n: int = 16, seed: int = 0) -> list[dict]:
    """``n`` requests from ``n`` threads, each after a random delay; prompt i % len(PROMPTS)."""
    delays = random.Random(seed).choices([0.0, 0.01, 0.03, 0.08, 0.15], k=n)
    results: list = [None] * n

    def send(i: int) -> None:
        time.sleep(delays[i])
        try:
            results[i] = greedy(engine, PROMPTS[i % len(PROMPTS)])
        except Exception as exc:  # reported below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    return results


def test_concurrent_requests_are_batched_and_match_inline(inline, reference):
    engine = inline["gqa"]
    runner = runner_of(engine)
    runner.max_batch_seqs = 0
    results = concurrent(engine)
    for i, result in enumerate(results):
        assert result == {"token_ids": [reference["gqa"][i % len(PROMPTS)]], "finish_reasons": ["length"]}, i
    assert runner.max_batch_seqs > 1  # some step ran several requests' sequences at once


def test_concurrent_requests_match_tp2_local(local, reference):
    # 16 sequences of up to 64 tokens need more than the 48 blocks of 4: preemption happens too
    results = concurrent(local, seed=1)
    for i, result in enumerate(results):
        assert result == {"token_ids": [reference["gqa"][i % len(PROMPTS)]], "finish_reasons": ["length"]}, i
    assert local.replicas[0].healthy


# --------------------------------------------------------------------------- sampling and stopping


def test_seeded_sampling_is_reproducible_and_seeds_differ(inline, reference):
    engine = inline["gqa"]
    request = {"prompt_token_ids": [PROMPTS[1], PROMPTS[1]], "max_tokens": 16, "temperature": 1.0, "seed": 3}
    first = engine.step(request, timeout=60)
    assert first["token_ids"][0] != first["token_ids"][1]  # each prompt draws from its own stream
    # the same seed alongside other traffic, and submitted again: the same tokens
    noise = [engine.submit({"prompt_token_ids": p, "max_tokens": 16, "temperature": 0.8}) for p in PROMPTS]
    again = engine.submit(request)
    assert again.result(60) == first
    assert [f.result(60)["finish_reasons"] for f in noise] == [["length"]] * len(PROMPTS)
    other = engine.step(request | {"seed": 4}, timeout=60)
    assert other["token_ids"] != first["token_ids"]
    # top_k 1 or a tiny top_p leave only the argmax
    for extra in ({"top_k": 1}, {"top_p": 1e-9}):
        sharp = engine.step(request | {"prompt_token_ids": PROMPTS[2], "max_tokens": MAX_TOKENS} | extra, timeout=60)
        assert sharp["token_ids"] == [reference["gqa"][2]]


def test_stop_token_ids_end_a_sequence(inline, reference):
    engine = inline["gqa"]
    want = reference["gqa"][3]
    stop = want[5]
    cut = want[:want.index(stop) + 1]
    result = greedy(engine, [PROMPTS[3], PROMPTS[0]], stop_token_ids=[stop])
    assert result["token_ids"][0] == cut and result["finish_reasons"][0] == "stop"
    other = reference["gqa"][0]
    assert result["token_ids"][1] == (other[:other.index(stop) + 1] if stop in other else other)


def test_eos_stops_unless_ignored(ckpt, reference, tmp_path):
    from transformers import Qwen3ForCausalLM

    want = reference["gqa"][2]
    eos = want[4]
    model = Qwen3ForCausalLM.from_pretrained(ckpt["gqa"])
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path / "eos")
    hf = hf_greedy(tmp_path / "eos", [PROMPTS[2]])[0]
    assert hf == want[:want.index(eos) + 1]  # transformers stops on it, and keeps it
    with Engine(EngineArgs("qwen3", {"model": str(tmp_path / "eos")})) as engine:
        assert greedy(engine, PROMPTS[2]) == {"token_ids": [hf], "finish_reasons": ["stop"]}
        assert greedy(engine, PROMPTS[2], ignore_eos=True) == {"token_ids": [want], "finish_reasons": ["length"]}


def test_preemption_keeps_the_greedy_tokens(ckpt, reference):
    # 8 sequences of up to 64 tokens (16 blocks of 4 each) in 20 blocks
    with Engine(EngineArgs("qwen3", {"model": str(ckpt["gqa"]), "block_size": 4, "kv_cache_blocks": 20})) as engine:
        futures = [engine.submit({"prompt_token_ids": p, "max_tokens": MAX_TOKENS}) for p in PROMPTS * 2]
        results = [f.result(120) for f in futures]
        runner = runner_of(engine)
        assert runner.num_preemptions > 0 and runner.num_blocks == 20
        assert [r["token_ids"][0] for r in results] == reference["gqa"] * 2
        with pytest.raises(ValueError, match="cannot fit kv_cache_blocks=20"):
            engine.submit({"prompt_token_ids": [1] * 60, "max_tokens": 30})


def test_kv_cache_derived_from_memory_when_not_given(inline, ckpt):
    """From available host memory on the CPU (a CPU feature: pinned to cpu), from free CUDA memory
    on a GPU; either way capped at what max_num_seqs (64) sequences of max_position_embeddings
    (256) could use."""
    runner = runner_of(inline["tied"])
    if runner.device.type == "cuda":
        assert runner.num_blocks == 64 * 256 // 16
        # CUDA graphs are on by default there: the cache holds one more block, the padding block
        assert runner.cuda_graphs.startswith("on") and runner.decoder is not None and runner.decoder.graphs
        assert runner.kv_cache.shape == (2, 2, runner.num_blocks + 1, 16, 4, 16)
    with contextlib.ExitStack() as stack:
        runner = runner_of(on_cpu(stack, inline["tied"], {"model": str(ckpt["tied"])}))
        assert runner.num_blocks == 64 * 256 // 16
        assert runner.decoder is None  # no static decode on the CPU unless asked: no padding block
        assert runner.kv_cache.shape == (2, 2, runner.num_blocks, 16, 4, 16)


# --------------------------------------------------------------------------- validation in the caller


@pytest.mark.parametrize("request_, error, match", [
    ([1, 2], TypeError, "must be a dict"),
    ({"prompt_token_ids": [1, 2]}, ValueError, "needs 'max_tokens'"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "n": 2}, ValueError, "unknown keys \\['n'\\]"),
    ({"prompt_token_ids": [], "max_tokens": 2}, ValueError, "non-empty"),
    ({"prompt_token_ids": [[1], []], "max_tokens": 2}, ValueError, "prompt 1 is empty"),
    ({"prompt_token_ids": "1 2", "max_tokens": 2}, TypeError, "list of ints"),
    ({"prompt_token_ids": [1, 2.0], "max_tokens": 2}, TypeError, "not an int"),
    ({"prompt_token_ids": [1, True], "max_tokens": 2}, TypeError, "not an int"),
    ({"prompt_token_ids": [1, 384], "max_tokens": 2}, ValueError, "outside the vocabulary \\[0, 384\\)"),
    ({"prompt_token_ids": [[1], [-1]], "max_tokens": 2}, ValueError, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 250, "max_tokens": 7}, ValueError, "max_position_embeddings 256"),
    ({"prompt_token_ids": [1], "max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
    ({"prompt_token_ids": [1], "max_tokens": "3"}, TypeError, "max_tokens must be an int"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "temperature": -0.5}, ValueError, "temperature"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "temperature": "hot"}, TypeError, "temperature"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "top_k": -1}, ValueError, "top_k"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "top_p": 0.0}, ValueError, "top_p"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "seed": -1}, ValueError, "seed"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "seed": 1.5}, TypeError, "seed"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "ignore_eos": 1}, TypeError, "ignore_eos"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "stop_token_ids": [400]}, ValueError, "stop token id 400"),
    ({"prompt_token_ids": [1], "max_tokens": 2, "stop_token_ids": 3}, TypeError, "stop_token_ids"),
])
def test_bad_requests_fail_in_the_caller(inline, request_, error, match):
    with pytest.raises(error, match=match):
        inline["gqa"].submit(request_)


def test_bad_request_to_a_local_group_fails_in_the_caller(local):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        local.submit({"prompt_token_ids": [999], "max_tokens": 2})
    assert local.replicas[0].healthy and greedy(local, [1], max_tokens=2)["finish_reasons"] == ["length"]


@pytest.mark.parametrize("plugin_args, parallel, error, match", [
    (None, None, TypeError, "must be a dict"),
    ({"model": "CKPT", "blocks": 4}, None, ValueError, "unknown keys \\['blocks'\\]"),
    ({"model": "/nonexistent/qwen3"}, None, ValueError, "no config.json"),
    ({"model": "CKPT", "block_size": 0}, None, ValueError, "block_size"),
    ({"model": "CKPT", "kv_cache_blocks": 2.5}, None, TypeError, "kv_cache_blocks"),
    ({"model": "CKPT", "packed_weights": 1}, None, TypeError, "packed_weights"),
    ({"model": "CKPT"}, ParallelConfig(dense=DenseParallelConfig(tp_size=2)), ValueError, "dense tp == attention tp"),
    ({"model": "CKPT"}, ParallelConfig(dense=DenseParallelConfig(tp_size=8),
                                       attention=AttentionParallelConfig(tp_size=8)), ValueError, "must divide"),
])
def test_bad_configuration_fails_before_any_rank_starts(ckpt, plugin_args, parallel, error, match):
    if isinstance(plugin_args, dict) and plugin_args["model"] == "CKPT":
        plugin_args = plugin_args | {"model": str(ckpt["gqa"])}
    config = EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel or ParallelConfig())
    with pytest.raises(error, match=match):
        Engine(EngineArgs("qwen3", plugin_args, config), DeploymentConfig.local(devices=(0, 1)) if parallel else None)


# --------------------------------------------------------------------------- the agreement, driven directly


def test_ranks_agree_whatever_order_requests_arrive_in(ckpt, tmp_path):
    from tests.ranks import launch

    want = hf_greedy(ckpt["gqa"], [[1, 2, 3]], 8)[0]
    leader, follower = launch(__file__, 2, tmp_path, args=[str(ckpt["gqa"])], timeout=120)
    results = {request_id: result for request_id, result in leader["log"]}
    assert results["a"]["token_ids"] == [want[:6]] and results["b"]["token_ids"] == [want[:6]]
    assert results["c"]["token_ids"] == [want[:1]] and results["y"]["token_ids"] == [want]
    assert results["d"] is None  # the stream the leader dropped
    assert sorted(request_id for request_id, _ in leader["log"]) == ["a", "b", "c", "d", "y"]
    # the follower answers nothing (the leader's rank does), and steps exactly as often as the leader
    assert follower["log"] == [] and leader["steps"] == follower["steps"]
    assert leader["unfinished"] is False and follower["unfinished"] is False


def _rank_main() -> None:
    """One rank of ``test_ranks_agree_whatever_order_requests_arrive_in``: the serve loop by hand."""
    from models.qwen3 import Qwen3Entry, rank_model
    from runtime import parallel as P
    from runtime.core.plugins import BuildContext, Partial
    from tests.ranks import finish, init_gloo, rank_args

    (model,), rank, world, port, out = rank_args(1)
    init_gloo(rank, world, port)
    P.initialize(TP2, rank)
    ctx = BuildContext(rank=rank, world_size=world, replica_index=0, device=torch.device("cpu"), target="cpu",
                       params_dtype=torch.float32, parallel=TP2)
    runner = Qwen3Entry().build(ctx, {"model": model})
    rank_model.PLAN_BYTES = 96  # most plans take the two-broadcast path; a model-free one does not
    log: list = []

    def request(max_tokens: int) -> dict:
        return {"prompt_token_ids": [1, 2, 3], "max_tokens": max_tokens}

    def step() -> None:
        log.extend(done for done in runner.step() if not isinstance(done[1], Partial))

    def drain() -> None:
        while runner.has_unfinished():
            step()

    # "a" reaches the leader first: it steps (and waits in the broadcast) before the follower has it
    if rank == 1:
        time.sleep(0.5)
    runner.add("a", request(6))
    drain()
    # "b" reaches the follower first: it waits in step() until the leader has it
    if rank == 0:
        time.sleep(0.5)
    runner.add("b", request(6))
    drain()
    # "c" (one token) finishes while the follower still lacks it
    runner.add("y", request(8))
    if rank == 0:
        runner.add("c", request(1))
    else:
        for _ in range(4):
            step()
        runner.add("c", request(1))
    drain()
    # "d" is a stream the leader drops after a step: a follower holds nothing to cancel
    if rank == 0:
        runner.add_stream("d", request(8))
        step()
        runner.cancel("d")
    else:
        runner.add("d", request(8))
        step()
    drain()
    result = {"log": log, "steps": runner.num_steps, "unfinished": runner.has_unfinished()}
    finish(out, rank, result)


if __name__ == "__main__":
    _rank_main()
