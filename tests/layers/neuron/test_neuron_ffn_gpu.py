"""NeuronRoutedFFN's CUDA path as the trainer runs it (float32 parameters under bf16 autocast: the
grouped experts and the router on the autocast copy through kernels.router_matmul) against the
float32 torch backend on the same values, sparse and dense mode; skipped without CUDA."""

import pytest
import torch

from moezoo.layers import NeuronRoutedFFN

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run(m, x, dy, autocast):
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = m(xi)
    (y.float() * dy).sum().add(m.aux_loss).backward()
    return y, xi.grad


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("sparse", [True, False])
def test_grouped_path_under_bf16_autocast_matches_float32_reference(sparse, activation):
    D, H, G, K, T = 256, 1024, 16, 4, 768
    torch.manual_seed(0)
    ref = NeuronRoutedFFN(
        D, H, G, K, backend="torch", activation=activation, low_precision_router=False
    ).cuda()
    fast = NeuronRoutedFFN(D, H, G, K, backend="grouped", activation=activation).cuda()
    with torch.no_grad():  # values bf16 can hold: both models route the same tokens
        for p in ref.parameters():
            p.normal_(std=0.05).copy_(p.bfloat16().float())
    fast.load_state_dict(ref.state_dict())
    ref.sparse = fast.sparse = sparse
    x = torch.randn(T, D, device="cuda").bfloat16().float()
    dy = torch.randn(T, D, device="cuda")
    yr, dxr = run(ref, x, dy, autocast=False)
    yf, dxf = run(fast, x, dy, autocast=True)
    assert yf.dtype == torch.bfloat16
    assert rel(yf, yr) < 2e-2 and rel(dxf, dxr) < 2e-2
    for (name, pr), pf in zip(ref.named_parameters(), fast.parameters()):
        # the router takes no gradient from a sparse step, only a zero one
        if name == "router.weight" and sparse:
            assert pf.grad is not None and not pf.grad.any()
        else:
            assert rel(pf.grad, pr.grad) < 3e-2, name
    if sparse:
        torch.testing.assert_close(fast.stats["tokens_per_group"], ref.stats["tokens_per_group"])
    else:
        assert (
            abs(fast.router_stats["router_loss"].item() - ref.router_stats["router_loss"].item())
            < 1e-2
        )
