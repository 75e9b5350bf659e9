"""models.layers for Qwen3: fused QKV / gate-up, vocab-parallel embedding and head, RMSNorm,
rotary, paged attention; each against plain torch (or transformers) at tp=1, with faked
group ranks for the slicing, and over a real 2-rank gloo group (this file run as
``python this_file RANK WORLD PORT OUT_DIR``; each rank writes JSON for the test).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn import functional as F
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from models.layers.attention import Attention, AttentionMetadata
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import MergedColumnParallelLinear, QKVColumnParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm, rms_norm_heads
from models.layers.rotary import RotaryEmbedding, rope_theta, rotate_heads
from models.loader import LazySlice
from runtime import parallel as P
from runtime.core.config import AttentionParallelConfig, DenseParallelConfig, ParallelConfig
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(120)

HIDDEN, HEAD = 16, 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv_weights(heads: int, kv_heads: int, bias: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    g = gen(seed)
    w = {s: torch.randn(n * HEAD, HIDDEN, generator=g) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    if bias:
        w |= {s + "b": torch.randn(n * HEAD, generator=g) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    return w


def build_qkv(heads: int, kv_heads: int, w: dict[str, torch.Tensor]) -> QKVColumnParallelLinear:
    bias = "qb" in w
    layer = QKVColumnParallelLinear(HIDDEN, HEAD, heads, kv_heads, bias)
    for s in "qkv":
        layer.weight.weight_loader(layer.weight, w[s], s)
        if bias:
            layer.bias.weight_loader(layer.bias, w[s + "b"], s)
    return layer


def expected_qkv(x, w, heads, kv_heads, rank, tp) -> torch.Tensor:
    """This rank's [q heads | its kv heads] columns of the full projections."""
    full = {s: F.linear(x, w[s], w.get(s + "b")) for s in "qkv"}
    h = heads // tp
    kv_per, kv_start = (kv_heads // tp, rank * kv_heads // tp) if kv_heads >= tp else (1, rank // (tp // kv_heads))
    q = full["q"][:, rank * h * HEAD:(rank + 1) * h * HEAD]
    k = full["k"][:, kv_start * HEAD:(kv_start + kv_per) * HEAD]
    v = full["v"][:, kv_start * HEAD:(kv_start + kv_per) * HEAD]
    return torch.cat([q, k, v], dim=-1)


def merged_weights(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    return torch.randn(12, HIDDEN, generator=g), torch.randn(12, HIDDEN, generator=g)


@pytest.fixture
def fake_tp(monkeypatch):
    """Pretend this process is group rank ``r`` of ``n`` (collectives stay no-ops)."""
    P.destroy()

    def set_rank(r: int, n: int) -> None:
        monkeypatch.setattr(P, "rank", lambda group="world": r)
        monkeypatch.setattr(P, "size", lambda group="world": n)

    return set_rank


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_tp1_is_the_three_projections_side_by_side(bias):
    w, x = qkv_weights(4, 2, bias), torch.randn(5, HIDDEN)
    layer = build_qkv(4, 2, w)
    assert layer.weight.shape == ((4 + 2 * 2) * HEAD, HIDDEN) and (layer.num_heads, layer.num_kv_heads) == (4, 2)
    assert torch.allclose(layer(x), expected_qkv(x, w, 4, 2, 0, 1), atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 2), (4, 4, 4), (8, 2, 4), (4, 1, 2), (8, 1, 4), (8, 2, 8)])
