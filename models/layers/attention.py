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

Paths (``flash_attention_status`` says which one a device, dtype and block size get,
and why):

- flash-attn, when ``flash_attn`` imports, q is on CUDA in fp16/bf16 and the block size
  is a multiple of 256 (upstream flash-attn 2's paged-KV rule: "Paged KV cache block size
  must be divisible by 256"): ``flash_attn_varlen_func`` (prefill; over the new k/v, or
  over the paged cache through ``block_table`` when a sequence has a cached prefix) and
  ``flash_attn_with_kvcache`` (decode, over the paged cache). The layout it needs is this
  module's own: ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``
  with a contiguous last dim (the runner's per-layer ``cache[0, i]``/``cache[1, i]`` slices
  are), ``block_table`` int32 ``[B, max_blocks]`` (contiguous; columns past a sequence's
  own blocks are never read), ``cache_seqlens``/``cu_seqlens_k`` int32 counting the new
  tokens too (they are stored before attention runs), same dtype for q and cache.
- torch SDPA otherwise: decode batched over sequences (keys gathered from their blocks,
  padded, masked), prefill one sequence at a time (new k/v used directly when nothing
  is cached before them).

Static decode (``meta.static``, the CUDA-graph path of ``models/qwen3/static_decode.py``):
nothing in the forward reads a device value on the host (a stream that is being
captured into a CUDA graph may not synchronise). The caller guarantees every
``slot_mapping`` entry is a real slot (padding rows write to a slot no sequence owns),
so the ``-1`` filter and its ``bool(...)`` are skipped, and decode attends over every
column of ``block_tables`` (a fixed width) under the context-length mask instead of
cutting the width at ``context_lens.max()`` (entries past a sequence's own blocks are
read, then masked; -1 reads block 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

try:  # the CUDA path; absent on CPU machines
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    FLASH_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installation (ImportError, or a broken build)
    flash_attn_varlen_func = flash_attn_with_kvcache = None
    FLASH_IMPORT_ERROR = f"flash_attn does not import ({type(exc).__name__}: {exc})"

FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attention_status(device: torch.device | str, dtype: torch.dtype, block_size: int) -> tuple[bool, str]:
    """Whether ``Attention`` takes the flash-attn path for this device, dtype and block size, and why."""
    device = torch.device(device)
    if FLASH_IMPORT_ERROR is not None:
        return False, FLASH_IMPORT_ERROR
    if device.type != "cuda":
        return False, f"flash-attn needs a CUDA device, the model is on {device}"
    if dtype not in FLASH_DTYPES:
        return False, f"flash-attn needs float16 or bfloat16, the model is {dtype}"
    if block_size % FLASH_BLOCK_MULTIPLE:
        return False, (f"flash-attn's paged KV cache needs a block_size that is a multiple of "
                       f"{FLASH_BLOCK_MULTIPLE}, got {block_size}")
    return True, f"flash-attn (paged KV cache, block_size {block_size})"


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
    static:       a fixed-shape decode that must not synchronise with the host (see the module
                  docstring): no -1 in slot_mapping, attention spans every block_tables column.
    cache:        None, or a dict in which the layers of ONE forward pass keep what they derive
                  from this metadata alike (the kept slots, the decode's block list and mask):
                  the model gives each forward a fresh one (``per_forward``), never a layer.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    static: bool = False
    cache: dict[str, Any] | None = None

    def per_forward(self) -> "AttentionMetadata":
        """A copy whose layers derive the shared tensors once (a new ``cache``): one per forward
        pass, since the runner may refill the same tensors for the next step."""
        return replace(self, cache={})

    def derived(self, key: str, make: Any) -> Any:
        """``make()``, kept in ``cache`` under ``key`` for the other layers of this forward pass."""
        if self.cache is None:
            return make()
        value = self.cache.get(key)
        if value is None:
            value = self.cache[key] = make()
        return value


def kept_slots(slot_mapping: torch.Tensor, all_valid: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to write (int64) and, where some are -1, the mask of the tokens kept (else None)."""
    slots = slot_mapping.long()
    if not all_valid:
        keep = slots >= 0
        if not bool(keep.all()):
            return slots[keep], keep
    return slots, None


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, all_valid: bool = False, meta: AttentionMetadata | None = None) -> None:
    """``cache.view(-1, kv_heads, head_dim)[slot] = k/v`` for every token whose slot is not -1.

    ``all_valid``: the caller guarantees no slot is -1; nothing is then read back to the host
    (the check below is a host-device sync on CUDA, and its filter a data-dependent shape).
    """
    slots, keep = kept_slots(slot_mapping, all_valid) if meta is None else meta.derived(
        "slots", lambda: kept_slots(slot_mapping, all_valid))
    if keep is not None:
        k, v = k[keep], v[keep]
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
            store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.static, meta)
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
        lens = meta.context_lens
        if q.size(0) != lens.numel():
            raise ValueError(f"Attention: a decode step has one token per sequence, got {q.size(0)} tokens "
                             f"for {lens.numel()} sequences")
        block_size = self.k_cache.size(1)
        flat, longest, mask = meta.derived(f"decode/{block_size}", lambda: decode_plan(meta, block_size, q.device))
        shape = (lens.numel(), -1, *self.k_cache.shape[2:])            # [B, S, kv, d]
        keys = self.k_cache.index_select(0, flat).view(shape).to(q.dtype)
        values = self.v_cache.index_select(0, flat).view(shape).to(q.dtype)
        if mask is None and longest is not None:
            keys, values = keys[:, :longest], values[:, :longest]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),  # [B, h, 1, d] x [B, kv, S, d]
            attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    # ------------------------------------------------------------------ flash-attn path (CUDA)

    def _flash(self, q: torch.Tensor) -> bool:
        """``flash_attention_status`` for q and this cache (cheap: no device work)."""
        return (flash_attn_varlen_func is not None and q.is_cuda and q.dtype in FLASH_DTYPES
                and self.k_cache.dtype == q.dtype and self.k_cache.size(1) % FLASH_BLOCK_MULTIPLE == 0)

    def _flash_forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:  # pragma: no cover - CUDA only
        # int32 copies (contiguous, as flash-attn needs); no host sync on the decode path
        lens = meta.context_lens.to(torch.int32)
        tables = meta.block_tables.to(torch.int32).contiguous()
        if not meta.is_prefill:
            # q [B, 1, h, d] against each sequence's first cache_seqlens slots (its new token included)
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


def decode_plan(meta: AttentionMetadata, block_size: int, device: torch.device
                ) -> tuple[torch.Tensor, int | None, torch.Tensor | None]:
    """What every layer's decode attention reads: the blocks to gather (flattened, int64), the
    longest sequence (None on the static path) and the mask of the slots each sequence attends
    to (None when every sequence attends to exactly its first ``longest`` slots)."""
    lens = meta.context_lens.to(device)
    longest = None
    if meta.static:  # a fixed width, no host sync: the caller sized the table for the longest sequence
        blocks = meta.block_tables
    else:
        longest = int(lens.max())
        blocks = meta.block_tables[:, :-(-longest // block_size)]  # blocks of the longest sequence
    flat = blocks.long().clamp(min=0).flatten()  # -1 padding reads block 0, masked below
    if longest is not None and bool((lens == longest).all()):
        # every sequence attends to exactly its first `longest` slots (one request, or equal
        # lengths): no mask, which the CPU kernel runs in about half the time
        return flat, longest, None
    width = blocks.size(1) * block_size
    return flat, longest, (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]
