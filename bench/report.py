"""The Markdown report of ``python -m bench`` (and its JSON twin), from plain results.

``render(run, sections)`` is a pure function of its inputs (no clock, no I/O), so it can
be tested with made-up measurements; ``write(out_dir, run, sections)`` writes
``latest.md`` and ``latest.json`` there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from bench.common import Section, Table


_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(×| ms| s| µs)?$")


def _numeric(rows: list[list[str]], column: int) -> bool:
    """Right-align a column whose every cell is a number (or "-")"""
    cells = [str(row[column]) for row in rows if column < len(row)]
    cells = [c for c in cells if c and not c.startswith("not available")]
    return bool(cells) and all(c == "-" or _NUMBER.match(c) for c in cells)


def table_lines(table: Table) -> list[str]:
    """``table`` as Markdown lines: its title, its method, the table (numeric columns right-aligned)."""
    lines = [f"#### {table.title}", ""]
    for i, paragraph in enumerate(table.method):
        lines += [f"_Method._ {paragraph}" if i == 0 else paragraph, ""]
    lines.append("| " + " | ".join(table.headers) + " |")
    lines.append("|" + "|".join("---:" if _numeric(table.rows, i) else "---" for i in range(len(table.headers)))
                 + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return lines + [""]


def _machine(m: dict[str, Any]) -> list[str]:
    def load(key: str) -> str:
        value = m.get(key)
        return ", ".join(f"{x:.2f}" for x in value) if value else "not taken"

    cores = f"{m.get('logical_cores')} logical cores ({m.get('physical_cores')} physical"
    if m.get("affinity_cores") not in (None, m.get("logical_cores")):
        cores += f", {m['affinity_cores']} usable by this process"
    cores += ")"
    return [
        "## Machine",
        "",
        f"- date: {m.get('date')}; host `{m.get('host')}`; {m.get('platform')}",
        f"- CPU: {m.get('cpu_model')}, {cores}; memory {m.get('memory_gib')} GiB "
        f"({m.get('memory_available_gib')} GiB available at start); GPU: {m.get('cuda', 'none')}",
        f"- load average (1, 5, 15 min): {load('load_start')} at start; {load('load_end')} at the end",
        f"- software: Python {m.get('python')}, torch {m.get('torch')} ({m.get('torch_threads')} intra-op threads "
        f"in this process), pyzmq {m.get('pyzmq')} (libzmq {m.get('libzmq')}), msgpack {m.get('msgpack')}, "
        f"numpy {m.get('numpy')}, transformers {m.get('transformers')}, ray {m.get('ray')}, websockets "
        f"{m.get('websockets')}, matplotlib {m.get('matplotlib')}",
        "",
        "Every comparison in a table was measured in this one run, side by side (interleaved where the "
        "method says so), so that load from elsewhere lands on all paths alike: read the ratios; absolute "
        "times move with the machine and its load.",
        "",
    ]


def render(run: dict[str, Any], sections: list[Section]) -> str:
    """``run``: {"command", "wall_s", "machine", "cleanup"}; ``sections`` in run order."""
    lines = ["# phyrt benchmarks", "",
             f"`{run.get('command', 'python -m bench')}`: {len(sections)} section(s) in "
             f"{run.get('wall_s', 0.0):.0f} s wall time. Sections: "
             + ", ".join(f"{s.name} ({s.seconds:.0f} s)" for s in sections) + ".", ""]
    lines += _machine(run.get("machine", {}))
    lines += ["## Targets", "", "| section | target | measured | verdict |", "|---|---|---|---|"]
    any_target = False
    for s in sections:
        for t in s.targets:
            any_target = True
            lines.append(f"| {s.name} | {t.name} | {t.figure} | {t.verdict} |")
        if s.error:
            lines.append(f"| {s.name} | (every target of this section) | the section failed | not measured |")
    if not any_target and not any(s.error for s in sections):
        lines.append("| - | no section with targets ran | - | - |")
    lines.append("")
    for s in sections:
        lines += [f"## {s.title}", "", f"Section `{s.name}`, {s.seconds:.1f} s.", ""]
        if s.error:
            lines += ["**This section failed:**", "", "```", s.error.rstrip(), "```", ""]
        for note in s.notes:
            lines += [f"> {note}", ""]
        for table in s.tables:
            lines += table_lines(table)
        if s.targets:
            lines += ["| target | measured | verdict |", "|---|---|---|"]
            lines += [f"| {t.name} | {t.figure} | {t.verdict} |" for t in s.targets]
            lines.append("")
        for name, caption in s.plots:
            lines += [f"![{caption}]({name})", ""]
    lines += ["## Cleanup", "", run.get("cleanup", "not checked"), ""]
    return "\n".join(lines)


def to_json(run: dict[str, Any], sections: list[Section]) -> dict[str, Any]:
    return {**run, "sections": [dataclasses.asdict(s) for s in sections]}


def write(out_dir: str, run: dict[str, Any], sections: list[Section]) -> str:
    """Write ``latest.md`` and ``latest.json`` into ``out_dir``; returns the Markdown file's path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "latest.md")
    with open(path, "w") as f:
        f.write(render(run, sections))
    with open(os.path.join(out_dir, "latest.json"), "w") as f:
        json.dump(to_json(run, sections), f, indent=1, default=str)
    return path
