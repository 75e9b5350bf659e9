"""Streaming (issue 17, item 2 and 3): ``Engine.stream``, ``Client.stream``, ``AsyncClient.stream``.

The generic path with ``tests.stream_plugins:Ticker`` (a tiny stepped plugin) and a plugin
that does not stream; then ``qwen3`` on a tiny random checkpoint whose tokenizer (byte-level
BPE) was trained here on text with accents, CJK and emoji: chunks concatenate to the full
result (ids and text) inline and on tp=2; a stream left early frees its KV blocks (a
following request that needs the whole cache completes); many concurrent streams from
several clients; a killed rank ends every stream, in process and through the server, with
the typed error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import msgpack
import pytest

from runtime import Engine, EngineArgs, EngineUnavailableError
from runtime.client import AsyncClient, Client, ServerError
from runtime.serving.server import Server
from tests import stream_plugins
from tests.conftest import close_engine, group_pids, start_engine, tp_parallel, wait_until

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Le bras du robot 🤖 saisit le cube", "机器人手臂 👍", "Größer, schöner 🇫🇷"]
#: 8 blocks of 16 tokens: one sequence of up to 128 cached tokens fills the whole cache
BLOCKS, BLOCK_SIZE, FULL = 8, 16, 8 * 16 - 8 + 1


def joined(chunks: list[dict]) -> dict:
    """The chunks of a qwen3 stream put together as one result."""
    count = len(chunks[0]["token_ids"])
    out = {"token_ids": [[t for c in chunks for t in c["token_ids"][i]] for i in range(count)]}
    if "text" in chunks[0]:
        out["text"] = ["".join(c["text"][i] for c in chunks) for i in range(count)]
    out["finish_reasons"] = chunks[-1]["finish_reasons"]
    assert all("finish_reasons" not in c for c in chunks[:-1])
    return out


def text_request(max_tokens: int = 24, **extra) -> dict:
    return {"prompt": PROMPTS, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def full_length() -> dict:
    """A request whose sequence needs every KV block of the cache."""
    return {"prompt_token_ids": [5] * 8, "max_tokens": FULL, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from examples.make_tiny_qwen3 import make_checkpoint, train_tokenizer

    return make_checkpoint(tmp_path_factory.mktemp("stream") / "tiny", train_tokenizer())


def qwen3_args(model_dir: Path) -> dict:
    return {"model": str(model_dir), "kv_cache_blocks": BLOCKS, "block_size": BLOCK_SIZE}


@pytest.fixture(scope="module")
def inline(model_dir):
    with Engine(EngineArgs(plugin="qwen3", plugin_args=qwen3_args(model_dir))) as engine:
        yield engine


@pytest.fixture(scope="module")
def tp2(model_dir):
    engine = start_engine("qwen3", parallel=tp_parallel(2), plugin_args=qwen3_args(model_dir))
    yield engine
    close_engine(engine)


# -- the generic capability --------------------------------------------------------------------


def test_stepped_plugin_streams_chunks_and_a_plain_one_gives_its_result():
    with Engine(EngineArgs(plugin="tests.stream_plugins:Ticker")) as engine:
        chunks = list(engine.stream({"n": 4}))
        assert chunks == [{"items": [0]}, {"items": [1]}, {"items": [2]}, {"items": [3], "done": True}]
        assert engine.step({"n": 4}) == {"items": [0, 1, 2, 3], "done": True}  # not streamed: one result
        with pytest.raises(ValueError, match="ticker takes"):
            engine.stream({"n": 0})
    with Engine(EngineArgs(plugin="tests.plugins:Echo")) as engine:
        assert list(engine.stream({"x": 1})) == [{"x": 1}]


def test_leaving_a_stream_cancels_it_in_the_runner():
    with Engine(EngineArgs(plugin="tests.stream_plugins:Ticker")) as engine:
        for leave in ("break", "close", "timeout"):
            before = len(stream_plugins.cancelled)
            if leave == "timeout":
                with pytest.raises(TimeoutError):
                    for _ in engine.stream({"n": 10**6, "delay": 0.001}, timeout=0.2):
                        pass
            else:
                stream = engine.stream({"n": 10**6, "delay": 0.001})
                for chunk in stream:
                    if chunk["items"][0] == 3:
                        break
                if leave == "close":
                    stream.close()
                del stream  # "break": collected, which cancels it
            assert wait_until(lambda: len(stream_plugins.cancelled) == before + 1, 10), leave
            assert wait_until(lambda: engine.replicas[0].inflight == 0, 10), leave
        assert not stream_plugins.held


@pytest.mark.timeout(120)
def test_a_rank_death_ends_every_stream_of_a_generic_plugin():
    engine = start_engine("tests.stream_plugins:Ticker", parallel=tp_parallel(2))
    try:
        assert list(engine.stream({"n": 3})) == [{"items": [0]}, {"items": [1]}, {"items": [2], "done": True}]
        streams = [engine.stream({"n": 1000, "delay": 0.01, "die_at": 20 if i == 0 else None}) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineUnavailableError, match="rank 1 exited"):
                for _ in stream:
                    pass
    finally:
        close_engine(engine)


# -- qwen3 in process ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["inline", "tp2"])
def test_qwen3_chunks_concatenate_to_the_full_result(where, request):
    engine = request.getfixturevalue(where)
    full = engine.step(text_request())
    chunks = list(engine.stream(text_request()))
    # a chunk per step that gave the request ids: 24 or more (8 KV blocks hold 2 of the 3
    # sequences, so the third is preempted and recomputed meanwhile)
    assert len(chunks) >= 24 and all(any(ids for ids in c["token_ids"]) for c in chunks)
    assert joined(chunks) == full
    assert "text" in full and all(isinstance(t, str) for t in full["text"])
    ids = {"prompt_token_ids": [[3, 1, 4], [1, 5, 9, 2, 6]], "max_tokens": 9}  # token ids in, ids and text out
    assert joined(list(engine.stream(ids))) == engine.step(ids)


@pytest.mark.parametrize("where", ["inline", "tp2"])
def test_qwen3_cancel_mid_stream_frees_the_kv_blocks(where, request):
    engine = request.getfixturevalue(where)
    stream = engine.stream(full_length())
    for i, _ in enumerate(stream):
        if i == 20:
            break
    stream.close()
    # the cache holds one such sequence: it completes only if the cancelled one gave its blocks back
    result = engine.step(full_length(), timeout=120)
    assert result["finish_reasons"] == ["length"] and len(result["token_ids"][0]) == FULL
    if where == "inline":
        bm = engine._dispatcher.executors[0]._core.runner.scheduler.block_manager
        assert bm.num_free == bm.num_blocks


def test_qwen3_stream_that_ended_in_time_is_read_whole_after_its_deadline(inline):
    """``timeout`` bounds when a stream's chunks come, not when they are read: a generation that
    ended before its deadline is handed out whole after it, no ``TimeoutError``. (A deadline
    that a stream passes is tested with a plugin whose pace the test sets, not raced against
    the model's speed: ``tests/test_stream_deadline.py``.)"""
    request, deadline = text_request(4), 2.0
    want = inline.step(request)
    start = time.monotonic()
    stream = inline.stream(request, timeout=deadline)
    assert wait_until(stream.call.future.done, deadline / 2, 0.005), "4 tokens took over half the deadline"
    time.sleep(max(0.0, start + deadline - time.monotonic()) + 0.1)
    assert joined(list(stream)) == want


# -- through the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tp2, tmp_path_factory):
    """The tp=2 engine behind a server (its close closes the engine; ``tp2`` then checks leftovers)."""
    server = Server(tp2, f"ipc://{tmp_path_factory.mktemp('srv')}/s.sock").start()
    yield server
    server.close()


def test_client_streams_from_several_clients_at_once(served, tp2):
    want = tp2.step(text_request(16))
    results, errors = [], []

    def run(client: Client) -> None:
        try:
            for _ in range(2):
                results.append(joined(list(client.stream(text_request(16), timeout=120))))
        except BaseException as exc:  # reported below
            errors.append(exc)

    clients = [Client(served.address) for _ in range(3)]
    try:
        threads = [threading.Thread(target=run, args=(c,)) for c in clients for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
    finally:
        for c in clients:
            c.close()
    assert not errors and len(results) == 12
    assert all(r == want for r in results)


def test_async_client_stream_and_cancel(served, tp2):
    want = tp2.step(text_request(12))

    async def main():
        async with AsyncClient(served.address) as client:
            got = joined([c async for c in client.stream(text_request(12), timeout=120)])
            stream = client.stream(full_length())
            async for i, _ in _enumerate(stream):
                if i == 10:
                    break
            await stream.aclose()
            return got

    assert asyncio.run(main()) == want
    with Client(served.address) as client:
        assert client.call(full_length(), timeout=120)["finish_reasons"] == ["length"]
        assert wait_until(lambda: served.inflight == 0, 10)


async def _enumerate(stream):
    i = 0
    async for chunk in stream:
        yield i, chunk
        i += 1


def test_client_stream_of_a_bad_request_fails_typed(served):
    with Client(served.address) as client:
        with pytest.raises(ServerError, match="InvalidRequest|max_tokens"):
            list(client.stream({"prompt": "hi"}))


@pytest.mark.timeout(150)
def test_a_killed_rank_ends_every_stream_with_the_typed_error(model_dir, tmp_path):
    engine = start_engine("qwen3", parallel=tp_parallel(2), plugin_args=qwen3_args(model_dir))
    server = Server(engine, f"ipc://{tmp_path}/s.sock").start()
    errors: list[BaseException] = []
    try:
        long = {"prompt_token_ids": [[5] * 4, [6] * 4], "max_tokens": 100, "ignore_eos": True}
        local = [engine.stream(long) for _ in range(2)]
        clients = [Client(server.address) for _ in range(2)]
        remote = [c.stream(long, timeout=120) for c in clients]
        for stream in local + remote:
            next(stream)  # every stream is under way
        os.kill(group_pids(engine, 0)[1], signal.SIGKILL)
        for stream in local + remote:
            try:
                for _ in stream:
                    pass
            except BaseException as exc:
                errors.append(exc)
        for c in clients:
            c.close()
    finally:
        server.close()
    assert len(errors) == 4
    assert all(isinstance(e, EngineUnavailableError) and "rank 1" in str(e) for e in errors[:2])
    assert all(isinstance(e, ServerError) and "rank 1" in str(e) for e in errors[2:])


# -- the wire: flow control and order ---------------------------------------------------------------


def test_a_chunk_the_client_does_not_take_cancels_the_stream_with_overloaded():
    """The server keeps no chunk: one that cannot be sent (the client's queue is full) cancels the
    stream in the runner, and the stream's final reply is an Overloaded error."""
    from runtime.link.listener import Responder
    from runtime.serving.handlers import MessageHandler
    from runtime.transport.protocol import pack_header

    sent: list[dict] = []

    def send(identity: bytes, header: dict, frames=()) -> bool:
        if header.get("op") == "stream" and header.get("seq") == 2 and not header.get("final"):
            return False  # as ServerSocket.send answers for a peer whose queue is full
        sent.append(msgpack.unpackb(pack_header(header)))
        return True

    with Engine(EngineArgs(plugin="tests.stream_plugins:Ticker")) as engine:
        handler = MessageHandler(engine, Responder("ipc:///nonexistent/phyrt.sock", send))
        try:
            before = len(stream_plugins.cancelled)
            handler.handle(b"peer", [pack_header({"v": 1, "op": "stream", "id": 5,
                                                  "payload": {"n": 10**6, "delay": 0.001}})])
            assert wait_until(lambda: handler.inflight == 0, 20)
        finally:
            handler.close()
    assert len(stream_plugins.cancelled) == before + 1
    assert [m["seq"] for m in sent[:-1]] == [0, 1]
    assert sent[-1]["ok"] is False and sent[-1]["op"] == "stream" and sent[-1]["error"]["type"] == "Overloaded"


def test_the_client_ends_a_stream_whose_chunks_have_a_gap():
    from runtime.client import server_errors
    from runtime.client.client import ClientStream
    from runtime.link.awaited import Awaited, Request
    from runtime.link.current_session import CurrentSession
    from runtime.transport.protocol import pack_header

    replies = Awaited("ipc:///nonexistent", "numpy", CurrentSession(False, 0, list.append), server_errors)
    stream = ClientStream("ipc:///nonexistent", 5.0)
    future: Future = Future()
    replies.table.add(Request(3, future, "submit", time.monotonic(), stream=stream.state))
    stream.start(future, lambda: None)
    done: list = []
    for seq in (0, 2):  # chunk 1 went missing
        replies.handle(pack_header({"v": 1, "op": "stream", "id": 3, "ok": True, "result": {"x": seq}, "seq": seq}),
                       [], done)
    replies.complete(done)
    assert next(stream) == {"x": 0}
    with pytest.raises(ServerError, match="chunk 2 came where 1 was due"):
        next(stream)
    assert 3 not in replies.table
