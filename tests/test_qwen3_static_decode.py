"""The static-buffer decode of the ``qwen3`` plugin (the CUDA-graph path, run eagerly on CPU).

``models/qwen3/static_decode.py`` runs a decode step on fixed-shape buffers, padded to
the next captured batch size; on CUDA each shape is replayed from a CUDA graph, here the
very same function runs eagerly. Checked here: its logits and greedy tokens equal the
eager path's and ``transformers.generate``'s (3 sequences of different lengths padded to
4, then fewer as they finish, across block-table widths); padding rows write only the
padding block and real rows never depend on it; nothing in it reads a device value on
the host; batches that do not fit fall back to the eager path; the engine (inline, and
2 gloo ranks) gives transformers' tokens with it; the decisions for CUDA graphs and
flash-attn give their reasons (off on CPU); the flash-attn calls, against stand-ins that
implement flash-attn's documented semantics and input rules, give SDPA's output. The CUDA
side is ``tests/gpu/check_cuda.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.layers import attention as attention_module
from models.layers.attention import flash_attention_status
from models.qwen3.rank_model import Batch
from models.qwen3.static_decode import StaticDecoder, capture_sizes, capture_widths, cuda_graph_status
from runtime import (DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, WorkerSupervisorConfig)
from tests.test_qwen3_model import BLOCK, PROMPTS, Pages, load, make_checkpoint
from tests.test_qwen3_plugin import PROMPTS as PLUGIN_PROMPTS
from tests.test_qwen3_plugin import SHAPES, TP2, free_port, hf_greedy, runner_of
from tests.test_qwen3_plugin import make_checkpoint as make_plugin_checkpoint

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS = 64  # handed out by Pages; block 64 is the padding block
WIDTHS = [2, 4, 8, 32]  # blocks of 4 tokens: the 3 prompts grow across 4 -> 8


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    directory = tmp_path_factory.mktemp("static") / "gqa"
    return directory, make_checkpoint(directory, "gqa")


def decoder_for(model, **kw) -> StaticDecoder:
    args = dict(block_size=BLOCK, padding_block=NUM_BLOCKS, max_num_seqs=8, max_len=128, flash=False,
                use_graphs=False, widths=WIDTHS)
    return StaticDecoder(model, **(args | kw))


def decode_batch(pages: Pages, tokens: dict[int, int]) -> tuple[Batch, tuple]:
    """One decode step of ``tokens`` (sequence -> its newest token): the runner's Batch and the eager inputs."""
    ids, positions, meta = pages.step({s: [t] for s, t in tokens.items()}, False)

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.numpy().astype(np.int64)

    batch = Batch(False, arr(ids), arr(positions), arr(meta.slot_mapping), arr(meta.cu_seqlens_q),
                  arr(meta.context_lens), arr(meta.block_tables))
    return batch, (ids, positions, meta)


def prefill(model, pages: Pages) -> list[int]:
    ids, positions, meta = pages.step(dict(enumerate(PROMPTS)), True)
    logits = model.compute_logits(model(ids, positions, meta))
    return logits[meta.cu_seqlens_q[1:] - 1].argmax(-1).tolist()


# which sequences decode at each step: all 3 (padded to 4), then 2, then 1 (lengths differ throughout)
SCHEDULE = [[0, 1, 2]] * 7 + [[0, 1]] * 3 + [[1]] * 2


def test_static_decode_equals_eager_and_transformers(gqa):
    directory, hf = gqa
    eager, static = load(directory), load(directory)
    eager_pages, static_pages = Pages(eager), Pages(static, spare=1)
    decoder = decoder_for(static)
    seqs = [list(p) for p in PROMPTS]
    with torch.inference_mode():
        first = prefill(eager, eager_pages)
        assert prefill(static, static_pages) == first
        for s, token in enumerate(first):
            seqs[s].append(token)
        for active in SCHEDULE:
            newest = {s: seqs[s][-1] for s in active}
            batch, _ = decode_batch(static_pages, newest)
            _, (ids, positions, meta) = decode_batch(eager_pages, newest)
            want = eager.compute_logits(eager(ids, positions, meta))
            got = static.compute_logits(decoder.run(batch))
            assert got.shape == want.shape and (got - want).abs().max() < 1e-5
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            for s, token in zip(active, got.argmax(-1).tolist()):
                seqs[s].append(token)
    # padded 3 -> 4, then exact sizes; the table widened from 4 to 8 blocks on the way
    assert {shape[0] for shape in decoder.steps} == {4, 2, 1}
    assert {shape[1] for shape in decoder.steps} == {4, 8}
    with torch.inference_mode():
        for prompt, seq in zip(PROMPTS, seqs):
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=len(seq) - len(prompt), do_sample=False, pad_token_id=0)
            assert out[0].tolist() == seq


