"""The CUDA path in one go, for a machine with at least one GPU (two for NCCL).

    python tests/gpu/check_cuda.py              # one line per check, exits 1 on a failure
    python tests/gpu/check_cuda.py --self-test  # this script's own verdict logic, no GPU needed

Every check prints ``ok``, ``FAIL`` or ``skip`` (a skip only where the capability is absent
on this machine, with the reason: no CUDA device, one GPU for a two-GPU check, flash_attn
not installed or a GPU older than it supports); an exception in a group of checks is that
group's FAIL, and the others still run. The last line lists the failures and the skips.

Checks: the qwen3 plugin on CUDA (greedy tokens equal to ``transformers.generate``
on a tiny random checkpoint, inline and, with two GPUs, tp=2 over NCCL; CUDA graphs
are on by default there), device pinning and NCCL (a tp=2 policy replica on devices 0
and 1 gives the inline actions), CUDA-IPC requests and results (a CUDA result of the
local engine is a CUDA tensor on the rank's device, readable here, zero-copy). Skips
the two-GPU checks when one GPU is visible.

qwen3 decode on CUDA graphs (``check_qwen3_graphs``), on a random checkpoint of the
bench.llm shape (58M parameters): graphs were captured, graph decode gives the eager
decode's greedy tokens (3 prompts of different lengths: a batch padded 3 -> 4) at tp=1
and, with two GPUs, tp=2 over NCCL (collectives inside the graphs), in fp32 with torch
SDPA; with flash_attn installed, the flash-attn kernels against SDPA at the layer level
(prefill, prefill after a cached prefix, decode, static decode; bf16) and the plugin on
flash-attn (bf16, block_size 256) with and without graphs. Then a table of generated
tokens/s, eager vs graphs, 1 and 16 concurrent prompts.

On the bf16 plugin run, graph and eager decode need not give the same greedy tokens: on a
random checkpoint the top two logits are often within bf16 rounding, the padded graph batch
rounds differently, and one flipped token changes the rest of that sequence. So its verdict
(``bf16_tokens_verdict``) asks what a broken graph decode cannot give and a correct one
always does: every prompt's first token (from the prefill, eager in both runs) is equal, and
some prompt agrees on its first 4 tokens (3 of them decoded on graphs). The fp32 runs are
held to equal tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                     Engine, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

FAILURES: list[str] = []
SKIPS: list[str] = []
PASSED: list[str] = []


def check(name: str, ok: Any, detail: str = "") -> bool:
    """Record and print one verdict (``ok`` is computed by the caller, never a constant)."""
    ok = bool(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
    (PASSED if ok else FAILURES).append(name)
    return ok


def skip(name: str, reason: str) -> None:
    """A check this machine cannot run: the capability is absent (``reason`` says which)."""
    print(f"skip {name}: {reason}", flush=True)
    SKIPS.append(f"{name} ({reason})")


def guarded(name: str, checks: Callable[..., None], *args: Any) -> None:
    """Run a group of checks; an exception out of it is that group's failure, the others still run."""
    try:
        checks(*args)
    except Exception as exc:  # noqa: BLE001 - reported as a FAIL line, with its type and message
        check(name, False, f"{type(exc).__name__}: {exc}")


def needs_gpus(name: str, count: int, need: int) -> bool:
    """Whether ``need`` GPUs are visible; else ``name`` is skipped, saying why."""
    if count >= need:
        return True
    skip(name, f"{count} CUDA device(s) visible, it needs {need}")
    return False


def summary() -> int:
    print(f"passed: {len(PASSED)}; failures: {FAILURES or 'none'}; skipped: {SKIPS or 'none'}", flush=True)
    return 1 if FAILURES else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The CUDA path in one go (see the module docstring); exits 1 "
                                                 "on a failure.")
    parser.add_argument("--self-test", action="store_true",
                        help="check this script's own verdict and skip logic on made-up inputs (no GPU needed)")
    if parser.parse_args(argv).self_test:
        return self_test()
    if not torch.cuda.is_available():
        skip("every check", f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
                            f"{torch.cuda.device_count()} device(s) visible)")
        return summary()
    count = torch.cuda.device_count()
    print(f"{count} CUDA device(s): {[torch.cuda.get_device_name(i) for i in range(count)]}")
    guarded("policy on cuda", check_policy, count)
    guarded("qwen3 on cuda", check_qwen3, count)
    guarded("qwen3 graphs and flash-attn", check_qwen3_graphs, count)
    return summary()


