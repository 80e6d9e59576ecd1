"""RMSNorm, RoPE (plain, linear, NTK), dense GQA attention with KV cache, SwiGLU: against plain
formulas."""

import math

import pytest
import torch

from moezoo.configs import load_config
from moezoo.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from moezoo.zoo import build_model


def test_rmsnorm_matches_formula():
    x, n = torch.randn(3, 5, 16), RMSNorm(16, eps=1e-6)
    n.weight.data = torch.randn(16)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight
    torch.testing.assert_close(n(x), ref)


def _naive_rope(x, pos, theta):
    """Rotate pairs (i, i + D/2) by angle pos * theta^(-2i/D), one position at a time."""
    D = x.shape[-1]
    out = torch.empty_like(x)
    for s, p in enumerate(pos.tolist()):
        for i in range(D // 2):
            a = p * theta ** (-2 * i / D)
            x1, x2 = x[..., s, i], x[..., s, i + D // 2]
            out[..., s, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[..., s, i + D // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("linear", 4.0), ("ntk", 4.0)])
def test_rope_matches_naive_rotation_with_scaling(scaling, factor):
    D, theta = 8, 10000.0
    x, pos = torch.randn(2, 3, 6, D, dtype=torch.float64), torch.arange(5, 11)
    cos, sin = RotaryEmbedding(D, theta, scaling, factor)(pos)
    eff_pos = pos / factor if scaling == "linear" else pos
    eff_theta = theta * factor ** (D / (D - 2)) if scaling == "ntk" else theta
    torch.testing.assert_close(
        apply_rotary(x, cos.double(), sin.double()),
        _naive_rope(x, eff_pos, eff_theta),
        rtol=1e-5,
        atol=1e-5,
    )


def _naive_attention(attn, x, cos, sin):
    """Per-head softmax(q k^T / sqrt(d)) v with an explicit causal loop and KV heads repeated."""
    B, S, _ = x.shape
    H, Hk, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rotary(attn.wq(x).view(B, S, H, Dh).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.wk(x).view(B, S, Hk, Dh).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(B, S, Hk, Dh).transpose(1, 2)
    out = torch.zeros(B, H, S, Dh)
    for h in range(H):
        kh, vh = k[:, h * Hk // H], v[:, h * Hk // H]
        for i in range(S):
            w = torch.softmax(
                q[:, h, i : i + 1] @ kh[:, : i + 1].transpose(-1, -2) / math.sqrt(Dh), -1
            )
            out[:, h, i] = (w @ vh[:, : i + 1])[:, 0]
    return attn.wo(out.transpose(1, 2).reshape(B, S, H * Dh))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_dense_gqa_attention_matches_naive_loop(n_kv_heads):
    torch.manual_seed(0)
    attn = Attention(32, 4, n_kv_heads)
    attn.init_weights(0.2, 0.2)
    x = torch.randn(2, 7, 32)
    cos, sin = RotaryEmbedding(8)(torch.arange(7))
    torch.testing.assert_close(
        attn(x, cos, sin), _naive_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5
    )


def test_kv_cache_prefill_then_decode_equals_full_forward():
    cfg = load_config("zoo/tiny_dense.yaml", ["model.n_layers=2"]).model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        model.setup_cache(2, 16)
        steps = [model(tokens[:, :8], start_pos=0)] + [
            model(tokens[:, i : i + 1], start_pos=i) for i in range(8, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_swiglu_matches_formula():
    f, x = SwiGLU(8, 16), torch.randn(4, 8)
    ref = (torch.nn.functional.silu(x @ f.w1.weight.T) * (x @ f.w3.weight.T)) @ f.w2.weight.T
    torch.testing.assert_close(f(x), ref)


def test_transformer_loss_is_cross_entropy_of_logits():
    cfg = load_config("zoo/tiny_dense.yaml", ["model.n_layers=1"]).model
    model = build_model(cfg)
    tok, tgt = torch.randint(0, cfg.vocab_size, (2, 9)), torch.randint(0, cfg.vocab_size, (2, 9))
    loss, parts = model.loss(tok, tgt)
    ref = torch.nn.functional.cross_entropy(model(tok).flatten(0, 1), tgt.flatten())
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(parts["ce"], ref)


@pytest.mark.parametrize(
    "preset,overrides",
    [("zoo/tiny_moe.yaml", ["model.moe.bias_update_rate=0.001"]), ("zoo/tiny_neuron.yaml", [])],
)
def test_meta_build_then_init_weights_leaves_no_uninitialised_buffer(preset, overrides):
    """What FSDP2's meta-device path does for big models: to_empty (garbage), then init_weights."""
    cfg = load_config(preset, overrides).model
    model = build_model(cfg, "meta").to_empty(device="cpu")
    for b in model.buffers():
        b.fill_(-7)
    model.init_weights()
    fresh = build_model(cfg)
    for (name, got), (_, want) in zip(model.named_buffers(), fresh.named_buffers()):
        if not want.is_floating_point() or name.endswith(("expert_bias", "inv_freq")):
            assert torch.equal(got, want), name