def test_qkv_shards_whole_heads_and_replicates_kv_heads(fake_tp, heads, kv_heads, tp):
    w, x = qkv_weights(heads, kv_heads, True), torch.randn(3, HIDDEN)
    kv_seen = []
    for r in range(tp):
        fake_tp(r, tp)
        layer = build_qkv(heads, kv_heads, w)
        assert layer.num_heads == heads // tp and layer.num_kv_heads == max(1, kv_heads // tp)
        assert torch.allclose(layer(x), expected_qkv(x, w, heads, kv_heads, r, tp), atol=1e-5)
        kv_seen.append(layer.kv_head_start)
        # every q head of this rank uses one of the KV heads it holds (the GQA grouping)
        group = heads // kv_heads
        q_heads = range(r * layer.num_heads, (r + 1) * layer.num_heads)
        held = range(layer.kv_head_start, layer.kv_head_start + layer.num_kv_heads)
        assert {h // group for h in q_heads} <= set(held)
    if kv_heads < tp:
        assert kv_seen == [r // (tp // kv_heads) for r in range(tp)]


def test_merged_gate_up_shards(fake_tp):
    gate, up = merged_weights()
    x = torch.randn(3, HIDDEN)
    full = torch.cat([F.linear(x, gate), F.linear(x, up)], dim=-1)
    layer = MergedColumnParallelLinear(HIDDEN, [12, 12])
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert torch.allclose(layer(x), full, atol=1e-6)
    for r in range(3):
        fake_tp(r, 3)
        layer = MergedColumnParallelLinear(HIDDEN, [12, 12])
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)
        assert torch.allclose(g, F.linear(x, gate)[:, r * 4:(r + 1) * 4], atol=1e-6)
        assert torch.allclose(u, F.linear(x, up)[:, r * 4:(r + 1) * 4], atol=1e-6)


def test_divisibility_errors_name_the_sizes(fake_tp):
    fake_tp(0, 4)
    with pytest.raises(ValueError, match=r"total_num_heads 6 is not divisible by the size 4 of group 'attention_tp'"):
        QKVColumnParallelLinear(HIDDEN, HEAD, 6, 2)
    fake_tp(0, 2)
    with pytest.raises(ValueError, match=r"total_num_kv_heads 3 is not divisible by the size 2"):
        QKVColumnParallelLinear(HIDDEN, HEAD, 6, 3)
    fake_tp(0, 3)
    with pytest.raises(ValueError, match=r"total_num_kv_heads 2 neither is divisible by nor divides the size 3"):
        QKVColumnParallelLinear(HIDDEN, HEAD, 6, 2)
    with pytest.raises(ValueError, match=r"total_num_heads 6 is not a multiple of total_num_kv_heads 4"):
        QKVColumnParallelLinear(HIDDEN, HEAD, 6, 4)
    fake_tp(0, 4)
    with pytest.raises(ValueError, match=r"output_sizes\[1\] 10 is not divisible by the size 4 of group 'dense_tp'"):
        MergedColumnParallelLinear(HIDDEN, [12, 10])


def test_fused_loaders_check_shard_ids_and_shapes():
    qkv = QKVColumnParallelLinear(HIDDEN, HEAD, 4, 2)
    with pytest.raises(ValueError, match=r"shard_id must be 'q', 'k' or 'v', got 'x'"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(16, HIDDEN), "x")
    with pytest.raises(ValueError, match=r"\['k'\]: expected the full tensor of shape \(8, 16\).*got \(16, 16\)"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(16, HIDDEN), "k")
    merged = MergedColumnParallelLinear(HIDDEN, [12, 12])
    with pytest.raises(ValueError, match=r"shard_id must be an int in \[0, 2\), got 2"):
        merged.weight.weight_loader(merged.weight, torch.zeros(12, HIDDEN), 2)
    with pytest.raises(ValueError, match=r"\[1\]: expected the full tensor of shape \(12, 16\)"):
        merged.weight.weight_loader(merged.weight, torch.zeros(12, 8), 1)


def test_loaders_read_only_their_slice_of_a_safetensors_file(fake_tp, tmp_path):
    """Through a LazySlice, rank 1 of 2 reads half of each sharded tensor and nothing more."""
    w = qkv_weights(4, 2, False)
    gate, up = merged_weights()
    row, emb = torch.randn(HIDDEN, 12), torch.randn(11, HIDDEN)
    tensors = {"q": w["q"], "k": w["k"], "v": w["v"], "gate": gate, "up": up, "row": row, "emb": emb}
    save_file(tensors, tmp_path / "t.safetensors")
    fake_tp(1, 2)
    counter = [0]
    qkv, merged = QKVColumnParallelLinear(HIDDEN, HEAD, 4, 2), MergedColumnParallelLinear(HIDDEN, [12, 12])
    rowp, embp = RowParallelLinear(12, HIDDEN, bias=False), VocabParallelEmbedding(11, HIDDEN)
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        for s in "qkv":
            qkv.weight.weight_loader(qkv.weight, LazySlice(s, f, counter), s)
        merged.weight.weight_loader(merged.weight, LazySlice("gate", f, counter), 0)
        merged.weight.weight_loader(merged.weight, LazySlice("up", f, counter), 1)
        rowp.weight.weight_loader(rowp.weight, LazySlice("row", f, counter))
        embp.weight.weight_loader(embp.weight, LazySlice("emb", f, counter))
    full = sum(t.numel() * 4 for t in tensors.values())
    assert counter[0] == (full - emb.numel() * 4) // 2 + 5 * HIDDEN * 4  # rank 1 of vocab 11 holds rows 6..10
    assert torch.equal(rowp.weight, row[:, 6:]) and torch.equal(embp.weight[:5], emb[6:])
    assert torch.equal(qkv.weight[:8], w["q"][8:]) and torch.equal(merged.weight[6:], up[6:])


# --------------------------------------------------------------------------- embedding, head


def test_embedding_and_head_tp1_equal_plain_torch():
    table, ids, x = torch.randn(13, HIDDEN), torch.tensor([[0, 5, 12], [3, 3, 7]]), torch.randn(4, HIDDEN)
    emb, head = VocabParallelEmbedding(13, HIDDEN), ParallelLMHead(13, HIDDEN)
    emb.weight.weight_loader(emb.weight, table)
    head.weight.weight_loader(head.weight, table)
    assert torch.equal(emb(ids), F.embedding(ids, table))
    assert torch.allclose(head(x), x @ table.T, atol=1e-6)
    with pytest.raises(ValueError, match=r"expected the full tensor of shape \(13, 16\).*got \(12, 16\)"):
        emb.weight.weight_loader(emb.weight, table[:12])


@pytest.mark.parametrize("vocab,tp", [(12, 2), (13, 2), (13, 3), (13, 4)])
def test_vocab_is_padded_and_shards_recombine(fake_tp, vocab, tp):
    table, ids, x = torch.randn(vocab, HIDDEN), torch.arange(vocab).flip(0), torch.randn(3, HIDDEN)
    rows, partial, logits = math.ceil(vocab / tp), [], []
    for r in range(tp):
        fake_tp(r, tp)
        emb = VocabParallelEmbedding(vocab, HIDDEN)
        head = ParallelLMHead(vocab, HIDDEN)
        head.weight = emb.weight  # tied: one parameter, one load
        emb.weight.weight_loader(emb.weight, table)
        assert emb.weight.shape == (rows, HIDDEN)
        held = max(0, min(vocab, (r + 1) * rows) - r * rows)
        assert torch.equal(emb.weight[:held], table[r * rows:r * rows + held])
        assert not emb.weight[held:].any()  # padding rows stay zero
        partial.append(emb(ids))  # all_reduce is a no-op here: this rank's rows, 0 elsewhere
        logits.append(F.linear(x, head.weight))
    assert torch.allclose(sum(partial), F.embedding(ids, table))
    assert torch.allclose(torch.cat(logits, dim=-1)[:, :vocab], x @ table.T, atol=1e-6)


def test_lm_head_refuses_bias():
    with pytest.raises(ValueError, match="bias"):
        ParallelLMHead(13, HIDDEN, bias=True)


# --------------------------------------------------------------------------- norm, rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 24), (16, 512), (3, 8, 64)])
def test_rmsnorm_matches_transformers_with_and_without_residual(dtype, shape):
    """Bitwise: float32 takes torch's fused F.rms_norm, other dtypes the steps transformers takes."""
    width = shape[-1]
    ref = hf_qwen3.Qwen3RMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(width))
    norm = RMSNorm(width, 1e-5, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(ref.weight)
    x, res = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    assert torch.equal(norm(x), ref(x))
    y, new_res = norm(x, res)
    assert torch.equal(new_res, x + res) and torch.equal(y, ref(x + res))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_and_key_heads_normed_and_rotated_together_equal_them_apart(dtype):
    """Qwen3Attention's joint pass over a strided [T, h + kv, d] view of the qkv output: the same
    bits as transformers' q_norm and k_norm (each its own weight) and the rotation of q and k apart."""
    tokens, heads, kv_heads, d = 6, 4, 2, 32
    q_norm, k_norm = hf_qwen3.Qwen3RMSNorm(d, eps=1e-6).to(dtype), hf_qwen3.Qwen3RMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.3 * torch.randn(d))
        k_norm.weight.copy_(1 - 0.3 * torch.randn(d))
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * d)).to(dtype)
    table = RotaryEmbedding(d, 64, 1e4).table(torch.tensor([0, 5, 9, 63, 2, 2]), dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q, want_k = RotaryEmbedding.rotate(table, q_norm(q.unflatten(-1, (heads, d))),
                                            k_norm(k.unflatten(-1, (kv_heads, d))))
    weight = torch.cat((q_norm.weight.expand(heads, d), k_norm.weight.expand(kv_heads, d)))
    qk = rotate_heads(table, rms_norm_heads(qkv.unflatten(-1, (-1, d))[:, :heads + kv_heads], weight, 1e-6))
    assert torch.equal(qk[:, :heads], want_q) and torch.equal(qk[:, heads:], want_k)


def test_rotary_matches_transformers():
    cfg = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=24, max_position_embeddings=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert rope_theta(cfg) == 5000.0
    rope = RotaryEmbedding(24, 64, rope_theta(cfg))
    hf_rope = hf_qwen3.Qwen3RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 63, 2])
    q, k = torch.randn(5, 4, 24), torch.randn(5, 2, 24)
    cos, sin = hf_rope(q, pos[None])
    want_q, want_k = hf_qwen3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(pos, q, k)
    assert torch.allclose(got_q, want_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(got_k, want_k[0].transpose(0, 1), atol=1e-6)


def test_rope_scaling_is_refused():
    linear = transformers.Qwen3Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"rope type 'linear'.*only the default rope"):
        rope_theta(linear)

    class Legacy:
        rope_theta, rope_scaling = 1e6, {"type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match=r"rope type 'yarn'"):
        rope_theta(Legacy())
    Legacy.rope_scaling = None
    assert rope_theta(Legacy()) == 1e6


# --------------------------------------------------------------------------- paged attention

H, KV, D, BS = 4, 2, 8, 4


def reference_attention(q, k, v, scale):
    """Causal attention of the LAST len(q) positions of k/v: q [n, h, d], k/v [L, kv, d]."""
    n, L = q.size(0), k.size(0)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    allowed = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


class Pages:
    """A tiny block manager: shuffled free blocks, one table per sequence."""

    def __init__(self, attn: Attention | list[Attention], num_blocks: int, shape: tuple, dtype=torch.float32):
        self.free = torch.randperm(num_blocks, generator=gen(5)).tolist()
        self.tables, self.lens, self.bs = {}, {}, shape[1]
        for layer in attn if isinstance(attn, list) else [attn]:
            layer.k_cache, layer.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def meta(self, new: dict[int, int], is_prefill: bool) -> tuple[AttentionMetadata, torch.Tensor]:
        """Append ``new[seq]`` tokens to each sequence; return the metadata and the positions."""
        slots, positions, cu = [], [], [0]
        for seq, n in new.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.bs < start + n:
                table.append(self.free.pop())
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + n)]
            positions += range(start, start + n)
            self.lens[seq] = start + n
            cu.append(cu[-1] + n)
        width = max(len(self.tables[s]) for s in new)
        tables = torch.tensor([self.tables[s] + [-1] * (width - len(self.tables[s])) for s in new])
        lens = torch.tensor([self.lens[s] for s in new])
        meta = AttentionMetadata(is_prefill, torch.tensor(slots), lens, tables, torch.tensor(cu))
        return meta, torch.tensor(positions)


