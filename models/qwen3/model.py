"""Qwen3 for causal LM, tensor parallel, over a paged KV cache (the model side of the qwen3 plugin).

Interface with the runner (models/qwen3/runner.py)::

    model = Qwen3ForCausalLM(config, params_dtype, device)     on every rank, after P.initialize
    load_checkpoint(model, model_dir)                          models.loader: each rank reads its slices
    shape = model.kv_cache_shape(num_blocks, block_size)       (num_blocks, block_size, kv_heads_per_rank, head_dim)
    for layer in model.attention_layers():                     the runner allocates and assigns, per layer,
        layer.k_cache, layer.v_cache = k[i], v[i]              tensors of `shape`, dtype params_dtype, on device
    hidden = model(input_ids [T], positions [T], meta)         [T, hidden_size] on every rank (collectives inside:
                                                               every rank of the replica calls it in lock step)
    logits = model.compute_logits(hidden[rows])                [N, vocab] on the output rank, None elsewhere

``meta`` is a ``models.layers.attention.AttentionMetadata`` (see there): ``is_prefill``,
``slot_mapping`` [T] int64 (-1 = don't store), ``context_lens`` [B] (cached + new after
this step), ``block_tables`` [B, max_blocks] (-1 padded), ``cu_seqlens_q`` [B+1] int64;
integer tensors may be int32 or int64, on the model's device. A prefill batch may hold
any number of new tokens per sequence (starting after a cached prefix or at 0); a decode
batch exactly one per sequence (T == B). ``positions`` are each new token's absolute
position in its sequence (``context_lens[b] - n_b + i``). The caches must be contiguous
(``cache.view(-1, kv_heads, head_dim)`` is the slot-indexed view); call the model under
``torch.inference_mode()``. The runner passes to ``compute_logits`` the rows it samples
from (the last new token of each sequence); ``compute_logits`` is collective over
``dense_tp`` too. With ``meta.static`` (a decode batch of fixed shape: no -1 slot,
attention over every table column) the forward reads nothing back to the host, so it
can be captured in a CUDA graph (``models/qwen3/static_decode.py``, which captures the
forward only; ``compute_logits`` runs after the replay).

Groups: q/k/v, attention and o_proj are split over ``attention_tp``; the MLP, embedding
and LM head over ``dense_tp``; logits are gathered to group rank 0 of ``dense_tp``
(world rank 0, the output rank, for a replica that is one tp group).

    ids -> embed_tokens -> [ input_layernorm(+res) -> qkv_proj -> q_norm/k_norm -> rope -> attn -> o_proj
                             post_attention_layernorm(+res) -> gate_up_proj -> silu*up -> down_proj ] x L
        -> norm(+res) -> hidden                     compute_logits: lm_head (tied to embed_tokens or not)
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from torch.nn import functional as F

from models.layers.attention import Attention, AttentionMetadata
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import MergedColumnParallelLinear, QKVColumnParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm, rms_norm_heads
from models.layers.rotary import RotaryEmbedding, rope_theta, rotate_heads


def check_config(config: transformers.Qwen3Config) -> None:
    """ValueError for what this implementation does not do (sliding windows, other activations)."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"Qwen3ForCausalLM: only full attention is supported, the config has layer types "
                         f"{sorted(kinds)} (use_sliding_window={getattr(config, 'use_sliding_window', False)})")
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3ForCausalLM: hidden_act must be 'silu', got {config.hidden_act!r}")
    rope_theta(config)


class Qwen3Attention(nn.Module):
    def __init__(self, config: transformers.Qwen3Config, rotary_emb: RotaryEmbedding, kw: dict):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVColumnParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias,
                                                group="attention_tp", **kw)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias, group="attention_tp", **kw)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope``: ``RotaryEmbedding.table`` of this pass's positions.

        The query and key heads are normalised and rotated together, as one [T, h + kv, d] view
        of the qkv output: half the operators of q and k apart, the same arithmetic per element."""
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).unflatten(-1, (heads + 2 * kv_heads, d))
        weight = torch.cat((self.q_norm.weight.expand(heads, d), self.k_norm.weight.expand(kv_heads, d)))
        qk = rotate_heads(rope, rms_norm_heads(qkv[:, :heads + kv_heads], weight, self.q_norm.eps))
        o = self.attn(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], meta)
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, config: transformers.Qwen3Config, kw: dict):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], group="dense_tp", **kw)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, group="dense_tp", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: transformers.Qwen3Config, rotary_emb: RotaryEmbedding, kw: dict):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, kw)
        self.mlp = Qwen3MLP(config, kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, rope, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: transformers.Qwen3Config, kw: dict):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group="dense_tp", **kw)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta(config), device=kw["device"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary, kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        # what every layer derives alike from the positions and the metadata, made once per pass
        rope, meta = self.layers[0].self_attn.rotary_emb.table(positions, x.dtype), meta.per_forward()
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name part -> (fused parameter name part, shard id of its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: transformers.Qwen3Config, params_dtype: torch.dtype, device: torch.device):
        super().__init__()
        check_config(config)
        self.config, self.params_dtype, self.device = config, params_dtype, torch.device(device)
        kw = {"params_dtype": params_dtype, "device": self.device}
        self.model = Qwen3Model(config, kw)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group="dense_tp", **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        attn = self.model.layers[0].self_attn
        return (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
