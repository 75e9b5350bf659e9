"""Blocks lent from a shared-memory arena (``ShmArena.lend``): a tensor written there is sent as a
reference, not copied, and its block goes back to the pool only when the caller dropped it and
every message that carried it was freed."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from runtime.transport import wire
from runtime.transport.arena import SHM_DIR, ShmArena, ShmMapper, new_run_id

pytestmark = pytest.mark.timeout(30)


class Tracking:
    """The allocator a group's encoder sees: the arena, remembering what each message placed."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena, self.placed = arena, []

    def place(self, nbytes):
        segment, offset, view = self.arena.place(nbytes)
        self.placed.append((segment, offset))
        return segment, offset, view

    def borrow(self, address, nbytes):
        lent = self.arena.borrow(address, nbytes)
        if lent is not None:
            self.placed.append(lent[:2])
        return lent

    def free(self, segment, offset):
        self.arena.free(segment, offset)


def lent_tensor(arena: ShmArena, shape, dtype=torch.float32) -> torch.Tensor:
    """What ``Engine.empty`` does with a group's arena."""
    import weakref

    count = int(np.prod(shape))
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    segment, offset, view, _ = arena.lend(nbytes)
    holder = np.frombuffer(view, dtype=np.uint8)
    weakref.finalize(holder, arena.let_go, segment, offset)
    return torch.frombuffer(memoryview(holder), dtype=dtype, count=count).view(shape)


def send(arena: ShmArena, payload):
    """Encode as a group's request, decode as a rank would: (the decoded payload, what the
    message holds)."""
    alloc = Tracking(arena)
    encoder = wire.TensorEncoder(allocator=alloc, inline_threshold=1024)
    data = wire.pack_message("request", 1, payload=payload, tensor_encoder=encoder)
    mapper = ShmMapper(arena.run_id)
    message = wire.unpack_message(data, tensor_decoder=wire.TensorDecoder(mapper=mapper))
    return message["payload"], alloc.placed, mapper


@pytest.fixture
def arena():
    with ShmArena(new_run_id(), 1 << 20, prefault=False) as arena:
        yield arena


def test_a_lent_tensor_crosses_as_a_reference_to_its_own_block(arena):
    x = lent_tensor(arena, (64, 64))
    x.copy_(torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
    placed_before = arena.capacity
    payload, held, mapper = send(arena, {"x": x})
    try:
        got = payload["x"]
        assert torch.equal(got, x)
        x[0, 0] = -1.0  # the peer sees the very block: no copy was made
        assert got[0, 0].item() == -1.0
        assert arena.capacity == placed_before
        assert len(held) == 1
    finally:
        del payload, got
        mapper.close()


def test_a_slice_inside_a_lent_block_is_sent_from_where_it_lies(arena):
    x = lent_tensor(arena, (8, 1024))
    x.copy_(torch.randn(8, 1024))
    payload, _, mapper = send(arena, {"row": x[3]})
    try:
        assert torch.equal(payload["row"], x[3])
        x[3, 5] = 42.0
        assert payload["row"][5].item() == 42.0
    finally:
        del payload
        mapper.close()


def test_a_strided_view_or_an_outside_tensor_is_copied(arena):
    x = lent_tensor(arena, (64, 64))
    x.fill_(1.0)
    outside = torch.ones(64, 64)
    payload, held, mapper = send(arena, {"t": x.t(), "o": outside})
    try:
        assert torch.equal(payload["t"], x.t()) and torch.equal(payload["o"], outside)
        x.fill_(2.0)
        outside.fill_(2.0)
        assert payload["t"][0, 0].item() == 1.0 and payload["o"][0, 0].item() == 1.0  # copies
        assert len(held) == 2  # two fresh blocks, not the lent one
    finally:
        del payload
        mapper.close()


def test_the_block_returns_only_after_the_caller_and_every_message_let_go(arena):
    x = lent_tensor(arena, (256,))  # 1 KiB, the arena's first block
    payload1, held1, mapper1 = send(arena, {"x": x})
    payload2, held2, mapper2 = send(arena, {"x": x})
    (segment, offset), = held1
    assert held2 == held1  # both messages refer to the lent block itself
    del payload1, payload2
    mapper1.close()
    mapper2.close()
    del x
    gc.collect()  # the caller let go
    arena.free(segment, offset)  # the first message was answered
    probe = arena.place(1024)
    assert probe[:2] != (segment, offset)  # the second message still holds the block
    arena.free(*probe[:2])
    del probe
    arena.free(segment, offset)  # the second message was answered: the block is back, reused first
    assert arena.place(1024)[:2] == (segment, offset)


def test_a_tensor_lent_by_another_arena_is_copied_not_referenced(arena):
    with ShmArena(new_run_id(), 1 << 20, prefault=False) as other:
        foreign = lent_tensor(other, (512,))
        foreign.fill_(3.0)
        payload, held, mapper = send(arena, {"x": foreign})
        try:
            assert torch.equal(payload["x"], foreign)
            assert held and held[0][0].startswith(f"phyrt-{arena.run_id}-")
        finally:
            del payload
            mapper.close()


def test_a_lent_tensor_outlives_its_closed_arena_and_leaves_no_name(arena):
    x = lent_tensor(arena, (1024,))
    x.fill_(7.0)
    names = arena.segments
    arena.close()
    assert all(not os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert x.sum().item() == 7.0 * 1024  # still mapped: the mapping goes with the last view
    with ShmArena(new_run_id(), 1 << 20, prefault=False) as fresh:
        payload, held, mapper = send(fresh, {"x": x})  # a closed arena's tensor: copied
        try:
            assert torch.equal(payload["x"], x) and len(held) == 1
        finally:
            del payload
            mapper.close()


def test_lend_refuses_an_empty_block(arena):
    with pytest.raises(ValueError, match="at least 1 byte"):
        arena.lend(0)