def test_padding_rows_write_only_the_padding_block(gqa):
    directory, _ = gqa
    model = load(directory)
    pages = Pages(model, spare=1)
    layers = model.attention_layers()
    for layer in layers:  # a sentinel everywhere: what is still 7 was never written
        layer.k_cache.fill_(7.0)
        layer.v_cache.fill_(7.0)
    decoder = decoder_for(model)
    with torch.inference_mode():
        tokens = dict(enumerate(prefill(model, pages)))
        for _ in range(3):
            batch, _ = decode_batch(pages, tokens)
            assert decoder.shape_for(batch)[0] == 4  # 3 sequences + 1 padding row
            tokens = dict(enumerate(model.compute_logits(decoder.run(batch)).argmax(-1).tolist()))
        # real rows never depend on the padding block: garbage there changes none of their outputs
        batch, _ = decode_batch(pages, tokens)
        saved = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
        clean = decoder.run(batch).clone()
        for layer, (k, v) in zip(layers, saved):
            layer.k_cache.copy_(k)
            layer.v_cache.copy_(v)
            layer.k_cache[NUM_BLOCKS].fill_(1e4)
            layer.v_cache[NUM_BLOCKS].fill_(-1e4)
        assert torch.equal(decoder.run(batch), clean)
    owned = {block for table in pages.tables.values() for block in table}
    for layer in layers:
        for cache in (layer.k_cache, layer.v_cache):
            for block in range(NUM_BLOCKS):
                if block not in owned:
                    assert (cache[block] == 7.0).all(), f"unowned block {block} was written"
            assert (cache[NUM_BLOCKS, 0] != 7.0).any()  # the padding row's store landed in the padding block
            assert (cache[NUM_BLOCKS, 1:] == 7.0).all() or (cache[NUM_BLOCKS, 1:].abs() == 1e4).all()
            for s, table in pages.tables.items():  # each sequence: its slots written, the rest of its blocks not
                slots = cache[table].flatten(0, 1)
                assert (slots[:pages.lens[s]] != 7.0).any(dim=(1, 2)).all()
                assert (slots[pages.lens[s]:] == 7.0).all()


def test_padding_rows_leave_real_kv_equal_to_the_eager_paths(gqa):
    directory, _ = gqa
    eager, static = load(directory), load(directory)
    eager_pages, static_pages = Pages(eager), Pages(static, spare=1)
    decoder = decoder_for(static)
    with torch.inference_mode():
        tokens = dict(enumerate(prefill(eager, eager_pages)))
        prefill(static, static_pages)
        for _ in range(4):
            batch, _ = decode_batch(static_pages, tokens)
            _, (ids, positions, meta) = decode_batch(eager_pages, tokens)
            eager(ids, positions, meta)
            tokens = dict(enumerate(static.compute_logits(decoder.run(batch)).argmax(-1).tolist()))
    for a, b in zip(eager.attention_layers(), static.attention_layers()):
        assert torch.allclose(a.k_cache, b.k_cache[:NUM_BLOCKS], atol=1e-5)
        assert torch.allclose(a.v_cache, b.v_cache[:NUM_BLOCKS], atol=1e-5)


