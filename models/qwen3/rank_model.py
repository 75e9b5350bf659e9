"""One rank's share of ``qwen3``: the model, its KV cache and the forward pass (``RankModel``),
the batch every rank runs (``Batch``) and the leader's plan broadcast (``broadcast_plan``).

The leader and the followers of ``models/qwen3/runner.py`` are both a ``RankModel``: what
they share is the weights, the cache and ``forward``; what differs is who schedules.

KV cache: ``kv_cache_blocks`` blocks per rank, or, when None, what fits in a share
of free memory (``KV_CACHE_MEMORY_FRACTION`` of free CUDA memory on the device
after loading, or of available host memory divided among the ranks on CPU), capped
at what ``max_num_seqs`` sequences of ``max_position_embeddings`` tokens could use;
the count is agreed with an all_reduce MIN over the world so that every rank holds
the same blocks. With the static decode on, the cache holds one more block, the
padding block (``num_blocks``), which no sequence owns.

Decode steps (see ``models/qwen3/static_decode.py``): with CUDA graphs on
(``cuda_graph_status``: a CUDA device, not ``enforce_eager``, and NCCL >= 2.9.6 when
tp > 1) or ``static_decode=True``, a decode step that fits the captured shapes runs
on static buffers, padded to the next captured batch size: replayed from a CUDA graph,
or run eagerly where graphs are off. Every other step (prefill, or a decode that does
not fit) runs the eager forward below. Each rank picks the same path and shape from
the same plan. The reasons (graphs, attention kernel) are logged once by rank 0 on
"phyrt.qwen3" and kept in ``cuda_graphs``/``attention_backend``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.qwen3.request import Qwen3Args
from runtime import parallel as P
from runtime import BuildContext

#: size of the one broadcast that carries a typical plan (longer plans take two)
PLAN_BYTES = 16384
#: share of free memory the KV cache takes when ``kv_cache_blocks`` is None
KV_CACHE_MEMORY_FRACTION = {"cuda": 0.8, "cpu": 0.2}
log = logging.getLogger("phyrt.qwen3")
_ARRAYS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens", "block_tables")


@dataclass
class Batch:
    """One forward pass's inputs, identical on every rank; int64 arrays."""

    is_prefill: bool
    input_ids: np.ndarray      # [T] the new tokens of all sequences, sequence after sequence
    positions: np.ndarray      # [T]
    slot_mapping: np.ndarray   # [T] KV-cache slot each new token is written to
    cu_seqlens_q: np.ndarray   # [B+1] offsets of each sequence's new tokens
    context_lens: np.ndarray   # [B] tokens in each sequence's cache after this step
    block_tables: np.ndarray   # [B, max_blocks], -1 padded

    def pack(self) -> dict[str, Any]:
        return {"prefill": self.is_prefill, **{k: getattr(self, k).tobytes() for k in _ARRAYS}}

    @classmethod
    def unpack(cls, plan: dict[str, Any]) -> "Batch":
        arrays = {k: np.frombuffer(plan[k], dtype=np.int64).copy() for k in _ARRAYS}
        arrays["block_tables"] = arrays["block_tables"].reshape(len(arrays["context_lens"]), -1)
        return cls(is_prefill=plan["prefill"], **arrays)


