"""Activation checkpointing replays the forward's sparse-attention selection in the recompute
(layers.attention.replay, training.parallel._checkpointed): one estimate per checkpointed forward,
and the recompute attends exactly the forward's blocks, so the gradients are the un-checkpointed
layer's even when a second estimate would choose differently."""

import pytest
import torch

import moezoo.layers.attention.plan as plan_mod
from moezoo.layers import SparsityPattern
from moezoo.layers.attention.module import Attention
from moezoo.layers.attention.replay import SelectionReplay, replayed
from moezoo.layers.rope import RotaryEmbedding
from moezoo.training.parallel import _checkpointed

BS, H, HK, D, T = 16, 8, 2, 64, 128


def test_a_replay_returns_the_first_runs_values_in_order_and_then_forgets_them():
    calls = []

    def compute(tag):
        calls.append(tag)
        return len(calls)

    def forward(tags):
        return [replayed(t, lambda t=t: compute(t)) for t in tags]

    r = SelectionReplay()
    x = torch.ones(1, requires_grad=True)
    with torch.enable_grad():
        assert r.run(forward, ["a", "b"]) == [1, 2]  # recorded
        assert r.run(forward, ["a", "c"]) == [1, 3]  # "a" replayed, "c" not recorded: computed
        assert r.run(forward, ["a"]) == [4]  # the replay is spent
    with torch.no_grad():  # no graph: nothing will be recomputed, nothing is kept
        r2 = SelectionReplay()
        r2.run(forward, ["a"])
        assert r2.saved == []
    assert calls == ["a", "b", "c", "a", "a"] and x.grad is None
    assert replayed("a", lambda: 7) == 7  # no replay active: computed


def _layer(backend="reference", bs=BS, dim=D, device="cpu"):
    torch.manual_seed(0)
    pats = [SparsityPattern(type="a_shape", sinks=bs, window=2 * bs, block_size=bs)] * 4 + [
        SparsityPattern(type="block_topk", top_k=3, share_group=1, query_max=1, block_size=bs)
    ] * 4
    att = Attention(dim, H, HK, pattern=pats, backend=backend, layer_id=3).to(device)
    att.init_weights(std=0.5, out_std=0.05)  # peaked scores: q, k decide the selection
    return att


def _run(att, x, checkpointed):
    T, dim = x.shape[1], x.shape[2]
    rope = RotaryEmbedding(dim // H, 10000.0)
    cos, sin = (t.to(x.device) for t in rope(torch.arange(T)))
    fwd = (
        (lambda x: _checkpointed(att, x, cos, sin))
        if checkpointed
        else (lambda x: att(x, cos, sin))
    )
    x = x.clone().requires_grad_(True)
    fwd(x).square().sum().backward()
    return x.grad, [p.grad.clone() for p in att.parameters()]


def _check_replay(monkeypatch, make, x, tol):
    """Checkpointed with a second estimate that would choose the complement, against the plain
    layer: one estimate, the same gradients."""
    want = _run(make(), x, checkpointed=False)
    estimate = plan_mod.estimate_block_topk
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        out = estimate(*a, **kw)
        # a second estimate that chose otherwise would make the recompute attend other blocks
        return out if len(calls) == 1 else ~out

    monkeypatch.setattr(plan_mod, "estimate_block_topk", counted)
    got = _run(make(), x, checkpointed=True)
    assert len(calls) == 1
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())


def test_the_recompute_estimates_nothing_and_attends_the_forwards_blocks(monkeypatch):
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1))
    _check_replay(monkeypatch, _layer, x, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_flex_recompute_reuses_the_forwards_block_mask(monkeypatch):
    """The GPU path: FlexAttention with the block mask built once, float32, 128-token blocks."""
    bs, dim, n = 128, 512, 1024  # head dim 64
    x = torch.randn(1, n, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    _check_replay(monkeypatch, lambda: _layer("flex", bs, dim, "cuda"), x, 1e-5)
