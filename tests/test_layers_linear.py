"""models.layers.linear: slicing, the Column -> Row pair over a real 2-rank gloo group, divisibility.

The 2-rank run starts two copies of this file as rank processes (``python this_file
RANK WORLD PORT OUT_DIR``); each writes its output as plain JSON for the test to compare.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from models.layers import ColumnParallelLinear, LinearBase, RowParallelLinear
from runtime import parallel as P
from runtime.core.config import DenseParallelConfig, ParallelConfig
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(120)

IN, MID, OUT = 16, 32, 12


def full_weights(bias: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w = {"w1": torch.randn(MID, IN, generator=gen), "w2": torch.randn(OUT, MID, generator=gen)}
    if bias:
        w |= {"b1": torch.randn(MID, generator=gen), "b2": torch.randn(OUT, generator=gen)}
    return w


def reference(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w["w1"], w.get("b1"))), w["w2"], w.get("b2"))


def pair(w: dict[str, torch.Tensor]) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    bias = "b1" in w
    col, row = ColumnParallelLinear(IN, MID, bias=bias), RowParallelLinear(MID, OUT, bias=bias)
    col.weight.weight_loader(col.weight, w["w1"])
    row.weight.weight_loader(row.weight, w["w2"])
    if bias:
        col.bias.weight_loader(col.bias, w["b1"])
        row.bias.weight_loader(row.bias, w["b2"])
    return col, row


@pytest.fixture
def fake_tp(monkeypatch):
    """Pretend this process is group rank ``r`` of ``n`` (no processes: collectives stay no-ops)."""
    P.destroy()

    def set_rank(r: int, n: int) -> None:
        monkeypatch.setattr(P, "rank", lambda group="world": r)
        monkeypatch.setattr(P, "size", lambda group="world": n)

    return set_rank


@pytest.mark.parametrize("bias", [True, False])
def test_tp1_equals_nn_linear(bias):
    x = torch.randn(5, IN)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        ref = torch.nn.Linear(IN, MID, bias=bias)
        layer = cls(IN, MID, bias=bias)
        assert isinstance(layer, LinearBase) and layer.weight.shape == ref.weight.shape
        layer.weight.weight_loader(layer.weight, ref.weight.detach())
        if bias:
            layer.bias.weight_loader(layer.bias, ref.bias.detach())
        else:
            assert layer.bias is None
        with torch.inference_mode():
            assert torch.allclose(layer(x), ref(x), atol=1e-6)


def test_shards_recombine_to_the_full_layer(fake_tp):
    w, x = full_weights(), torch.randn(3, IN)
    cols, partials = [], []
    for r in range(2):
        fake_tp(r, 2)
        col, row = pair(w)
        assert col.weight.shape == (MID // 2, IN) and col.bias.shape == (MID // 2,)
        assert row.weight.shape == (OUT, MID // 2) and row.bias.shape == (OUT,)
        assert torch.equal(col.weight, w["w1"][r * 16:(r + 1) * 16])
        assert torch.equal(row.weight, w["w2"][:, r * 16:(r + 1) * 16])
        with torch.inference_mode():
            y = col(x)
            cols.append(y)
            partials.append(row(F.gelu(y)))  # all_reduce is a no-op here: a partial sum
    full_mid = F.linear(x, w["w1"], w["b1"])
    assert torch.allclose(torch.cat(cols, dim=-1), full_mid, atol=1e-5)
    # the row bias is added by group rank 0 only, so the partials add up to the full output
    assert torch.allclose(partials[0] + partials[1], reference(x, w), atol=1e-5)


def test_divisibility_and_loader_shape_are_checked(fake_tp):
    fake_tp(0, 3)
    with pytest.raises(ValueError, match=r"output_size 32 .* size 3 of group 'dense_tp'"):
        ColumnParallelLinear(IN, MID)
    with pytest.raises(ValueError, match=r"input_size 32 .* size 3 of group 'attention_tp'"):
        RowParallelLinear(MID, OUT, group="attention_tp")
    fake_tp(0, 2)
    col = ColumnParallelLinear(IN, MID)
    with pytest.raises(ValueError, match=r"expected the full tensor of shape \(32, 16\)"):
        col.weight.weight_loader(col.weight, torch.zeros(MID // 2, IN))


def test_loader_converts_dtype():
    layer = RowParallelLinear(IN, OUT, params_dtype=torch.float64)
    full = torch.randn(OUT, IN)
    layer.weight.weight_loader(layer.weight, full)
    assert layer.weight.dtype == torch.float64 and torch.equal(layer.weight, full.double())


# --------------------------------------------------------------------------- 2 real ranks


def rank_main() -> None:
    _, rank, world, port, out = rank_args()
    init_gloo(rank, world, port)
    try:
        P.initialize(ParallelConfig(dense=DenseParallelConfig(tp_size=world)), rank)
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(3))
        result = {}
        for bias in (True, False):
            col, row = pair(full_weights(bias))
            with torch.inference_mode():
                result[str(bias)] = row(F.gelu(col(x))).tolist()
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, result)


def test_two_ranks_column_row_equals_full_matmul(tmp_path):
    results = launch(__file__, 2, tmp_path)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(3))
    for bias in (True, False):
        want = reference(x, full_weights(bias))
        for result in results:
            assert torch.allclose(torch.tensor(result[str(bias)]), want, atol=1e-5)


if __name__ == "__main__":
    rank_main()
