"""Call a running phyrt server from asyncio: many requests in flight, one deadline.

    python -m runtime.launch                              # terminal 1: prints "phyrt ready address=..."
    python examples/async_client.py --address ADDRESS     # terminal 2
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from runtime.client import AsyncClient, DeadlineExceededError


async def run(address: str, obs_dim: int, requests: int) -> None:
    rng = np.random.default_rng(0)
    async with AsyncClient(address) as client:
        info = await client.info(timeout=30)
        print(f"server: plugin={info['plugin']} mode={info['mode']}; ping {await client.ping() * 1e6:.0f} us")

        observations = [rng.standard_normal((1, obs_dim), dtype=np.float32) for _ in range(requests)]
        started = time.perf_counter()
        results = await asyncio.gather(*(client.call({"obs": obs}, timeout=30) for obs in observations))
        elapsed = time.perf_counter() - started
        print(f"{len(results)} concurrent requests in {elapsed * 1e3:.1f} ms; "
              f"actions {results[0]['actions'].shape} {results[0]['actions'].dtype}")

        try:  # a deadline far too short for any engine: the server answers DeadlineExceeded
            await client.call({"obs": observations[0]}, timeout=1e-6)
            print("deadline: answered in time anyway")
        except DeadlineExceededError as exc:
            print(f"deadline: {type(exc).__name__}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the address from the server's 'phyrt ready' line")
    parser.add_argument("--obs-dim", type=int, default=32, help="the policy's observation width")
    parser.add_argument("--requests", type=int, default=16, help="requests sent at once")
    opts = parser.parse_args(argv)
    asyncio.run(run(opts.address, opts.obs_dim, opts.requests))


if __name__ == "__main__":
    main()
