"""kernels.adamw: the torch path is torch.optim.AdamW bit for bit; the one-launch Triton kernel
(interpreted on CPU, compiled on CUDA) updates every tensor of a list like it, applies the clipping
factor on the fly and writes the low-precision copy as the updated float32 weight rounded."""

import math

import pytest
import torch

from moezoo.kernels import adamw as A

HP = dict(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# sizes around the kernel's block: one element, a partial block, a block and one, a 3-D stack
SHAPES = [(1,), (7, 33), (A.BLOCK + 1,), (3, 40, 17)]


def _state(device, seed):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(s, generator=g) for s in SHAPES]
    m = [torch.randn(s, generator=g) * 0.05 for s in SHAPES]
    v = [torch.rand(s, generator=g) * 1e-3 for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    return [[t.to(device) for t in ts] for ts in (w, m, v, grads)]


def test_torch_path_is_torch_adamw_bit_for_bit():
    w, _, _, grads = _state("cpu", 0)
    params = [torch.nn.Parameter(t.clone()) for t in w]
    opt = torch.optim.AdamW(
        params,
        lr=HP["lr"],
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        weight_decay=HP["weight_decay"],
    )
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    low = [t.to(torch.bfloat16) for t in w]
    for step in range(1, 4):
        g16 = [(g.float() * step).to(torch.bfloat16) for g in grads]
        for p, g in zip(params, g16):
            p.grad = g.float()  # what autocast hands a float32 parameter
        opt.step()
        A.adamw_reference_(
            w,
            g16,
            m,
            v,
            low,
            1 - HP["lr"] * HP["weight_decay"],
            HP["beta1"],
            HP["beta2"],
            HP["eps"],
            HP["lr"] / (1 - HP["beta1"] ** step),
            math.sqrt(1 - HP["beta2"] ** step),
            None,
        )
    for p, t, lo, s in zip(params, w, low, SHAPES):
        assert torch.equal(p.detach(), t), s
        assert torch.equal(lo, t.to(torch.bfloat16)), s
        assert torch.equal(opt.state[p]["exp_avg_sq"], v[SHAPES.index(s)]), s


def _compare_kernel_to_reference(device, rtol, atol, exact_round):
    scale = torch.tensor(0.37, device=device)
    for with_params, with_scale in ((True, True), (False, False)):
        w, m, v, grads = _state(device, 1)
        ref = [[t.clone() for t in ts] for ts in (w, m, v)]
        low = [t.to(torch.bfloat16) for t in w] if with_params else None
        A._adamw_triton(
            w,
            grads,
            m,
            v,
            low,
            1 - 2e-4,
            0.9,
            0.95,
            1e-8,
            0.0125,
            0.3,
            scale if with_scale else None,
        )
        A.adamw_reference_(
            *ref[:1],
            grads,
            *ref[1:],
            None,
            1 - 2e-4,
            0.9,
            0.95,
            1e-8,
            0.0125,
            0.3,
            scale if with_scale else None,
        )
        for got, want in zip((w, m, v), ref):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        if with_params and exact_round:  # the compiled cast rounds to nearest even
            assert all(torch.equal(lo, t.to(torch.bfloat16)) for lo, t in zip(low, w))
        elif with_params:  # the interpreter's own cast is not IEEE: within one bf16 step
            for lo, t in zip(low, w):
                torch.testing.assert_close(lo.float(), t, rtol=2**-7, atol=0)
    # found_inf: 0 updates as without it, nonzero (a skipped step) writes nothing, even with NaN
    # gradients
    for flag in (0.0, 1.0):
        w, m, v, grads = _state(device, 4)
        if flag:
            grads[1][0, 0] = float("nan")
        before = [[t.clone() for t in ts] for ts in (w, m, v)]
        low = [t.to(torch.bfloat16) for t in w]
        low_before = [t.clone() for t in low]
        A._adamw_triton(
            w,
            grads,
            m,
            v,
            low,
            1 - 2e-4,
            0.9,
            0.95,
            1e-8,
            0.0125,
            0.3,
            scale,
            torch.tensor(flag, device=device),
        )
        ref = [[t.clone() for t in ts] for ts in before]
        if not flag:
            A.adamw_reference_(
                ref[0], grads, ref[1], ref[2], None, 1 - 2e-4, 0.9, 0.95, 1e-8, 0.0125, 0.3, scale
            )
        for got, want in zip((w, m, v), ref):
            for a, b in zip(got, want):
                if flag:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        assert not flag or all(torch.equal(a, b) for a, b in zip(low, low_before))
    w, m, v, grads = _state(device, 5)  # the torch path reads the flag on the host
    before = [t.clone() for t in w]
    A.adamw_reference_(
        w,
        grads,
        m,
        v,
        None,
        1 - 2e-4,
        0.9,
        0.95,
        1e-8,
        0.0125,
        0.3,
        None,
        torch.tensor(1.0, device=device),
    )
    assert all(torch.equal(a, b) for a, b in zip(w, before))


@pytest.mark.usefixtures("triton_interpreter")
def test_triton_kernel_updates_every_tensor_like_the_torch_path():
    pytest.importorskip("triton")
    _compare_kernel_to_reference("cpu", rtol=2e-6, atol=1e-7, exact_round=False)


@pytest.mark.usefixtures("triton_interpreter")
def test_unaligned_tensors_take_the_torch_path():
    # the kernel reads full blocks with 16-byte vector loads: a view 4 bytes into its storage must
    # not reach it
    pytest.importorskip("triton")
    w, m, v, grads = _state("cpu", 3)
    w[1] = torch.randn(SHAPES[1][0] * SHAPES[1][1] + 1)[1:].view(SHAPES[1])
    assert w[1].data_ptr() % 16
    ref = [[t.clone() for t in ts] for ts in (w, m, v)]
    A.adamw_(w, grads, m, v, step=2, **HP)
    args = (
        1 - HP["lr"] * HP["weight_decay"],
        HP["beta1"],
        HP["beta2"],
        HP["eps"],
        HP["lr"] / (1 - HP["beta1"] ** 2),
        math.sqrt(1 - HP["beta2"] ** 2),
        None,
    )
    A.adamw_reference_(ref[0], grads, ref[1], ref[2], None, *args)
    assert all(torch.equal(a, b) for got, want in zip((w, m, v), ref) for a, b in zip(got, want))


def test_adamw_refuses_mixed_dtypes_in_one_call():
    w, m, v, grads = _state("cpu", 2)
    with pytest.raises(TypeError, match="one gradient dtype"):
        A.adamw_(w, [grads[0].float()] + grads[1:], m, v, step=1, **HP)
    with pytest.raises(TypeError, match="weights must be float32"):
        A.adamw_([t.bfloat16() for t in w], grads, m, v, step=1, **HP)


@pytest.mark.gpu
def test_triton_kernel_on_cuda_matches_the_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare_kernel_to_reference("cuda", rtol=2e-6, atol=1e-7, exact_round=True)
