"""Causal attention over a paged KV cache (nano-vllm's Attention, with explicit metadata).

One forward pass carries a flat batch of T new tokens from B sequences::

    tokens   [ seq 0: n0 new | seq 1: n1 new | ... ]     cu_seqlens_q = [0, n0, n0+n1, ...]
    cache    k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim]   (per layer)
    seq b    logical slot j (0 <= j < context_lens[b]) lives in block block_tables[b, j // block_size]
             at offset j % block_size; its new tokens are its LAST n_b slots

``forward(q, k, v, meta)`` first writes every new token's k/v to
``cache.view(-1)[slot_mapping[t]]`` (skipped where the slot is -1, or when no cache is
assigned yet), then each new token of sequence b attends causally to the first
``context_lens[b] - n_b + i + 1`` slots of b (cached prefix + new tokens up to itself).

Paths: on CUDA with ``flash_attn`` importable and a block size that is a multiple of
256 (flash-attn's paged-KV rule), ``flash_attn_varlen_func`` (prefill) and
``flash_attn_with_kvcache`` (decode); otherwise torch SDPA: decode batched over
sequences (keys gathered from their blocks, padded, masked), prefill one sequence at
a time (new k/v used directly when nothing is cached before them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

try:  # the CUDA path; absent on CPU machines
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the installation
    flash_attn_varlen_func = flash_attn_with_kvcache = None

FLASH_BLOCK_MULTIPLE = 256


@dataclass
class AttentionMetadata:
    """One forward pass's batch layout (nano-vllm's Context), the same for every layer.

    is_prefill:   True for a prefill step (any n_b >= 1, may start mid-sequence after a
                  cached prefix), False for decode (exactly one new token per sequence).
    slot_mapping: [T] int64, the cache slot (block * block_size + offset) of each new token; -1 = don't store.
    context_lens: [B] int32/64, tokens in each sequence's cache AFTER this step (cached + new).
    block_tables: [B, max_blocks] int32/64, -1 padded: each sequence's blocks in logical order.
                  May be empty ([B, 0]) in a prefill where no sequence has a cached prefix.
    cu_seqlens_q: [B+1] int64, offsets of each sequence's new tokens in the flat batch.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """``cache.view(-1, kv_heads, head_dim)[slot] = k/v`` for every token whose slot is not -1."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    # index_copy_, not ``cache[slots] = k``: the index_put path is orders of magnitude slower on CPU
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


class Attention(nn.Module):
    """Attention of ``num_heads`` query heads over ``num_kv_heads`` cached heads (this rank's).

    ``k_cache``/``v_cache`` are assigned by the runner (``[num_blocks, block_size,
    num_kv_heads, head_dim]``); until then they are empty and nothing is stored, which
    suits a warm-up prefill without a prefix.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        cached = self.k_cache.numel() > 0
        if cached:
            store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if cached and self._flash(q):
            return self._flash_forward(q, k, v, meta)
        if not meta.is_prefill:
            if not cached:
                raise RuntimeError("Attention: a decode step needs the KV cache, but none is assigned")
            return self._decode(q, meta)
        return self._prefill(q, k, v, meta, cached)

    # ------------------------------------------------------------------ torch path

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """Slots [0, length) of a sequence whose block table row is ``blocks``: [length, kv, d]."""
        n = -(-length // cache.size(1))
        return cache.index_select(0, blocks[:n].long()).flatten(0, 1)[:length]

    def _prefill(self, q, k, v, meta: AttentionMetadata, cached: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        bounds = meta.cu_seqlens_q.tolist()
        for b, length in enumerate(meta.context_lens.tolist()):
            s, e = bounds[b], bounds[b + 1]
            prefix = length - (e - s)
            if prefix < 0:
                raise ValueError(f"Attention: sequence {b} has {e - s} new tokens but context_lens {length}")
            if prefix == 0:
                keys, values, mask = k[s:e], v[s:e], None
            elif not cached:
                raise RuntimeError(f"Attention: sequence {b} has a cached prefix of {prefix} tokens, "
                                   "but no KV cache is assigned")
            else:
                keys = self._gather(self.k_cache, meta.block_tables[b], length)
                values = self._gather(self.v_cache, meta.block_tables[b], length)
                rows = torch.arange(e - s, device=q.device)[:, None] + prefix
                mask = torch.arange(length, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out

    def _decode(self, q, meta: AttentionMetadata) -> torch.Tensor:
        lens = meta.context_lens.to(q.device)
        if q.size(0) != lens.numel():
            raise ValueError(f"Attention: a decode step has one token per sequence, got {q.size(0)} tokens "
                             f"for {lens.numel()} sequences")
        used = -(-int(lens.max()) // self.k_cache.size(1))  # blocks of the longest sequence
        blocks = meta.block_tables[:, :used].long().clamp(min=0)  # -1 padding reads block 0, masked below
        flat = blocks.flatten()
        shape = (blocks.size(0), -1, *self.k_cache.shape[2:])            # [B, S, kv, d]
        keys = self.k_cache.index_select(0, flat).view(shape).to(q.dtype)
        values = self.v_cache.index_select(0, flat).view(shape).to(q.dtype)
        mask = torch.arange(keys.size(1), device=q.device)[None, :] < lens[:, None]  # [B, S]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),  # [B, h, 1, d] x [B, kv, S, d]
            attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    # ------------------------------------------------------------------ flash-attn path (CUDA)

    def _flash(self, q: torch.Tensor) -> bool:
        return (flash_attn_varlen_func is not None and q.is_cuda
                and self.k_cache.size(1) % FLASH_BLOCK_MULTIPLE == 0)

    def _flash_forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:  # pragma: no cover - CUDA only
        lens = meta.context_lens.to(torch.int32)
        tables = meta.block_tables.to(torch.int32)
        if not meta.is_prefill:
            return flash_attn_with_kvcache(q.unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=lens,
                                           block_table=tables, softmax_scale=self.scale, causal=True).squeeze(1)
        cu_q = meta.cu_seqlens_q.to(torch.int32)
        cu_k = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        new = cu_q[1:] - cu_q[:-1]
        if bool((lens > new).any()):  # a cached prefix: read every key through the block tables
            k, v, table = self.k_cache, self.v_cache, tables
        else:
            table = None
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=int(new.max()), max_seqlen_k=int(lens.max()),
                                      softmax_scale=self.scale, causal=True, block_table=table)
