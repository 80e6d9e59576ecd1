"""kernels.grouped_wgrad on CPU (torch._grouped_mm's CPU path): the row split partitions every
group, the split weight gradient equals the per-expert float32 product within bf16 error for any
number of parts (uneven and empty groups, rows past the last group), the grouped linear's gradients
equal autograd through torch._grouped_mm, and the split count follows the output-tile count."""

import pytest
import torch

from moezoo.kernels import grouped_wgrad as gw

OFFS = [5, 5, 40, 41, 100]  # uneven groups, one empty expert; rows 100.. past the last group


def per_expert(a_t, b, offs):
    out, start = [], 0
    for end in offs:
        out.append(a_t[:, start:end].double() @ b[start:end].double())
        start = end
    return torch.stack(out)


def test_split_group_ends_partition_each_group_into_near_equal_consecutive_parts():
    offs = torch.tensor(OFFS, dtype=torch.int32)
    for s in (1, 2, 3, 4):
        ends = gw.split_group_ends(offs, s)
        assert ends.dtype == torch.int32 and ends.numel() == len(OFFS) * s
        assert torch.equal(ends.view(-1, s)[:, -1], offs), (
            "the last part of a group ends where the group does"
        )
        sizes = torch.diff(ends, prepend=ends.new_zeros(1)).view(-1, s)
        assert bool((sizes >= 0).all())
        assert bool((sizes.amax(1) - sizes.amin(1) <= 1).all()), "parts differ by at most one row"


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_split_weight_gradient_equals_the_per_expert_product(monkeypatch, splits):
    monkeypatch.setattr(gw, "SPLITS", splits)
    g = torch.Generator().manual_seed(splits)
    a = torch.randn(110, 24, generator=g).bfloat16()
    b = torch.randn(110, 16, generator=g).bfloat16()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    got = gw.grouped_wgrad(a.t(), b, offs)
    want = per_expert(a.t(), b, OFFS)
    assert got.shape == (len(OFFS), 24, 16) and got.dtype == torch.bfloat16
    assert torch.count_nonzero(got[1]) == 0, "an empty expert's gradient is zero"
    err = float((got.double() - want).norm() / want.norm())
    assert err < 2**-7, err  # bf16 rounding of the partial products and of the sum


def test_grouped_linear_gradients_equal_autograd_through_grouped_mm(monkeypatch):
    monkeypatch.setattr(gw, "SPLITS", 3)
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    x = torch.randn(110, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(len(OFFS), 48, 32, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(110, 48, generator=g).bfloat16()
    y = gw.grouped_linear(x, w, offs)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = torch._grouped_mm(x2, w2.transpose(-2, -1), offs=offs)
    y2.backward(dy)
    n = OFFS[-1]
    assert torch.equal(y[:n], y2[:n]) and torch.equal(x.grad[:n], x2.grad[:n])
    assert float((w.grad.double() - w2.grad.double()).norm() / w2.grad.double().norm()) < 2**-7


def test_splits_follow_the_output_tile_count(monkeypatch):
    monkeypatch.setattr(gw, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # the dim-512 MoE: 8 experts of 704 x 512 over 65536 rows -> 96 tiles of 128 x 256 on 132 SMs:
    # split in 2 or 3 some SMs still get 2 or 3 tiles (no gain); in 4, 3 tiles of a quarter each
    # (3/4 of the time)
    assert gw.wgrad_splits(65536, 8, 704, 512, cuda) == 4
    assert gw.wgrad_splits(8 * 2048, 8, 704, 512, cuda) == 1  # 2 parts of 1024 rows would not pay
    assert gw.wgrad_splits(32768, 8, 14336, 4096, cuda) == 1  # Mixtral: tiles to spare
    assert gw.wgrad_splits(131072, 64, 1024, 2048, cuda) == 1  # OLMoE
    assert gw.wgrad_splits(4096, 8, 704, 512, cuda) == 1  # too few rows a part
    assert gw.wgrad_splits(65536, 8, 704, 512, torch.device("cpu")) == 1
    # inside a compiled graph (a block's backward) the SM count is read once while tracing, a
    # constant
    torch._dynamo.reset()
    traced = torch.compile(
        lambda t: t * gw.wgrad_splits(65536, 8, 704, 512, cuda), backend="eager", fullgraph=True
    )
    assert float(traced(torch.ones(()))) == 4.0


def test_grouped_linear_traces_into_one_graph_forward_and_backward(monkeypatch):
    # the MoE block is compiled: the split backward must not break its graph
    monkeypatch.setattr(gw, "SPLITS", 2)
    torch._dynamo.reset()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    x = torch.randn(110, 32).bfloat16().requires_grad_()
    w = torch.randn(len(OFFS), 48, 32).bfloat16().requires_grad_()

    def loss(x, w):
        return gw.grouped_linear(x, w, offs).float().square().sum()

    # backward: AOT-traced at compile
    torch.compile(loss, backend="aot_eager", fullgraph=True)(x, w).backward()
    got = w.grad.clone()
    w.grad = None
    loss(x, w).backward()
    assert torch.allclose(got.float(), w.grad.float(), rtol=0, atol=0)
