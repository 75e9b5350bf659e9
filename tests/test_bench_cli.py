"""``python -m bench``: its command line and its report writer, from made-up measurements.

Only the cheap parts: no section is run and nothing is timed (the benchmarks themselves
are not tests). The plots are drawn only where matplotlib is installed (the bench extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.common import Section, Table, Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_the_options_and_sections():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("--quick", "--only", "--out", "bench/results", "latency", "compute", "batching", "openpi", "lifecycle", "gpu"):
        assert word in out.stdout


def test_io_batch_bench_has_help_and_restores_the_variable(monkeypatch):
    """``python -m bench.io_batch`` (run alone, not a section): its --help, and the setting it
    switches for each side put back as it was."""
    out = subprocess.run([sys.executable, "-m", "bench.io_batch", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "PHYRT_IO_BATCH" in out.stdout
    from bench.io_batch import io_batch

    monkeypatch.delenv("PHYRT_IO_BATCH", raising=False)
    with io_batch("1"):
        assert os.environ["PHYRT_IO_BATCH"] == "1"
    assert "PHYRT_IO_BATCH" not in os.environ
    monkeypatch.setenv("PHYRT_IO_BATCH", "0")
    with pytest.raises(RuntimeError), io_batch("1"):
        raise RuntimeError("a load failed")
    assert os.environ["PHYRT_IO_BATCH"] == "0"


def test_only_picks_sections_in_run_order_and_rejects_unknown_names(capsys):
    from bench.__main__ import SECTIONS, parse_args

    assert parse_args([]).sections == list(SECTIONS)
    assert parse_args(["--only", "llm, latency"]).sections == ["latency", "llm"]
    with pytest.raises(SystemExit):
        parse_args(["--only", "latency,warp-drive"])
    assert "warp-drive" in capsys.readouterr().err


def _committed_report() -> dict[str, tuple[int, bytes]]:
    """bench/results as it is on disk: each file's mtime and bytes."""
    folder = os.path.join(ROOT, "bench", "results")
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            files[name] = (os.stat(path).st_mtime_ns, f.read())
    return files


def _git_status(path: str) -> str | None:
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        return None
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
    except FileNotFoundError:  # no git on this machine: the byte-for-byte check still runs
        return None
    return out.stdout if out.returncode == 0 else None


@pytest.mark.timeout(120)
def test_a_run_without_out_writes_outside_the_checkout_and_leaves_the_committed_report(tmp_path):
    """``python -m bench`` with no ``--out`` (the gpu section alone: skipped in a second without
    CUDA) writes its report under $XDG_CACHE_HOME/phyrt/bench, says where, and leaves the committed
    bench/results byte for byte and ``git status`` as they were."""
    before, status = _committed_report(), _git_status("bench/results")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "bench", "--only", "gpu"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    report = tmp_path / "cache" / "phyrt" / "bench" / "latest.md"
    assert report.read_text().startswith("# phyrt benchmarks")
    assert (report.parent / "latest.json").exists()
    assert f"report: {report}" in out.stderr
    assert _committed_report() == before
    assert _git_status("bench/results") == status


def test_out_picks_the_report_directory_and_the_default_follows_xdg(monkeypatch, tmp_path):
    from bench.__main__ import parse_args

    monkeypatch.chdir(tmp_path)
    assert parse_args(["--out", "elsewhere"]).out == str(tmp_path / "elsewhere")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parse_args([]).out == str(tmp_path / "xdg" / "phyrt" / "bench")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: only an absolute path counts
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse_args([]).out == str(tmp_path / "home" / ".cache" / "phyrt" / "bench")


