"""Host-side overhead of the MoE routing stage that does not scale with FLOPs (issue 16, item 2):
the expert sort runs on the narrowest key dtype and the per-expert counts stay an inductor kernel
under torch.compile, and top-1/2 selection is argmax passes there, with exactly the results of the
formulations they replace."""

import pytest
import torch

from moezoo.layers.moe.experts import make_plan
from moezoo.layers.moe.router import sort_key_dtype, stable_order, tokens_per_expert, top_k_indices


@pytest.mark.parametrize(
    "num_ids,dtype",
    [
        (1, torch.uint8),
        (8, torch.uint8),
        (256, torch.uint8),
        (257, torch.int16),
        (2**15, torch.int16),
        (2**15 + 1, torch.int32),
    ],
)
def test_stable_order_is_the_int64_stable_argsort(num_ids, dtype):
    assert sort_key_dtype(num_ids) == dtype
    g = torch.Generator().manual_seed(num_ids)
    for n in (0, 1, 37, 5000):  # many ties: stability decides the order
        ids = torch.randint(0, num_ids, (n,), generator=g)
        ids[:1] = num_ids - 1  # the largest id is representable
        assert torch.equal(stable_order(ids, num_ids), torch.argsort(ids, stable=True))


@pytest.mark.parametrize(
    "kw", [dict(), dict(capacity=3), dict(align=4), dict(capacity=2, align=8)], ids=str
)
def test_make_plan_equals_the_plan_of_the_int64_sort(kw, monkeypatch):
    from moezoo.layers.moe import experts

    torch.manual_seed(0)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(17)])
    got = make_plan(idx, 6, **kw)
    monkeypatch.setattr(experts, "stable_order", lambda ids, n: torch.argsort(ids, stable=True))
    want = make_plan(idx, 6, **kw)
    for name in ("inv", "counts", "group_sizes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.num_rows, got.dense) == (want.num_rows, want.dense)


def test_tokens_per_expert_under_compile_is_the_eager_count():
    """The compiled one-hot reduction and the eager scatter_add give bincount's int64 counts (an
    expert with no assignment included)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 6, (50, 3))  # expert 6 of 7 gets none
    # aot_eager traces the compiled branch (is_compiling) without inductor's codegen, which took
    # 62-80 s of a GPU-machine suite run for this CPU test
    fn = torch.compile(tokens_per_expert, backend="aot_eager", fullgraph=True)
    got, want = fn(idx, 7), tokens_per_expert(idx, 7)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want) and torch.equal(
        want, torch.bincount(idx.reshape(-1), minlength=7)
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_under_compile_is_topk(k):
    # k <= 2: argmax passes when compiled; k = 3: torch.topk in both. Rows with -inf outside k
    # finite scores (group-limited routing) included.
    torch.manual_seed(1)
    scores = torch.randn(64, 8)
    scores[::4, 3:] = float("-inf")
    fn = torch.compile(top_k_indices, backend="aot_eager", fullgraph=True)
    want = scores.topk(k, dim=-1).indices
    assert torch.equal(fn(scores, k), want) and torch.equal(top_k_indices(scores, k), want)
