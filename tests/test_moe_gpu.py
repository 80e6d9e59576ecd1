"""The grouped CUDA path (Triton permute/combine/swiglu + torch._grouped_mm) against the float32 loop
reference, bf16 tolerances; skipped without CUDA."""
import pytest
import torch

from layers import MoE

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=0.8), dict(router="sigmoid", shared_experts=1),
                                dict(E=16, K=4, router="noisy_topk")], ids=str)
@pytest.mark.parametrize("align", [1, 16])
def test_grouped_bf16_matches_fp32_reference_within_bf16_error(kw, align):
    E, K = kw.pop("E", 8), kw.pop("K", 2)
    torch.manual_seed(0)
    ref = MoE(256, 384, E, K, backend="torch", **kw).cuda().eval()
    fast = MoE(256, 384, E, K, backend="grouped", **kw).cuda().to(torch.bfloat16).eval()
    fast.load_state_dict(ref.state_dict())
    ref.load_state_dict(fast.state_dict())            # same bf16-representable weights in both
    MoE.group_align = align
    try:
        x = torch.randn(1000, 256, device="cuda").bfloat16().float()   # same values in both dtypes
        xr, xf = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
        dy = torch.randn(1000, 256, device="cuda")
        yr, yf = ref(xr), fast(xf)
        yr.backward(dy)
        yf.backward(dy.bfloat16())
    finally:
        MoE.group_align = 1
    assert rel(yf, yr) < 2e-2
    assert rel(xf.grad, xr.grad) < 2e-2
    for (n, pr), pf in zip(ref.named_parameters(), fast.parameters()):
        if pr.grad is not None:                     # noise.weight has none in eval
            assert rel(pf.grad, pr.grad) < 3e-2, n
    torch.testing.assert_close(fast.stats["tokens_per_expert"], ref.stats["tokens_per_expert"])


def test_low_precision_router_logits_equal_fp32_logits_of_the_same_values():
    from layers.moe_router import router_matmul
    x = torch.randn(4096, 512, device="cuda").bfloat16()
    w = torch.randn(64, 512, device="cuda").bfloat16()
    fast = router_matmul(x, w)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, x.float() @ w.float().T, rtol=1e-5, atol=1e-4)