def fake_run() -> tuple[dict, list[Section]]:
    machine = {"date": "2030-01-01T00:00:00+00:00", "host": "box", "platform": "Linux", "cpu_model": "Test CPU",
               "logical_cores": 2, "physical_cores": 2, "memory_gib": 24.0, "memory_available_gib": 20.0,
               "load_start": [0.5, 0.4, 0.3], "load_end": [1.5, 0.9, 0.4], "python": "3.11", "torch": "2.13",
               "torch_threads": 2, "pyzmq": "27", "libzmq": "4.3", "msgpack": "1.1", "numpy": "2", "ray": "2.60",
               "websockets": "17", "transformers": "5", "matplotlib": "3.11", "cuda": "none"}
    latency = Section("latency", "Round-trip latency against payload size, per transport", seconds=12.5,
                      notes=["Ray actor (peer): not available: ray does not import (ModuleNotFoundError)"])
    latency.tables.append(Table("Small request (~100 B) round trip", ["path", "p50 µs", "p99 µs", "p50 / floor"],
                                [["bare ZMQ (floor)", "50.0", "90.0", "1.00×"],
                                 ["phyrt local engine, 1 rank", "70.0", "140", "1.40×"]],
                                ["500 warm-up, 5000 timed round trips in 5 interleaved rounds."]))
    latency.targets += [Target("local small p50 ≤ 1.5× bare ZMQ", "1.40× (70.0 µs / 50.0 µs)", True),
                        Target("64 MiB ≥ 10× faster than pickle", "8.0×", False)]
    latency.data = {"plot_sizes": {"small": 107, "1": 1 << 20, "64": 64 << 20},
                    "labels": {"zmq": "bare ZMQ (floor)", "local": "phyrt local engine, 1 rank"},
                    "p50_ns": {"small": {"zmq": 50e3, "local": 70e3}, "1": {"zmq": 1e6, "local": 0.8e6},
                               "64": {"zmq": 60e6, "local": 20e6}}}
    scaling = Section("scaling", "Throughput against replicas", seconds=8.0,
                      targets=[Target("2 replicas ≥ 1.8× 1 replica", "1.90×", True)],
                      data={"median": {"bare": 60.0, "1": 55.0, "2": 104.5}, "work_n": 48,
                            "rates": {"bare": [60.0], "1": [55.0], "2": [104.5]}})
    llm = Section("llm", "LLM decode: tokens per second against concurrency", seconds=20.0,
                  data={"levels": [1, 16], "median_tokens_per_s": [
                      {"path": "transformers, one call per request", "concurrency": 1, "tokens_per_s": 60.0},
                      {"path": "qwen3 tp=1 (inline engine)", "concurrency": 1, "tokens_per_s": 40.0},
                      {"path": "qwen3 tp=1 (inline engine)", "concurrency": 16, "tokens_per_s": 240.0}]})
    broken = Section("lifecycle", "lifecycle (failed)", error="Traceback ...\nRuntimeError: boom\n")
    gpu = Section("gpu", "GPU rows", notes=["Skipped: `torch.cuda.is_available()` is False on this machine"])
    run = {"command": "python -m bench --quick", "wall_s": 95.0, "machine": machine,
           "cleanup": "No child process left behind."}
    return run, [latency, scaling, llm, broken, gpu]


def test_report_has_machine_targets_sections_and_methods(tmp_path):
    from bench import report

    run, sections = fake_run()
    path = report.write(str(tmp_path), run, sections)
    text = open(path).read()
    assert path == str(tmp_path / "latest.md")
    assert text.startswith("# phyrt benchmarks")
    for heading in ("## Machine", "## Targets", "## Round-trip latency against payload size, per transport",
                    "## Throughput against replicas", "## GPU rows", "## Cleanup",
                    "#### Small request (~100 B) round trip"):
        assert f"\n{heading}\n" in text, heading
    assert "Test CPU, 2 logical cores" in text
    assert "0.50, 0.40, 0.30 at start; 1.50, 0.90, 0.40 at the end" in text
    assert "torch 2.13" in text and "pyzmq 27" in text and "2030-01-01" in text
    assert "| latency | local small p50 ≤ 1.5× bare ZMQ | 1.40× (70.0 µs / 50.0 µs) | met |" in text
    assert "| latency | 64 MiB ≥ 10× faster than pickle | 8.0× | **missed** |" in text
    assert "| lifecycle | (every target of this section) | the section failed | not measured |" in text
    assert "_Method._ 500 warm-up, 5000 timed round trips" in text
    assert "> Ray actor (peer): not available: ray does not import" in text
    assert "RuntimeError: boom" in text
    assert "| phyrt local engine, 1 rank | 70.0 | 140 | 1.40× |" in text
    assert "|---|---:|---:|---:|" in text  # numbers right-aligned, names left
    data = json.loads((tmp_path / "latest.json").read_text())
    assert [s["name"] for s in data["sections"]] == ["latency", "scaling", "llm", "lifecycle", "gpu"]
    assert data["machine"]["cpu_model"] == "Test CPU"


