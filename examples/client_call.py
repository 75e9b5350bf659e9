"""Call a running phyrt server from another process: the policy demo, synchronously.

    python -m runtime.launch                              # terminal 1: prints "phyrt ready address=..."
    python examples/client_call.py --address ADDRESS      # terminal 2

The client needs pyzmq, msgpack and numpy only (no torch). Over ipc:// large tensors
travel through shared memory; results come back as ordinary numpy arrays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from runtime.client import Client


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the address from the server's 'phyrt ready' line")
    parser.add_argument("--obs-dim", type=int, default=32, help="the policy's observation width")
    parser.add_argument("--calls", type=int, default=100, help="calls in the latency loop")
    opts = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    with Client(opts.address) as client:
        info = client.info(timeout=30)
        print(f"server: plugin={info['plugin']} mode={info['mode']} {info['replica_count']} replica(s) x "
              f"{info['ranks_per_replica']} rank(s) on {info['device']}; ping {client.ping() * 1e6:.0f} us")

        obs = rng.standard_normal((4, opts.obs_dim), dtype=np.float32)
        actions = client.call({"obs": obs}, timeout=30)["actions"]
        print(f"actions {actions.shape} {actions.dtype} range [{actions.min():.3f}, {actions.max():.3f}]")

        # Many requests in flight: submit() returns a concurrent.futures.Future at once.
        futures = [client.submit({"obs": obs[i:i + 1]}) for i in range(len(obs))]
        rows = np.concatenate([f.result(30)["actions"] for f in futures])
        print(f"one by one == batched: max |diff| {np.abs(rows - actions).max():.2e}")

        latencies = []
        for _ in range(opts.calls):
            started = time.perf_counter()
            client.call({"obs": obs[:1]}, timeout=30)
            latencies.append(time.perf_counter() - started)
        latencies.sort()
        print(f"{opts.calls} calls: p50 {statistics.median(latencies) * 1e6:.0f} us, "
              f"p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
