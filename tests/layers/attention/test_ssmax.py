"""SSMax (model.attention.ssmax): each query at position p scaled by max(0, 1 + s_h log(p + 1)),
checked against an independent masked-softmax reference with the scale on the logits, on the dense
and the sparse (reference) paths, through prefill + decode and left padding (packed documents:
tests/zoo/test_masks.py); s = 0 is plain attention bit for bit; s trains (gets a gradient, no weight
decay); MLA and HF export refuse it by key."""

import math

import pytest
import torch

from helpers import TOL, randomize_, tiny_attention_model, tokens
from moezoo.configs import AttentionConfig, ConfigError
from moezoo.layers import Attention, SparsityPattern, pattern_mask
from moezoo.layers.rope import RotaryEmbedding, apply_rotary
from moezoo.zoo import build_model


def reference(att: Attention, x: torch.Tensor, theta: float, pattern=None) -> torch.Tensor:
    """Causal attention of x [B, S, D] in float64 with each row's logits times 1 + s_h log(p + 1),
    over the pairs ``pattern`` allows (its token mask, layers.pattern_mask) when given."""
    B, S, _ = x.shape
    Hq, Hk, Dh = att.n_heads, att.n_kv_heads, att.head_dim
    x = x.double()
    q = (x @ att.wq.weight.double().T).view(B, S, Hq, Dh).transpose(1, 2)
    k = (x @ att.wk.weight.double().T).view(B, S, Hk, Dh).transpose(1, 2)
    v = (x @ att.wv.weight.double().T).view(B, S, Hk, Dh).transpose(1, 2)
    cos, sin = RotaryEmbedding(Dh, theta=theta)(torch.arange(S))
    q, k = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    k, v = (t.repeat_interleave(Hq // Hk, dim=1) for t in (k, v))
    logits = q @ k.transpose(-1, -2) / math.sqrt(Dh)  # [B, Hq, S, S]
    p = torch.arange(S, dtype=torch.float64)
    logits = logits * (1 + att.ssmax.double()[:, None, None] * torch.log(p + 1)[:, None]).clamp(
        min=0
    )
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    if pattern is not None:
        allowed = allowed & pattern_mask(pattern, S, S, Hq)  # [Hq, S, S]
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, S, Hq * Dh)
    return (out @ att.wo.weight.double().T).float()


@pytest.mark.parametrize(
    "pattern",
    [
        None,
        {"type": "local", "window": 16, "block_size": 16},
        {"type": "a_shape", "sinks": 4, "window": 8, "block_size": 16},
    ],
)
def test_ssmax_attention_equals_the_scaled_logit_reference(pattern):
    # the sparse windows are shorter than the 48 keys: the layer's sparse (reference backend) path
    # runs
    torch.manual_seed(0)
    pattern = SparsityPattern.from_dict(pattern) if pattern else None
    assert pattern is None or not pattern.is_dense_at(48)
    att = Attention(32, 4, 2, pattern=pattern, backend="reference", ssmax=True)
    randomize_(att, 1)
    with torch.no_grad():
        att.ssmax.copy_(torch.tensor([0.5, -0.1, 0.0, 1.2]))
    x = torch.randn(2, 48, 32)
    cos, sin = RotaryEmbedding(8, theta=10000.0)(torch.arange(48))
    with torch.no_grad():
        got = att(x, cos, sin)
    assert (got - reference(att, x, 10000.0, pattern)).abs().max().item() < TOL


def test_a_negative_slope_past_its_zero_gives_uniform_rows_not_inverted_ones():
    # s = -0.5: the scale 1 - 0.5 log(p + 1) is 0 from p = e^2 - 1 = 6.4 on; rows 7.. average their
    # keys' values
    torch.manual_seed(1)
    att = Attention(32, 4, 2, backend="reference", ssmax=True)
    randomize_(att, 2)
    with torch.no_grad():
        att.ssmax.fill_(-0.5)
    S = 24
    x = torch.randn(1, S, 32)
    cos, sin = RotaryEmbedding(8, theta=10000.0)(torch.arange(S))
    with torch.no_grad():
        got = att(x, cos, sin)
        v = att.wv(x).view(1, S, 2, 8).repeat_interleave(2, dim=2)  # [1, S, Hq, Dh]
        mean_v = v.cumsum(1) / torch.arange(1, S + 1)[None, :, None, None]  # causal running mean
        uniform = att.wo(mean_v.reshape(1, S, 32))
    assert (got[0, 7:] - uniform[0, 7:]).abs().max().item() < TOL
    assert (got - reference(att, x, 10000.0)).abs().max().item() < TOL


def model(ssmax: bool, seed: int = 0, mla: bool = False):
    return tiny_attention_model(AttentionConfig(ssmax=ssmax), seed, mla)


def test_zero_slope_is_plain_attention_bit_for_bit():
    plain, scaled = model(False, 2), model(True, 2)
    missing, unexpected = scaled.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(k.endswith("attention.ssmax") for k in missing)
    for layer in scaled.layers:
        torch.nn.init.zeros_(layer.attention.ssmax)
    x = tokens(3, b=2, s=20)
    with torch.no_grad():
        assert torch.equal(plain(x), scaled(x))
    # FSDP2's path: meta, then memory, then init_weights
    fresh = build_model(scaled.cfg, device="meta")
    fresh.to_empty(device="cpu")
    for layer in fresh.layers:
        torch.nn.init.ones_(layer.attention.ssmax)  # what uninitialised memory might hold
    fresh.init_weights()
    assert all(torch.count_nonzero(layer.attention.ssmax) == 0 for layer in fresh.layers)


def test_negative_padding_positions_stay_finite():
    # HF-style left padding: position_ids = cumsum(mask) - 1 is -1 on the padding rows
    m = model(True, 3)
    x = tokens(4, b=2, s=10)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with torch.no_grad():
        out = m(x, attention_mask=mask, position_ids=mask.cumsum(1) - 1)
        alone = m(x[:1, 3:])
    assert torch.isfinite(out).all()
    assert (out[0, 3:] - alone[0]).abs().max().item() < TOL


def test_decode_with_a_cache_equals_the_full_pass():
    m = model(True, 4)
    x = tokens(5, b=2, s=12)
    with torch.no_grad():
        ref = m(x)
        m.setup_cache(2, 12)
        outs = [m(x[:, :7])] + [m(x[:, t : t + 1], start_pos=t) for t in range(7, 12)]
        m.clear_cache()
    assert (torch.cat(outs, 1) - ref).abs().max().item() < TOL


def test_the_slope_trains_without_weight_decay():
    from moezoo.configs import OptimConfig
    from moezoo.training.optim import build_optimizer

    m = model(True, 7).train()
    for layer in m.layers:
        torch.nn.init.zeros_(layer.attention.ssmax)  # the init: the gradient must move it off zero
    loss, _ = m(tokens(8, b=2, s=16), tokens(9, b=2, s=16))
    loss.backward()
    assert all(layer.attention.ssmax.grad.abs().sum() > 0 for layer in m.layers)
    opt = build_optimizer(m, OptimConfig(weight_decay=0.1))
    no_decay = [g for g in opt.param_groups if g["weight_decay"] == 0.0][0]["params"]
    assert all(any(p is layer.attention.ssmax for p in no_decay) for layer in m.layers)


def test_mla_and_hf_export_refuse_it_by_key():
    with pytest.raises(ConfigError, match=r"model\.attention\.ssmax"):
        model(True, mla=True)
    from moezoo.zoo.hf_config import hf_model_type

    with pytest.raises(ConfigError, match=r"model\.attention\.ssmax"):
        hf_model_type(model(True).cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "pattern, compiled",
    [
        (None, False),
        (None, True),
        ({"type": "a_shape", "sinks": 128, "window": 128, "block_size": 128}, False),
    ],
)
def test_ssmax_on_cuda_bf16_matches_the_float64_reference_fwd_bwd(pattern, compiled):
    # dense runs SDPA's fused kernels, the A-shape head (256 of the 512 keys at most) flex's
    # block-sparse kernel: both must see the scaled queries, forward and in the slope's gradient
    import copy

    torch.manual_seed(0)
    pattern = SparsityPattern.from_dict(pattern) if pattern else None
    assert pattern is None or not pattern.is_dense_at(512)
    att = Attention(256, 4, 2, pattern=pattern, ssmax=True)
    randomize_(att, 3, std=0.05)
    with torch.no_grad():
        att.ssmax.copy_(torch.tensor([0.3, -0.05, 0.0, 0.6]))
    cpu = copy.deepcopy(att)
    att = att.cuda()
    x = torch.randn(2, 512, 256)
    do = torch.randn(2, 512, 256)
    ref = reference(cpu, x, 10000.0, pattern)
    ref.backward(do)
    cos, sin = RotaryEmbedding(64, theta=10000.0)(torch.arange(512, device="cuda"))
    run = torch.compile(att) if compiled else att
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = run(x.cuda(), cos, sin)
    got.float().backward(do.cuda())
    scale = ref.abs().max().item()
    assert (got.float().cpu() - ref).abs().max().item() < 2e-2 * scale
    g_ref, g = cpu.ssmax.grad, att.ssmax.grad.cpu()
    assert (g - g_ref).abs().max().item() < 5e-2 * g_ref.abs().max().item()