def check_policy(count: int) -> None:
    obs = torch.randn(8, 32, device="cuda:0")
    cuda_cfg = EngineConfig(device=DeviceConfig(target="cuda"))
    with Engine(EngineArgs("policy", {"obs_dim": 32}, cuda_cfg)) as inline:
        reference = inline.step({"obs": obs})["actions"].cpu()
    check("inline on cuda", reference.shape == (8, 8, 7), str(tuple(reference.shape)))

    started = time.monotonic()
    with Engine(EngineArgs("policy", {"obs_dim": 32}, cuda_cfg),
                DeploymentConfig.local(devices=(0,), process_config=WorkerSupervisorConfig(base_port=29650))) as one:
        [replica] = one.replicas
        check("local 1 rank start", one.mode == "local" and replica.healthy and tuple(replica.devices) == (0,),
              f"{time.monotonic() - started:.1f} s, mode {one.mode}, {replica}")
        out = one.step({"obs": obs})["actions"]
        check("CUDA-IPC result is a cuda tensor on the rank's device", out.is_cuda and out.device == obs.device,
              str(out.device))
        check("local 1 rank equals inline", torch.allclose(out.cpu(), reference, atol=1e-5))

    if needs_gpus("policy tp=2 over NCCL", count, 2):
        args = EngineArgs("policy", {"obs_dim": 32}, EngineConfig(
            device=DeviceConfig(target="cuda"),
            parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))))
        with Engine(args, DeploymentConfig.local(devices=(0, 1),
                                                 process_config=WorkerSupervisorConfig(base_port=29660))) as tp:
            out = tp.step({"obs": obs})["actions"]
            check("NCCL tp=2 equals inline", torch.allclose(out.cpu(), reference, atol=1e-4),
                  f"max diff {(out.cpu() - reference).abs().max():.2e}")


def check_qwen3(count: int) -> None:
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    prompts = [[7], [3, 1, 4, 1, 5], [(11 * i) % 250 for i in range(17)]]
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=256, initializer_range=0.1)
        model = Qwen3ForCausalLM(config).eval()
        model.save_pretrained(model_dir)
        reference = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0)
            reference.append(out[0, len(prompt):].tolist())
        request = {"prompt_token_ids": prompts, "max_tokens": 16}
        cuda = EngineConfig(device=DeviceConfig(target="cuda"))
        with Engine(EngineArgs("qwen3", {"model": model_dir}, cuda)) as inline:
            tokens = inline.step(request)["token_ids"]
        check("qwen3 inline on cuda (graphs on) equals transformers", tokens == reference)
        if needs_gpus("qwen3 tp=2 over NCCL", count, 2):
            args = EngineArgs("qwen3", {"model": model_dir}, EngineConfig(
                device=DeviceConfig(target="cuda"),
                parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2),
                                        attention=AttentionParallelConfig(tp_size=2))))
            with Engine(args, DeploymentConfig.local(devices=(0, 1),
                                                     process_config=WorkerSupervisorConfig(base_port=29670))) as tp:
                tokens = tp.step(request)["token_ids"]
            check("qwen3 tp=2 over NCCL (graphs on) equals transformers", tokens == reference)



# --------------------------------------------------------------------------- qwen3: CUDA graphs, flash-attn

GRAPH_CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                    tie_word_embeddings=False)
NEW_TOKENS = 128


def runner_of(engine: Engine):
    """An inline engine's Qwen3Runner (internal, for inspection)."""
    return engine._dispatcher.executors[0]._core.runner


def qwen3_engine(model_dir: str, tp: int, port: int, dtype: str = "float32", **plugin_args) -> Engine:
    args = {"model": model_dir, "max_num_seqs": 16, "kv_cache_blocks": 1024, **plugin_args}
    if tp == 1:
        return Engine(EngineArgs("qwen3", args, EngineConfig(device=DeviceConfig(target="cuda", params_dtype=dtype))))
    return Engine(EngineArgs("qwen3", args, EngineConfig(
        device=DeviceConfig(target="cuda", params_dtype=dtype),
        parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp)))),
        DeploymentConfig.local(devices=tuple(range(tp)), process_config=WorkerSupervisorConfig(base_port=port)))


