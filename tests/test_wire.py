"""The wire codec: round trips, shared-memory views across processes, and hostile input."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.transport import wire
from runtime.core.errors import ProtocolError
from runtime.transport.arena import SHM_DIR, ShmArena, ShmMapper, new_run_id
from runtime.transport.wire import (
    EXT_CUDA_IPC, EXT_INLINE, EXT_SHM, PROTOCOL_VERSION, TensorDecoder, TensorEncoder,
    pack_message, unpack_message,
)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
NUMPY = TensorDecoder(tensor_type="numpy")
TORCH_DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8,
                torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 1, 2)]
_issued: list[str] = []


def fresh_run_id() -> str:
    run_id = new_run_id()
    _issued.append(run_id)
    return run_id


def _phyrt_entries() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("phyrt-")}


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Entries of this test's runs must be gone afterwards (other suites may run concurrently)."""
    _issued.clear()
    before = _phyrt_entries()
    yield
    ours = tuple(f"phyrt-{r}-" for r in _issued)
    leaked = sorted(n for n in _phyrt_entries() - before if n.startswith(ours))
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"leaked shared-memory segments: {leaked}"


class Recording:
    """An allocator wrapper that remembers which blocks a message holds."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena, self.placed = arena, []

    def place(self, nbytes):
        seg, off, view = self.arena.place(nbytes)
        self.placed.append((seg, off, nbytes))
        return seg, off, view

    def free(self, seg, off):
        self.arena.free(seg, off)
        self.placed = [p for p in self.placed if p[:2] != (seg, off)]


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -100, 100, shape, dtype=dtype)


def roundtrip(decoder=None, encoder=None, **fields):
    return unpack_message(pack_message("t", 1, tensor_encoder=encoder, **fields), tensor_decoder=decoder)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=50)


# --------------------------------------------------------------------------- round trips


def test_header_round_trip():
    msg = unpack_message(pack_message("ready", "rank-0", rank=0), expected_types={"ready"})
    assert msg == {"v": PROTOCOL_VERSION, "type": "ready", "id": "rank-0", "rank": 0}


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_inline_torch_round_trip(dtype, shape):
    x = sample(dtype, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "buffer is not writable"
        y = roundtrip(x=x)["x"]
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
    if y.numel():
        y.view(-1)[0] = y.view(-1)[-1]  # writable, owned memory


@pytest.mark.parametrize("name", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_inline_numpy_round_trip(name, shape):
    x = sample(getattr(torch, name), shape).numpy()
    y = roundtrip(NUMPY, x=x)["x"]
    assert y.dtype == x.dtype and y.shape == x.shape and np.array_equal(y, x)
    assert y.flags.writeable
    t = roundtrip(x=x)["x"]  # numpy in, torch out
    assert torch.equal(t, torch.from_numpy(x))


def test_numpy_output_of_bfloat16_is_refused():
    with pytest.raises(ProtocolError, match="bfloat16"):
        roundtrip(NUMPY, x=torch.ones(3, dtype=torch.bfloat16))


def test_big_endian_numpy_is_sent_little_endian():
    x = np.arange(6, dtype=">i4").reshape(2, 3)
    assert np.array_equal(roundtrip(NUMPY, x=x)["x"], x)


@pytest.mark.parametrize("shm", [False, True])
def test_non_contiguous_inputs(shm):
    run_id = fresh_run_id()
    with ShmArena(run_id, 1 << 20) as arena, ShmMapper(run_id) as mapper:
        enc = TensorEncoder(allocator=arena, inline_threshold=0 if shm else 1 << 30)
        base = torch.arange(48, dtype=torch.float32).reshape(4, 12)
        cases = [base.t(), base[:, ::3], torch.ones(3, 1).expand(3, 5), base.numpy()[::2, ::-1]]
        got = roundtrip(TensorDecoder(mapper=mapper), enc, xs=cases)["xs"]
        for x, y in zip(cases, got):
            assert torch.equal(y, torch.as_tensor(np.ascontiguousarray(x)))
        del got


def test_nested_containers():
    obs = {"cam": torch.rand(2, 3), "joints": [np.arange(3), (torch.tensor(1.5), 7)]}
    info = {"ok": True, "n": None, "f": 0.25, "s": "x", "b": b"\x00", "np": np.int64(3), "npf": np.float32(2)}
    msg = roundtrip(obs=obs, info=info)
    assert torch.equal(msg["obs"]["cam"], obs["cam"])
    assert torch.equal(msg["obs"]["joints"][0], torch.arange(3))
    assert msg["obs"]["joints"][1][0].item() == 1.5 and msg["obs"]["joints"][1][1] == 7
    assert isinstance(msg["obs"]["joints"][1], list)  # tuples travel as lists
    assert msg["info"] == {"ok": True, "n": None, "f": 0.25, "s": "x", "b": b"\x00", "np": 3, "npf": 2.0}


def test_small_tensors_stay_inline_and_the_threshold_is_inclusive():
    run_id = fresh_run_id()
    with ShmArena(run_id, 1 << 20) as arena:
        rec = Recording(arena)
        enc = TensorEncoder(allocator=rec, inline_threshold=1024)
        pack_message("t", 1, tensor_encoder=enc, a=torch.zeros(255), b=torch.zeros(0))
        assert rec.placed == []
        pack_message("t", 2, tensor_encoder=enc, a=torch.zeros(256))
        assert [p[2] for p in rec.placed] == [1024]


def test_encode_failure_frees_the_blocks_it_placed():
    with ShmArena(fresh_run_id(), 1 << 20) as arena:
        rec = Recording(arena)
        enc = TensorEncoder(allocator=rec, inline_threshold=0)
        with pytest.raises(TypeError, match="cannot encode object"):
            pack_message("t", 1, tensor_encoder=enc, a=torch.zeros(100), b=object())
        assert rec.placed == []


@pytest.mark.parametrize("bad, error", [
    ({"x": torch.zeros(2, dtype=torch.complex64)}, TypeError),
    ({"x": np.zeros(2, dtype=np.uint32)}, TypeError),
    ({"x": {1: "non-str key"}}, TypeError),
    ({"x": {1, 2}}, TypeError),
    ({"type": "clash"}, ValueError),
    ({"x": torch.zeros(2).to_sparse()}, TypeError),
    ({"x": [{"y": {b"k": "bytes key"}}]}, TypeError),
    ({"x": {"y": msgpack.Timestamp(1, 0)}}, TypeError),
    ({"x": 2**64}, OverflowError),
])
def test_encode_rejects(bad, error):
    with pytest.raises(error):
        pack_message("t", 1, **bad)


def nested_lists(depth: int):
    x = 1
    for _ in range(depth):
        x = [x]
    return x


def nested_dicts(depth: int):
    x = 1
    for _ in range(depth):
        x = {"k": x}
    return x


@pytest.mark.parametrize("fields, error, match", [
    ({"a": {"b": [1, {1, 2}]}}, TypeError, r"^a\.b\[1\]: cannot encode set$"),
    ({"x": [np.zeros(2, np.uint32)]}, TypeError, r"^x\[0\]: dtype uint32 is not allowed"),
    ({"x": {"y": (torch.zeros(1, dtype=torch.complex64),)}}, TypeError, r"^x\.y\[0\]: dtype torch\.complex64"),
    ({"x": [{"y": {3: 0}}]}, TypeError, r"^x\[0\]\.y: map keys must be str, got 3$"),
    ({"x": [{"y": {b"k": 0}}]}, TypeError, r"^x\[0\]\.y: map keys must be str, got b'k'$"),
    ({"x": {"y": msgpack.Timestamp(1, 0)}}, TypeError, r"^x\.y: cannot encode Timestamp$"),
    ({"x": nested_lists(33)}, ValueError, r"^x(\[0\]){32}: nested deeper than 32 levels$"),
    ({"x": nested_dicts(33)}, ValueError, r"^x(\.k){32}: nested deeper than 32 levels$"),
    ({"x": [nested_dicts(32)]}, ValueError, r"^x\[0\](\.k){31}: nested deeper than 32 levels$"),
])
def test_encode_errors_name_where_the_value_sat(fields, error, match):
    with pytest.raises(error, match=match):
        pack_message("t", 1, **fields)


def test_nesting_up_to_the_limit_is_fine():
    assert roundtrip(x=nested_lists(32))["x"] == nested_lists(32)
    assert roundtrip(x=nested_dicts(32))["x"] == nested_dicts(32)


class Key(str):
    pass


@pytest.mark.parametrize("value, expected", [
    (collections.namedtuple("point", "a b")(1, [2]), [1, [2]]),
    (collections.OrderedDict(a=(1,)), {"a": [1]}),
    (memoryview(bytes(range(8)))[::2], bytes(range(0, 8, 2))),
    (bytearray(b"ba"), b"ba"),
    ({Key("s"): np.float64(0.5)}, {"s": 0.5}),
    ([np.bool_(True), np.uint64(2**64 - 1), np.float16(0.5)], [True, 2**64 - 1, 0.5]),
], ids=["namedtuple", "OrderedDict", "strided memoryview", "bytearray", "str subclass key", "numpy scalars"])
def test_subclasses_and_views_travel_as_their_plain_forms(value, expected):
    assert roundtrip(x=value)["x"] == expected
    assert roundtrip(x=[{"y": value}])["x"] == [{"y": expected}]


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65535, 65536, 70000])
def test_inline_payload_is_the_msgpack_of_dtype_shape_and_bytes(n):
    for x in (np.arange(n, dtype=np.uint8), np.ones((n, 2), dtype=np.float32)):
        ext = msgpack.unpackb(pack_message("t", 1, x=x))["x"]
        assert ext.code == EXT_INLINE
        assert ext.data == msgpack.packb([str(x.dtype), list(x.shape), x.tobytes()], use_bin_type=True)


@pytest.mark.parametrize("kind, id_", [("", 1), (3, 1), ("t", True), ("t", 1.5), ("t", None)])
def test_encode_rejects_bad_header(kind, id_):
    with pytest.raises(TypeError):
        pack_message(kind, id_)


def test_import_without_torch():
    r = run_python("import runtime.transport.wire, runtime.transport.arena, sys; assert 'torch' not in sys.modules")
    assert r.returncode == 0, r.stderr


def test_numpy_round_trip_in_a_torch_free_process():
    code = (
        "import sys, numpy as np\n"
        "from runtime.transport.wire import TensorDecoder, pack_message, unpack_message\n"
        "x = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
        "y = unpack_message(pack_message('t', 1, x=x), tensor_decoder=TensorDecoder(tensor_type='numpy'))['x']\n"
        "assert np.array_equal(x, y) and 'torch' not in sys.modules\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- shared memory

BIG = 16 << 20  # int32 elements: 64 MiB
_shm_free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
needs_room = pytest.mark.skipif(_shm_free < 256 << 20, reason="/dev/shm has under 256 MiB free (docker default?)")


@needs_room
def test_shm_round_trip_in_process_is_a_view():
    run_id = fresh_run_id()
    with ShmArena(run_id, 80 << 20) as arena, ShmMapper(run_id) as mapper, ShmMapper(run_id) as other:
        rec = Recording(arena)
        x = torch.arange(BIG, dtype=torch.int32)
        data = pack_message("t", 1, tensor_encoder=TensorEncoder(allocator=rec), x=x)
        assert len(data) < 512  # the bytes went to the arena, not into the message
        [(seg, off, nbytes)] = rec.placed
        y = unpack_message(data, tensor_decoder=TensorDecoder(mapper=mapper))["x"]
        z = unpack_message(data, tensor_decoder=TensorDecoder(mapper=mapper, tensor_type="numpy"))["x"]
        assert torch.equal(y, x) and np.array_equal(z, x.numpy())
        np.frombuffer(other.view(seg, off, nbytes), dtype=np.int32)[5] = -5  # write to the arena...
        assert y[5].item() == -5 and z[5] == -5  # ...and both views see it: no copy was made
        del y, z


_CHILD = r"""
import sys, torch
from runtime.transport.arena import ShmMapper
from runtime.transport.wire import TensorDecoder, unpack_message
with ShmMapper(sys.argv[1]) as mapper:
    t = unpack_message(open(sys.argv[2], "rb").read(), tensor_decoder=TensorDecoder(mapper=mapper))["x"]
    ok = torch.equal(t, torch.arange(t.numel(), dtype=torch.int32))
    t[0] = -7  # written through the view: the parent must see it
    del t
