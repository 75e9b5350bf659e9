"""Every GPU check in one command, for a machine with at least one CUDA device:

    pip install -e '.[test]'         # or, offline: pip install --no-deps --no-build-isolation -e .
    python tests/gpu/run_all.py      # one verdict line per check; exits 1 on a failure

1. ``check_cuda.py``: qwen3 on CUDA equal to transformers (inline; tp=2 over NCCL with two GPUs),
   CUDA graphs, device pinning, CUDA-IPC requests and results (its own lines, passed through).
2. ``runtime.launch --model DIR --dtype bfloat16 --device cuda``: the ready line and ``info()`` say
   bfloat16 on cuda, and a client's greedy ids equal an in-process bfloat16 engine's.
3. pytest with CUDA visible over the files whose behaviour depends on the device (a CUDA tensor's
   second trip in both directions is tests/test_cuda_trips.py): one line per file.

Sized to finish in under 8 minutes on one GPU (the issue's budget; not yet timed there). Every
line starts with ``ok``, ``FAIL`` or ``skip``; the last one counts them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import signal
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

#: the pytest files whose expectations depend on the device torch sees
DEVICE_SENSITIVE = (
    "test_cuda_trips.py", "test_wire.py", "test_engine_inline.py", "test_policy.py", "test_own_policy.py",
    "test_qwen3_plugin.py", "test_qwen3_static_decode.py", "test_llm_stream.py", "test_local_groups.py",
    "test_local_lifecycle.py", "test_launch.py", "test_examples.py", "test_openpi.py", "test_server.py",
    "test_ros_example.py", "test_batching.py", "test_batching_helpers.py", "test_priority_wire.py",
)
VERDICTS: dict[str, list[str]] = {"ok": [], "FAIL": [], "skip": []}


def verdict(kind: str, name: str, detail: str = "") -> None:
    print(f"{kind:<4} {name} {detail}".rstrip(), flush=True)
    VERDICTS[kind].append(name)


def run_check_cuda() -> None:
    """check_cuda.py's own verdict lines, passed through; its exit status is this step's verdict."""
    proc = subprocess.run([sys.executable, "tests/gpu/check_cuda.py"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    print(proc.stdout, end="", flush=True)
    verdict("ok" if proc.returncode == 0 else "FAIL", "check_cuda.py", f"(exit status {proc.returncode})")


def run_launch_bf16() -> None:
    """bf16 qwen3 served by runtime.launch: the dtype reaches the ready line, info() and the tokens."""
    import torch

    from examples.make_tiny_qwen3 import make_checkpoint
    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
    from runtime.client import Client

    request = {"prompt_token_ids": [[7, 3, 9], [1, 2, 3, 4, 5, 6, 7, 8]], "max_tokens": 12}
    with tempfile.TemporaryDirectory() as model:
        make_checkpoint(Path(model), layers=2)  # saved in float32: bfloat16 is the command line's choice
        config = EngineConfig(device=DeviceConfig(target="cuda", params_dtype=torch.bfloat16))
        with Engine(EngineArgs("qwen3", {"model": model}, config)) as engine:
            want = engine.step(request, timeout=120)["token_ids"]
        proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "--model", model, "--dtype", "bfloat16",
                                 "--device", "cuda"], cwd=ROOT, text=True, stdout=subprocess.PIPE)
        watchdog = threading.Timer(240, proc.kill)  # a start that hangs: readline returns "" once it is killed
        watchdog.start()
        try:
            line = proc.stdout.readline()
            fields = dict(kv.split("=", 1) for kv in line.split()[2:])
            verdict("ok" if fields.get("dtype") == "bfloat16" and fields.get("device") == "cuda" else "FAIL",
                    "launch --dtype bfloat16: ready line", line.strip())
            with Client(fields["address"]) as client:
                info, got = client.info(), client.call(request, timeout=120)["token_ids"]
            verdict("ok" if info.get("dtype") == "bfloat16" else "FAIL", "launch --dtype bfloat16: info()",
                    f"dtype={info.get('dtype')}")
            verdict("ok" if got == want else "FAIL", "launch --dtype bfloat16: greedy ids equal the API's bf16 engine",
                    f"{got} vs {want}" if got != want else "")
        finally:
            watchdog.cancel()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(60)
        verdict("ok" if code == 0 else "FAIL", "launch --dtype bfloat16: SIGINT exits 0", f"(exit status {code})")


def run_pytest(files: tuple[str, ...]) -> None:
    """One pytest run over ``files``; a verdict line per file from its junit report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *(f"tests/{f}" for f in files)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=420)
        counts = {f: {"passed": 0, "failed": [], "skipped": 0} for f in files}
        for case in ET.parse(report).iter("testcase") if report.exists() else ():
            parts = case.get("classname", "").split(".")  # tests.test_x[.Class]
            name = (parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[-1]) + ".py"
            kind = ("failed" if case.find("failure") is not None or case.find("error") is not None
                    else "skipped" if case.find("skipped") is not None else "passed")
            entry = counts.setdefault(name, {"passed": 0, "failed": [], "skipped": 0})
            if kind == "failed":
                entry["failed"].append(case.get("name"))
            else:
                entry[kind] += 1
    for name, c in counts.items():
        detail = f"{c['passed']} passed, {c['skipped']} skipped" + (f", failed: {c['failed']}" if c["failed"] else "")
        kind = "FAIL" if c["failed"] else ("ok" if c["passed"] else "skip")
        verdict(kind, f"pytest tests/{name}", detail)
    if proc.returncode not in (0, 1):  # 1: tests failed (counted above); else pytest itself broke
        print(proc.stdout[-4000:])
        verdict("FAIL", "pytest run", f"(exit status {proc.returncode}, {time.monotonic() - started:.0f} s)")
    elif any(c["failed"] for c in counts.values()):
        print(proc.stdout[-6000:])


def main() -> int:
    import torch

    started = time.monotonic()
    if not torch.cuda.is_available():
        verdict("skip", "every check:", f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})")
    elif not metadata.entry_points(group="phyrt.plugins"):
        verdict("FAIL", "phyrt is not installed", "(its plugins are entry points): pip install --no-deps "
                "--no-build-isolation -e .")
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        for name, step in (("check_cuda.py", run_check_cuda), ("launch --dtype bfloat16", run_launch_bf16),
                           ("pytest", lambda: run_pytest(DEVICE_SENSITIVE))):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - that step's FAIL line; the others still run
                verdict("FAIL", name, f"{type(exc).__name__}: {exc}")
    failed = f" {VERDICTS['FAIL']}" if VERDICTS["FAIL"] else ""
    print(f"{len(VERDICTS['ok'])} ok, {len(VERDICTS['FAIL'])} failed{failed}, {len(VERDICTS['skip'])} skipped; "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return 1 if VERDICTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