def tokens_per_s(engine: Engine, prompts: list[list[int]]) -> float:
    """Generated tokens/s of one request of ``prompts`` (NEW_TOKENS each, prefill included), after a warm-up."""
    request = {"prompt_token_ids": prompts, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    engine.step(request, timeout=300)
    torch.cuda.synchronize()  # (the result is back only once the ranks sampled; this covers the inline device)
    start = time.perf_counter()
    engine.step(request, timeout=300)
    torch.cuda.synchronize()
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - start)


def check_qwen3_graphs(count: int) -> None:
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from models.layers import attention

    gen = torch.Generator().manual_seed(1)
    vocab = GRAPH_CONFIG["vocab_size"]
    mixed = [[7], [3, 1, 4, 1, 5], torch.randint(1, vocab, (40,), generator=gen).tolist()]  # a batch padded 3 -> 4
    batch16 = torch.randint(1, vocab, (16, 32), generator=gen).tolist()
    rows: list[tuple[str, int, int, float, float]] = []
    configs = [("fp32 SDPA", 1, "float32", {})]
    if needs_gpus("qwen3 graphs tp=2 over NCCL", count, 2):
        configs.append(("fp32 SDPA", 2, "float32", {}))
    usable, why = flash_availability(importlib.util.find_spec("flash_attn") is not None, attention.FLASH_IMPORT_ERROR,
                                     torch.cuda.get_device_capability(0))
    if usable:
        guarded("flash-attn layer against SDPA", check_flash_layer)
        configs.append(("bf16 flash-attn", 1, "bfloat16", {"block_size": 256, "kv_cache_blocks": 64}))
    elif why.startswith("broken:"):  # installed, yet it does not import: a regression, not an absence
        check("flash-attn imports", False, why)
    else:
        skip("flash-attn (layer and plugin)", why)
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**GRAPH_CONFIG))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(model_dir)
        del model
        port = 29680
        for name, tp, dtype, extra in configs:
            results = {}
            for mode, flags in (("eager", {"enforce_eager": True}), ("graphs", {})):
                port += 10
                try:
                    results[mode] = run_qwen3(model_dir, name, mode, tp, port, dtype, {**extra, **flags}, mixed,
                                              batch16)
                except Exception as exc:  # report, and go on with the other configurations
                    check(f"qwen3 {name} tp={tp} {mode}", False, f"{type(exc).__name__}: {exc}")
            if len(results) < 2:
                continue
            if dtype == "float32":
                check(f"qwen3 {name} tp={tp}: graph decode tokens equal eager",
                      results["graphs"][0] == results["eager"][0])
            else:  # bf16: padded batches may round differently, and greedy can flip on a near tie
                ok, detail = bf16_tokens_verdict(results["graphs"][0], results["eager"][0])
                check(f"qwen3 {name} tp={tp}: graph decode tokens agree with eager (bf16)", ok, detail)
            for i, batch in ((1, 1), (2, 16)):
                rows.append((name, tp, batch, results["eager"][i], results["graphs"][i]))
    print(f"\nqwen3 decode, random {GRAPH_CONFIG['hidden_size']}x{GRAPH_CONFIG['num_hidden_layers']} Qwen3 "
          f"({params / 1e6:.0f}M params), 32-token prompts, {NEW_TOKENS} new tokens, generated tokens/s "
          "(prefill included), one run after a warm-up\n")
    print("| path | tp | prompts | eager tok/s | graphs tok/s | graphs / eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, tp, batch, eager, graphs in rows:
        print(f"| {name} | {tp} | {batch} | {eager:.0f} | {graphs:.0f} | {graphs / eager:.2f} |")
    print()


def flash_availability(installed: bool, import_error: str | None, capability: tuple[int, int]) -> tuple[bool, str]:
    """(usable, why not): flash-attn is absent only when the package is not installed or the GPU
    predates it (compute capability below 8.0); installed but not importing is "broken: ..."."""
    if not installed:
        return False, "the flash_attn package is not installed"
    if import_error is not None:
        return False, f"broken: {import_error}"
    if tuple(capability) < (8, 0):
        return False, f"flash-attn needs compute capability 8.0 or newer, the GPU has {capability[0]}.{capability[1]}"
    return True, ""


def bf16_tokens_verdict(graphs: list[list[int]], eager: list[list[int]], decoded: int = 3) -> tuple[bool, str]:
    """Graph decode against eager decode in bf16 (see the module docstring): ok when both gave
    every prompt as many tokens, every prompt's first token (the prefill's) is equal, and some
    prompt agrees on its first ``1 + decoded`` tokens; the detail gives each common prefix."""
    prefixes = []
    for g, e in zip(graphs, eager):
        n = 0
        while n < min(len(g), len(e)) and g[n] == e[n]:
            n += 1
        prefixes.append(n)
    shapes_match = len(graphs) == len(eager) and all(len(g) == len(e) for g, e in zip(graphs, eager))
    ok = shapes_match and bool(prefixes) and min(prefixes) >= 1 and max(prefixes) >= 1 + decoded
    agree = sum(a == b for g, e in zip(graphs, eager) for a, b in zip(g, e))
    total = sum(len(e) for e in eager)
    return ok, f"common prefixes {prefixes}, {agree}/{total} tokens equal"


def self_test() -> int:
    """This script's CPU-independent logic on made-up inputs: the verdicts, skips and summary."""
    global FAILURES, SKIPS, PASSED
    saved = FAILURES, SKIPS, PASSED
    problems = []

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            problems.append(f"{what}: got {got!r}, want {want!r}")

    try:
        eager = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [9, 9, 9, 9, 9]]
        expect("equal tokens", bf16_tokens_verdict(eager, eager)[0], True)
        flipped = [[5, 6, 0, 0, 0], [1, 2, 3, 4, 0], [9, 1, 1, 1, 1]]  # near-tie flips after some agreement
        expect("flips after agreement", bf16_tokens_verdict(flipped, eager)[0], True)
        garbage = [[5, 0, 0, 0, 0], [1, 7, 7, 7, 7], [9, 4, 4, 4, 4]]  # every decode step wrong at once
        expect("garbage decode", bf16_tokens_verdict(garbage, eager)[0], False)
        wrong_prefill = [[4, 6, 7, 8, 9], [1, 2, 3, 4, 5], [9, 9, 9, 9, 9]]
        expect("a different prefill token", bf16_tokens_verdict(wrong_prefill, eager)[0], False)
        expect("a short answer", bf16_tokens_verdict([[5, 6, 7, 8], *eager[1:]], eager)[0], False)
        expect("no prompt", bf16_tokens_verdict([], [])[0], False)
        expect("flash absent", flash_availability(False, "x", (9, 0))[0], False)
        expect("flash broken", flash_availability(True, "ImportError: y", (9, 0))[1].startswith("broken:"), True)
        expect("flash on an old GPU", flash_availability(True, None, (7, 5))[0], False)
        expect("an old GPU is a skip", flash_availability(True, None, (7, 5))[1].startswith("broken:"), False)
        expect("flash usable", flash_availability(True, None, (9, 0)), (True, ""))
        FAILURES, SKIPS, PASSED = [], [], []
        print("(made-up checks follow: their ok, FAIL and skip lines are expected)")
        expect("check ok", check("made-up ok", 1 == 1), True)
        expect("check fail", check("made-up fail", 1 == 2), False)
        expect("two GPUs on one", needs_gpus("made-up tp=2", 1, 2), False)
        expect("two GPUs on two", needs_gpus("made-up tp=2 again", 2, 2), True)
        guarded("made-up group", lambda: 1 / 0)
        expect("bookkeeping", (PASSED, FAILURES, len(SKIPS)), (["made-up ok"], ["made-up fail", "made-up group"], 1))
        expect("exit code with a failure", summary(), 1)
        FAILURES, SKIPS = [], ["x"]
        expect("exit code with skips only", summary(), 0)
    finally:
        FAILURES, SKIPS, PASSED = saved
    for problem in problems:
        print("SELF-TEST FAIL", problem)
    print("self-test:", "failed" if problems else "ok")
    return 1 if problems else 0