print("equal" if ok else "DIFFERENT", flush=True)
"""


@needs_room
def test_shm_round_trip_across_processes_is_a_view(tmp_path):
    run_id = fresh_run_id()
    with ShmArena(run_id, 80 << 20) as arena, ShmMapper(run_id) as mapper:
        x = torch.arange(BIG, dtype=torch.int32)
        data = pack_message("t", 1, tensor_encoder=TensorEncoder(allocator=arena), x=x)
        (tmp_path / "msg").write_bytes(data)
        r = run_python(_CHILD, run_id, str(tmp_path / "msg"))
        assert r.returncode == 0 and r.stdout.strip() == "equal", r.stderr
        y = unpack_message(data, tensor_decoder=TensorDecoder(mapper=mapper))["x"]
        assert y[0].item() == -7 and torch.equal(y[1:], x[1:])
        del y


# --------------------------------------------------------------------------- hostile input


def with_ext(code: int, body=None, raw: bytes | None = None) -> bytes:
    payload = raw if raw is not None else msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"v": 1, "type": "t", "id": 1, "x": msgpack.ExtType(code, payload)}, use_bin_type=True)


def header(**over) -> bytes:
    return msgpack.packb({"v": 1, "type": "t", "id": 1, **over}, use_bin_type=True)


GOOD = pack_message("t", 1, x=torch.ones(2))
MALFORMED = {
    "empty": b"",
    "not a map": msgpack.packb([1, "t", 1]),
    "missing id": msgpack.packb({"v": 1, "type": "t"}),
    "missing v": msgpack.packb({"type": "t", "id": 1}),
    "wrong version": header(v=2),
    "version as bool": header(v=True),
    "version as str": header(v="1"),
    "type not str": header(type=5),
    "empty type": header(type=""),
    "id bool": header(id=True),
    "id float": header(id=1.0),
    "id list": header(id=[1]),
    "trailing garbage": GOOD + b"\x00",
    "truncated": GOOD[:-1],
    "int key": b"\x84" + header()[1:] + b"\x01\x01",
    "bytes key": b"\x84" + header()[1:] + b"\xc4\x01k\x01",
    "nested bytes key": b"\x84" + header()[1:] + b"\xa1x\x81\xc4\x01k\x01",
    "duplicate key": b"\x84" + header()[1:] + b"\xa1v\x01",
    "invalid utf-8": header(type="t").replace(b"\xa1t", b"\xa1\xff"),
    "unknown ext": with_ext(9, ["uint8", [1], b"\x00"]),
    "ext not msgpack": with_ext(EXT_INLINE, raw=b"\xc1"),
    "deep nesting": b"\x91" * 100_000 + b"\x00",
    "nested duplicate key": b"\x84" + header()[1:] + b"\xa1x\x82\xa1a\x01\xa1a\x02",
    "duplicate key beside bin": b"\x85" + header()[1:] + b"\xa1b\xc4\x01z\xa1v\x01",
    "forged array length": b"\x84" + header()[1:] + b"\xa1x\xdd\xff\xff\xff\xff",
    "forged map length": b"\x84" + header()[1:] + b"\xa1x\xdf\xff\xff\xff\xff",
    "forged str length": b"\x84" + header()[1:] + b"\xa1x\xdb\xff\xff\xff\xff",
    "forged ext length": b"\x84" + header()[1:] + b"\xa1x\xc9\xff\xff\xff\xff\x01",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_messages(data):
    with pytest.raises(ProtocolError):
        unpack_message(data)


@pytest.mark.parametrize("buffer", [bytearray, memoryview])
@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_messages_in_other_buffers(data, buffer):
    with pytest.raises(ProtocolError):
        unpack_message(buffer(data))


@pytest.mark.parametrize("code", [b"\xdd", b"\xdf"])
def test_forged_lengths_are_bounded_by_the_frame(code):
    with pytest.raises(ProtocolError, match="exceeds max_"):  # refused before allocating 2**32 slots
        unpack_message(b"\x84" + header()[1:] + b"\xa1x" + code + b"\xff\xff\xff\xff")


@pytest.mark.parametrize("pad", [0, 100_000])  # small frames and large ones, which are checked differently
@pytest.mark.parametrize("buffer", [bytes, bytearray, memoryview])
def test_key_checks_hold_in_any_frame(pad, buffer):
    head = b"\x85" + header()[1:] + b"\xa3pad" + msgpack.packb("p" * pad)
    for tail, match in ((b"\xa1x\x81\xc4\x01k\x01", "must be str"), (b"\xa1x\x82\xa1a\x01\xa1a\x02", "duplicate"),
                        (b"\xa1x\x83\xa1a\x01\xa1b\xc4\x00\xa1a\x02", "duplicate")):
        with pytest.raises(ProtocolError, match=match):
            unpack_message(buffer(head + tail))
    assert unpack_message(buffer(head + b"\xa1x\x81\xa1k\xc4\x01b"))["x"] == {"k": b"b"}


def test_type_allow_list_and_size_limit_and_input_type():
    with pytest.raises(ProtocolError, match="unexpected message type"):
        unpack_message(GOOD, expected_types={"ready"})
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack_message(GOOD, max_bytes=len(GOOD) - 1)
    with pytest.raises(ProtocolError, match="must be bytes"):
        unpack_message("text")  # type: ignore[arg-type]
    assert unpack_message(memoryview(GOOD))["type"] == "t"


INLINE_BAD = {
    "dtype not allowed": ["complex64", [1], b"\x00" * 8],
    "dtype not str": [5, [1], b"\x00" * 4],
    "negative dim": ["uint8", [-1], b""],
    "bool dim": ["uint8", [True], b"\x00"],
    "float dim": ["uint8", [1.0], b"\x00"],
    "shape not list": ["uint8", "1", b"\x00"],
    "too many dims": ["uint8", [1] * 17, b"\x00"],
    "huge dims": ["uint8", [1 << 40, 1 << 40], b""],
    "bytes too short": ["float32", [2], b"\x00" * 7],
    "bytes too long": ["float32", [2], b"\x00" * 9],
    "data not bytes": ["uint8", [1], "x"],
    "two items": ["uint8", [1]],
    "bool not 0/1": ["bool", [2], b"\x00\x02"],
}


@pytest.mark.parametrize("body", INLINE_BAD.values(), ids=INLINE_BAD.keys())
def test_bad_inline_descriptors(body):
    with pytest.raises(ProtocolError):
        unpack_message(with_ext(EXT_INLINE, body))


def test_bad_shm_descriptors():
    run_id = fresh_run_id()
    with ShmArena(run_id, 4096) as arena, ShmMapper(run_id) as mapper:
        seg = arena.segments[0]
        foreign = seg.replace(run_id, "abcd" if run_id != "abcd" else "dcba")
        ok = {"segment": seg, "offset": 64, "nbytes": 16, "dtype": "float32", "shape": [4]}
        dec = TensorDecoder(mapper=mapper)
        assert unpack_message(with_ext(EXT_SHM, ok), tensor_decoder=dec)["x"].shape == (4,)
        cases = {
            "no mapper": ({}, "no mapper"), "dtype": ({"dtype": "float128"}, "not allowed"),
            "shape/bytes": ({"shape": [5]}, "needs 20 bytes"), "negative offset": ({"offset": -64}, ">= 0"),
            "offset beyond": ({"offset": 4096}, "past its end"), "straddles end": ({"offset": 4088}, "past its end"),
            "misaligned": ({"offset": 66}, "aligned"), "foreign run": ({"segment": foreign}, "another run"),
            "traversal": ({"segment": "../../etc/passwd"}, "not a phyrt segment"),
            "traversal in name": ({"segment": f"phyrt-{run_id}-1-1/../../x"}, "not a phyrt segment"),
            "absolute": ({"segment": f"/dev/shm/{seg}"}, "not a phyrt segment"),
            "unknown": ({"segment": f"phyrt-{run_id}-1-123456"}, "does not exist"),
            "segment not str": ({"segment": 7}, "must be a str"), "offset bool": ({"offset": True}, ">= 0"),
        }
        for name, (change, match) in cases.items():
            decoder = TensorDecoder() if name == "no mapper" else dec
            with pytest.raises(ProtocolError, match=match):
                unpack_message(with_ext(EXT_SHM, {**ok, **change}), tensor_decoder=decoder)
        for body in ({k: v for k, v in ok.items() if k != "shape"}, {**ok, "extra": 1}, [seg, 0]):
            with pytest.raises(ProtocolError, match="exactly the keys"):
                unpack_message(with_ext(EXT_SHM, body), tensor_decoder=dec)


CUDA_OK = {
    "size": [2, 3], "stride": [3, 1], "offset": 0, "dtype": "float32", "device": 0,
    "handle": b"\x01" * 64, "storage_size_bytes": 24, "storage_offset_bytes": 0,
    "requires_grad": False, "ref_counter_handle": b"\x02" * 16, "ref_counter_offset": 0,
    "event_handle": b"\x03" * 64, "event_sync_required": True,
}
CUDA_BAD = {
    "missing handle": ({"handle": ...}, "exactly the keys"), "extra key": ({"pickle": b""}, "exactly the keys"),
    "dtype": ({"dtype": "object"}, "not allowed"), "size type": ({"size": "2,3"}, "size"),
    "negative size": ({"size": [-2, 3]}, "size"), "stride length": ({"stride": [1]}, "stride"),
    "negative stride": ({"stride": [-3, 1]}, "stride"), "offset bool": ({"offset": True}, "'offset'"),
    "negative device": ({"device": -1}, "'device'"), "handle str": ({"handle": "abc"}, "'handle'"),
    "ref handle none": ({"ref_counter_handle": None}, "'ref_counter_handle'"),
    "event int": ({"event_handle": 3}, "'event_handle'"), "sync int": ({"event_sync_required": 1}, "bool"),
    "grad on int": ({"requires_grad": True, "dtype": "int32"}, "requires_grad"),
    "past storage": ({"storage_size_bytes": 20}, "past its storage"),
    "offset past storage": ({"offset": 1}, "past its storage"),
    "no handle but elements": ({"handle": None}, "past its storage"),
}


@pytest.mark.parametrize("change, match", CUDA_BAD.values(), ids=CUDA_BAD.keys())
def test_bad_cuda_descriptors(change, match):
    body = {k: v for k, v in {**CUDA_OK, **change}.items() if v is not ...}
    with pytest.raises(ProtocolError, match=match):
        unpack_message(with_ext(EXT_CUDA_IPC, body), tensor_decoder=TensorDecoder(allow_cuda_ipc=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_valid_cuda_descriptor_without_cuda():
    data = with_ext(EXT_CUDA_IPC, CUDA_OK)
    with pytest.raises(ProtocolError, match="does not allow CUDA IPC"):
        unpack_message(data)
    with pytest.raises(ProtocolError, match="CUDA is not available"):
        unpack_message(data, tensor_decoder=TensorDecoder(allow_cuda_ipc=True))


_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=8) | st.binary(max_size=16))
_dims = st.lists(st.integers(-2, 4) | st.booleans(), max_size=4)
_descriptors = st.one_of(
    st.tuples(st.sampled_from(["float32", "bool", "bfloat16", "x"]), _dims, st.binary(max_size=64)).map(list),
    st.fixed_dictionaries({"segment": st.text(max_size=30), "offset": st.integers(-10, 10**6),
                           "nbytes": st.integers(-10, 64), "dtype": st.just("uint8"), "shape": _dims}),
    st.fixed_dictionaries({k: (_scalars | _dims) for k in CUDA_OK}),
    _scalars,
)
_exts = st.builds(
    msgpack.ExtType, st.sampled_from([EXT_INLINE, EXT_SHM, EXT_CUDA_IPC, 0, 127]),
    _descriptors.map(lambda d: msgpack.packb(d, use_bin_type=True)) | st.binary(max_size=32),
)
_objects = st.recursive(_scalars | _exts, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=4) | st.integers(0, 9) | st.binary(max_size=2), c, max_size=4), max_leaves=16)
_messages = st.fixed_dictionaries(
    {"v": st.just(1) | _objects, "type": st.just("t") | _objects, "id": st.integers(0, 9) | _objects},
    optional={"x": _objects, "y": _objects},
)
_HYPO = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def feed(data: bytes) -> None:
    """unpack_message either returns a dict or raises ProtocolError, nothing else."""
    run_id = "0123abcd"
    with ShmMapper(run_id) as mapper:
        for tensor_type in ("torch", "numpy"):
            dec = TensorDecoder(mapper=mapper, tensor_type=tensor_type, allow_cuda_ipc=True)
            try:
                assert isinstance(unpack_message(data, expected_types={"t"}, tensor_decoder=dec), dict)
            except ProtocolError:
                pass


@_HYPO
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_error(data):
    feed(data)


@_HYPO
@given(_objects | _messages)
def test_random_msgpack_objects_raise_only_protocol_error(obj):
    feed(msgpack.packb(obj, use_bin_type=True))


@_HYPO
@given(st.data())
def test_mutated_valid_messages_raise_only_protocol_error(data):
    good = pack_message("t", 1, a=torch.ones(2, 3), b=[np.arange(3, dtype=np.int8), {"c": torch.zeros(1).bool()}])
    pos = data.draw(st.integers(0, len(good) - 1))
    mutated = good[:pos] + bytes([data.draw(st.integers(0, 255))]) + good[pos + 1:]
    feed(mutated)
    with pytest.raises(ProtocolError):
        unpack_message(good[:pos])  # every proper prefix is incomplete


def test_cuda_descriptor_carries_every_field_of_torchs_reduction(monkeypatch):
    """Without a GPU: what reduce_tensor returns is what rebuild_cuda_tensor gets back."""
    import torch.multiprocessing.reductions as reductions

    from runtime.transport import cuda_ipc

    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 1, torch.storage.TypedStorage, torch.float32, 0,
            b"\x01" * 64, 28, 512, False, b"\x02" * 16, 8, b"\x03" * 64, True)
    rebuilt = {}

    def fake_rebuild(*got):
        rebuilt["args"] = got
        return torch.zeros(2, 3)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake_rebuild)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ext = cuda_ipc.encode(torch.zeros(2, 3), "float32", torch)
    data = msgpack.packb({"v": 1, "type": "t", "id": 1, "x": ext}, use_bin_type=True)
    unpack_message(data, tensor_decoder=TensorDecoder(allow_cuda_ipc=True))
    assert list(rebuilt["args"]) == list(args)


def test_a_tensor_received_by_cuda_ipc_goes_on_as_one_copy(monkeypatch):
    """Without a GPU: torch refuses to share memory this process got from another (its own
    message); the encoder then shares one clone, and any other refusal still raises."""
    import torch.multiprocessing.reductions as reductions

    from runtime.transport import cuda_ipc

    received, fresh = torch.arange(6.0).reshape(2, 3), []
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.storage.TypedStorage, torch.float32, 0,
            b"\x01" * 64, 24, 0, False, b"\x02" * 16, 8, None, False)

    def reduce(t):
        if t is received:
            raise RuntimeError("Attempted to send CUDA tensor received from another process; this is not "
                               "currently supported. Consider cloning before sending.")
        fresh.append(t)
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setattr(reductions, "reduce_tensor", reduce)
    cuda_ipc.encode(received, "float32", torch)
    assert len(fresh) == 1 and fresh[0] is not received and torch.equal(fresh[0], received)
    assert fresh[0].data_ptr() != received.data_ptr()  # a copy, not a view of the refused memory

    def refuse(t):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(reductions, "reduce_tensor", refuse)
    with pytest.raises(RuntimeError, match="out of memory"):
        cuda_ipc.encode(received, "float32", torch)


_CUDA_CHILD = r"""
import sys, torch
from runtime.transport.wire import TensorDecoder, unpack_message
t = unpack_message(open(sys.argv[1], "rb").read(), tensor_decoder=TensorDecoder(allow_cuda_ipc=True))["x"]
ok = t.is_cuda and torch.equal(t.cpu(), torch.arange(12.0).reshape(3, 4)[:, 1:])
t.fill_(-1.0)  # through the IPC mapping: the parent's tensor changes
torch.cuda.synchronize()
print("equal" if ok else "DIFFERENT", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_round_trip_across_processes(tmp_path):
    x = torch.arange(12.0, device="cuda").reshape(3, 4)
    (tmp_path / "msg").write_bytes(pack_message("t", 1, x=x[:, 1:]))  # a strided view
    r = run_python(_CUDA_CHILD, str(tmp_path / "msg"))
    assert r.returncode == 0 and r.stdout.strip() == "equal", r.stderr
    assert torch.equal(x[:, 0].cpu(), torch.tensor([0.0, 4.0, 8.0])) and bool((x[:, 1:] == -1).all())


_plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.binary(max_size=8).map(bytearray) | st.integers(-(2**31), 2**31 - 1).map(np.int32)
    | st.floats(width=32).map(np.float32) | st.floats().map(np.float64) | st.booleans().map(np.bool_),
    lambda c: st.lists(c, max_size=4) | st.lists(c, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=4), c, max_size=4),
    max_leaves=20,
)