class RankModel:
    """The model of one rank, with its KV cache, decode buffers and counters."""

    def __init__(self, ctx: BuildContext, args: Qwen3Args) -> None:
        from models.layers.attention import flash_attention_status
        from models.qwen3.static_decode import StaticDecoder, cuda_graph_status

        self.args = args
        self.device = torch.device(ctx.device)
        dtype = ctx.params_dtype
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
        self.distributed = P.size("world") > 1
        self.leader = P.rank("world") == 0
        self.model, self.packed_layers = _load_model(args, self.dtype, self.device)
        flash, self.attention_backend = flash_attention_status(self.device, self.dtype, args.block_size)
        if not flash:
            self.attention_backend = f"torch SDPA ({self.attention_backend})"
        backend = None
        if self.distributed:
            import torch.distributed as dist

            backend = dist.get_backend()
        graphs, self.cuda_graphs = cuda_graph_status(self.device, enforce_eager=args.enforce_eager,
                                                     world_size=P.size("world"), backend=backend)
        static = graphs or args.static_decode
        self.num_blocks = self._allocate_kv_cache(ctx.target, padding_block=static)
        self.decoder = None
        if static:
            self.decoder = StaticDecoder(
                self.model, block_size=args.block_size, padding_block=self.num_blocks,
                max_num_seqs=args.max_num_seqs, max_len=min(args.max_seq_len_to_capture, args.max_positions),
                flash=flash, use_graphs=graphs)
            if graphs:
                self.cuda_graphs += (f", decode batch sizes {self.decoder.sizes} x block-table widths "
                                     f"{self.decoder.widths} captured")
        if self.leader:
            decode = ("CUDA graphs" if graphs else "static buffers, run eagerly (static_decode=True)" if static
                      else "eager")
            log.log(logging.WARNING if self.device.type == "cuda" and not graphs and not args.enforce_eager
                    else logging.INFO, "qwen3: CUDA graphs %s; decode: %s; attention: %s; linear layers: %s",
                    self.cuda_graphs, decode, self.attention_backend,
                    f"{self.packed_layers} oneDNN-packed" if self.packed_layers else "F.linear")
        # counters for inspection: steps run, decode steps on the static buffers, most sequences in one step
        self.num_steps = 0
        self.num_static_steps = 0
        self.max_batch_seqs = 0

    @property
    def num_preemptions(self) -> int:
        return 0

    def _allocate_kv_cache(self, target: str, padding_block: bool = False) -> int:
        layers = self.model.attention_layers()
        block_shape = self.model.kv_cache_shape(1, self.args.block_size)
        block_bytes = 2 * len(layers) * math.prod(block_shape) * self.dtype.itemsize
        num_blocks = self.args.kv_cache_blocks
        if num_blocks is None:
            if target == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
            else:
                import psutil

                free = psutil.virtual_memory().available // P.size("world")  # the ranks share the host
            useful = self.args.max_num_seqs * math.ceil(self.args.max_positions / self.args.block_size)
            num_blocks = max(1, min(useful, int(free * KV_CACHE_MEMORY_FRACTION[target]) // block_bytes))
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        num_blocks = int(P.all_reduce(agreed, "world", op="min").item())
        shape = self.model.kv_cache_shape(num_blocks + padding_block, self.args.block_size)
        cache = torch.zeros(2, len(layers), *shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        self.kv_cache = cache
        return num_blocks

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Run the model on ``batch``; the logits of each sequence's last token on rank 0."""
        from models.layers.attention import AttentionMetadata

        self.num_steps += 1
        self.max_batch_seqs = max(self.max_batch_seqs, len(batch.context_lens))
        if not batch.is_prefill and self.decoder is not None:
            hidden = self.decoder.run(batch)  # None: the batch does not fit the static shapes
            if hidden is not None:
                self.num_static_steps += 1
                return self.model.compute_logits(hidden)

        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        meta = AttentionMetadata(is_prefill=batch.is_prefill, slot_mapping=dev(batch.slot_mapping),
                                 context_lens=dev(batch.context_lens), block_tables=dev(batch.block_tables),
                                 cu_seqlens_q=dev(batch.cu_seqlens_q))
        hidden = self.model(dev(batch.input_ids), dev(batch.positions), meta)
        return self.model.compute_logits(hidden[dev(batch.cu_seqlens_q[1:] - 1)])


def broadcast_plan(data: bytes | None) -> bytes:
    """The leader's plan on every rank: the leader passes it, followers pass None. Sent over
    ``P.cpu_broadcast`` (shared memory when the ranks share a host, else the gloo CPU group)."""
    head = np.zeros(PLAN_BYTES, dtype=np.uint8)
    if data is not None:
        head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        first = data[:PLAN_BYTES - 8]
        head[8:8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
    P.cpu_broadcast(torch.from_numpy(head), src=0)
    size = int.from_bytes(head[:8].tobytes(), "little")
    if size <= PLAN_BYTES - 8:
        return head[8:8 + size].tobytes()
    rest = np.zeros(size - (PLAN_BYTES - 8), dtype=np.uint8)
    if data is not None:
        rest[:] = np.frombuffer(data[PLAN_BYTES - 8:], dtype=np.uint8)
    P.cpu_broadcast(torch.from_numpy(rest), src=0)
    return head[8:].tobytes() + rest.tobytes()


def _load_model(args: Qwen3Args, dtype: torch.dtype, device: torch.device) -> tuple[Any, int]:
    """The model with this rank's slices of the checkpoint loaded; on the CPU its linear layers
    packed for oneDNN unless ``packed_weights`` is False (``models.layers.packed``); how many were."""
    from models.loader import load_checkpoint, load_config
    from models.qwen3.model import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(load_config(args.model), dtype, device).eval()
    load_checkpoint(model, args.model)
    if not args.packed_weights or device.type != "cpu":
        return model, 0
    from models.layers.packed import pack_model

    return model, pack_model(model)
