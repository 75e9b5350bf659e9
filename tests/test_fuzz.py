"""Property tests (hypothesis, bounded) for every decoder that reads another process's
bytes: only ``ProtocolError`` may come out, nothing else, and nothing hangs.

    property                                                   target (bench/fuzz.py)
    a rank's inbox and control decoding, with a real           decode_worker
      ShmMapper and forged shared-memory references
    the supervisor's decoding of a rank's messages             decode_supervisor
    the server's header and tensor-frame decoding, with        decode_server
      the segments a client registered
    the client's decoding of replies                           decode_client
    the server's whole message handling (Server._handle        ServerHandle.feed
      over an inline engine): every message gets exactly one
      typed reply (a well-formed release none: the protocol's
      one message without a reply), never an exception out of
      the I/O thread's step

Forged references point at a live segment of the run (offsets at, past, before its end,
misaligned, huge), at another run's live segment, at names of the run that do not exist,
and at decoys in /dev/shm named like segments of the run: a symlink to a live segment,
a directory, a FIFO (an open() that blocks would hang) and an empty file.

Every example runs under ``bench.fuzz.no_hang`` (SIGALRM): past ``HANG_S`` it fails as a
hang. ``tests/test_wire.py`` fuzzes the wire codec without shared memory; this module
adds the rest. ``python -m bench.fuzz --minutes N`` runs the same targets for longer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import (DTYPES, EDGE_INTS, BadReply, FuzzContext, Inputs, ServerHandle, check_reply, decode_client,
                        decode_server, decode_supervisor, decode_worker, no_hang, reply_fields, run_target)
from runtime.link.client_protocol import ERROR_TYPES
from runtime.transport import protocol, wire
from tests.conftest import wait_until

pytestmark = [pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]
HANG_S = 5.0
_HYPO = settings(max_examples=300, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def ctx():
    context = FuzzContext()
    yield context
    context.close()


class CountingHandle(ServerHandle):
    """``ServerHandle`` that also keeps every reply the server sent, in order (``sent``)."""

    def __init__(self, ctx: FuzzContext) -> None:
        self.sent: list[dict] = []
        super().__init__(ctx)

    def _capture(self, identity: bytes, header: dict | bytes, frames: Any = ()) -> bool:
        self.sent.append(reply_fields(header))
        return super()._capture(identity, header, frames)


@pytest.fixture(scope="module")
def handle(ctx):
    server = CountingHandle(ctx)
    yield server
    server.settle()
    server.close()


# --------------------------------------------------------------------------- strategies


class Name(int):
    """A placeholder for ``ctx.names[i]``: segment names exist only once the fixture ran."""


class Ext:
    """A placeholder extension, packed once its names are known."""

    def __init__(self, code: int, body: Any) -> None:
        self.code, self.body = code, body


def realize(obj: Any, ctx: FuzzContext) -> Any:
    if isinstance(obj, Name):
        return ctx.names[int(obj) % len(ctx.names)]
    if isinstance(obj, Ext):
        body = obj.body if isinstance(obj.body, bytes) else msgpack.packb(realize(obj.body, ctx), use_bin_type=True)
        return msgpack.ExtType(obj.code, body)
    if isinstance(obj, list):
        return [realize(x, ctx) for x in obj]
    if isinstance(obj, dict):
        return {k: realize(v, ctx) for k, v in obj.items()}
    return obj


names = st.integers(0, 200).map(Name)
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.sampled_from(EDGE_INTS)
           | st.floats() | st.text(max_size=8) | st.binary(max_size=16)
           | st.sampled_from(["request", "free", "shutdown", "done", "ready", "submit", "register", *DTYPES]))
dtypes = st.sampled_from(DTYPES) | st.sampled_from(["complex64", "object", ""]) | scalars
dims = (st.lists(st.integers(-2, 5) | st.sampled_from([1024, 2**40, 2**44, 2**45, True, 1.5]), max_size=5)
        | st.sampled_from([[1] * 17, "3", None, {}]))
offsets = st.sampled_from([0, 2, 4, 8, 64, 4096, 65532, 65536, 65600, 2**40, 2**63 - 1, -4, True, None]) \
    | st.integers(-8, 1 << 17)
segment_fields = {"segment": names | scalars, "offset": offsets, "nbytes": st.integers(-1, 1 << 17) | offsets,
                  "dtype": dtypes, "shape": dims}
wire_descriptors = st.one_of(
    st.tuples(dtypes, dims, st.binary(max_size=64) | scalars).map(list).map(lambda b: Ext(wire.EXT_INLINE, b)),
    st.fixed_dictionaries(segment_fields, optional={"extra": scalars}).map(lambda b: Ext(wire.EXT_SHM, b)),
    st.fixed_dictionaries(dict.fromkeys(["size", "stride", "offset", "dtype", "device", "handle",
                                         "storage_size_bytes", "storage_offset_bytes", "requires_grad",
                                         "ref_counter_handle", "ref_counter_offset", "event_handle",
                                         "event_sync_required"], scalars | dims))
    .map(lambda b: Ext(wire.EXT_CUDA_IPC, b)),
    st.tuples(st.integers(0, 127), st.binary(max_size=24)).map(lambda t: Ext(*t)),
)
frame_refs = st.one_of(
    st.tuples(dtypes, dims, st.integers(-1, 4) | scalars).map(list).map(lambda b: Ext(protocol.EXT_FRAME, b)),
    st.tuples(names | scalars, offsets, dtypes, dims).map(list).map(lambda b: Ext(protocol.EXT_SHM, b)),
    st.tuples(st.integers(0, 127), st.binary(max_size=24)).map(lambda t: Ext(*t)),
)


def objects(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(scalars | leaves, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6) | st.sampled_from(["x", "v", "obs"]), inner, max_size=4),
                        max_leaves=12)


wire_objects = objects(wire_descriptors)
wire_messages = st.fixed_dictionaries(
    {"v": st.just(1) | scalars,
     "type": st.sampled_from(["request", "free", "shutdown", "ready", "done", "startup_error"]) | scalars,
     "id": st.integers(0, 9) | scalars},
    optional={"payload": wire_objects, "blocks": st.lists(st.lists(names | scalars, max_size=3), max_size=3)
              | wire_objects, "segments": st.lists(names | scalars, max_size=3), "ok": scalars,
              "result": wire_objects})
frame_objects = objects(frame_refs)
ids = st.integers(0, 2**64 - 1) | st.text(max_size=130) | scalars
OPS = ["submit", "cancel", "ping", "info", "register", "release"]
server_messages = st.fixed_dictionaries(
    {"v": st.just(1) | scalars, "op": st.sampled_from(OPS) | scalars, "id": ids},
    optional={"payload": frame_objects, "timeout_s": st.floats() | scalars, "shm_results": scalars,
              "priority": scalars | st.integers(-(2**31) - 1, 2**31),
              "run_id": scalars | st.sampled_from(["", "abcd", "0" * 33]), "segments": st.lists(names | scalars,
                                                                                                   max_size=70),
              "pid": scalars, "blocks": st.lists(st.lists(names | scalars, max_size=3), max_size=4) | scalars,
              "target": ids, "extra": scalars})
#: well-formed headers without tensor frames: each op's own handling is reached (a ping is answered ok)
plain_messages = st.fixed_dictionaries({"v": st.just(1), "op": st.sampled_from(OPS), "id": st.integers(0, 2**64 - 1)},
                                       optional={"blocks": st.just([]), "target": st.integers(0, 9)})
reply_messages = st.fixed_dictionaries(
    {"v": st.just(1) | scalars, "op": st.sampled_from(OPS + ["inputs_done"]) | scalars, "id": ids},
    optional={"ok": st.booleans() | scalars, "result": frame_objects, "inputs_held": scalars,
              "error": st.fixed_dictionaries({"type": st.sampled_from(list(ERROR_TYPES)) | scalars,
                                              "message": scalars}) | scalars})
tensor_frames = st.lists(st.binary(max_size=64) | st.sampled_from([b"", b"\0" * 4096]), max_size=4)


def packed(message: dict, ctx: FuzzContext) -> bytes:
    return msgpack.packb(realize(message, ctx), use_bin_type=True)


# --------------------------------------------------------------------------- the ranks' and the supervisor's decoding


@_HYPO
@given(wire_messages)
def test_a_ranks_decoding_of_forged_messages_raises_only_protocol_error(ctx, message):
    run_target(decode_worker, ctx, packed(message, ctx), HANG_S)


@_HYPO
@given(wire_messages)
def test_the_supervisors_decoding_of_forged_messages_raises_only_protocol_error(ctx, message):
    run_target(decode_supervisor, ctx, packed(message, ctx), HANG_S)


@_HYPO
@given(st.data())
def test_mutated_valid_messages_raise_only_protocol_error_in_every_decoder(ctx, data):
    inputs = Inputs(ctx, data.draw(st.integers(0, 2**32), label="seed"))
    seeds = inputs.wire_seeds
    good = seeds[data.draw(st.integers(0, len(seeds) - 1), label="message")]
    donor = seeds[data.draw(st.integers(0, len(seeds) - 1), label="donor")]
    pos = data.draw(st.integers(0, len(good)), label="at")
    cut = data.draw(st.integers(0, len(donor)), label="cut")
    patch = data.draw(st.binary(max_size=8), label="patch")
    mutated = good[:pos] + patch + donor[cut:]
    for target in (decode_worker, decode_supervisor):
        run_target(target, ctx, mutated, HANG_S)


def test_the_decoys_and_the_forged_names_are_refused_with_protocol_errors(ctx):
    """The shared-memory references the strategies draw from, each one checked by name."""
    mapper_names = [n for n in ctx.names if n.startswith(f"phyrt-{ctx.run_id}-")]
    assert len(mapper_names) >= 5  # the live segment, four decoys, missing names
    for name in ctx.names:
        body = {"segment": name, "offset": 0, "nbytes": 4, "dtype": "float32", "shape": [1]}
        data = msgpack.packb({"v": 1, "type": "request", "id": 1,
                              "payload": msgpack.ExtType(wire.EXT_SHM, msgpack.packb(body))})
        decoded = run_target(decode_worker, ctx, data, HANG_S)
        assert decoded == (name == ctx.segment), name  # only the live segment of the run maps


# --------------------------------------------------------------------------- the server and the client


@_HYPO
@given(server_messages, tensor_frames)
def test_the_servers_header_and_frame_decoding_raises_only_protocol_error(ctx, message, frames):
    run_target(decode_server, ctx, [packed(message, ctx), *frames], HANG_S)


@_HYPO
@given(st.binary(max_size=200), tensor_frames)
def test_random_header_bytes_raise_only_protocol_error(ctx, header, frames):
    run_target(decode_server, ctx, [header, *frames], HANG_S)
    run_target(decode_client, ctx, [header, *frames], HANG_S)


@_HYPO
@given(reply_messages, tensor_frames)
def test_the_clients_reply_decoding_raises_only_protocol_error(ctx, message, frames):
    run_target(decode_client, ctx, [packed(message, ctx), *frames], HANG_S)


def _valid_id(value: Any) -> bool:
    """A request id as the protocol documents it: an int in [0, 2**64) or a str of 1 to 128 characters."""
    if isinstance(value, bool):
        return False
    return (0 <= value < 2**64) if isinstance(value, int) else isinstance(value, str) and 0 < len(value) <= 128


def replies_due(message: Any) -> int | None:
    """How many replies (``inputs_done`` notes aside) the server owes ``message``: 1, or 0 for a
    well-formed ``release`` (the protocol's one message without a reply); None when a random
    header decodes to a release-like map (0 or 1: which one depends on decoding details)."""
    if isinstance(message, bytes):
        try:
            decoded = msgpack.unpackb(message, raw=False)
        except Exception:  # noqa: BLE001 - not even msgpack: refused with a reply
            return 1
        return None if isinstance(decoded, dict) and decoded.get("op") == "release" else 1
    well_formed = (message.get("op") == "release" and message.get("v") == 1 and not isinstance(message.get("v"), bool)
                   and _valid_id(message.get("id")) and set(message) <= {"v", "op", "id", "blocks"})
    return 0 if well_formed else 1


def answers(handle: CountingHandle, frames: list[bytes], due: int | None) -> list[dict]:
    """Feed one message and let the engine finish it; the replies the server sent for it."""
    first = len(handle.sent)
    with no_hang(HANG_S):
        handle.feed(frames)  # BadReply on a reply outside the protocol
        handle.settle()
    if due and b"submit" in frames[0]:  # an engine thread sends a submit's reply a moment after
        wait_until(lambda: len(handle.sent) > first, 1.0, 0.002)  # it left the server's table
    return [r for r in handle.sent[first:] if not (isinstance(r, dict) and r.get("op") == "inputs_done")]


@settings(_HYPO, max_examples=150)
@given(st.tuples(server_messages | st.binary(max_size=100), tensor_frames) | st.tuples(plain_messages, st.just([])))
def test_the_server_answers_every_message_with_a_typed_reply(handle, ctx, message_and_frames):
    message, frames = message_and_frames
    header = message if isinstance(message, bytes) else packed(message, ctx)
    due = replies_due(message)
    replies = answers(handle, [header, *frames], due)
    if due is None:
        assert len(replies) <= 1, replies
        assert all(r.get("ok") is False for r in replies), replies  # a release is answered only to refuse it
    else:
        assert len(replies) == due, (due, replies)
    if isinstance(message, dict) and _valid_id(message.get("id")) and message.get("op") in OPS:
        assert all(r.get("id") in (None, message["id"]) for r in replies), replies


def test_every_op_gets_exactly_one_reply_and_a_release_none(handle, ctx):
    """The counting above, on one well-formed message of each op (and a malformed release)."""
    seeds = {"ping": {}, "info": {}, "cancel": {"target": 99}, "register": {"run_id": "", "segments": []},
             "submit": {"payload": {"x": 1}}, "release": {"blocks": []}}
    for i, (op, fields) in enumerate(seeds.items()):
        message = {"v": 1, "op": op, "id": 1000 + i, **fields}
        replies = answers(handle, [msgpack.packb(message)], replies_due(message))
        assert len(replies) == replies_due(message) == (0 if op == "release" else 1), (op, replies)
        assert all(r["id"] == message["id"] and r["op"] == op for r in replies), (op, replies)
    for bad in ({"v": 1, "op": "release", "id": -1, "blocks": []}, {"v": 1, "op": "release", "id": 7, "x": 1},
                {"v": 2, "op": "release", "id": 7}):
        replies = answers(handle, [msgpack.packb(bad)], replies_due(bad))
        assert len(replies) == replies_due(bad) == 1 and replies[0]["ok"] is False, (bad, replies)


def test_the_servers_replies_to_submits_are_checked_too(handle, ctx):
    """The fuzzed server answers valid submits once its engine is done (check_reply on each)."""
    for frames in Inputs(ctx, 0).frame_seeds[:2]:
        handle.feed(frames)
    handle.settle()
    assert handle.server.inflight == 0
    check_reply({"v": 1, "op": "submit", "id": 1, "ok": False, "error": {"type": "PluginError", "message": "m"}})
    with pytest.raises(BadReply):
        check_reply({"v": 1, "op": "submit", "id": 1, "ok": False,
                     "error": {"type": "PluginError", "message": 'Traceback (most recent call last):\n  File "x"'}})


# --------------------------------------------------------------------------- the long-run harness


@pytest.mark.timeout(180)
def test_bench_fuzz_reports_inputs_and_no_crash(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.fuzz", "--minutes", "0.1", "--seed", "7",
                          "--out", str(tmp_path / "failures")], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["crashes"] == 0 and report["hangs"] == 0, report
    assert report["inputs"] > 0 and all(n > 0 for n in report["per_target"].values()), report
    assert not (tmp_path / "failures").exists() or not list((tmp_path / "failures").iterdir())
