"""The fused per-token block choice (kernels.token_block_topk) against its torch oracle
(selection._token_topk_reference) on the same block scores, through TRITON_INTERPRET=1 on CPU:
the same bits, tile shares and statistics; the per-token estimate chooses alike with the kernel and
without it; and the compiled kernel on a GPU on bf16 scores.
"""

import math

import pytest
import torch

from helpers import needs_interpreter_loops
from moezoo.kernels.key_block_max import key_block_max
from moezoo.kernels.token_block_topk import token_block_topk
from moezoo.layers.attention.selection import (
    _own_block_max,
    _token_topk_reference,
    estimate_token_topk,
    index_tensor,
    unpack_blocks,
)


def _scores(B, Hs, T, bs, q0, R, seed, scale=3.0):
    """Random float32 block scores ``[B, Hs, R, nk]`` (-inf after each row's own block) and an own
    block score over the keys up to the query ``[B, Hs, R]`` below the whole block's."""
    g = torch.Generator().manual_seed(seed)
    nk = -(-T // bs)
    s = torch.randn(B, Hs, R, nk, generator=g) * scale
    own = torch.arange(q0, q0 + R) // bs
    s = s.masked_fill(torch.arange(nk)[None, :] > own[:, None], float("-inf"))
    own_max = s.gather(3, own.expand(B, Hs, R)[..., None])[..., 0]
    own_max = own_max - torch.rand(B, Hs, R, generator=g)
    return s, own_max


def _both(s, own_max, bs, q0, top_k, min_share, tile, stats, **shape):
    """``(bits, tile_share, stats)`` of the kernel (its tile ``shape``: rows, num_warps) and of
    the torch oracle."""
    B, Hs, R, nk = s.shape
    dev = s.device
    own = torch.arange(q0, q0 + R, device=dev) // bs
    causal = s.scatter(3, own.expand(B, Hs, R)[..., None], own_max[..., None])
    nq = (q0 + R - 1) // bs - q0 // bs + 1
    out = []
    for fused in (True, False):
        share = torch.full((B, Hs, nq, nk), float("-inf"), device=dev) if tile else None
        acc = torch.zeros(2, device=dev) if stats else None
        if fused:
            bits = torch.full((B, Hs, R, -(-nk // 32)), 7, dtype=torch.int32, device=dev)
            ks = index_tensor(top_k, dev)
            token_block_topk(s, q0, bs, ks, bits, own_max, min_share, share, q0 // bs, acc, **shape)
        else:
            bits = _token_topk_reference(s, causal, q0, bs, top_k, min_share, share, q0 // bs, acc)
        out.append((bits, share, acc))
    return out


# (B, Hs, T, bs, q_start, rows, top_k, min_share): partial last key blocks, rows from the middle of
# a block (chunked prefill, decode), nk not a power of two and over 32 (several words), budgets
# over the causal blocks
CASES = [
    (2, 3, 53, 4, 16, 37, [3, 1, 20], 0),
    (1, 2, 45, 8, 13, 30, [2, 4], 10),
    (1, 2, 300, 8, 0, 300, [5, 40], 5),
    (1, 2, 200, 16, 195, 5, [4, 2], 20),
    (1, 1, 1100, 16, 1060, 40, [70], 3),
]


@needs_interpreter_loops
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("tile,stats,rows", [(True, True, 0), (False, False, 0), (True, True, 1)])
def test_kernel_matches_the_torch_choice(case, tile, stats, rows):
    """Every case with the default tile (many rows a program) and with one row a program."""
    B, Hs, T, bs, q0, R, top_k, min_share = case
    s, own_max = _scores(B, Hs, T, bs, q0, R, seed=T + q0 + R)
    (bits, share, acc), (want_bits, want_share, want_acc) = _both(
        s, own_max, bs, q0, top_k, min_share, tile, stats, rows=rows, num_warps=1 if rows else 0
    )
    assert torch.equal(bits, want_bits)
    if min_share:  # the filter drops blocks here
        (plain, _, _), _ = _both(s, own_max, bs, q0, top_k, 0, False, False)
        nk = s.shape[-1]
        assert unpack_blocks(bits, nk).sum() < unpack_blocks(plain, nk).sum()
    if tile:
        assert want_share.isfinite().any()
        assert torch.equal(share.isinf(), want_share.isinf())
        torch.testing.assert_close(share, want_share, rtol=1e-5, atol=1e-5)
    if stats:
        torch.testing.assert_close(acc, want_acc, rtol=1e-5, atol=1e-4)


@needs_interpreter_loops
@pytest.mark.usefixtures("triton_interpreter")
def test_equal_scores_rank_the_later_block_first():
    """Scores drawn from a few values (+0.0 and -0.0 among them, which rank by their bit patterns
    as in selection._rank_keys): the kernel breaks every tie as the oracle does, the later block
    first."""
    B, Hs, T, bs, q0, R = 1, 2, 120, 4, 40, 80
    s, _ = _scores(B, Hs, T, bs, q0, R, seed=3)
    g = torch.Generator().manual_seed(4)
    values = torch.tensor([1.0, 0.0, -0.0, -2.0])
    tied = values[torch.randint(0, 4, s.shape, generator=g)]
    s = torch.where(s.isinf(), s, tied)
    own_max = torch.randn(B, Hs, R, generator=g)
    (bits, _, _), (want, _, _) = _both(s, own_max, bs, q0, [6, 3], 0, False, False)
    assert torch.equal(bits, want)
    # one score everywhere: the own block and the latest ones before it
    s = torch.where(s.isinf(), s, 0.5)
    (bits, _, _), _ = _both(s, own_max, bs, q0, [3, 3], 0, False, False)
    own = torch.arange(q0, q0 + R) // bs
    kb = torch.arange(s.shape[-1])
    latest = (kb[None, :] <= own[:, None]) & (kb[None, :] > own[:, None] - 3)
    assert torch.equal(unpack_blocks(bits, s.shape[-1]), latest.expand(B, Hs, R, -1))


@needs_interpreter_loops
@pytest.mark.parametrize("min_share", [0, 15])
def test_token_estimate_chooses_alike_with_and_without_the_kernels(min_share, monkeypatch):
    """``score_block: 1`` rows from the middle of a block, a KV group's two heads sharing a slot
    beside one of their own, a budget over the causal blocks: the kernels' choice (interpreted)
    is the full score matrix's, with the same tile shares and statistics."""
    B, H, S, T, D, bs = 1, 3, 40, 90, 16, 8
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, T, D, generator=g)
    q0, nk = T - S, -(-T // bs)

    def run():
        share = torch.full((B, 2, (T - 1) // bs - q0 // bs + 1, nk), float("-inf"))
        stats = {}
        bits, _ = estimate_token_topk(
            q, q0, k, bs, [3, 3, 20], [0, 0, 1], stats, bs, min_share, share
        )
        return unpack_blocks(bits, nk), share, stats

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want, want_share, want_stats = run()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, got_share, got_stats = run()
    assert torch.equal(got, want)
    assert want_share.isfinite().any()
    torch.testing.assert_close(got_share, want_share, rtol=1e-5, atol=1e-5)
    for key in ("entropy", "topk_mass"):
        torch.testing.assert_close(got_stats[key], want_stats[key], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "T,bs,min_share,shape",
    [
        (4096, 128, 0, {}),
        (4096, 128, 5, {}),
        (16384, 64, 2, {}),
        (16384, 64, 0, dict(rows=1, num_warps=1)),
        (16384, 128, 0, dict(rows=4, num_warps=4)),
        (16384, 128, 0, dict(rows=1, num_warps=2)),
    ],
    ids=str,
)
def test_compiled_kernel_matches_the_torch_choice_on_bf16_scores(T, bs, min_share, shape):
    """Four slots of prefill scores from bf16 q, k (kernels.key_block_max): the compiled kernel's
    bits equal the oracle's on them, tile shares and statistics to float tolerance. The one
    exception allowed: ``min_share``'s test of a block whose log share lies within 1e-5 of the
    threshold (the kernel's exp / log and sum order differ from torch's in the last bits), and the
    query blocks of such rows in ``tile_share``. Tile shapes: the default, and those
    bench/attention.py's selection stages time."""
    B, Hs, D = 1, 4, 128
    g = torch.Generator().manual_seed(T + bs)
    q = (torch.randn(B, Hs, T, D, generator=g) * 2).cuda().bfloat16()  # spread shares
    k = torch.randn(B, Hs, T, D, generator=g).cuda().bfloat16()
    s = key_block_max(q, k, 0, bs, D**-0.5)
    own_max = _own_block_max(q, k, 0, bs, D**-0.5)
    (bits, share, acc), (want, want_share, want_acc) = _both(
        s, own_max, bs, 0, [16, 8, 4, 24], min_share, True, True, **shape
    )
    nk = s.shape[-1]
    diff = unpack_blocks(bits, nk) != unpack_blocks(want, nk)
    if min_share:
        own = torch.arange(T, device="cuda") // bs
        causal = s.scatter(3, own.expand(B, Hs, T)[..., None], own_max[..., None])
        near = (causal.log_softmax(-1) - math.log(min_share / 100)).abs() < 1e-5
        assert not (diff & ~near).any()
        assert diff.sum() <= 4, "near-threshold shares are rare"
        # query blocks holding a row that chose differently
        odd = diff.any(-1).unflatten(2, (nk, bs)).any(-1)[..., None]
        share, want_share = share.masked_fill(odd, 0.0), want_share.masked_fill(odd, 0.0)
    else:
        assert not diff.any()
    assert want_share.isfinite().any()
    assert torch.equal(share.isinf(), want_share.isinf())
    torch.testing.assert_close(share, want_share, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc, want_acc, rtol=1e-4, atol=1e-2)
