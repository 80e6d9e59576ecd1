"""FP8 experts (``model.moe.precision: fp8``) on a Hopper / Blackwell GPU; skipped elsewhere. The
compiled Triton quantizers equal the torch references bit for bit; torch._scaled_grouped_mm computes
what the float32 emulation does (layouts, scales, padded wgrad groups, empty experts); the fp8 MoE
layer's output and gradients are within FP8 error of the bf16 layer's, eager, under autocast with
float32 master weights and compiled; a tiny fp8 MoE model trains with finite losses close to
bf16's."""

import pytest
import torch

from moezoo.configs.moe import fp8_missing
from moezoo.layers import MoE

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if fp8_missing("cuda") is not None:
    pytest.skip(f"FP8 grouped GEMMs: {fp8_missing('cuda')}", allow_module_level=True)

# normwise: e4m3 keeps 3 mantissa bits; three chained GEMMs measure ~0.066 (CPU emulation)
FP8_REL = 0.1
SIZES = [0, 17, 500, 3, 1000, 0, 700, 99]  # unaligned, empty experts; rows past the last group


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def wide_rows(R, C, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (
        torch.randn(R, C, device="cuda", generator=g)
        * torch.logspace(-6, 6, R, device="cuda")[:, None]
    )
    x[3] = 0
    return x.bfloat16()


def test_triton_quantizers_on_gpu_equal_the_reference_bit_for_bit():
    from moezoo.kernels import moe_fp8 as f

    x = wide_rows(300, 5000)  # > ROWS_BLOCK columns: the row loop steps
    q, d = f.quantize_rows_triton(x)
    qr, dr = f.quantize_rows_reference(x)
    assert (
        q.dtype == f.FP8
        and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        and torch.equal(d, dr)
    )
    offs = torch.tensor(SIZES, device="cuda").cumsum(0).to(torch.int32)
    y = wide_rows(3000, 333, seed=1)
    pends = f.padded_group_ends(offs)
    P = f.padded_rows(3000, len(SIZES))
    qt, dt = f.quantize_groups_t_triton(y, offs, pends, P)
    qtr, dtr = f.quantize_groups_t_reference(y, offs, pends, P)
    n = int(pends[-1])
    assert torch.equal(qt[:, :n].view(torch.uint8), qtr[:, :n].view(torch.uint8)) and torch.equal(
        dt, dtr
    )
    got, want = (
        f.quantize_dual_triton(y, offs, pends, P),
        f.quantize_dual_reference(y, offs, pends, P),
    )
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
        got[1], want[1]
    )
    assert torch.equal(
        got[2][:, :n].view(torch.uint8), want[2][:, :n].view(torch.uint8)
    ) and torch.equal(got[3], want[3])
    for w in (
        torch.randn(4, 300, 130, device="cuda"),
        torch.randn(4, 300, 130, device="cuda").bfloat16(),
    ):
        got = f.quantize_weight_dual_triton(w)
        qwr, dwr = f.quantize_weight_t_reference(w)
        assert torch.equal(got[2].view(torch.uint8), qwr.view(torch.uint8)) and torch.equal(
            got[3], dwr
        )
        for g_, w_ in zip(got, f.quantize_weight_dual_reference(w)):
            assert (
                torch.equal(g_.view(torch.uint8), w_.view(torch.uint8))
                if w_.dtype == f.FP8
                else torch.equal(g_, w_)
            )


