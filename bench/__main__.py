"""``python -m bench``: every benchmark in one run, a Markdown report with tables and PNG plots.

Sections (run in this order; ``--only`` picks some):

    latency    round trip against payload size (~100 B, 1/16/64 MiB) on phyrt inline and local, the
               bare ZMQ+msgpack and OS pipe floors, pickle over ZMQ, msgpack-numpy over websocket, Ray
    compute    64 MiB in, a new 64 MiB tensor out (a plugin that computes): inline against a local rank,
               in memcpys, with minor page faults per call on both sides
    serving    python -m runtime.launch + runtime.client against the floor, pickle REQ/REP and the
               websocket peer: small requests, a 5 MiB image, throughput with 1 and 8 client processes (--quick: 8)
    fleet      Client([a, b]) over two servers against Client(a): the routing client's cost per request,
               requests/s from 1 and 8 client processes (--quick: 8) with 1 and 2 servers
    batching   dynamic batching off and on (a fixed-cost plugin that models an accelerator kernel, and the
               policy demo): requests/s and p50/p99 from 1, 8 and 16 client processes; a high-priority
               client's latency against a server saturated by low-priority ones, priority on and off
    cpp        the C++ client (examples/cpp/client_call) against runtime.client and the bare ZMQ+msgpack
               echo floor: small-request round trip, p50 and p99
    openpi     openpi's client against phyrt's openpi door, a plain websockets + msgpack_numpy server running
               the same plugin (the protocol's floor) and runtime.client: a 32-float and a 640x480 image observation
    scaling    throughput of a compute-bound plugin on 1 and 2 replicas
    lifecycle  engine start-up (2-rank local replica) against bare spawn + gloo; failure detection
               after SIGKILL and SIGSTOP of a rank with a request in flight
    collectives  all-reduce of 4 KiB and 4 MiB between 2 CPU ranks: shared memory against gloo
    llm        qwen3 plugin against transformers.generate: tokens/s against concurrency
    gpu        CUDA-IPC of 1 GiB from a local rank, qwen3 decode on CUDA (skipped without CUDA)

Writes OUT/latest.md, OUT/latest.json and the plots (OUT/*.png); progress goes to stderr. OUT is
``--out DIR``, by default ``default_out()`` (``~/.cache/phyrt/bench``), outside the checkout: the
committed report in bench/results changes only with ``--out bench/results``.

Spawned children (ranks, echo servers, bare torch ranks) re-import this module as
``__mp_main__``: its top level imports nothing heavy and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

SECTIONS = ("latency", "compute", "serving", "fleet", "batching", "cpp", "openpi", "scaling", "lifecycle", "collectives", "llm", "gpu")
#: the committed report (the last full run on the 2-core CI-like machine): written only when asked for
COMMITTED_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_out() -> str:
    """Where a run writes its report when ``--out`` is not given: outside the checkout, so that a
    benchmark leaves the committed ``bench/results`` (report and plots together) as it was:
    ``$XDG_CACHE_HOME/phyrt/bench`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG spec says),
    else ``~/.cache/phyrt/bench``."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "phyrt", "bench")


def _runner(name: str):
    if name == "latency":
        from bench.latency import run
    elif name == "serving":
        from bench.frontdoor import run
    elif name == "compute":
        from bench.compute import run
    elif name == "fleet":
        from bench.fleet import run
    elif name == "batching":
        from bench.batching import run
    elif name == "cpp":
        from bench.cpp import run
    elif name == "openpi":
        from bench.openpi import run
    elif name == "scaling":
        from bench.scaling import run_scaling as run
    elif name == "lifecycle":
        from bench.scaling import run_lifecycle as run
    elif name == "collectives":
        from bench.collectives import run
    elif name == "llm":
        from bench.generation import run
    elif name == "gpu":
        from bench.gpu import run
    else:  # pragma: no cover - parse_args checks the names
        raise ValueError(name)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run phyrt's benchmarks side by side with their floors and peers (bare ZMQ, OS pipe, pickle "
                    "over ZMQ, msgpack-numpy over websocket, openpi's client, Ray actors, transformers.generate) and "
                    "write a Markdown report (medians, p99, ratios against baselines measured in the same run, targets "
                    "met or missed) with PNG plots. The peers need the bench extra: pip install -e '.[bench]'; "
                    "a peer that is missing gets a 'not available' row instead of failing the run.",
        epilog="sections: " + ", ".join(SECTIONS) + ". Read the ratios, not absolute times: other load on the "
               "machine moves those. Exit status 1 if a section failed or the run left a process, a /dev/shm "
               "name or a file behind.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations and shorter runs: under 3 minutes on 2 idle cores")
    parser.add_argument("--only", metavar="NAMES", default=None,
                        help=f"comma-separated sections to run, in the default order (from: {', '.join(SECTIONS)})")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where latest.md, latest.json and the plots go (default: $XDG_CACHE_HOME/phyrt/bench, "
                             "i.e. ~/.cache/phyrt/bench, outside the checkout; --out bench/results refreshes the "
                             "committed report)")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out) if args.out else default_out()
    if args.only is None:
        args.sections = list(SECTIONS)
    else:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in SECTIONS]
        if unknown or not names:
            parser.error(f"--only: unknown section(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SECTIONS)}")
        args.sections = [n for n in SECTIONS if n in names]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import shutil
    import tempfile
    import time
    import traceback

    from bench import plots, report
    from bench.common import Progress, RunContext, Section, leftovers, machine_info

    progress = Progress()
    started = time.monotonic()
    machine = machine_info()
    workdir = tempfile.mkdtemp(prefix="phyrt-bench-all-")  # mode 0700: sockets, run directories, checkpoints
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, workdir  # engines' run directories go here too
    ctx = RunContext(quick=args.quick, progress=progress, workdir=workdir, out_dir=args.out, pids={os.getpid()})
    os.makedirs(args.out, exist_ok=True)
    sections: list[Section] = []
    failed = False
    try:
        for name in args.sections:
            progress(f"== {name}: start")
            t0 = time.monotonic()
            try:
                section = _runner(name)(ctx)
            except Exception:  # noqa: BLE001 - one failed section must not lose the others
                failed = True
                section = Section(name, f"{name} (failed)", error=traceback.format_exc(limit=8))
                progress(f"== {name}: FAILED: {traceback.format_exc(limit=1).strip().splitlines()[-1]}")
            section.seconds = time.monotonic() - t0
            try:
                plots.draw(section, args.out)
            except Exception as exc:  # noqa: BLE001 - a plot that fails is a note, not a lost section
                section.notes.append(f"plot not drawn: {type(exc).__name__}: {exc}")
            sections.append(section)
            progress(f"== {name}: done in {section.seconds:.1f} s")
    finally:
        tempfile.tempdir = saved_tempdir
        left = leftovers(workdir, ctx.pids)
        shutil.rmtree(workdir, ignore_errors=True)
    machine["load_end"] = [round(x, 2) for x in os.getloadavg()]
    cleanup = ("No child process, no /dev/shm name of this run's processes, no socket file or run directory "
               "left behind." if not left else "WARNING, left behind: " + "; ".join(left))
    command = "python -m bench" + (" --quick" if args.quick else "") + (
        f" --only {','.join(args.sections)}" if args.only else "")
    run = {"command": command, "wall_s": time.monotonic() - started, "machine": machine, "cleanup": cleanup}
    path = report.write(args.out, run, sections)
    for s in sections:
        for t in s.targets:
            progress(f"target [{s.name}] {t.name}: {t.figure}: {t.verdict.strip('*')}")
    progress(f"report: {path} ({run['wall_s']:.0f} s in all)")
    if left:
        print(f"bench: {cleanup}", file=sys.stderr)
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
