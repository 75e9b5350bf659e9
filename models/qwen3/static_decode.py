"""Decode steps over static buffers, replayed from CUDA graphs where graphs can be used (vLLM style).

Shapes. A decode step of ``B`` sequences runs as a step of ``S`` rows, the smallest
capture size >= B (``capture_sizes``: 1, 2, 4, 8, ... and ``max_num_seqs``), and a block
table ``W`` columns wide. With CUDA graphs W is the smallest capture width >= the blocks
of its longest sequence (``capture_widths``: with flash-attn one width,
``max_seq_len_to_capture`` tokens, since flash-attn reads only each sequence's own
blocks; with torch SDPA, which attends over all W columns of every row under a
context-length mask, widths of 256, 1024, 4096, ... tokens up to it, so that a short
batch does not pay for the longest). Without graphs nothing constrains W, and it is
exactly the blocks of the longest sequence (so that the eager run costs what the eager
path does; the tests pass explicit ``widths`` to exercise the padded widths on CPU). A
step that does not fit (more rows than the largest size, or a sequence longer than
``max_seq_len_to_capture``) is refused (``run`` returns None) and the caller runs its
eager path.

Buffers, allocated once on the device::

    inputs  int64 [max_size, 4 + max_width]   per row: input id | position | slot | context len | block table
    hidden  [max_size, hidden_size]          the model's output rows

A step fills a host copy of rows ``[:S]`` and columns ``[:4 + W]`` (its B real rows,
then S - B padding rows), copies it to ``inputs`` in one host-to-device copy, runs
``forward_static(S, W)`` (which reads views of ``inputs`` and writes ``hidden[:S]``) and
returns ``hidden[:B]``. A padding row is token 0 at position 0, stored into the first
slot of the PADDING BLOCK, context length 1, every table entry the padding block; a
real row's table columns past its own blocks also hold the padding block (read, then
masked). The padding block is one KV-cache block past the block manager's
``num_blocks``: no sequence ever owns it, so whatever padding rows write there never
reaches a real sequence's cache, and a real row never attends to it (masked).

``forward_static`` has no host-device synchronisation inside (no ``.item()``,
``.tolist()``, ``bool(tensor)``, no data-dependent shape): its metadata has
``static=True``, under which ``models.layers.attention`` skips its ``-1`` slot filter
and attends over the fixed width (see there); the rest of the forward (embedding,
rotary, linear layers, RMSNorm, tp all_reduce) never syncs.

CUDA graphs, when ``cuda_graph_status`` says on: every (S, W) pair is captured once at
build time, from the largest to the smallest, into one shared memory pool, each after a
warm-up run on a side stream (lazy initialisations, cuBLAS workspaces, NCCL
communicators, must not happen inside a capture), with all rows padding so that
warm-up and capture write only to the padding block; a step then copies its inputs
and replays its graph. Every rank captures and replays the same (S, W) sequence, which
is a pure function of the plan every rank receives, so the collectives inside the
graphs match up. Otherwise ``forward_static`` runs eagerly: on CPU that is how its
numerics are tested (``static_decode=True``).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import numpy as np
import torch

from models.layers.attention import AttentionMetadata

#: NCCL collectives can be captured in a CUDA graph from this version on
MIN_NCCL_FOR_CAPTURE = (2, 9, 6)
#: the narrowest SDPA capture width, in tokens; each next one is 4 times wider
FIRST_WIDTH_TOKENS = 256
_ID, _POS, _SLOT, _LEN, _TABLE = 0, 1, 2, 3, 4


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two below ``max_num_seqs``, then ``max_num_seqs``."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def capture_widths(max_len: int, block_size: int, flash: bool, first_tokens: int = FIRST_WIDTH_TOKENS) -> list[int]:
    """Block-table widths (in blocks) captured for sequences of up to ``max_len`` tokens."""
    widest = -(-max_len // block_size)
    if flash:
        return [widest]
    widths, tokens = set(), first_tokens
    while tokens < max_len:
        widths.add(-(-tokens // block_size))
        tokens *= 4
    widths.add(widest)
    return sorted(widths)


def _nccl_version() -> tuple[int, ...] | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # pragma: no cover - a build without NCCL
        return None
    if isinstance(version, int):  # old torch: major * 1000 + minor * 100 + patch
        return (version // 1000, version % 1000 // 100, version % 100)
    return tuple(version)


def cuda_graph_status(device: torch.device | str, *, enforce_eager: bool, world_size: int = 1,
                      backend: str | None = None, nccl_version: tuple[int, ...] | None = None) -> tuple[bool, str]:
    """Whether decode steps are captured in CUDA graphs on this rank, and the reason in words.

    ``world_size``/``backend``: the replica's ranks and the backend of its tp collectives
    (``torch.distributed.get_backend()``), which run inside the captured forward when
    ``world_size > 1``. ``nccl_version``: for tests; None reads torch's. Every rank of a
    replica decides alike (same device type, arguments, backend and build).
    """
    device = torch.device(device)
    if enforce_eager:
        return False, "off: enforce_eager=True in plugin_args"
    if device.type != "cuda":
        return False, f"off: the model runs on {device.type}, and CUDA graphs need a CUDA device"
    if not torch.cuda.is_available():
        return False, "off: torch.cuda is not available"
    if world_size > 1:
        if backend != "nccl":
            return False, (f"off: the tp collectives of the {world_size} ranks run over {backend}, which cannot "
                           "be captured in a CUDA graph (NCCL's can)")
        version = nccl_version if nccl_version is not None else _nccl_version()
        if version is None or tuple(version) < MIN_NCCL_FOR_CAPTURE:
            need = ".".join(map(str, MIN_NCCL_FOR_CAPTURE))
            return False, (f"off: NCCL {'unknown' if version is None else '.'.join(map(str, version))} cannot "
                           f"capture collectives in a CUDA graph (needs >= {need})")
    return True, "on"


class StaticDecoder:
    """Decode steps on static buffers (see the module docstring); CUDA graphs when ``use_graphs``.

    ``widths``: the block-table widths to pad to; None: ``capture_widths`` with graphs, any width
    up to ``max_len`` tokens without.
    """

    def __init__(self, model: Any, *, block_size: int, padding_block: int, max_num_seqs: int, max_len: int,
                 flash: bool, use_graphs: bool, widths: list[int] | None = None) -> None:
        self.model = model
        self.device = torch.device(model.device)
        self.block_size = block_size
        self.padding_block = padding_block
        self.sizes = capture_sizes(max_num_seqs)
        if widths is None and use_graphs:
            widths = capture_widths(max_len, block_size, flash)
        self.widths = sorted(widths) if widths is not None else None
        self.max_width = self.widths[-1] if self.widths else -(-max_len // block_size)
        self.max_len = self.max_width * block_size
        rows, cols = self.sizes[-1], _TABLE + self.max_width
        # one padding row: token 0, position 0, the padding block's first slot, length 1, the padding block
        self._padding = np.full(cols, padding_block, dtype=np.int64)
        self._padding[[_ID, _POS, _SLOT, _LEN]] = (0, 0, padding_block * block_size, 1)
        with torch.inference_mode():
            self.inputs = torch.from_numpy(np.tile(self._padding, (rows, 1))).to(self.device)
            self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=model.params_dtype, device=self.device)
            self.cu_seqlens = torch.arange(rows + 1, dtype=torch.int64, device=self.device)
        on_cuda = self.device.type == "cuda"
        # the host side of the copy: pinned on CUDA (a truly asynchronous copy), reused once the last one is done
        self._host = torch.empty(rows * cols, dtype=torch.int64, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.steps: collections.Counter[tuple[int, int]] = collections.Counter()  # (S, W) -> steps run
        if use_graphs:
            self._capture()

    # -- the step ----------------------------------------------------------------------

    def shape_for(self, batch: Any) -> tuple[int, int] | None:
        """(S, W) for a decode batch, or None when it does not fit (from host arrays: no sync)."""
        n = len(batch.context_lens)
        longest = int(batch.context_lens.max())
        if n > self.sizes[-1] or longest > self.max_len:
            return None
        need = -(-longest // self.block_size)
        width = need if self.widths is None else next(w for w in self.widths if w >= need)
        return next(s for s in self.sizes if s >= n), width

    @torch.inference_mode()
    def run(self, batch: Any) -> torch.Tensor | None:
        """``hidden[:B]`` for a decode batch (``runner.Batch``), or None when it does not fit."""
        shape = self.shape_for(batch)
        if shape is None:
            return None
        size, width = shape
        n, cols = len(batch.context_lens), _TABLE + width
        self.steps[shape] += 1
        with torch.cuda.device(self.device) if self._copied is not None else contextlib.nullcontext():
            if self._copied is not None:
                self._copied.synchronize()  # the previous step's copy has left the pinned buffer (long since)
            host = self._host[:size * cols].view(size, cols)
            rows = host.numpy()
            rows[:] = self._padding[:cols]
            rows[:n, _ID], rows[:n, _POS] = batch.input_ids, batch.positions
            rows[:n, _SLOT], rows[:n, _LEN] = batch.slot_mapping, batch.context_lens
            tables = batch.block_tables[:, :width]
            rows[:n, _TABLE:_TABLE + tables.shape[1]] = np.where(tables < 0, self.padding_block, tables)
            self.inputs[:size, :cols].copy_(host, non_blocking=True)
            if self._copied is not None:
                self._copied.record()
            graph = self.graphs.get((size, width))
            if graph is not None:
                graph.replay()
            else:
                self.forward_static(size, width)
        return self.hidden[:n]

    def forward_static(self, size: int, width: int) -> None:
        """The model on ``inputs[:size]`` with a ``width``-block table into ``hidden[:size]``; no host sync."""
        rows = self.inputs[:size]
        meta = AttentionMetadata(is_prefill=False, slot_mapping=rows[:, _SLOT], context_lens=rows[:, _LEN],
                                 block_tables=rows[:, _TABLE:_TABLE + width], cu_seqlens_q=self.cu_seqlens[:size + 1],
                                 static=True)
        self.hidden[:size].copy_(self.model(rows[:, _ID], rows[:, _POS], meta))

    # -- CUDA graphs ---------------------------------------------------------------------

    @torch.inference_mode()
    def _capture(self) -> None:  # pragma: no cover - CUDA only (tests/gpu/check_cuda.py)
        """Capture every (S, W), largest first, into one pool; ``inputs`` holds padding rows only."""
        pool = None
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            for size in reversed(self.sizes):
                for width in reversed(self.widths):
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):  # warm-up, outside any capture
                        self.forward_static(size, width)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    try:
                        # thread_local: CUDA work of other threads of this process (an inline
                        # engine's caller) may go on meanwhile
                        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                            self.forward_static(size, width)
                    except Exception as exc:
                        raise RuntimeError(
                            f"qwen3: capturing the decode step of {size} sequences x {width} blocks in a CUDA "
                            f"graph failed ({type(exc).__name__}: {exc}); plugin_args enforce_eager=True runs "
                            "without graphs") from exc
                    if pool is None:
                        pool = graph.pool()
                    self.graphs[(size, width)] = graph
            torch.cuda.synchronize()
