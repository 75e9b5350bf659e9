"""models.layers.packed: linear layers through oneDNN's prepacked weights on the CPU.

The products equal ``F.linear`` up to float rounding, for any number of rows, with and
without bias, on 2-D and 3-D inputs; a row does not depend on the rows beside it; what
cannot be packed is left to ``F.linear``; a packed model frees the plain weights it no
longer reads, but not one another module shares (a tied embedding).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from models.layers import packed as packing
from runtime import parallel as P

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not packing.available(torch.zeros(2, 2)), reason="torch without oneDNN's linear ops")]


@pytest.fixture(autouse=True)
def single_rank():
    P.destroy()  # group rank 0 of 1: no collectives


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 3, 16, 257])
def test_a_packed_product_equals_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 80, generator=gen)
    packed = packing.pack(w)
    assert packed is not None
    assert close(packing.linear(x, packed), F.linear(x, w))
    assert close(packing.linear(x, packed, b), F.linear(x, w, b))
    x3 = x.reshape(1, rows, 80)
    assert close(packing.linear(x3, packed, b), F.linear(x3, w, b))


def test_a_row_does_not_depend_on_the_rows_beside_it():
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(512, 256, generator=gen), torch.randn(16, 256, generator=gen)
    packed = packing.pack(w)
    batched = packing.linear(x, packed)
    for i in (0, 7, 15):
        assert torch.equal(batched[i:i + 1], packing.linear(x[i:i + 1], packed))


@pytest.mark.parametrize("weight", [torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.bfloat16),
                                    torch.zeros(4), torch.zeros(0, 4)])
def test_what_cannot_be_packed_is_left_to_f_linear(weight):
    assert packing.pack(weight) is None
    layer = ColumnParallelLinear(4, 4, bias=False, params_dtype=weight.dtype) if weight.dim() == 2 and weight.numel() \
        else None
    if layer is not None:
        assert packing.pack_model(layer) == 0 and layer.packed is None and layer.weight.numel() == 16


class TwoLayers(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 32)
        self.up, self.down = ColumnParallelLinear(32, 64), RowParallelLinear(64, 32, bias=False)
        self.head = ParallelLMHead(50, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(F.silu(self.up(self.embed(ids)))))


@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_model_gives_the_same_logits_and_frees_what_it_no_longer_reads(tied):
    torch.manual_seed(0)
    model = TwoLayers(tied).eval()
    ids = torch.tensor([1, 7, 49, 3])
    with torch.inference_mode():
        want = model(ids)
    assert packing.pack_model(model) == 3  # up, down, head; not the embedding
    with torch.inference_mode():
        got = model(ids)
    assert close(got, want) and torch.equal(got.argmax(-1), want.argmax(-1))
    assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0
    assert model.embed.weight.shape == (50, 32)  # the embedding still reads its table
    assert (model.head.weight.numel() == 0) is not tied
    assert "in=32, out=64" in repr(model.up) and "packed=True" in repr(model.up)
    assert packing.pack_model(model) == 0  # packed once
