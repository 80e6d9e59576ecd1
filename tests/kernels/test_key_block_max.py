"""The fused per-block max of single-key scores (kernels.key_block_max) against its torch oracle,
through TRITON_INTERPRET=1 on CPU; the block top-k estimates with ``score_block: 1`` choose the
same blocks through it as through the full score matrix; and the compiled kernel on a GPU in bf16.
"""

import pytest
import torch

from helpers import needs_interpreter_loops
from moezoo.kernels.key_block_max import key_block_max, key_block_max_reference
from moezoo.layers.attention.selection import (
    estimate_block_topk,
    estimate_token_topk,
    unpack_blocks,
)

# (B, H, S, T, D, block, q_start): partial last key blocks, blocks smaller than tl.dot's 16-key
# tile, queries from the middle of a block, a head dim that is not a power of two, decode rows
SHAPES = [
    (2, 3, 37, 53, 8, 16, 16),
    (1, 2, 20, 20, 16, 4, 0),
    (1, 1, 70, 130, 24, 32, 60),
    (1, 2, 5, 200, 16, 64, 195),
    (2, 2, 64, 64, 32, 128, 0),
]


def _inputs(B, H, S, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, S, D, generator=g), torch.randn(B, H, T, D, generator=g)


@needs_interpreter_loops
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tile", [{}, dict(block_q=32, block_k=16)], ids=str)
def test_kernel_matches_the_reference(shape, tile):
    B, H, S, T, D, bs, q0 = shape
    q, k = _inputs(B, H, S, T, D, seed=sum(shape))
    got = key_block_max(q, k, q0, bs, D**-0.5, **tile)
    want = key_block_max_reference(q, k, q0, bs, D**-0.5)
    assert torch.equal(got.isinf(), want.isinf()), "the same blocks are causal"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_is_the_max_over_each_blocks_keys():
    """The oracle itself, by a loop over (query, block)."""
    B, H, S, T, D, bs, q0 = 1, 2, 9, 23, 4, 4, 14
    q, k = _inputs(B, H, S, T, D, seed=1)
    out = key_block_max_reference(q, k, q0, bs, 0.5)
    for h in range(H):
        for i in range(S):
            for j in range((T + bs - 1) // bs):
                if j > (q0 + i) // bs:
                    assert out[0, h, i, j] == float("-inf")
                    continue
                want = max(
                    float(q[0, h, i] @ k[0, h, t]) * 0.5 for t in range(j * bs, min(T, j * bs + bs))
                )
                assert abs(float(out[0, h, i, j]) - want) < 1e-5


@needs_interpreter_loops
@pytest.mark.parametrize("token,qmax", [(True, 0), (True, 20), (False, 1), (False, 2)])
def test_estimates_choose_the_same_blocks_through_the_kernel(token, qmax, monkeypatch):
    """``score_block: 1`` (sub-blocks of one key) per query token (with ``min_share`` 20; and the
    query blocks' highest shares that ``union_blocks`` ranks by) and per query block
    (``query_max`` 1 and 2): the kernel's scores select what the full float32 score matrix
    selects, with the group's heads sharing one choice."""
    B, H, S, D, bs = 2, 4, 96, 16, 8
    q, k = _inputs(B, H, S, S, D, seed=5)
    slot = [0, 0, 1, 1]

    def run():
        if token:
            share = torch.full((B, 2, S // bs, S // bs), float("-inf"))
            bits, _ = estimate_token_topk(
                q, 0, k, bs, [3] * H, slot, sub_blocks=bs, min_share=qmax, tile_share=share
            )
            return unpack_blocks(bits, S // bs), share
        blocks = torch.arange(S // bs)
        return estimate_block_topk(q, 0, k, blocks, 0, bs, [3] * H, slot, None, qmax, bs), None

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want, want_share = run()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, got_share = run()
    assert torch.equal(got, want)
    if token:
        assert want_share.isfinite().any()
        torch.testing.assert_close(got_share, want_share, rtol=1e-5, atol=1e-5)


@needs_interpreter_loops
@pytest.mark.usefixtures("triton_interpreter")
def test_min_share_through_the_kernel_chooses_alike_under_bf16_autocast():
    """The trainer runs under bf16 autocast: ``min_share``'s rescored own block stays float32, as
    the kernel's scores are, so the choice is the one made without autocast."""
    B, H, S, D, bs = 1, 4, 96, 16, 8
    q, k = _inputs(B, H, S, S, D, seed=7)

    def run():
        bits, _ = estimate_token_topk(
            q, 0, k, bs, [3] * H, [0, 0, 1, 1], sub_blocks=bs, min_share=20
        )
        return unpack_blocks(bits, S // bs)

    want = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "bs,D,tile",
    [
        (128, 64, {}),
        (64, 128, {}),
        (16, 64, {}),
        (128, 128, dict(block_q=128, num_warps=8)),
        (128, 128, dict(block_k=64)),
        (128, 128, dict(block_q=128, block_k=128, num_warps=8)),
    ],
    ids=str,
)
def test_compiled_kernel_matches_the_reference_in_bf16(bs, D, tile):
    """bf16 products are exact in the float32 accumulator: the two differ by summation order.
    Tiles: the default, and those bench/attention.py's selection stages time."""
    B, H, S, T = 1, 2, 1000, 3000
    q, k = (t.cuda().bfloat16() for t in _inputs(B, H, S, T, D, seed=bs + D))
    got = key_block_max(q, k, T - S, bs, D**-0.5, **tile)
    want = key_block_max_reference(q, k, T - S, bs, D**-0.5)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