def run_qwen3(model_dir: str, name: str, mode: str, tp: int, port: int, dtype: str, plugin_args: dict,
              mixed: list[list[int]], batch16: list[list[int]]) -> tuple[list[list[int]], float, float]:
    """One engine: the greedy tokens of ``mixed`` (32 each), then tokens/s with 1 and 16 prompts."""
    with qwen3_engine(model_dir, tp, port, dtype, **plugin_args) as engine:
        if tp > 1 and mode == "graphs":  # (its runners live in the rank processes)
            skip(f"qwen3 {name} tp={tp}: graphs captured and used", "not inspectable from this process; "
                 "the tokens against eager are checked")
        if tp == 1:
            runner = runner_of(engine)
            if mode == "graphs":
                check(f"qwen3 {name}: graphs captured", bool(runner.decoder and runner.decoder.graphs),
                      runner.cuda_graphs)
            if "flash" in name:
                check(f"qwen3 {name} ({mode}): attention is flash-attn",
                      runner.attention_backend.startswith("flash-attn"), runner.attention_backend)
        tokens = engine.step({"prompt_token_ids": mixed, "max_tokens": 32}, timeout=300)["token_ids"]
        if tp == 1 and mode == "graphs":
            check(f"qwen3 {name}: decode steps ran on graphs", runner.num_static_steps > 0,
                  f"{runner.num_static_steps} of {runner.num_steps} steps, shapes {dict(runner.decoder.steps)}")
        return tokens, tokens_per_s(engine, batch16[:1]), tokens_per_s(engine, batch16)


