"""bench/triton_grouped_gemm.py (the fused grouped-GEMM contender of bench/moe_gemm.py,
BENCHMARKS.md, Tried and rejected) against per-group matmuls, under the Triton interpreter on CPU.
Not part of the library suite (it lost every benchmark, so nothing in the library uses it); run it
with ``pytest bench/test_triton_grouped_gemm.py``.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _groups(E=5, k=64, T=20, K=2):
    """Uneven groups with an empty one, gathered rows, float32 operands (fresh random values)."""
    counts = torch.tensor([9, 0, 17, 1, 13])[:E]
    ends = torch.cumsum(counts, 0).to(torch.int32)
    M = int(ends[-1])
    return ends, torch.randn(T, k), torch.randint(0, T, (M,), dtype=torch.int32)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("n", [48, 64], ids=["n48", "n64"])
def test_triton_grouped_gemm_matches_per_group_matmuls(tma, n):
    import triton

    from bench import triton_grouped_gemm as G

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    cfg = dict(BM=16, BN=16 if n == 48 else 32, BK=16, GROUP_M=2, TMA=tma)
    ends, x, src = _groups()
    E, k = ends.numel(), x.shape[1]
    b1, b3, b_nn = torch.randn(E, n, k), torch.randn(E, n, k), torch.randn(E, k, n)
    xs, scale = x[src.long()], torch.rand(src.numel())
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        G.grouped_mm(xs, b1, ends, config=cfg), G.grouped_mm_reference(xs, b1, ends), **tol
    )
    torch.testing.assert_close(
        G.grouped_mm(x, b1, ends, src=src, config=cfg),
        G.grouped_mm_reference(x, b1, ends, src),
        **tol,
    )
    torch.testing.assert_close(
        G.grouped_mm(xs, b_nn, ends, b_kmajor=False, config=cfg),
        G.grouped_mm_reference(xs, b_nn, ends, b_kmajor=False),
        **tol,
    )
    for got, want in zip(
        G.grouped_swiglu(x, b1, b3, ends, src=src, scale=scale, config=cfg),
        G.grouped_swiglu_reference(x, b1, b3, ends, src, scale),
    ):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_triton_grouped_weight_gradient_matches_per_group_matmuls(gather):
    from bench import triton_grouped_gemm as G

    ends, x, src = _groups()
    da = torch.randn(src.numel(), 48)
    b, s = (x, src) if gather else (x[src.long()], None)
    cfg = dict(BM=16, BN=32, BK=16, GROUP_M=2)
    torch.testing.assert_close(
        G.grouped_mm_t(da, b, ends, src_b=s, config=cfg),
        G.grouped_mm_t_reference(da, b, ends, s),
        rtol=1e-4,
        atol=1e-4,
    )
