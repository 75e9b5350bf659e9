"""Streaming rows of section "llm": time to first token and inter-token latency, beside tokens/s.

``bench.generation.run`` calls ``stream_table`` with its engines once its tokens/s rounds are
done: each engine is put behind a ``Server`` and streamed through one ``Client`` (the tp=1
engine's own ``Engine.stream`` beside it, as the in-process baseline), at concurrency 1, 4 and
16 (that many threads, each streaming its requests one after another, all started together):

    TTFT  from the call to ``stream`` to its first chunk        p50, p99 over the requests
    ITL   between one chunk and the next (a chunk is a step's   p50, p99 over every gap
          token; a preempted sequence's chunk may hold more)
    tokens/s  generated tokens of all streams / wall time

On a 2-core machine shared with other work the absolute figures move a lot between runs;
compare rows of one run (the client's against ``Engine.stream``'s, one concurrency against
another).
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from typing import Any, Callable, Iterable

from bench.common import Table, p50, p99

CONCURRENCY = (1, 4, 16)


def timed_stream(open_stream: Callable[[], Iterable[dict]]) -> tuple[float, list[float], int]:
    """TTFT, the gaps between chunks, and the tokens of one stream."""
    start = time.perf_counter()
    stamps, tokens = [], 0
    for chunk in open_stream():
        stamps.append(time.perf_counter())
        tokens += sum(map(len, chunk["token_ids"]))
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], tokens


def run_load(open_stream: Callable[[Any], Iterable[dict]], requests: list[Any], concurrency: int) -> dict:
    """``requests`` streamed by ``concurrency`` threads; the figures of one row."""
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for ttft, itl, count in pool.map(lambda r: timed_stream(lambda: open_stream(r)), requests):
            ttfts.append(ttft)
            gaps += itl
            tokens += count
    wall = time.perf_counter() - start
    return {"tokens/s": tokens / wall, "ttft50": p50(ttfts), "ttft99": p99(ttfts), "itl50": p50(gaps) if gaps else 0.0,
            "itl99": p99(gaps) if gaps else 0.0, "requests": len(requests)}


def stream_table(engines: dict[str, Any], batch: list[list[int]], new_tokens: int, quick: bool,
                 progress: Callable[[str], None]) -> Table:
    """The streaming table; serves each engine (the server closes it at the end)."""
    from runtime.client import Client
    from runtime.serving.server import Server

    def requests(concurrency: int) -> list[dict]:
        count = max(concurrency * (1 if quick else 2), 3)
        return [{"prompt_token_ids": batch[i % len(batch)], "max_tokens": new_tokens, "ignore_eos": True}
                for i in range(count)]

    rows: list[tuple[str, int, dict]] = []
    first_name, first = next(iter(engines.items()))
    progress("llm: streaming in process (Engine.stream)")
    for c in CONCURRENCY:
        rows.append((f"{first_name}, Engine.stream", c, run_load(lambda r: first.stream(r, timeout=600),
                                                                 requests(c), c)))
    with tempfile.TemporaryDirectory(prefix="phyrt-bench-llm-stream-") as tmp:
        for index, (name, engine) in enumerate(engines.items()):
            progress(f"llm: streaming through the client ({name})")
            server = Server(engine, f"ipc://{tmp}/{index}.sock").start()
            try:
                with Client(server.address) as client:
                    for c in CONCURRENCY:
                        rows.append((f"{name}, Client.stream", c,
                                     run_load(lambda r: client.stream(r, timeout=600), requests(c), c)))
            finally:
                server.close()
    method = [f"{new_tokens} new greedy tokens per request, streamed. Concurrency c: c threads started together, "
              "each streaming its share of the requests one after another (at least 3 requests in all). TTFT: "
              "from the call to `stream` to its first chunk (p50, p99 over requests); ITL: between consecutive "
              "chunks (p50, p99 over every gap); tokens/s: generated tokens of all streams / wall time. "
              "Client.stream: one `Client` over ipc:// to a `Server` of that engine. One run each, right after "
              "the tokens/s rounds; on a shared 2-core machine compare rows of one run."]
    table_rows = [[path, str(c), str(f["requests"]), f"{f['tokens/s']:.0f}", f"{f['ttft50'] * 1e3:.1f}",
                   f"{f['ttft99'] * 1e3:.1f}", f"{f['itl50'] * 1e3:.1f}", f"{f['itl99'] * 1e3:.1f}"]
                  for path, c, f in rows]
    return Table("Streaming: time to first token and inter-token latency (CPU)",
                 ["path", "concurrent streams", "requests", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                  "ITL p99 ms"], table_rows, method)
