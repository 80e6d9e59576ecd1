"""Every public layer refuses an input it cannot compute with one ValueError naming the layer, the
constructor argument, the expected and the given shape (issue 51, finding 2: ``MoE(dim=64)`` on
``[2, 5, 32]`` returned a tensor of the input's shape)."""

import re

import pytest
import torch
from torch import nn

from moezoo.layers import (
    Attention,
    DynamicSparsity,
    MoE,
    NeuronRoutedFFN,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from moezoo.layers.dst.semi_structured import _semi_forward
from moezoo.layers.moe.experts import GroupedExperts

LAYERS = {
    "MoE": lambda: MoE(64, 32, 4, 2),
    "SwiGLU": lambda: SwiGLU(64, 32),
    "RMSNorm": lambda: RMSNorm(64),
    "NeuronRoutedFFN": lambda: NeuronRoutedFFN(64, 32, 4, 2),
}


def expect_shape_error(fn, layer: str, arg: str, expected: str, given: str) -> None:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for part in (f"{layer}(", arg, expected, given):
        assert part in msg, (part, msg)


def test_moe_dim_64_on_width_32_raises_naming_dim():
    """Finding 2 as written: MoE(dim=64) given [2, 5, 32] or [2, 5, 128]."""
    moe = MoE(dim=64, hidden_dim=32, num_experts=4, top_k=2)
    for width in (32, 128):
        with pytest.raises(ValueError, match=re.escape("MoE(dim=64)")) as info:
            moe(torch.randn(2, 5, width))
        assert "[..., 64]" in str(info.value) and f"[2, 5, {width}]" in str(info.value)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("width", [1, 32, 128])
def test_layer_with_wrong_width_raises_naming_layer_dim_expected_and_given(name, width):
    layer = LAYERS[name]()
    expect_shape_error(
        lambda: layer(torch.randn(2, 5, width)), name, "dim=64", "[..., 64]", f"[2, 5, {width}]"
    )


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_with_integer_input_raises_naming_dtype(name):
    with pytest.raises(ValueError, match=f"{name}: expected a floating-point x, got torch.int64"):
        LAYERS[name]()(torch.ones(2, 5, 64, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_with_right_width_keeps_the_shape(name):
    assert LAYERS[name]()(torch.randn(2, 5, 64)).shape == (2, 5, 64)


def attention_inputs(S=5, head_dim=16):
    cos, sin = RotaryEmbedding(head_dim)(torch.arange(S))
    return torch.randn(2, S, 64), cos, sin


def test_attention_with_wrong_width_raises_naming_dim():
    attn = Attention(64, 4)
    _, cos, sin = attention_inputs()
    expect_shape_error(
        lambda: attn(torch.randn(2, 5, 32), cos, sin),
        "Attention",
        "dim=64",
        "[B, S, 64]",
        "[2, 5, 32]",
    )
    # a 2-D input is not [B, S, D] even with the right width
    expect_shape_error(
        lambda: attn(torch.randn(5, 64), cos, sin), "Attention", "dim=64", "[B, S, 64]", "[5, 64]"
    )


def test_attention_with_rotary_angles_of_wrong_length_or_head_dim_raises():
    attn = Attention(64, 4)
    x, cos, sin = attention_inputs()
    expect_shape_error(
        lambda: attn(x, cos[:4], sin[:4]), "Attention", "head_dim=16", "[S, 16]", "[4, 16]"
    )
    expect_shape_error(
        lambda: attn(x, cos, sin[:, :8]), "Attention", "head_dim=16", "sin of shape", "[5, 8]"
    )
    expect_shape_error(
        lambda: attn(x, cos.expand(3, 5, 16), sin.expand(3, 5, 16)),
        "Attention",
        "head_dim=16",
        "[B, S, 16]",
        "[3, 5, 16]",
    )


def test_attention_with_positions_of_wrong_shape_raises():
    attn = Attention(64, 4, ssmax=True)
    x, cos, sin = attention_inputs()
    with pytest.raises(ValueError, match=re.escape("positions of shape [S] or [B, S]")) as info:
        attn(x, cos, sin, positions=torch.arange(6))
    assert "got [6]" in str(info.value)
    # per-row positions and per-row angles are accepted
    pos = torch.arange(5).expand(2, 5)
    cos_b, sin_b = RotaryEmbedding(16)(pos)
    assert attn(x, cos_b, sin_b, positions=pos).shape == x.shape


def test_grouped_experts_with_wrong_width_or_counts_raise():
    experts = GroupedExperts(4, 64, 32)
    experts.init_weights()
    counts = torch.tensor([1, 2, 0, 3])
    expect_shape_error(
        lambda: experts(torch.randn(6, 32), counts),
        "GroupedExperts",
        "dim=64",
        "[..., 64]",
        "[6, 32]",
    )
    with pytest.raises(ValueError, match=re.escape("expected counts of shape [4], got [3]")):
        experts(torch.randn(6, 64), counts[:3])


def test_dst_targets_refuse_a_wrong_width():
    """DST's targets: stacked experts (GroupedExperts) and its 2:4 Linear forward check their input
    width; plain masked Linears keep torch's own matmul shape error."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False), MoE(64, 32, 4, 2), nn.Linear(64, 8))
    dst = DynamicSparsity(model, sparsity=0.5, total_steps=10)
    names = [t.name for t in dst.targets]
    assert "1.experts.w1" in names
    expect_shape_error(
        lambda: model[1].experts(torch.randn(3, 32), torch.tensor([3, 0, 0, 0])),
        "GroupedExperts",
        "dim=64",
        "[..., 64]",
        "[3, 32]",
    )
    linear = model[0]
    expect_shape_error(
        lambda: _semi_forward(linear, torch.randn(3, 32)),
        "Linear",
        "in_features=64",
        "[..., 64]",
        "[3, 32]",
    )
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear(torch.randn(3, 32))


def test_shape_checks_compile_with_fullgraph_and_still_refuse():
    """The checks read Python ints: a fullgraph compile traces them (no graph break, also with
    dynamic batch sizes); a wrong width raises the ValueError from a compiled module, and a
    fullgraph compile, which turns every raise into its own error, reports it by name."""
    for layer in (RMSNorm(64), SwiGLU(64, 32)):
        x = torch.randn(2, 5, 64)
        full = torch.compile(layer, fullgraph=True, backend="eager")
        torch.testing.assert_close(full(x), layer(x))
        torch.testing.assert_close(full(x[:1]), layer(x[:1]))
        name = type(layer).__name__
        # torch 2.13 quotes the message; 2.11 lists its constant pieces ('RMSNorm', '(', 'dim', ..)
        with pytest.raises(Exception, match=rf"(?s)ValueError\(.*{name}.{{0,80}}dim.{{0,80}}64"):
            full(torch.randn(2, 5, 32))
        compiled = torch.compile(layer, backend="eager")
        compiled(x), compiled(x[:1])
        with pytest.raises(ValueError, match=re.escape("(dim=64): expected x of shape [..., 64]")):
            compiled(torch.randn(2, 5, 32))
    attn = Attention(64, 4)
    x, cos, sin = attention_inputs()
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, cos, sin), attn(x, cos, sin))


def test_mla_with_wrong_width_raises_naming_dim():
    from moezoo.configs import MLAConfig, ModelConfig
    from moezoo.layers.attention.mla import MLA

    cfg = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=1,
        n_heads=4,
        ffn_hidden=40,
        max_seq_len=16,
        attention_type="mla",
        mla=MLAConfig(
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        ),
    )
    mla = MLA.from_config(cfg)
    rope = torch.ones(5, 4)
    expect_shape_error(
        lambda: mla(torch.randn(2, 5, 16), rope, rope), "MLA", "dim=32", "[B, S, 32]", "[2, 5, 16]"
    )
