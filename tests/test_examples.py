"""Every example runs as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_inline_engine_example():
    out = subprocess.run([sys.executable, "examples/inline_engine.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "mode=inline actions (4, 8, 7) torch.float32" in out.stdout
    assert "100 requests in" in out.stdout


@pytest.mark.timeout(180)
def test_local_replicas_example_matches_inline():
    import socket

    with socket.socket() as s:  # a free pair of ports for the two replicas' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "examples/local_replicas.py", "--base-port", str(port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mode=local, 2 replicas x 2 ranks" in out.stdout
    assert "max |local - inline|" in out.stdout


@pytest.mark.timeout(240)
def test_tiny_qwen3_script_then_llm_client_streams_the_text_of_a_plain_call(tmp_path):
    """The LLM steps of README.md and docs/llm.md: make the tiny model, serve it, call it streamed and not."""
    from runtime.client import Client
    from tests.test_launch import Launched

    made = subprocess.run([sys.executable, "examples/make_tiny_qwen3.py", "--out", str(tmp_path / "tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    model = Path(made.stdout.strip())
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in model.iterdir()}
    server = Launched("--model", str(model), log_dir=tmp_path)
    try:
        chat = {"messages": [{"role": "user", "content": "Hello, robot 🤖"}], "max_tokens": 24}
        with Client(server.address) as client:
            want = {"--no-stream": client.call({"prompt": "Hello, robot 🤖", "max_tokens": 24}, timeout=60),
                    "--chat": client.call(chat, timeout=60)}
        for how, result in want.items():  # --chat streams
            out = subprocess.run([sys.executable, "examples/llm_client.py", "--address", server.address,
                                  "--max-tokens", "24", how, "Hello, robot 🤖"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            text, rest = out.stdout.rsplit("\n[finish: ", 1)
            assert text == result["text"][0] and rest.startswith(result["finish_reasons"][0] + ";")
            assert ("first text after" in rest) == (how == "--chat")
    finally:
        assert server.stop() == 0, server.log()
