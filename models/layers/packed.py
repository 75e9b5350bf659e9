"""Linear layers on the CPU through oneDNN's prepacked weights: the same products, faster.

``F.linear(x, W)`` on the CPU hands an ``[out, in]`` weight to MKL's GEMM on every
call. For the few rows of a decode step that is far from what the memory and the
cores allow (measured on the 2-core AMD VMs we run on, fp32, 8 layers of a 512-wide
Qwen3 and its 32,000-row head: 1 row 1.5 to 1.8x faster, 16 rows about 2x, a
512-token prefill 1.6x). oneDNN (bundled with torch as MKL-DNN) can reorder a weight
once into the blocked layout its kernels stream best, and then multiply any number
of rows by it: what Intel's extension for PyTorch and vLLM's CPU backend do.

    after the checkpoint is loaded:  pack(layer.weight) -> packed (an opaque oneDNN tensor)
    every forward:                   linear(x, packed, bias) == F.linear(x, W, bias)
                                     up to float rounding: the sums run in another order

Results: each output element is the same dot product, summed in oneDNN's order rather
than MKL's (differences of a few units in the last place: about 1e-4 on logits of
magnitude 20). Row ``i`` of a product does not depend on the other rows (checked in
tests/test_packed.py), so a batched decode gives each sequence what it alone would get.
Greedy tokens therefore stay those of ``transformers`` except at exact near-ties, as
with tensor parallelism, whose partial sums reorder the same additions.

Used only where ``available`` says so: a CPU fp32 weight and a torch whose oneDNN
offers the two operators (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, the ones torch's own compiler emits for CPU linear layers);
``pack`` checks one product against ``F.linear`` and returns None (the layer keeps
``F.linear``) if the operator fails or disagrees.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

#: the largest difference from F.linear that ``pack``'s check accepts, relative to the output's scale
_TOLERANCE = 1e-4


def available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed: fp32, on the CPU, with torch's oneDNN operators present."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() == 0:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def pack(weight: torch.Tensor) -> Any | None:
    """``weight`` ([out, in]) reordered for oneDNN, or None where that is not available or does
    not reproduce ``F.linear`` on a test row (then the caller keeps ``F.linear``)."""
    if not available(weight):
        return None
    with torch.no_grad():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.linspace(-1.0, 1.0, weight.shape[1], dtype=weight.dtype).unsqueeze(0)
            got, want = linear(probe, packed), F.linear(probe, weight)
        except RuntimeError:
            return None
    scale = float(want.abs().max()) or 1.0
    if got.shape != want.shape or float((got - want).abs().max()) > _TOLERANCE * scale:
        return None
    return packed


def linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``packed = pack(W)``; ``x`` of any leading shape."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def matmul(layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + bias`` for a layer with ``weight`` and a ``packed`` slot: through the packed
    weight once ``pack_layer`` packed it, else ``F.linear``."""
    if layer.packed is not None:
        return linear(x, layer.packed, bias)
    return F.linear(x, layer.weight, bias)


def pack_layer(layer: Any, free: bool) -> bool:
    """Pack ``layer.weight`` into ``layer.packed`` (which its forward then uses); with ``free``, the
    plain weight's memory is given back (its shape stays in ``layer.weight_shape``). False where
    ``pack`` declined: the layer keeps its plain weight and ``F.linear``."""
    packed = pack(layer.weight)
    if packed is None:
        return False
    layer.packed = packed
    if free:
        layer.weight_shape = tuple(layer.weight.shape)
        layer.weight.data = layer.weight.data.new_empty(0)
    return True


def pack_model(model: torch.nn.Module) -> int:
    """Pack the weight of every layer of ``model`` that has a ``packed`` slot (the linear layers and
    the LM head of ``models.layers``); a weight another module shares (a head tied to its
    embedding) is kept too. How many layers were packed."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if hasattr(module, "packed") and module.packed is None:
            count += pack_layer(module, free=users.get(id(module.weight), 0) == 1)
    return count