def test_scaled_grouped_mm_forward_dgrad_wgrad_match_the_float32_emulation():
    # The CUDA op on the operands the quantizers laid out, against the same recipe emulated on CPU:
    # equal up to accumulation order, FP8 fast accumulation and the bf16 output (a layout or scale
    # mistake is O(1)).
    from moezoo.kernels.moe_fp8 import fp8_grouped_linear, fp8_grouped_linear_reference

    torch.manual_seed(0)
    R, I, O = 3000, 512, 768
    offs = torch.tensor(SIZES, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(R, I, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(len(SIZES), O, I, device="cuda") * 0.05).requires_grad_()
    dy = torch.randn(R, O, device="cuda").bfloat16()
    y = fp8_grouped_linear(x, w, offs)
    y.backward(dy)
    yr, dxr, dwr = fp8_grouped_linear_reference(
        x.detach().cpu(), w.detach().cpu(), offs.cpu(), dy.cpu()
    )
    n = int(offs[-1])
    assert (
        w.grad.dtype == torch.float32
        and torch.count_nonzero(w.grad[0]) == 0
        and torch.count_nonzero(w.grad[5]) == 0
    )
    for name, got, want in (("y", y[:n], yr[:n]), ("dx", x.grad[:n], dxr[:n]), ("dw", w.grad, dwr)):
        assert rel(got.cpu(), want) < 1e-2, name


def layer_pair(kw, D=512, H=1024, E=8, K=2):
    torch.manual_seed(0)
    bf = (
        MoE(D, H, E, K, backend="grouped", compile_routing=None, **kw)
        .cuda()
        .to(torch.bfloat16)
        .eval()
    )
    f8 = (
        MoE(D, H, E, K, backend="grouped", compile_routing=None, precision="fp8", **kw)
        .cuda()
        .to(torch.bfloat16)
    )
    f8.load_state_dict(bf.state_dict())
    return bf, f8.eval()


def grads(m, x, dy, fn=None):
    """Output, input and parameter gradients of ``fn`` (default ``m``; e.g. its torch.compile)."""
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    # not `fn or m`: a compiled module has no truth value (__len__)
    y = (fn if fn is not None else m)(xi)
    (y.float() * dy).sum().backward()
    return {
        "y": y,
        "dx": xi.grad,
        **{n: p.grad for n, p in m.named_parameters() if p.grad is not None},
    }


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(capacity_factor=0.8),
        dict(group_align=16),
        dict(E=16, K=4, router="noisy_topk"),
        dict(router="sigmoid", shared_experts=1),
    ],
    ids=str,
)
def test_fp8_moe_output_and_gradients_are_within_fp8_error_of_bf16(kw):
    E, K = kw.pop("E", 8), kw.pop("K", 2)
    bf, f8 = layer_pair(kw, E=E, K=K)
    x = torch.randn(4096, 512, device="cuda").bfloat16()
    dy = torch.randn(4096, 512, device="cuda")
    want, got = grads(bf, x, dy), grads(f8, x, dy)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.isfinite(got[name]).all(), name
        assert rel(got[name], want[name]) < FP8_REL, name
    torch.testing.assert_close(f8.stats["tokens_per_expert"], bf.stats["tokens_per_expert"])


def test_fp8_under_autocast_reads_float32_master_weights_and_gives_float32_grads():
    torch.manual_seed(0)
    m = MoE(512, 1024, 8, 2, backend="grouped", compile_routing=None, precision="fp8").cuda()
    x = torch.randn(2048, 512, device="cuda")
    dy = torch.randn(2048, 512, device="cuda")
    out = {}
    for p in ("bf16", "fp8"):
        m.cfg.precision = p
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out[p] = grads(m, x, dy)
    for name, g in out["fp8"].items():
        if name not in ("y", "dx"):
            assert g.dtype == torch.float32, name
        assert rel(g, out["bf16"][name]) < FP8_REL, name


def test_compiled_fp8_moe_equals_eager():
    _, f8 = layer_pair({})
    x = torch.randn(2048, 512, device="cuda").bfloat16()
    dy = torch.randn(2048, 512, device="cuda")
    eager = grads(f8, x, dy)
    compiled = grads(f8, x, dy, torch.compile(f8))
    for name in eager:
        assert rel(compiled[name], eager[name]) < 1e-2, name


def test_tiny_fp8_moe_model_trains_with_finite_losses_close_to_bf16(tmp_path, corpus_dir):
    # The trainer in this process (no train.py start-up per precision): 6 steps each, the same data.
    from helpers import tiny_overrides
    from moezoo.configs import load_config
    from moezoo.training.loop import Trainer

    losses = {}
    for p in ("bf16", "fp8"):
        cfg = load_config(
            "zoo/tiny_moe.yaml",
            tiny_overrides(
                tmp_path / p, corpus_dir, **{"train.device": "cuda", "model.moe.precision": p}
            ),
        )
        trainer = Trainer(cfg)
        losses[p] = [float(trainer.train_step()["loss/total"]) for _ in range(6)]
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert a == a and abs(a) != float("inf") and abs(a - b) < 0.02 * abs(b), losses
