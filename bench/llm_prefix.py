"""Rows of section "llm" for issue 35: prefix caching and chunked prefill of the ``qwen3`` plugin.

    python -m bench --only llm        (``bench.generation.run`` calls ``run`` at its end)
    python -m bench.llm_prefix [--quick]   (these rows alone, printed)

On ``bench.llm``'s random Qwen3 checkpoint (about 58M parameters, fp32, CPU), tp=1 inline
engines, one pair per table, built here:

    prefix caching   16 requests sharing a 384-token prefix, each with its own 16-token suffix,
                     max_tokens 1 (its latency is its time to first token): sent one after
                     another (the first one finds the cache cold), and 16 at once after one
                     request with the prefix warmed it; ``prefix_caching`` on against off.
                     Prompt tokens computed = prompt tokens - those served from the cache
                     (the runner's ``info()``). A fresh prefix every round.
    chunked prefill  one stream decoding (32-token prompt, 48 new tokens); after its 5th
                     chunk a 1,500-token prompt arrives (max_tokens 1); the largest gap between
                     two chunks of the stream. ``max_num_batched_tokens`` 256, ``chunked_prefill``
                     on against off (prefix caching off, so that nothing is reused).

Targets (issue 35): time to first token with caching >= 3x faster, >= 80% fewer prompt tokens
computed; largest gap with chunked prefill <= 0.4x the gap without. Medians over rounds; on a
loaded machine the absolute figures move, the ratios less.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from bench.common import Table, Target, p50
from models.qwen3 import Qwen3Entry

PREFIX_TOKENS, SUFFIX_TOKENS, REQUESTS = 384, 16, 16
LONG_PROMPT, BUDGET, STREAM_PROMPT, STREAM_TOKENS, ARRIVE_AFTER = 1500, 256, 32, 48, 5
TTFT_TARGET, COMPUTED_TARGET, GAP_TARGET = 3.0, 0.8, 0.4


class CountedQwen3(Qwen3Entry):
    """The ``qwen3`` plugin, keeping each runner it builds (inline engines build in this process)
    so that the bench reads its ``info()`` counters."""

    runners: list[Any] = []

    def build(self, ctx: Any, plugin_args: Any) -> Any:
        runner = super().build(ctx, plugin_args)
        CountedQwen3.runners.append(runner)
        return runner


def start(plugin_args: dict) -> Any:
    """An inline engine of ``CountedQwen3``; its runner is ``RUNNERS[engine]``."""
    from runtime import Engine, EngineArgs

    built = len(CountedQwen3.runners)
    engine = Engine(EngineArgs(f"{__name__}:CountedQwen3", plugin_args))
    if len(CountedQwen3.runners) != built + 1:
        engine.close()
        raise RuntimeError("the engine did not build its runner in this process")
    RUNNERS[engine] = CountedQwen3.runners[-1]
    return engine


RUNNERS: dict[Any, Any] = {}


def runner_info(engine: Any) -> dict:
    return RUNNERS[engine].info()


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefix_load(engine: Any, round_: int, vocab: int, together: bool) -> dict:
    """16 requests sharing a prefix (fresh for the round): their TTFTs, first tokens and prompt tokens computed."""
    prefix = _tokens(PREFIX_TOKENS, 1000 + 2 * round_ + together, vocab)
    prompts = [prefix + _tokens(SUFFIX_TOKENS, 5000 + 100 * round_ + i, vocab) for i in range(REQUESTS)]
    request = lambda p: {"prompt_token_ids": p, "max_tokens": 1, "ignore_eos": True}  # noqa: E731
    if together:  # one request warms the prefix, then 16 at once
        engine.step(request(prefix + [1]), timeout=600)
    before = runner_info(engine)
    ttfts, firsts = [], []
    if together:
        start = time.perf_counter()
        futures = [engine.submit(request(p)) for p in prompts]
        for future in futures:  # stamped when each completes, whatever order they are read in
            future.add_done_callback(lambda _: ttfts.append(time.perf_counter() - start))
        firsts = [future.result(600)["token_ids"][0][0] for future in futures]
        while len(ttfts) < len(futures):  # a future's callbacks run just after its result is set
            time.sleep(0.001)
    else:
        for prompt in prompts:
            start = time.perf_counter()
            firsts.append(engine.step(request(prompt), timeout=600)["token_ids"][0][0])
            ttfts.append(time.perf_counter() - start)
    after = runner_info(engine)
    return {"ttft": p50(ttfts), "firsts": firsts,
            "computed": after["computed_prompt_tokens"] - before["computed_prompt_tokens"],
            "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"]}


def largest_gap(engine: Any, round_: int, vocab: int) -> dict:
    """The largest gap between two chunks of a decoding stream while a long prompt arrives."""
    stream_prompt = _tokens(STREAM_PROMPT, 7000 + round_, vocab)
    long_prompt = _tokens(LONG_PROMPT, 8000 + round_, vocab)
    stamps, future = [], None
    for chunk in engine.stream({"prompt_token_ids": stream_prompt, "max_tokens": STREAM_TOKENS,
                                "ignore_eos": True}, timeout=600):
        stamps.append(time.perf_counter())
        if len(stamps) == ARRIVE_AFTER:
            future = engine.submit({"prompt_token_ids": long_prompt, "max_tokens": 1, "ignore_eos": True})
    first = future.result(600)["token_ids"][0][0]
    return {"gap": max(b - a for a, b in zip(stamps, stamps[1:])), "first": first}


def run(path: Any, quick: bool, progress: Any) -> tuple[list[Table], list[Target], dict]:
    from bench import llm

    vocab, rounds = llm.CONFIG["vocab_size"], 1 if quick else 3
    base = {"model": str(path), "max_num_seqs": REQUESTS, "kv_cache_blocks": 512}
    prefix: dict[tuple[bool, bool], list[dict]] = {}
    gaps: dict[bool, list[dict]] = {}
    with start(base | {"prefix_caching": True}) as on, start(base | {"prefix_caching": False}) as off:
        prefix_load(on, -1, vocab, False), prefix_load(off, -1, vocab, False)  # warm-up
        for r in range(rounds):
            progress(f"llm: prefix caching, round {r + 1}/{rounds}")
            for together in (False, True):
                for caching, engine in ((True, on), (False, off)):
                    prefix.setdefault((caching, together), []).append(prefix_load(engine, r, vocab, together))
    chunk_args = base | {"prefix_caching": False, "max_num_batched_tokens": BUDGET}
    with start(chunk_args | {"chunked_prefill": True}) as on, start(chunk_args | {"chunked_prefill": False}) as off:
        largest_gap(on, -1, vocab), largest_gap(off, -1, vocab)  # warm-up
        for r in range(rounds):
            progress(f"llm: chunked prefill, round {r + 1}/{rounds}")
            for chunked, engine in ((True, on), (False, off)):
                gaps.setdefault(chunked, []).append(largest_gap(engine, r, vocab))
    return report(prefix, gaps, rounds)


def report(prefix: dict, gaps: dict, rounds: int) -> tuple[list[Table], list[Target], dict]:
    rows, med = [], {}
    for (caching, together), runs in sorted(prefix.items(), key=lambda kv: (kv[0][1], not kv[0][0])):
        ttft, computed = p50(r["ttft"] for r in runs), p50(r["computed"] for r in runs)
        same = all(r["firsts"] == o["firsts"] for r, o in zip(runs, prefix[(False, together)]))
        med[(caching, together)] = (ttft, computed)
        rows.append(["16 at once, prefix warm" if together else "one after another", "on" if caching else "off",
                     f"{ttft * 1e3:.0f}", f"{computed:.0f} of {runs[0]['prompt_tokens']}", "yes" if same else "no"])
    prefix_table = Table(
        f"Prefix caching: {REQUESTS} requests sharing a {PREFIX_TOKENS}-token prefix (CPU)",
        ["load", "prefix_caching", "TTFT p50 ms (median of rounds)", "prompt tokens computed",
         "first tokens = caching off"], rows,
        [f"Each request: the prefix + its own {SUFFIX_TOKENS}-token suffix, max_tokens 1 (its latency is its TTFT). "
         "One after another: each sent when the previous one answered, the first finds the cache cold. 16 at once: "
         f"submitted together after one request with the prefix. {rounds} round(s), a fresh prefix each; "
         "medians. The machine is shared: read the ratios."])
    gap = {c: p50(r["gap"] for r in runs) for c, runs in gaps.items()}
    same = all(a["first"] == b["first"] for a, b in zip(gaps[True], gaps[False]))
    gap_table = Table(
        f"Chunked prefill: a decoding stream while a {LONG_PROMPT:,}-token prompt arrives (CPU)",
        ["chunked_prefill", "largest inter-token gap ms (median of rounds)", "long prompt's first token = off"],
        [[("on" if c else "off"), f"{gap[c] * 1e3:.0f}", "yes" if same else "no"] for c in (True, False)],
        [f"max_num_batched_tokens {BUDGET}; the stream: {STREAM_PROMPT}-token prompt, {STREAM_TOKENS} new tokens; "
         f"the long prompt (max_tokens 1) submitted after its {ARRIVE_AFTER}th chunk. {rounds} round(s); medians."])
    targets = []
    for together in (False, True):
        speedup = med[(False, together)][0] / med[(True, together)][0]
        fewer = 1 - med[(True, together)][1] / med[(False, together)][1]
        load = "16 at once, prefix warm" if together else "one after another"
        targets.append(Target(f"prefix caching, {load}: TTFT ≥ {TTFT_TARGET:g}× faster", f"{speedup:.1f}×",
                              speedup >= TTFT_TARGET))
        targets.append(Target(f"prefix caching, {load}: ≥ {COMPUTED_TARGET:.0%} fewer prompt tokens computed",
                              f"{fewer:.1%} fewer", fewer >= COMPUTED_TARGET))
    ratio = gap[True] / gap[False]
    targets.append(Target(f"chunked prefill: largest inter-token gap ≤ {GAP_TARGET:g}× the gap without",
                          f"{ratio:.2f}×", ratio >= 0 and ratio <= GAP_TARGET))
    data = {"prefix": {f"caching={c} together={t}": runs for (c, t), runs in prefix.items()},
            "gaps": {f"chunked={c}": runs for c, runs in gaps.items()}}
    return [prefix_table, gap_table], targets, data


def main(argv: list[str] | None = None) -> int:
    import tempfile
    from pathlib import Path

    from bench import llm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="phyrt-bench-llm-prefix-") as tmp:
        path = Path(tmp) / "qwen3-58m"
        llm.make_checkpoint(path)
        tables, targets, _ = run(path, opts.quick, lambda m: print(m, file=sys.stderr))
    for table in tables:
        print(f"\n{table.title}\n\n" + "\n".join(table.method) + "\n\n| " + " | ".join(table.headers) + " |")
        print("|" + "---|" * len(table.headers))
        for row in table.rows:
            print("| " + " | ".join(row) + " |")
    for t in targets:
        print(f"target: {t.name}: {t.figure}: {t.verdict.strip('*')}")
    return 0 if all(t.met for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
