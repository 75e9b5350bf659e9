"""PNG plots of ``python -m bench``'s sections (matplotlib, Agg backend: no display needed).

``draw(section, out_dir)`` draws what the section's data supports and records each file
in ``section.plots``; a section without a plot is left alone. Missing matplotlib is a
note in the report, not a failure.
"""

from __future__ import annotations

import os
from typing import Any

from bench.common import Section

#: one style per transport, so that the same path looks the same in every plot
_STYLE = {
    "inline": dict(color="tab:blue", marker="o"),
    "local": dict(color="tab:blue", marker="s", linestyle="--"),
    "zmq": dict(color="black", marker="^"),
    "pipe": dict(color="gray", marker="v"),
    "pickle": dict(color="tab:red", marker="x"),
    "websocket": dict(color="tab:orange", marker="D"),
    "ray": dict(color="tab:green", marker="P"),
    "memcpy": dict(color="gray", marker=".", linestyle=":"),
}


def draw(section: Section, out_dir: str) -> None:
    drawer = {"latency": latency_vs_size, "scaling": throughput_vs_replicas, "llm": tokens_vs_concurrency}.get(
        section.name)
    if drawer is None or not section.data:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        section.notes.append(f"plot not drawn: matplotlib does not import ({exc}); pip install -e '.[bench]'")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    try:
        name, caption = drawer(section.data, ax)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name))
        section.plots.append((name, caption))
    finally:
        plt.close(fig)


def latency_vs_size(data: dict[str, Any], ax: Any) -> tuple[str, str]:
    sizes = data["plot_sizes"]
    labels = data["labels"]
    for key, label in labels.items():
        xs, ys = [], []
        for size, nbytes in sizes.items():
            value = data["p50_ns"].get(size, {}).get(key)
            if value is not None:
                xs.append(nbytes)
                ys.append(value / 1e6)
        if xs:
            ax.plot(xs, ys, label=label, **_STYLE.get(key, {}))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("payload (bytes; ~100 B request, then 1, 16, 64 MiB float32 tensors)")
    ax.set_ylabel("round trip, median (ms)")
    ax.set_title("Round-trip latency against payload size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return "latency_vs_size.png", "Median round trip against payload size, per transport (log-log)"


def throughput_vs_replicas(data: dict[str, Any], ax: Any) -> tuple[str, str]:
    med = data["median"]
    replicas = [1, 2]
    rates = [med["1"], med["2"]]
    ax.plot(replicas, rates, marker="o", color="tab:blue", label="phyrt local, one-rank replicas (median)")
    for r, key in zip(replicas, ("1", "2")):
        ax.scatter([r] * len(data["rates"][key]), data["rates"][key], color="tab:blue", alpha=0.35, s=12)
    if "pool1" in med:
        ax.plot(replicas, [med["pool1"], med["pool2"]], marker="^", color="black",
                label="bare process pool, 1 and 2 processes (baseline)")
    ax.plot(replicas, [med["1"] * r for r in replicas], linestyle=":", color="gray", label="linear from 1 replica")
    ax.axhline(med["bare"], color="tab:red", linestyle="--", label="same work in one process, 1 thread (no runtime)")
    ax.set_xticks(replicas)
    ax.set_xlabel("replicas / processes (1 torch thread each)")
    ax.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput against replicas ({data['work_n']} matmuls of 256² per request)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return "throughput_vs_replicas.png", "Requests per second of a compute-bound plugin against replicas"


def tokens_vs_concurrency(data: dict[str, Any], ax: Any) -> tuple[str, str]:
    from bench.generation import HF_BATCH, HF_ONE

    by_path: dict[str, list[tuple[int, float]]] = {}
    for row in data["median_tokens_per_s"]:
        by_path.setdefault(row["path"], []).append((row["concurrency"], row["tokens_per_s"]))
    if HF_BATCH in by_path and HF_ONE in by_path:  # a batch of one prompt is one call per request
        by_path[HF_BATCH].append((1, by_path[HF_ONE][0][1]))
    levels = data["levels"]
    for path, points in sorted(by_path.items()):
        if path == HF_ONE:  # one call per request: the same rate at every concurrency
            ax.plot(levels, [points[0][1]] * len(levels), linestyle="--", color="tab:red", label=path)
            continue
        points.sort()
        style = dict(color="tab:orange", marker="x") if path.startswith("transformers") else dict(marker="o")
        ax.plot([c for c, _ in points], [r for _, r in points], label=path, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("LLM decode: tokens per second against concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return "llm_tokens_vs_concurrency.png", "Generated tokens per second against concurrency (qwen3 vs transformers)"