def normalized(x):
    if isinstance(x, dict):
        return {k: normalized(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [normalized(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return bytes(x) if isinstance(x, bytearray) else x


@_HYPO
@given(st.dictionaries(st.text(max_size=4).filter(lambda k: k not in ("v", "type", "id", "tensor_encoder")),
                       _plain_values, max_size=4))
def test_the_wire_is_the_msgpack_of_the_normalized_fields(fields):
    """Tuples become lists, numpy scalars Python numbers, bytearrays bytes; nothing else changes."""
    expected = {"v": PROTOCOL_VERSION, "type": "t", "id": 1, **normalized(fields)}
    assert pack_message("t", 1, **fields) == msgpack.packb(expected, use_bin_type=True)


@pytest.mark.parametrize("stamp", [msgpack.Timestamp(1, 0), msgpack.Timestamp(1, 5), msgpack.Timestamp(1 << 40, 7)])
def test_a_msgpack_timestamp_anywhere_is_refused(stamp):
    """msgpack decodes extension -1 itself (no ext_hook): the decoder must still refuse it."""
    for body in ({"t": stamp}, {"x": [1, {"y": [stamp]}]}):
        data = msgpack.packb({"v": wire.PROTOCOL_VERSION, "type": "submit", "id": 1, **body})
        with pytest.raises(ProtocolError, match="Timestamp"):
            wire.unpack_message(data)


@pytest.mark.parametrize("head", [b"\xc7\x04\xff", b"\xc8\x00\x04\xff", b"\xc9\x00\x00\x00\x04\xff"])
def test_a_timestamp_in_a_longer_ext_encoding_is_refused(head):
    """msgpack also reads ext 8/16/32 headers of 4 bytes with type -1 as a Timestamp."""
    data = msgpack.packb({"v": wire.PROTOCOL_VERSION, "type": "submit", "id": 1, "t": 0})[:-1] + head + b"\0\0\0\1"
    assert type(msgpack.unpackb(data)["t"]) is msgpack.Timestamp  # what the decoder must not let through
    with pytest.raises(ProtocolError, match="Timestamp"):
        wire.unpack_message(data)


def test_timestamp_like_bytes_inside_a_string_are_harmless():
    data = msgpack.packb({"v": wire.PROTOCOL_VERSION, "type": "submit", "id": 1, "s": "\xd6\xff", "b": b"\xd7\xff"})
    assert wire.unpack_message(data)["b"] == b"\xd7\xff"