class Ops(TorchDispatchMode):
    """The aten ops a region dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                   for i in args[1]):
            name = "index with a boolean mask"
        self.names.add(name)
        return func(*args, **(kwargs or {}))


# a read of a device value on the host (.item(), bool(), int(), .tolist()) or a data-dependent shape
SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "resolve_conj", "nonzero", "masked_select", "unique",
         "_unique2", "index with a boolean mask"}


def test_the_static_forward_reads_nothing_back_to_the_host(gqa):
    directory, _ = gqa
    model = load(directory)
    pages = Pages(model, spare=1)
    decoder = decoder_for(model)
    with torch.inference_mode():
        tokens = dict(enumerate(prefill(model, pages)))
        batch, (ids, positions, meta) = decode_batch(pages, tokens)
        decoder.run(batch)  # fills the static buffers
        size, width = decoder.shape_for(batch)
        with Ops() as static_ops:
            decoder.forward_static(size, width)
        with Ops() as eager_ops:  # the detector works: the eager decode does sync
            model(ids, positions, meta)
    assert not static_ops.names & SYNCS, static_ops.names & SYNCS
    assert eager_ops.names & SYNCS


def test_batches_that_do_not_fit_are_left_to_the_eager_path(gqa):
    model = load(gqa[0])
    decoder = decoder_for(model, max_num_seqs=2, widths=[2])
    lens = np.array([3, 8])
    batch = Batch(False, np.zeros(2, np.int64), lens - 1, np.zeros(2, np.int64), np.arange(3), lens,
                  np.zeros((2, 2), np.int64))
    assert decoder.sizes == [1, 2] and decoder.shape_for(batch) == (2, 2)
    longer = Batch(False, batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q,
                   np.array([3, 9]), np.zeros((2, 3), np.int64))
    assert decoder.shape_for(longer) is None and decoder.run(longer) is None  # 9 tokens > 2 blocks of 4
    three = Batch(False, *(np.zeros(3, np.int64) for _ in range(3)), np.arange(4), np.array([1, 1, 1]),
                  np.zeros((3, 1), np.int64))
    assert decoder.run(three) is None  # 3 sequences > the largest size, 2


def test_capture_shapes():
    assert capture_sizes(1) == [1] and capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_widths(8192, 16, flash=True) == [512]
    assert capture_widths(8192, 16, flash=False) == [16, 64, 256, 512]  # 256, 1024, 4096, 8192 tokens
    assert capture_widths(100, 16, flash=False) == [7]
    assert capture_widths(256, 4, flash=False, first_tokens=16) == [4, 16, 64]


# --------------------------------------------------------------------------- the decisions


def test_cuda_graph_status_gives_its_reason(monkeypatch):
    on, why = cuda_graph_status("cpu", enforce_eager=False)
    assert not on and why == "off: the model runs on cpu, and CUDA graphs need a CUDA device"
    assert cuda_graph_status("cpu", enforce_eager=True) == (False, "off: enforce_eager=True in plugin_args")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_graph_status("cuda:0", enforce_eager=False) == (False, "off: torch.cuda is not available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rest of the decision, without a GPU
    assert cuda_graph_status("cuda:0", enforce_eager=False) == (True, "on")
    assert cuda_graph_status("cuda:1", enforce_eager=True)[0] is False
    on, why = cuda_graph_status("cuda:0", enforce_eager=False, world_size=2, backend="gloo")
    assert not on and "over gloo, which cannot be captured" in why
    on, why = cuda_graph_status("cuda:0", enforce_eager=False, world_size=2, backend="nccl", nccl_version=(2, 8, 4))
    assert not on and "NCCL 2.8.4 cannot capture" in why and ">= 2.9.6" in why
    assert cuda_graph_status("cuda:0", enforce_eager=False, world_size=2, backend="nccl",
                             nccl_version=(2, 21, 5)) == (True, "on")


def test_flash_attention_status_gives_its_reason(monkeypatch):
    on, why = flash_attention_status("cpu", torch.float32, 16)
    assert not on and why  # no flash_attn here, or no CUDA device
    monkeypatch.setattr(attention_module, "FLASH_IMPORT_ERROR", None)  # as if flash_attn imported
    assert flash_attention_status("cpu", torch.bfloat16, 256) == (
        False, "flash-attn needs a CUDA device, the model is on cpu")
    assert "float16 or bfloat16" in flash_attention_status("cuda", torch.float32, 256)[1]
    assert "multiple of 256, got 16" in flash_attention_status("cuda", torch.bfloat16, 16)[1]
    assert flash_attention_status("cuda:0", torch.float16, 512)[0]


def _reference(q, k, v, scale):
    """Causal attention, aligned bottom-right (flash-attn's convention): q [n, h, d], k/v [L, kv, d]."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    n, length = q.size(0), k.size(0)
    allowed = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _paged(cache, table, length):
    return cache[table[:-(-length // cache.size(1))].long()].flatten(0, 1)[:length]


def _fake_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
    """``flash_attn_with_kvcache`` as documented, with its input requirements asserted."""
    assert causal and cache_seqlens.dtype == block_table.dtype == torch.int32 and block_table.is_contiguous()
    assert q.dim() == 4 and q.size(1) == 1 and k_cache.stride(-1) == 1
    return torch.stack([_reference(q[b], _paged(k_cache, block_table[b], int(cache_seqlens[b])),
                                   _paged(v_cache, block_table[b], int(cache_seqlens[b])), softmax_scale)
                        for b in range(q.size(0))])


def _fake_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 block_table):
    """``flash_attn_varlen_func`` as documented (paged k/v when ``block_table`` is given)."""
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        (qs, qe), (ks, ke) = cu_seqlens_q[b:b + 2].tolist(), cu_seqlens_k[b:b + 2].tolist()
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        if block_table is None:
            keys, values = k[ks:ke], v[ks:ke]
        else:
            keys, values = _paged(k, block_table[b], ke - ks), _paged(v, block_table[b], ke - ks)
        out[qs:qe] = _reference(q[qs:qe], keys, values, softmax_scale)
    return out


def test_flash_attn_calls_follow_its_documented_semantics(monkeypatch):
    """The flash-attn path on CPU, flash-attn replaced by its documented semantics: same output as SDPA."""
    from models.layers.attention import Attention, AttentionMetadata

    monkeypatch.setattr(attention_module, "flash_attn_varlen_func", _fake_varlen)
    monkeypatch.setattr(attention_module, "flash_attn_with_kvcache", _fake_with_kvcache)
    heads, kv, dim, block = 4, 2, 8, 256
    attn = Attention(heads, dim, dim**-0.5, kv)
    attn.k_cache, attn.v_cache = torch.zeros(5, block, kv, dim), torch.zeros(5, block, kv, dim)  # block 4: padding
    tables, lens, g = {0: [3, 1], 1: [2]}, {0: 0, 1: 0}, torch.Generator().manual_seed(0)
    for new, is_prefill, static in (({0: 300, 1: 17}, True, False), ({0: 20, 1: 3}, True, False),
                                    ({0: 1, 1: 1}, False, False), ({0: 1, 1: 1}, False, True)):
        slots, cu = [], [0]
        for seq, n in new.items():
            slots += [tables[seq][p // block] * block + p % block for p in range(lens[seq], lens[seq] + n)]
            lens[seq] += n
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(is_prefill, torch.tensor(slots), torch.tensor([lens[0], lens[1]]),
                                 torch.tensor([[3, 1], [2, 4 if static else -1]]), torch.tensor(cu), static=static)
        q, k, v = (torch.randn(cu[-1], h, dim, generator=g) for h in (heads, kv, kv))
        monkeypatch.setattr(Attention, "_flash", lambda self, q: True)
        flash = attn(q, k, v, meta)
        monkeypatch.setattr(Attention, "_flash", lambda self, q: False)
        assert torch.allclose(flash, attn(q, k, v, meta), atol=1e-5), (new, is_prefill, static)


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def plugin_ckpt(tmp_path_factory):
    return make_plugin_checkpoint(tmp_path_factory.mktemp("static-plugin") / "gqa", 0, **SHAPES["gqa"])


@pytest.fixture(scope="module")
def plugin_reference(plugin_ckpt):
    return hf_greedy(plugin_ckpt, PLUGIN_PROMPTS)


def request(prompts, max_tokens: int = 24) -> dict:
    return {"prompt_token_ids": prompts, "max_tokens": max_tokens}


#: the engines here are about the static buffers run eagerly, which is what the CPU does (on a
#: CUDA device graphs would be on, with capture widths): pinned to cpu wherever CUDA is visible too
CPU = EngineConfig(device=DeviceConfig(target="cpu"))


def test_engine_static_decode_matches_transformers(plugin_ckpt, plugin_reference, caplog):
    args = {"model": str(plugin_ckpt), "static_decode": True, "block_size": 4, "max_num_seqs": 8}
    with caplog.at_level(logging.INFO, logger="phyrt.qwen3"), Engine(EngineArgs("qwen3", args, CPU)) as engine:
        runner = runner_of(engine)
        # 3 prompts of 1, 5 and 17 tokens decode together, padded to 4
        assert engine.step(request(PLUGIN_PROMPTS[:3]), timeout=120)["token_ids"] == plugin_reference[:3]
        # without graphs the table is exactly as wide as the longest sequence needs: 18..40 tokens, 5..10 blocks
        assert runner.decoder.widths is None and runner.decoder.max_width == 64  # 256 positions, blocks of 4
        assert runner.decoder.steps == {(4, w): 3 if w == 5 else 4 for w in range(5, 11)}
        assert runner.num_static_steps == 23
        # 16 concurrent requests (up to 8 at a time), of every length
        futures = [engine.submit(request(PLUGIN_PROMPTS[i % 4])) for i in range(16)]
        assert [f.result(120)["token_ids"][0] for f in futures] == [plugin_reference[i % 4] for i in range(16)]
        assert any(size == 8 for size, _ in runner.decoder.steps)
        assert runner.cuda_graphs.startswith("off: the model runs on cpu") and not runner.decoder.graphs
        assert runner.kv_cache.shape[2] == runner.num_blocks + 1  # the padding block
    assert "CUDA graphs off: the model runs on cpu" in caplog.text
    assert "decode: static buffers, run eagerly" in caplog.text and "attention: torch SDPA" in caplog.text


def test_engine_decodes_eagerly_what_the_static_shapes_do_not_fit(plugin_ckpt, plugin_reference):
    args = {"model": str(plugin_ckpt), "static_decode": True, "block_size": 4, "max_seq_len_to_capture": 24}
    with Engine(EngineArgs("qwen3", args, CPU)) as engine:
        runner = runner_of(engine)
        # the 17-token prompt decodes on the static buffers while it holds up to 24 tokens (7 steps), then
        # eagerly; the 40-token one eagerly throughout
        assert engine.step(request(PLUGIN_PROMPTS[2]), timeout=120)["token_ids"] == plugin_reference[2:3]
        assert runner.decoder.max_width == 6 and runner.decoder.steps == {(1, 5): 3, (1, 6): 4}
        assert engine.step(request(PLUGIN_PROMPTS[3]), timeout=120)["token_ids"] == plugin_reference[3:]
        assert runner.num_static_steps == 7 and runner.num_steps == 48
    with Engine(EngineArgs("qwen3", {"model": str(plugin_ckpt)}, CPU)) as engine:  # default on CPU: eager only
        assert engine.step(request(PLUGIN_PROMPTS[:2]), timeout=120)["token_ids"] == plugin_reference[:2]
        assert runner_of(engine).decoder is None and runner_of(engine).num_static_steps == 0


def test_engine_static_decode_tp2_local(plugin_ckpt, plugin_reference):
    args = EngineArgs("qwen3", {"model": str(plugin_ckpt), "static_decode": True, "block_size": 4},
                      EngineConfig(device=DeviceConfig(target="cpu"), parallel=TP2))
    for attempt in range(3):
        deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(
            base_port=free_port(), heartbeat_timeout_s=10.0))
        try:
            engine = Engine(args, deployment)
            break
        except Exception as exc:  # a port taken between the check and the rendezvous
            if attempt == 2 or "rendezvous" not in str(exc):
                raise
    with engine:
        assert engine.step(request(PLUGIN_PROMPTS[:3]), timeout=120)["token_ids"] == plugin_reference[:3]
        futures = [engine.submit(request(p)) for p in PLUGIN_PROMPTS]
        assert [f.result(120)["token_ids"][0] for f in futures] == plugin_reference
        assert engine.replicas[0].healthy


@pytest.mark.parametrize("plugin_args, error, match", [
    ({"enforce_eager": 1}, TypeError, "enforce_eager'\\] must be a bool"),
    ({"static_decode": "yes"}, TypeError, "static_decode'\\] must be a bool"),
    ({"max_seq_len_to_capture": 0}, ValueError, "max_seq_len_to_capture"),
])
def test_bad_static_decode_args(plugin_ckpt, plugin_args, error, match):
    with pytest.raises(error, match=match):
        Engine(EngineArgs("qwen3", {"model": str(plugin_ckpt), **plugin_args}))
