"""Text in, streamed text out: call a phyrt server that serves a Qwen3 checkpoint.

    python examples/make_tiny_qwen3.py --out /tmp/tiny-qwen3          # a tiny random model, once
    python -m runtime.launch --model /tmp/tiny-qwen3                   # terminal 1: "phyrt ready address=..."
    python examples/llm_client.py --address ADDRESS "Hello, robot"     # terminal 2
    python examples/llm_client.py --address ADDRESS --chat "Hello, robot"

The text is printed as the server generates it (``Client.stream``), then the finish
reason ("stop": an end token; "length": ``--max-tokens`` reached). ``--chat`` sends the
text as a user message through the model's chat template; ``--no-stream`` waits for the
whole answer (``Client.call``). The client needs pyzmq, msgpack and numpy only (no torch).
"""

from __future__ import annotations

import argparse
import sys
import time

from runtime.client import Client


def request_of(opts: argparse.Namespace) -> dict:
    request = {"max_tokens": opts.max_tokens, "temperature": opts.temperature}
    if opts.chat:
        request["messages"] = [{"role": "user", "content": opts.text}]
    else:
        request["prompt"] = opts.text
    return request


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text", help="the prompt (or with --chat, the user's message)")
    parser.add_argument("--address", required=True, help="the address from the server's 'phyrt ready' line")
    parser.add_argument("--chat", action="store_true", help="send the text as a chat message")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--no-stream", action="store_true", help="print the answer once it is complete")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the request may take")
    opts = parser.parse_args(argv)

    started = time.perf_counter()
    with Client(opts.address) as client:
        if opts.no_stream:
            result = client.call(request_of(opts), timeout=opts.timeout)
            text, reason, first = result["text"][0], result["finish_reasons"][0], None
            sys.stdout.write(text)
        else:
            reason, first = None, None
            for chunk in client.stream(request_of(opts), timeout=opts.timeout):
                if first is None:
                    first = time.perf_counter() - started
                sys.stdout.write(chunk["text"][0])
                sys.stdout.flush()
                reason = chunk.get("finish_reasons", [reason])[0]
    took = time.perf_counter() - started
    timing = f"first text after {first * 1e3:.0f} ms, " if first is not None else ""
    print(f"\n[finish: {reason}; {timing}{took * 1e3:.0f} ms in all]")


if __name__ == "__main__":
    main()
