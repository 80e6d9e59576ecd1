"""The torch references behind the MoE dispatch ops (what runs without Triton) have no boolean-mask
indexing, i.e. no data-dependent shape and no host sync on CUDA, and equal the masked formulations
they replace bit for bit."""

import torch

from moezoo.kernels.moe_combine import moe_combine_backward
from moezoo.kernels.moe_permute import moe_permute_reference
from moezoo.layers.moe.experts import make_plan


def plan_with_drops(T=11, E=5, K=2):
    torch.manual_seed(0)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    plan = make_plan(idx, E, capacity=3, align=2)
    assert (plan.inv < 0).any()
    return plan


def masked_permute(x, inv, num_rows):  # the formulation before: boolean-mask indexing
    T, K = inv.shape
    flat = inv.reshape(-1).long()
    valid = flat >= 0
    tok = torch.arange(T).repeat_interleave(K)
    return x.new_zeros(num_rows, x.shape[1]).index_put((flat[valid],), x[tok[valid]])


def test_permute_reference_has_no_data_dependent_shape_and_equals_the_masked_one():
    plan = plan_with_drops()
    x = torch.randn(plan.inv.shape[0], 6, requires_grad=True)
    got, want = (
        moe_permute_reference(x, plan.inv, plan.num_rows),
        masked_permute(x, plan.inv, plan.num_rows),
    )
    assert got.shape == want.shape and torch.equal(got, want)
    g = torch.randn(want.shape)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    # meta tensors carry no data: a boolean mask (nonzero) would raise here
    out = moe_permute_reference(x.detach().to("meta"), plan.inv.to("meta"), plan.num_rows)
    assert out.shape == (plan.num_rows, 6)


def test_combine_backward_fallback_equals_the_masked_closed_form(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch body, not the interpreted kernel
    plan = plan_with_drops()
    T, K = plan.inv.shape
    ys, w, dout = torch.randn(plan.num_rows, 6), torch.rand(T, K), torch.randn(T, 6)
    dys, dw = moe_combine_backward(dout, ys, plan.inv, w, True)
    valid = plan.inv >= 0
    rows = plan.inv.clamp(min=0).long()
    g = dout.float().unsqueeze(1) * valid.unsqueeze(-1)
    want_dys = torch.zeros_like(ys).index_put(
        (rows[valid],), (g * w.float().unsqueeze(-1))[valid].to(ys.dtype)
    )
    assert dys.shape == ys.shape and torch.equal(dys, want_dys)
    assert torch.equal(dw, (g * ys[rows].float()).sum(-1).to(w.dtype))
    torch.library.opcheck(moe_combine_backward, (dout, ys, plan.inv, w, True))
