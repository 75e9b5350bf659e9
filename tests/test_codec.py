"""The codec core both wires share (``runtime.transport.codec``): dtypes, checks, fast paths."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from runtime.core.errors import ProtocolError
from runtime.transport import codec, tensor_fields

pytestmark = pytest.mark.timeout(60)


def _pack(obj):
    """The fast path if it vouches for ``obj`` (numpy arrays as ["tensor", name, bytes]), else the slow one."""
    default = _default()
    data = codec.pack(obj, (("x", obj),), default)
    return msgpack.packb(codec.encode(obj, default, 1, "x"), use_bin_type=True) if data is None else data


def _default():
    return lambda obj: codec.leaf("cannot encode {}", lambda _, t, name: ["tensor", name, t.tobytes()], None, obj)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", sorted(tensor_fields.NP_CODES))
def test_numpy_dtypes_round_trip_through_their_wire_names(name):
    arr = (np.arange(6) % 2).astype(tensor_fields.NP_DTYPES[name]).reshape(2, 3)
    assert tensor_fields.NP_NAMES[arr.dtype] == name and tensor_fields.ITEMSIZE[name] == arr.itemsize
    got = codec.leaf("{}", lambda _, t, n: (n, t), None, arr)
    assert got[0] == name and got[1] is arr
    raw = bytearray(arr.tobytes())
    out = tensor_fields.build(raw, name, [2, 3], 6, "numpy")
    assert out.dtype == arr.dtype and np.array_equal(out, arr)
    out[0, 0] = 1  # a view over the buffer
    assert raw[:arr.itemsize] == np.ones(1, arr.dtype).tobytes()


@pytest.mark.parametrize("name", sorted(tensor_fields.ITEMSIZE))
def test_torch_dtypes_round_trip_through_their_wire_names(name):
    t = (torch.arange(6) % 2).to(getattr(torch, name)).reshape(2, 3)
    assert codec.leaf("{}", lambda _, x, n: n, None, t) == name
    assert tensor_fields.ITEMSIZE[name] == t.element_size()
    raw = bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert torch.equal(tensor_fields.build(raw, name, [2, 3], 6, "torch"), t)
    assert tensor_fields.build(bytearray(), name, [0, 3], 0, "torch").shape == (0, 3)


def test_bfloat16_is_torch_only_on_decoding():
    with pytest.raises(ProtocolError, match="bfloat16 has no numpy dtype"):
        tensor_fields.build(bytearray(4), "bfloat16", [2], 2, "numpy")


def test_big_endian_arrays_travel_little_endian_and_other_dtypes_are_refused():
    be = np.arange(3, dtype=">i4")
    name, le = codec.leaf("{}", lambda _, t, n: (n, t), None, be)
    assert name == "int32" and le.dtype == np.dtype("<i4") and np.array_equal(le, be)
    refused = (np.zeros(2, np.complex64), np.zeros(2, ">c8"), np.zeros(2, np.uint32), torch.zeros(2, dtype=torch.complex64))
    for bad in refused:
        with pytest.raises(tensor_fields.Unencodable, match="not allowed on the wire and cannot be sent") as info:
            codec.leaf("{}", lambda *_: None, None, bad)
        assert info.value.obj is bad


def test_bool_bytes_other_than_0_and_1_are_refused():
    with pytest.raises(ProtocolError, match="other than 0 and 1"):
        tensor_fields.build(bytearray(b"\x00\x02"), "bool", [2], 2, "numpy")
    assert tensor_fields.build(bytearray(b"\x00\x01"), "bool", [2], 2, "numpy").tolist() == [False, True]


# --------------------------------------------------------------------------- field checks


@pytest.mark.parametrize("dims, below, ok", [
    ([0, 3], 4, True), ([4], 4, False), ([-1], 4, False), ([True], 4, False), ([1.0], 4, False),
    ("1", 4, False), ([1] * (tensor_fields.MAX_NDIM + 1), 4, False), ([2**44], 2**44 + 1, True), ([2**40], 2**40, False),
])
def test_check_dims_bounds_each_entry(dims, below, ok):
    if ok:
        assert tensor_fields.check_dims(dims, "shape", below) == dims
    else:
        with pytest.raises(ProtocolError, match="tensor shape"):
            tensor_fields.check_dims(dims, "shape", below)


def test_error_messages_name_the_bound_and_clip_the_value():
    with pytest.raises(ProtocolError, match=r"in \[0, 2\*\*40\), got \[1099511627776\]"):
        tensor_fields.check_dims([2**40], "shape", 2**40)
    with pytest.raises(ProtocolError, match=r"in \[0, 2\*\*44\]"):
        tensor_fields.check_dims([2**44 + 1], "shape", 2**44 + 1)
    with pytest.raises(ProtocolError) as info:
        tensor_fields.check_dtype("x" * 10_000)
    assert len(str(info.value)) == tensor_fields.CLIP
    with pytest.raises(ProtocolError, match="needs 8 bytes, frame 0 has 7"):
        tensor_fields.check_nbytes("float32", [2], 7, "frame 0 has")
    assert tensor_fields.check_nbytes("float32", [2], 8) == 2


@pytest.mark.parametrize("segment, offset, match", [
    (7, 0, "segment must be a str, got 7"), ("s", -4, "offset must be an int >= 0, got -4"),
    ("s", True, "offset must be an int >= 0, got True"), ("s", 2, "offset 2 is not aligned to the float32"),
])
def test_check_placement_names_the_offending_value(segment, offset, match):
    with pytest.raises(ProtocolError, match=match):
        tensor_fields.check_placement(segment, offset, "float32")
    tensor_fields.check_placement("s", 8, "float32")


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("stamp", [
    b"\xd6\xff" + bytes(4), b"\xd7\xff" + bytes(8), b"\xc7\x0c\xff" + bytes(12), b"\xc7\x04\xff" + bytes(4),
    b"\xc8\x00\x08\xff" + bytes(8), b"\xc9\x00\x00\x00\x04\xff" + bytes(4),
])
def test_the_timestamp_guard_refuses_every_encoding_anywhere(stamp):
    for data in (b"\x81\xa1t" + stamp, b"\x81\xa1t\x91" + stamp, b"\x92\x01" + stamp):
        for frame in (data, memoryview(bytearray(data + bytes(5000)))[:len(data)]):  # fast and large frames
            with pytest.raises(ProtocolError, match="Timestamp"):
                codec.loads(frame, codec.reject_ext, "frame")


def test_timestamp_bytes_inside_a_str_or_bin_are_data():
    data = msgpack.packb({"s": "\xd6\xff", "b": b"\xd7\xff\x00\x00\x00\x00"}, use_bin_type=True)
    assert codec.loads(data, codec.reject_ext, "frame") == {"s": "\xd6\xff", "b": b"\xd7\xff\x00\x00\x00\x00"}


@pytest.mark.parametrize("data", [
    b"\x82\xa1k\x01\xa1k\x02",  # no bin in the frame: the hook that only counts keys
    b"\x83\xa1k\x01\xa1b\xc4\x00\xa1k\x02",  # a bin somewhere: the hook that checks key types too
    b"\x91\x82\xa1k\x01\xa1k\x02",
])
def test_duplicate_keys_are_refused(data):
    with pytest.raises(ProtocolError, match="duplicate keys"):
        codec.loads(data, codec.reject_ext, "frame")
    with pytest.raises(ProtocolError, match="duplicate keys"):
        codec.loads_descriptor(data)


def test_bytes_and_other_keys_are_refused():
    with pytest.raises(ProtocolError, match="map keys must be str, got b'k'"):
        codec.loads(b"\x81\xc4\x01k\x01", codec.reject_ext, "frame")
    with pytest.raises(ProtocolError, match="malformed frame: ValueError"):  # msgpack's strict_map_key
        codec.loads(b"\x81\x01\x01", codec.reject_ext, "frame")
    with pytest.raises(ProtocolError, match="malformed tensor descriptor: ExtraData"):
        codec.loads_descriptor(b"\x90\x90")


def test_extensions_inside_a_descriptor_are_refused():
    with pytest.raises(ProtocolError, match="extension type 5 is not allowed"):
        codec.loads_descriptor(msgpack.packb([msgpack.ExtType(5, b"")]))


# --------------------------------------------------------------------------- encoding


def nested(levels: int):
    value: object = 1
    for _ in range(levels):
        value = {"k": value}
    return value


@pytest.mark.parametrize("obj", [
    {"a": [1, 2.5, "s", None, True, b"b"]}, [np.zeros(2, np.float32), {"t": np.ones(1, np.int8)}],
    {"t": (1, [2, (3,)])}, {"s": np.float32(1.5), "i": np.int64(-2)}, {"b": bytearray(b"ab")},
    nested(codec.MAX_DEPTH), [[[[[[np.zeros(1)]]]]]],
])
def test_the_fast_path_packs_what_the_slow_path_packs(obj):
    default = _default()
    assert codec.packable((("x", obj),), 0)
    assert codec.pack(obj, (("x", obj),), default) == msgpack.packb(codec.encode(obj, default, 1, "x"),
                                                                     use_bin_type=True)


@pytest.mark.parametrize("obj", [
    {1: 2}, {"a": msgpack.ExtType(1, b"")}, {"a": msgpack.Timestamp(1)}, {"a": memoryview(b"ab")},
    {"a": __import__("collections").OrderedDict(b=1)}, nested(codec.MAX_DEPTH + 1), [nested(codec.MAX_DEPTH)],
])
def test_the_fast_path_leaves_conversions_and_refusals_to_the_slow_path(obj):
    assert not codec.packable((("x", obj),), 0)


def test_the_depth_limit_counts_every_level():
    assert _pack(nested(codec.MAX_DEPTH))  # x sits at depth 1, its innermost dict at MAX_DEPTH
    with pytest.raises(ValueError, match=r"^x(\.k){32}: nested deeper than 32 levels$"):
        _pack(nested(codec.MAX_DEPTH + 1))
    deep_tensor = np.zeros(1)
    for _ in range(codec.MAX_DEPTH - 1):
        deep_tensor = [deep_tensor]
    assert _pack(deep_tensor)
    with pytest.raises(ValueError, match="nested deeper"):
        _pack([deep_tensor])
    assert _pack([[[1]]] * 3) == msgpack.packb([[[1]]] * 3)


def test_refusals_name_the_path_on_both_paths():
    with pytest.raises(TypeError, match=r"^x\.a\[1\]: cannot encode set$"):
        _pack({"a": [1, {2}]})  # fast path: located once it failed
    with pytest.raises(TypeError, match=r"^x\.a\[1\]: cannot encode set$"):
        _pack({"a": [1, {2}], "m": memoryview(b"")})  # slow path
    with pytest.raises(OverflowError):
        _pack({"a": 2**64})