def check_flash_layer(dev: torch.device = torch.device("cuda:0"), dtype: torch.dtype = torch.bfloat16) -> None:
    """flash-attn against torch SDPA on one Attention layer over the paged cache (bf16, block 256)."""
    from models.layers.attention import Attention, AttentionMetadata

    heads, kv, dim, block, num_blocks = 8, 4, 64, 256, 8
    attn = Attention(heads, dim, dim**-0.5, kv)
    attn.k_cache = torch.zeros(num_blocks + 1, block, kv, dim, dtype=dtype, device=dev)  # + a padding block
    attn.v_cache = torch.zeros_like(attn.k_cache)
    tables, lens = {0: [3, 5], 1: [1]}, {0: 0, 1: 0}
    gen = torch.Generator(device=dev).manual_seed(0)

    def step(new: dict[int, int], is_prefill: bool, static: bool = False) -> float:
        """Store and attend ``new[s]`` tokens of each sequence; the largest |flash - SDPA|."""
        slots, cu = [], [0]
        for s, n in new.items():
            slots += [tables[s][p // block] * block + p % block for p in range(lens[s], lens[s] + n)]
            lens[s] += n
            cu.append(cu[-1] + n)
        width = max(len(tables[s]) for s in new)
        pad = num_blocks if static else -1
        meta = AttentionMetadata(
            is_prefill, torch.tensor(slots, device=dev), torch.tensor([lens[s] for s in new], device=dev),
            torch.tensor([tables[s] + [pad] * (width - len(tables[s])) for s in new], device=dev),
            torch.tensor(cu, device=dev), static=static)
        q = torch.randn(cu[-1], heads, dim, generator=gen, device=dev, dtype=dtype)
        k = torch.randn(cu[-1], kv, dim, generator=gen, device=dev, dtype=dtype)
        v = torch.randn(cu[-1], kv, dim, generator=gen, device=dev, dtype=dtype)
        assert attn._flash(q)
        flash = attn(q, k, v, meta)
        attn._flash = lambda q: False  # the SDPA path, on the same cache (storing the same k/v again)
        try:
            sdpa = attn(q, k, v, meta)
        finally:
            del attn._flash
        return (flash.float() - sdpa.float()).abs().max().item()

    for what, new, is_prefill, static in (("prefill", {0: 300, 1: 17}, True, False),
                                          ("prefill after a cached prefix", {0: 20, 1: 3}, True, False),
                                          ("decode", {0: 1, 1: 1}, False, False),
                                          ("static decode", {0: 1, 1: 1}, False, True)):
        try:
            diff = step(new, is_prefill, static)
        except Exception as exc:  # a flash-attn build without some feature: report, go on
            check(f"flash-attn {what} equals SDPA (bf16)", False, f"{type(exc).__name__}: {exc}")
            continue
        check(f"flash-attn {what} equals SDPA (bf16)", diff < 5e-2, f"max diff {diff:.1e}")


if __name__ == "__main__":
    sys.exit(main())
