"""Transformer.forward with attention_mask, position_ids and packed documents
(training.data.pack_documents): padding contributes nothing and gets no loss, packed documents see
only themselves with RoPE restarting, for dense, sparse (reference path), MoE and MLA models; bad
masks are refused by argument name."""

import pytest
import torch

from helpers import TOL, V, randomize_, tokens
from moezoo.configs import AttentionConfig, MLAConfig, ModelConfig, MoEConfig
from moezoo.training.data import pack_documents
from moezoo.zoo import build_model

LOCAL = {"0:*": {"type": "local", "window": 3}}
A_SHAPE = {"*": {"type": "a_shape", "sinks": 2, "window": 3}}


def zoo_model(seed=0, patterns=None, mla=False, moe=False, ssmax=False):
    cfg = ModelConfig(
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=40,
        max_seq_len=64,
        rope_theta=500.0,
        qk_norm="head",
        attention=AttentionConfig(patterns=patterns or {}, ssmax=ssmax),
    )
    if mla:
        cfg.attention_type, cfg.qk_norm = "mla", "none"
        cfg.mla = MLAConfig(
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        )
    if moe:
        cfg.ffn, cfg.moe = (
            "moe",
            MoEConfig(
                num_experts=4,
                top_k=2,
                hidden_dim=16,
                backend="torch",
                router="sigmoid",
                n_group=2,
                topk_group=1,
            ),
        )
    m = build_model(cfg).eval()
    randomize_(m, seed)
    return m


@pytest.mark.parametrize("kind", ["dense", "local", "mla_moe", "ssmax"])
def test_packed_documents_give_each_document_its_own_logits(kind):
    # ssmax: each document's queries are scaled by their own positions (randomize_ makes the slopes
    # nonzero)
    model = zoo_model(
        1,
        patterns=LOCAL if kind == "local" else None,
        mla=kind == "mla_moe",
        moe=kind == "mla_moe",
        ssmax=kind == "ssmax",
    )
    docs = [tokens(s, b=1, s=n)[0].tolist() for s, n in ((1, 5), (2, 7), (3, 4), (4, 9))]
    packed = pack_documents(docs, seq_len=12)
    with torch.no_grad():
        out = model(packed.tokens, document_ids=packed.document_ids)
        alone = [model(torch.tensor([d]))[0] for d in docs]
    got = [
        out[r, packed.document_ids[r] == j]
        for r in range(out.shape[0])
        for j in range(int(packed.document_ids[r].max()) + 1)
    ]
    assert len(got) == len(docs)
    for g, a in zip(got, alone):
        assert (g - a).abs().max().item() < TOL


def test_no_attention_crosses_a_document_under_sink_and_random_block_patterns():
    # (input-dependent patterns estimate their columns over the whole packed row: their selection,
    # not their values, sees the other documents; docs/sparse_attention.md)
    for patterns in (
        A_SHAPE,
        {"*": {"type": "bigbird", "sinks": 1, "window": 2, "random_blocks": 1, "block_size": 4}},
    ):
        model = zoo_model(2, patterns=patterns)
        x = tokens(5, b=1, s=16)
        ids = torch.tensor([[0] * 6 + [1] * 10])
        y = x.clone()
        y[0, :6] = (y[0, :6] + 1) % V  # change only document 0
        with torch.no_grad():
            a, b = model(x, document_ids=ids), model(y, document_ids=ids)
        assert (a[0, 6:] - b[0, 6:]).abs().max().item() == 0
        assert (a[0, :6] - b[0, :6]).abs().max().item() > 0


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("patterns", [None, LOCAL])
def test_padded_row_with_position_ids_equals_the_row_alone_and_padding_gets_no_loss(side, patterns):
    model = zoo_model(3, patterns=patterns)
    x = tokens(6, b=2, s=10)
    mask = torch.ones_like(x)
    pad = slice(0, 3) if side == "left" else slice(7, 10)
    mask[0, pad] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=pos)
        alone = model(x[:1, mask[0].bool()])
        full = model(x[1:])
    assert torch.isfinite(out).all()
    assert (out[0, mask[0].bool()] - alone[0]).abs().max().item() < TOL
    assert (out[1] - full[0]).abs().max().item() < TOL
    targets = tokens(7, b=2, s=10)
    loss, _ = model(x, targets, attention_mask=mask, position_ids=pos)
    kept = torch.nn.functional.cross_entropy(out[mask.bool()], targets[mask.bool()])
    assert torch.allclose(loss, kept, atol=1e-5)


@pytest.mark.parametrize("mla", [False, True])
def test_decode_of_a_left_padded_prompt_equals_the_masked_full_pass(mla):
    model = zoo_model(4, mla=mla)
    x = tokens(8, b=2, s=9)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with torch.no_grad():
        ref = model(x, attention_mask=mask)
        model.setup_cache(2, 9)
        outs = [model(x[:, :5], attention_mask=mask[:, :5])]
        for t in range(5, 9):
            outs.append(model(x[:, t : t + 1], attention_mask=mask[:, : t + 1], start_pos=t))
        model.clear_cache()
    keep = mask.bool()
    assert (torch.cat(outs, 1)[keep] - ref[keep]).abs().max().item() < TOL


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(attention_mask=torch.ones(2, 5, dtype=torch.long)), "attention_mask"),
        (dict(attention_mask=torch.ones(2, 6)), "attention_mask"),
        (dict(document_ids=torch.zeros(1, 6, dtype=torch.long)), "document_ids"),
        (dict(position_ids=torch.zeros(2, 6)), "position_ids"),
    ],
)
def test_masks_of_the_wrong_shape_or_dtype_are_refused_naming_the_argument(kw, name):
    model = zoo_model()
    with pytest.raises(ValueError, match=f"^{name}: "):
        model(tokens(0, b=2, s=6), **kw)


def test_pack_documents_targets_stay_inside_documents():
    p = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12], [13]], seq_len=5)
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 0, 0]]
    assert p.targets.tolist() == [
        [2, 3, -100, 5, -100],
        [7, 8, 9, 10, -100],
        [12, -100, -100, -100, -100],
    ]
    assert p.document_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, -1, -1]]


@pytest.mark.gpu
@pytest.mark.parametrize("v_dim", [16, 8])
def test_flex_path_of_packed_and_padded_attention_matches_masked_sdpa_on_cuda(v_dim):
    import torch.nn.functional as F

    from moezoo.layers.attention.masking import AttnMask, causal_mask, masked_causal_attention

    T, dev = 2048, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 4, T, 16, device=dev, generator=g)
    k = torch.randn(2, 2, T, 16, device=dev, generator=g)
    v = torch.randn(2, 2, T, v_dim, device=dev, generator=g)
    doc = (torch.arange(T, device=dev) // 300).expand(2, T).contiguous()
    valid = torch.ones(2, T, dtype=torch.bool, device=dev)
    valid[1, :100] = False
    mask = AttnMask.build(2, T, T, 0, valid, doc, dev)
    got = masked_causal_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense(T, T) & causal_mask(T, T, 0, dev), enable_gqa=True
    )
    assert (got - ref).abs().max().item() < 1e-3
