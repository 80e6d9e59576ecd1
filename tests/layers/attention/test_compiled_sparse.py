"""The long-context preset's layer (A-shape heads + GQA-shared block top-k) compiled as the trainer
compiles it (the block in place, static shapes, activation checkpointing) against eager, in float32
on CPU: the same selection, output and gradients, input after input (a plan or mask baked into the
graph at trace time, a stats-only branch that changes the computation, or a different block list
would show as a difference)."""

import functools

import pytest
import torch
from torch import nn

from moezoo.layers import SparsityPattern
from moezoo.layers.attention.module import Attention
from moezoo.layers.attention.plan import plan_pattern
from moezoo.layers.rope import RotaryEmbedding, apply_rotary
from moezoo.training.parallel import _checkpointed

BS, H, HK, D, T = 16, 8, 2, 64, 128
# heads 0-3 A-shape (sinks + window), heads 4-7 block top-k shared per KV group
# (bench/configs/ashape_topk_1b_64k.yaml); here the shared heads are one KV group, one selection
# slot
PATS = [SparsityPattern(type="a_shape", sinks=BS, window=2 * BS, block_size=BS)] * 4 + [
    SparsityPattern(type="block_topk", top_k=3, share_group=1, block_size=BS)
] * 4
# the same with the block top-k heads scoring by their blocks' best query (query_max)
PATS_QMAX = (
    PATS[:4]
    + [SparsityPattern(type="block_topk", top_k=3, share_group=1, query_max=1, block_size=BS)] * 4
)
# and with NSA's gated compressed branch on them (compress: 1)
PATS_NSA = (
    PATS[:4]
    + [
        SparsityPattern(
            type="block_topk", top_k=3, share_group=1, query_max=1, compress=1, block_size=BS
        )
    ]
    * 4
)


class _Layer(nn.Module):
    """Attention with its rotary angles, its forward checkpointed as training.parallel does to
    blocks."""

    def __init__(self, backend: str, pats=PATS):
        super().__init__()
        torch.manual_seed(0)
        self.pats = pats
        self.attention = Attention(D, H, HK, pattern=pats, backend=backend, layer_id=5)
        # peaked scores: q, k matter for the selection
        self.attention.init_weights(std=0.5, out_std=0.05)
        self.rope = RotaryEmbedding(D // H, 10000.0)
        self.forward = functools.partial(_checkpointed, self._forward)

    def _forward(self, x):
        cos, sin = self.rope(torch.arange(x.shape[1]))
        return self.attention(x, cos, sin)


def _selection(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """The block top-k heads' chosen blocks for input ``x`` (eager planning)."""
    a = layer.attention
    with torch.no_grad():
        cos, sin = layer.rope(torch.arange(x.shape[1]))
        q = apply_rotary(a.wq(x).view(1, T, H, D // H).transpose(1, 2), cos, sin)
        k = apply_rotary(a.wk(x).view(1, T, HK, D // H).transpose(1, 2), cos, sin)
        return plan_pattern(layer.pats, H, 0, T, T, 5, q, k).blocks[:, 4:]


def _close(got, want):
    """Equal up to float32 rounding (relative to the tensor's scale): one differently chosen block
    moves its query block's outputs, and the gradients, by about their own size."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-5 * scale, f"max |difference| {err:.3g} for values up to {scale:.3g}"


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, T, D, generator=g) for _ in range(2)]


# aot_eager_decomp_partition: dynamo, AOTAutograd's decompositions and the partitioner's recompute
# of the checkpointed block, without inductor's code generation (seconds). inductor (what the
# trainer runs; ~1 min on CPU with a cold compile cache) failed to build the one-slot layer before
# estimate_block_topk took its heads-per-slot counts from the host (its CPU code for an index_add_
# into a one-element tensor asserts).
@pytest.mark.parametrize(
    "backend,pats",
    [
        ("aot_eager_decomp_partition", PATS),
        ("aot_eager_decomp_partition", PATS_QMAX),
        ("aot_eager_decomp_partition", PATS_NSA),
        pytest.param("inductor", PATS, marks=pytest.mark.slow),
    ],
)
def test_compiled_block_topk_a_shape_layer_equals_eager_fwd_bwd_float32(backend, pats):
    eager, compiled = _Layer("reference", pats), _Layer("reference", pats)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(dynamic=False, backend=backend)  # as training.loop compiles each block
    xs = _inputs()
    picks = [_selection(eager, x) for x in xs]
    # the second input selects other blocks: nothing may be reused
    assert not torch.equal(picks[0], picks[1])
    for x in xs:
        outs, grads = [], []
        for m in (eager, compiled):
            xi = x.clone().requires_grad_()
            out = m(xi)
            out.square().sum().backward()
            outs.append(out.detach())
            grads.append([xi.grad] + [p.grad for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        _close(outs[1], outs[0])
        for gc, ge in zip(grads[1], grads[0]):
            _close(gc, ge)
    # the eager layer records the selection stats; the compiled one records none and computes the
    # same
    assert "entropy" in eager.attention.attn_stats


def test_compiled_flex_path_equals_the_reference_on_each_input():
    # The GPU path (flex) inside a block compiled by dynamo + AOTAutograd on CPU (forward: CPU flex
    # has no backward). The sparse flex call itself runs eager there (a graph break:
    # functional._flex_sparse; traced into the graph its gradients are off on a GPU): its plan
    # and mask follow each input.
    ref, flex = _Layer("reference"), _Layer("flex")
    flex.load_state_dict(ref.state_dict())
    compiled = torch.compile(flex, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        for x in _inputs():
            _close(compiled(x), ref(x))


def test_compiled_selection_under_bf16_autocast_scores_in_float32_as_eager(monkeypatch):
    # The trainer runs compiled blocks under bf16 autocast; the selection scores stay float32 there
    # too (selection._group_scores disables autocast). 128 key blocks, top 16: bf16 scores flip a
    # few near ties.
    pats = [SparsityPattern(type="block_topk", top_k=16, share_group=1, block_size=BS)] * H
    g = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(1, H, 2048, D // H, generator=g),
        torch.randn(1, HK, 2048, D // H, generator=g),
    )

    def blocks(q, k):
        return plan_pattern(pats, H, 0, 2048, 2048, 0, q, k).blocks

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = blocks(q, k)
        got = torch.compile(blocks, backend="aot_eager_decomp_partition", dynamic=False)(q, k)
    assert torch.equal(got, want)
    assert torch.equal(want, blocks(q, k))  # = float32 without autocast
    # scores rounded to bf16 would choose otherwise here
    import moezoo.layers.attention.selection as selection

    scores = selection._group_scores
    monkeypatch.setattr(selection, "_group_scores", lambda q, k: scores(q, k).bfloat16().float())
    assert not torch.equal(blocks(q, k), want)
