"""Section "llm": generated tokens per second against concurrency, qwen3 plugin against transformers.

Uses ``bench.llm``'s random-weight Qwen3 checkpoint (about 58M parameters), prompts
and model loading; every path generates the same number of greedy tokens per
request (EOS ignored):

    transformers, one call per request   ``generate`` on one prompt at a time: what a server built
                                         on ``generate`` serves at any concurrency
    transformers, hand-batched           the c prompts in one ``generate`` call (equal lengths, no
                                         padding): its best case, when every prompt is known together
    qwen3 tp=1 (inline engine)           c requests submitted at once (continuous batching)
    qwen3 tp=2 (local, 2 CPU ranks)      the same (full runs only); the ranks' collectives go through
                                         shared memory (``runtime.parallel.shm_collectives``)
    qwen3 tp=1, F.linear                 the inline engine with ``packed_weights=False`` (full runs, at 1
                                         and the top concurrency only): what oneDNN's prepacked weights
                                         (``models.layers.packed``, the default) gain over torch's F.linear

The helpers take a device, so that ``bench.gpu`` runs the same paths on CUDA.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import RunContext, Section, Table, Target, p50

HF_ONE, HF_BATCH = "transformers, one call per request", "transformers, c prompts hand-batched in one call"
TP1, TP2 = "qwen3 tp=1 (inline engine)", "qwen3 tp=2 (local, 2 CPU ranks, shared-memory collectives)"
TP1_PLAIN = "qwen3 tp=1, F.linear (packed_weights=False)"


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(batch, device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def engine_generate(engine: Any, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Every prompt as its own request, all submitted at once; the greedy tokens of each."""
    futures = [engine.submit({"prompt_token_ids": p, "max_tokens": new_tokens, "ignore_eos": True}) for p in batch]
    return [f.result(600)["token_ids"][0] for f in futures]


def measure(paths: dict[tuple[str, int], Any], reference: tuple[str, int], rounds: int,
            progress: Any) -> tuple[dict[tuple[str, int], list[float]], set[tuple[str, int]]]:
    """Tokens per second of every path in every round (paths interleaved within a round), and
    the paths whose greedy tokens differ from those of the ``reference`` path (transformers with
    every prompt in one batch) on the same prompts."""
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in paths}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}: {len(paths)} paths")
        for key, run in paths.items():
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
            outputs.setdefault(key, tokens)
            rates[key].append(sum(map(len, tokens)) / seconds)
    want = outputs[reference]
    mismatched = {key for key, tokens in outputs.items() if tokens != want[:len(tokens)]}
    return rates, mismatched


def build_paths(hf_model: Any, engines: dict[str, Any], batch: list[list[int]], levels: tuple[int, ...],
                singles: int, new_tokens: int) -> dict[tuple[str, int], Any]:
    paths: dict[tuple[str, int], Any] = {(HF_ONE, 1): lambda: [hf_generate(hf_model, [p], new_tokens)[0]
                                                               for p in batch[:singles]]}
    for c in levels:
        if c > 1:
            paths[(HF_BATCH, c)] = lambda c=c: hf_generate(hf_model, batch[:c], new_tokens)
    for name, engine in engines.items():
        for c in levels:
            if c == 1:  # one request at a time, ``singles`` of them
                paths[(name, 1)] = lambda e=engine: [engine_generate(e, [p], new_tokens)[0] for p in batch[:singles]]
            else:
                paths[(name, c)] = lambda e=engine, c=c: engine_generate(e, batch[:c], new_tokens)
    return paths


def tables(rates: dict[tuple[str, int], list[float]], mismatched: set[tuple[str, int]], levels: tuple[int, ...],
           method: list[str], title: str) -> tuple[Table, dict[str, Any]]:
    med = {key: p50(v) for key, v in rates.items()}
    hf_one = med[(HF_ONE, 1)]
    rows = []
    for (name, c), rate in sorted(med.items(), key=lambda kv: (kv[0][0] != HF_ONE, kv[0][0], kv[0][1])):
        same = "no" if (name, c) in mismatched else "yes"
        rows.append([name, "any (served one by one)" if name == HF_ONE else str(c), f"{rate:.0f}",
                     f"{rate / hf_one:.2f}×", same])
    data = {"levels": list(levels), "median_tokens_per_s": [{"path": n, "concurrency": c, "tokens_per_s": r}
                                                            for (n, c), r in med.items()],
            "rounds": {f"{n} @ {c}": v for (n, c), v in rates.items()}, "mismatched": sorted(map(str, mismatched))}
    return Table(title, ["path", "concurrent requests", "tokens/s (median of rounds)",
                         "× transformers one call per request", "greedy tokens = transformers"], rows, method), data