def test_plots_are_drawn_from_section_data(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots

    _, sections = fake_run()
    for section in sections:
        plots.draw(section, str(tmp_path))
    drawn = {name for s in sections for name, _ in s.plots}
    assert drawn == {"latency_vs_size.png", "throughput_vs_replicas.png", "llm_tokens_vs_concurrency.png"}
    for name in drawn:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openpi_section_ratios_target_and_missing_peer(tmp_path):
    """The openpi section from made-up samples: ratios against the floor and the client, the target's
    verdict, and 'not available' rows (no failure) when openpi_client is missing."""
    from bench import openpi, report

    us = lambda *values: [int(v * 1000) for v in values]  # noqa: E731 - samples are in ns
    measured = {"small": {openpi.DOOR: us(300, 300, 310), openpi.FLOOR: us(200, 200, 220),
                          openpi.CLIENT: us(150, 150, 160)},
                "image": {openpi.DOOR: us(2000), openpi.FLOOR: us(1000), openpi.CLIENT: us(800)}}
    section = openpi.build_section(measured, None, "made up")
    by_path = {(row[0], row[1]): row[2:] for row in section.tables[0].rows}
    small = openpi.OBSERVATIONS[0].title
    assert by_path[(small, openpi.DOOR)] == ["300", "310", "1.50×", "3"]
    assert section.tables[1].rows[0] == [small, "1.50×", "1.41×", "2.00×", "1.94×"]
    assert section.tables[1].rows[1][1:] == ["2.00×", "2.00×", "2.50×", "2.50×"]
    [target] = section.targets
    assert target.met is True and target.figure == "1.50× (300 µs / 200 µs)"
    assert section.data["p50_ns"]["image"][openpi.FLOOR] == 1e6

    missing = "not available: openpi_client does not import (No module named 'openpi_client')"
    section = openpi.build_section({"small": {openpi.CLIENT: us(150)}}, missing, "made up")
    rows = {row[1]: row[2:] for row in section.tables[0].rows}
    assert rows[openpi.DOOR][0] == rows[openpi.FLOOR][0] == missing
    assert rows[openpi.CLIENT][:2] == ["150", "150"]
    assert section.targets[0].met is None and section.tables[1].rows[0][1:] == ["n/a"] * 4
    text = report.render({"command": "python -m bench --only openpi"}, [section])
    assert "| openpi | openpi door small-observation p50 ≤ 1.5× the protocol's floor | not available" in text


def test_compute_section_counts_page_faults_of_another_process():
    """The compute section's fault counter reads a process's minor faults from /proc: a child
    that touches 8 MiB of fresh memory shows at least that many pages more."""
    import subprocess
    import sys

    from bench import compute

    child = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.readline(); "
                              "b = bytearray(8 << 20); b[::4096] = b'x' * len(b[::4096]); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, text=True)
    try:
        before = compute._rank_faults(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert wait_for(lambda: compute._rank_faults(child.pid) - before >= (8 << 20) // 4096, 20)
        assert compute._rank_faults(None) == 0
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(20)


def wait_for(check, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.mark.timeout(180)
def test_ab_serving_compares_two_checkouts_and_leaves_nothing(tmp_path):
    """``python -m bench.ab_serving``: this checkout against itself, one short round: both
    servers answer, each side's figures and the B/A ratios are printed, nothing is left; a
    directory without the client package is refused with a usage error."""
    out = subprocess.run([sys.executable, "-m", "bench.ab_serving", ROOT, ROOT, "--rounds", "1", "--seconds", "0.5",
                          "--clients", "1"], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| median")]
    assert len(rows) == 2, out.stdout
    cells = [cell.strip().strip("*") for cell in rows[0].strip("|").split("|")]
    assert all(float(cell.replace(",", "")) > 0 for cell in cells[1:]), cells  # rates, µs, ratios
    assert "nothing left behind" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.ab_serving", str(tmp_path), ROOT], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no runtime/client package" in bad.stderr


def test_soak_expects_the_servers_own_exit_status_for_no_replica_left():
    """``bench.soak`` keeps the client-only imports (no torch), so it names the server's exit
    status for "no replica can serve" itself: a server that stops that way is restarted, not
    counted as an unexpected exit, and the number must stay the one ``runtime.launch`` uses."""
    from bench import soak
    from runtime import launch

    assert soak.UNHEALTHY_EXIT == launch.EXIT_CANNOT_SERVE
    assert soak.UNHEALTHY_EXIT != launch.EXIT_STOPPED