def test_paged_attention_prefill_prefix_and_decode_match_the_reference():
    scale, g = D**-0.5, gen(9)
    lengths = {0: 6, 1: 9, 2: 1}
    full = {s: [torch.randn(n + 3, h, D, generator=g) for h in (H, KV, KV)] for s, n in lengths.items()}
    attn = Attention(H, D, scale, KV)
    pages = Pages(attn, 16, (16, BS, KV, D))

    def run(chunk: dict[int, tuple[int, int]], is_prefill: bool) -> None:
        meta, _ = pages.meta({s: e - b for s, (b, e) in chunk.items()}, is_prefill)
        q, k, v = (torch.cat([full[s][i][b:e] for s, (b, e) in chunk.items()]) for i in range(3))
        out = attn(q, k, v, meta)
        for j, (s, (b, e)) in enumerate(chunk.items()):
            qs, ks, vs = full[s]
            want = reference_attention(qs[b:e], ks[:e], vs[:e], scale)
            assert torch.allclose(out[meta.cu_seqlens_q[j]:meta.cu_seqlens_q[j + 1]], want, atol=1e-5), (s, b, e)

    # seq 1 is prefilled in two chunks: the second starts mid-sequence after a cached prefix
    run({0: (0, 6), 1: (0, 4), 2: (0, 1)}, True)
    run({1: (4, 9)}, True)
    for step in range(3):
        run({s: (n + step, n + step + 1) for s, n in lengths.items()}, False)
    # the cache holds exactly each sequence's keys at its slots
    for s, n in lengths.items():
        slots = [pages.tables[s][p // BS] * BS + p % BS for p in range(n + 3)]
        assert torch.equal(attn.k_cache.view(-1, KV, D)[slots], full[s][1])


def test_slot_minus_one_is_not_stored_and_decode_needs_a_cache():
    attn = Attention(H, D, 1.0, KV)
    q, k, v = torch.randn(3, H, D), torch.randn(3, KV, D), torch.randn(3, KV, D)
    meta = AttentionMetadata(True, torch.tensor([-1, -1, -1]), torch.tensor([3]), torch.empty(1, 0, dtype=torch.long),
                             torch.tensor([0, 3]))
    no_cache = attn(q, k, v, meta)  # a warm-up prefill before the runner assigns caches
    assert torch.allclose(no_cache, reference_attention(q, k, v, 1.0), atol=1e-5)
    with pytest.raises(RuntimeError, match="decode step needs the KV cache"):
        attn(q[:1], k[:1], v[:1], AttentionMetadata(False, meta.slot_mapping[:1], meta.context_lens, meta.block_tables,
                                                      torch.tensor([0, 1])))
    Pages(attn, 4, (4, BS, KV, D))
    meta.slot_mapping = torch.tensor([0, -1, 2])
    assert torch.allclose(attn(q, k, v, meta), no_cache, atol=1e-6)
    assert torch.equal(attn.k_cache.view(-1, KV, D)[[0, 2]], k[[0, 2]])
    assert not attn.k_cache.view(-1, KV, D)[1].any() and not attn.k_cache.view(-1, KV, D)[3:].any()


# --------------------------------------------------------------------------- 2 real ranks

VOCAB = 13


def layer_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = gen(11)
    x, ids = torch.randn(4, HIDDEN, generator=g), torch.randint(0, VOCAB, (6,), generator=g)
    return x, ids, torch.randn(VOCAB, HIDDEN, generator=g)


def rank_main() -> None:
    _, rank, world, port, out = rank_args()
    init_gloo(rank, world, port)
    result = {}
    try:
        P.initialize(ParallelConfig(dense=DenseParallelConfig(tp_size=world),
                                    attention=AttentionParallelConfig(tp_size=world)), rank)
        x, ids, table = layer_inputs()
        with torch.inference_mode():
            for heads, kv in ((4, 2), (4, 1)):
                w = qkv_weights(heads, kv, True)
                qkv = build_qkv(heads, kv, w)
                result[f"qkv{heads}{kv}"] = qkv(x).tolist()
                # q heads -> o_proj (row parallel on attention_tp) gives the full output on every rank
                o = RowParallelLinear(heads * HEAD, HIDDEN, bias=True, group="attention_tp")
                ow = torch.randn(HIDDEN, heads * HEAD, generator=gen(3))
                o.weight.weight_loader(o.weight, ow)
                o.bias.weight_loader(o.bias, torch.ones(HIDDEN))
                result[f"o{heads}{kv}"] = o(qkv(x)[:, :qkv.num_heads * HEAD]).tolist()
            gate, up = merged_weights()
            merged = MergedColumnParallelLinear(HIDDEN, [12, 12])
            merged.weight.weight_loader(merged.weight, gate, 0)
            merged.weight.weight_loader(merged.weight, up, 1)
            down = RowParallelLinear(12, HIDDEN, bias=False)
            down.weight.weight_loader(down.weight, torch.randn(HIDDEN, 12, generator=gen(4)))
            g, u = merged(x).chunk(2, dim=-1)
            result["mlp"] = down(F.silu(g) * u).tolist()
            emb, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
            head.weight = emb.weight
            emb.weight.weight_loader(emb.weight, table)
            result["emb"] = emb(ids).tolist()
            logits = head(x)
            result["logits"] = None if logits is None else logits.tolist()
        dist.barrier()
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, result)


def test_two_ranks_sharded_layers_equal_the_full_computation(tmp_path):
    results = launch(__file__, 2, tmp_path)
    x, ids, table = layer_inputs()
    for heads, kv in ((4, 2), (4, 1)):
        w = qkv_weights(heads, kv, True)
        ow = torch.randn(HIDDEN, heads * HEAD, generator=gen(3))
        want_o = F.linear(F.linear(x, w["q"], w["qb"]), ow, torch.ones(HIDDEN))
        for r, result in enumerate(results):
            want_qkv = expected_qkv(x, w, heads, kv, r, 2)
            assert torch.allclose(torch.tensor(result[f"qkv{heads}{kv}"]), want_qkv, atol=1e-5)
            assert torch.allclose(torch.tensor(result[f"o{heads}{kv}"]), want_o, atol=1e-4)
    gate, up = merged_weights()
    want_mlp = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), torch.randn(HIDDEN, 12, generator=gen(4)))
    for result in results:
        assert torch.allclose(torch.tensor(result["mlp"]), want_mlp, atol=1e-4)
        assert torch.allclose(torch.tensor(result["emb"]), F.embedding(ids, table))
    assert torch.allclose(torch.tensor(results[0]["logits"]), x @ table.T, atol=1e-5)
    assert results[1]["logits"] is None  # gathered to group rank 0 only


if __name__ == "__main__":
    rank_main()