def run(ctx: RunContext) -> Section:
    from bench import llm
    from runtime import Engine, EngineArgs

    section = Section("llm", "LLM decode: tokens per second against concurrency")
    levels = (1, 4, 16) if ctx.quick else (1, 2, 4, 8, 16)
    new_tokens, rounds, singles = (16, 1, 2) if ctx.quick else (llm.NEW_TOKENS, 3, 4)
    batch = llm.prompts(max(levels))
    with contextlib.ExitStack() as stack:
        path = Path(ctx.workdir) / "qwen3-58m"
        ctx.progress("llm: writing a random Qwen3 checkpoint and loading it into transformers")
        params = llm.make_checkpoint(path)
        hf = llm.HFPaths(path)
        stack.callback(shutil.rmtree, path, True)
        ctx.progress("llm: starting the qwen3 engine" + ("" if ctx.quick else "s (tp=1 inline, tp=2 local)"))
        plugin_args = {"model": str(path), "max_num_seqs": max(levels), "kv_cache_blocks": 256}
        if ctx.quick:
            engines = {TP1: stack.enter_context(Engine(EngineArgs("qwen3", plugin_args)))}
        else:
            started = llm.start_engines(path, stack)
            engines = {TP1: started["tp=1"], TP2: started["tp=2"]}
            plain = plugin_args | {"packed_weights": False}
            engines[TP1_PLAIN] = stack.enter_context(Engine(EngineArgs("qwen3", plain)))
        ctx.progress("llm: warm-up (one single-prompt generate, one request per engine)")
        hf_generate(hf.model, batch[:1], new_tokens)
        for engine in engines.values():
            engine_generate(engine, batch[:1], new_tokens)
        paths = build_paths(hf.model, engines, batch, levels, singles, new_tokens)
        for c in levels[1:-1]:  # the F.linear baseline only at both ends
            paths.pop((TP1_PLAIN, c), None)
        rates, mismatched = measure(paths, (HF_BATCH, max(levels)), rounds, lambda m: ctx.progress(f"llm: {m}"))
        from bench.llm_stream import stream_table  # TTFT and ITL, streamed (its servers close the engines)

        streaming = stream_table({k: e for k, e in engines.items() if k != TP1_PLAIN}, batch, new_tokens, ctx.quick,
                                 ctx.progress)
        from bench import llm_prefix  # issue 35: prefix caching and chunked prefill (engines of its own)

        prefix_tables, prefix_targets, prefix_data = llm_prefix.run(path, ctx.quick, ctx.progress)
    import torch

    method = [f"`bench.llm`'s random Qwen3 ({params / 1e6:.0f}M parameters, fp32, CPU, torch "
              f"{torch.__version__} with {torch.get_num_threads()} threads here), {llm.PROMPT_TOKENS}-token prompts, "
              f"{new_tokens} new greedy tokens per request (EOS ignored). tokens/s = generated tokens / wall time "
              f"of the whole batch of requests. Concurrency c: c requests `submit`ted at once to the engine; "
              f"transformers one call per request: {singles} prompts one after another (its rate at any "
              "concurrency, since `generate` has no notion of concurrent requests); hand-batched: the c prompts "
              f"in one `generate` call. One warm-up request per engine and one single-prompt `generate`; {rounds} round(s), paths interleaved "
              "within a round. Greedy tokens compared with those of transformers' hand-batched call on all prompts "
              "(first round)."]
    table, section.data = tables(rates, mismatched, levels, method, "Tokens per second against concurrency (CPU)")
    section.data["prefix_caching_and_chunked_prefill"] = prefix_data
    section.tables.append(table)
    section.tables.append(streaming)
    section.tables += prefix_tables
    ours = p50(rates[("qwen3 tp=1 (inline engine)", max(levels))]) / p50(rates[(HF_ONE, 1)])
    section.targets.append(Target(
        f"qwen3 tp=1 serving {max(levels)} concurrent requests ≥ {llm.TARGET_RATIO:g}× transformers serving them "
        "(one generate call per request)", f"{ours:.2f}×", ours >= llm.TARGET_RATIO))
    section.targets += decode_targets({key: p50(v) for key, v in rates.items()}, max(levels))
    section.targets += prefix_targets
    return section


#: issue 18's targets: (numerator path, its concurrency, denominator path, its concurrency, at least)
DECODE_TARGETS = (
    (TP1, 1, HF_ONE, 1, 1.1),
    (TP1, 16, HF_BATCH, 16, 1.5),
    (TP2, 16, TP1, 16, 0.85),
    (TP2, 1, TP1, 1, 0.7),
)


def decode_targets(med: dict[tuple[str, int], float], top: int) -> list[Target]:
    """Issue 18's decode targets that this run measured (tp=2 only in full runs)."""
    out = []
    for path, c, base, c_base, least in DECODE_TARGETS:
        c, c_base = min(c, top), min(c_base, top)
        if (path, c) in med and (base, c_base) in med:
            ratio = med[(path, c)] / med[(base, c_base)]
            where = "one request at a time" if c == 1 else f"{c} concurrent requests"
            out.append(Target(f"{path}, {where} ≥ {least:g}× {base}" + ("" if base == HF_ONE else f" at {c_base}"),
                              f"{ratio:.2f}×", ratio >= least))
    return out
