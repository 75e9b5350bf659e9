"""The qwen3 plugin, tensor parallel 2, in processes that torchrun starts.

One node, two ranks:

    torchrun --standalone --nproc-per-node 2 examples/torchrun_engine.py --model DIR --prompt 3,1,4,1,5

Two nodes, one rank each (run the first command on HOST0, the second on the other node):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        examples/torchrun_engine.py --model DIR
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        examples/torchrun_engine.py --model DIR

Every rank builds the engine, reads the same requests (one per ``--prompt``, with
``--max-tokens``; or one qwen3 request as JSON with ``--request FILE``) and calls
``engine.step`` with each in turn. Rank 0 prints one line ``result {"token_ids": ...,
"finish_reasons": ...}`` per request; the other ranks get ``None``. Ranks given
different requests all fail with ``RequestMismatchError`` and exit 1. (``python -m
torch.distributed.run`` is the same launcher as ``torchrun``.)

Devices: ``--device auto`` (the default) is CUDA with NCCL wherever torch sees a GPU, one
GPU per rank (``LOCAL_RANK``), so each node needs as many visible GPUs as its
``--nproc-per-node``; on a machine with fewer (one GPU, two ranks), or none, add
``--device cpu``: the same ranks run on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                     EngineArgs, EngineConfig, ParallelConfig)
from runtime import parallel as P
from runtime.core.errors import PhyrtError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face Qwen3 checkpoint directory")
    parser.add_argument("--prompt", action="append", default=None,
                        help="comma-separated token ids; repeat it for several requests, run one after another "
                             "(default: 3,1,4,1,5)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request", metavar="FILE", default=None,
                        help="a whole qwen3 request as JSON (overrides --prompt and --max-tokens)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size: the number of ranks in all")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda (one GPU per rank, NCCL) where torch sees a GPU, else cpu (gloo); "
                             "cpu runs anywhere")
    parser.add_argument("--collective-timeout-s", type=float, default=60.0)
    opts = parser.parse_args(argv)

    if opts.request is not None:
        with open(opts.request) as f:
            requests = [json.load(f)]
    else:
        requests = [{"prompt_token_ids": [int(t) for t in prompt.split(",")], "max_tokens": opts.max_tokens}
                    for prompt in opts.prompt or ["3,1,4,1,5"]]

    started = time.monotonic()
    engine = Engine(
        EngineArgs("qwen3", {"model": opts.model}, EngineConfig(
            device=DeviceConfig(target=opts.device),
            parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=opts.tp),
                                    attention=AttentionParallelConfig(tp_size=opts.tp)))),
        DeploymentConfig.external(collective_timeout_s=opts.collective_timeout_s),
    )
    rank = P.rank("world")  # the launcher's RANK: the engine made one replica of all the ranks
    try:
        _line(f"rank {rank}: ready in {time.monotonic() - started:.1f} s", sys.stderr)
        for request in requests:  # the same requests in the same order on every rank
            began = time.monotonic()
            try:
                result = engine.step(request)
            except PhyrtError as exc:
                _line(f"rank {rank}: {type(exc).__name__}: {exc}", sys.stderr)
                return 1
            took = time.monotonic() - began
            if result is None:
                _line(f"rank {rank}: step returned None (only rank 0 answers) in {took:.2f} s", sys.stderr)
            else:
                _line(f"rank {rank}: step in {took:.2f} s", sys.stderr)
                _line("result " + json.dumps(result), sys.stdout)
    finally:
        engine.close()
    return 0


def _line(text: str, stream) -> None:
    """One whole line in one write: torchrun runs its workers unbuffered (PYTHONUNBUFFERED), where
    ``print`` writes the text and its newline separately, and ranks sharing one log interleave."""
    stream.write(text + "\n")
    stream.flush()


if __name__ == "__main__":
    raise SystemExit(main())
