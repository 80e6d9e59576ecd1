"""DST under data parallelism: 2 gloo processes with different per-rank gradients derive identical
masks, equal to the single-process masks of the summed gradient; DTensor (FSDP2-style Shard(0))
parameters give the same masks, with mask buffers sharded like their parameters; a real FSDP2
(fully_shard) run matches an unsharded run fed the mean gradient, masks and weights."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn  # forked gloo ranks: spawn(fn, world) runs fn(rank, world) on each
from moezoo.layers import DynamicSparsity

SHAPES = [(16, 32), (32, 16), (8, 32)]  # (out, in); 16 and 32 rows split evenly over 2 ranks, 8 too
# every layer, the last one too (no head here)
OPTS = dict(
    sparsity=0.75,
    update_every=1,
    total_steps=4,
    stop_fraction=1.0,
    drop_schedule="constant",
    include=["layers.*"],
)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # same weights on every rank
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in SHAPES)


def _grads(rank, step):
    """Per-rank gradients: different on each rank, a fixed function of (rank, step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(o, i, generator=g) for o, i in SHAPES]


def _run(model, grads_at, wrap=lambda g: g):
    # lr 0: weights change only by DST
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    dst = DynamicSparsity(model, opt, **OPTS)
    for step in (1, 2, 3):
        before = [lin.weight_mask.clone() for lin in model.layers]
        for lin, g in zip(model.layers, grads_at(step)):
            lin.weight.grad = wrap(g)
        opt.step()
        dst.step(step)
        opt.zero_grad(set_to_none=True)
    return model, opt, dst, before


def _check_identical_masks(rank, world):
    plain, _, _, _ = _run(Stack(), lambda step: _grads(rank, step))
    masks = [lin.weight_mask.clone() for lin in plain.layers]
    gathered = [None] * world
    dist.all_gather_object(gathered, masks)
    assert all(torch.equal(a, b) for a, b in zip(gathered[0], gathered[1]))

    # reference: the summed gradient on every rank (the all-reduce doubles it, which ranks alike)
    def summed(step):
        return [sum(gs) for gs in zip(*(_grads(r, step) for r in range(world)))]

    ref, _, _, _ = _run(Stack(), summed)
    assert all(torch.equal(m, lin.weight_mask) for m, lin in zip(masks, ref.layers))

    # DTensor parameters sharded on dim 0 (what FSDP2 holds), gradients already reduced (as FSDP2's
    # are)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sharded = Stack()
    for lin in sharded.layers:
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.data, mesh, [Shard(0)]))
    sharded, opt, dst, before = _run(
        sharded, summed, wrap=lambda g: distribute_tensor(g, mesh, [Shard(0)])
    )
    for m, lin, old in zip(masks, sharded.layers, before):
        mb = lin.weight_mask
        assert isinstance(mb, DTensor) and mb.placements == (Shard(0),)
        assert mb.to_local().shape[0] == m.shape[0] // world
        assert torch.equal(mb.full_tensor(), m)
        w = lin.weight.to_local()
        assert torch.all(w[~mb.to_local()] == 0)
        changed = mb.to_local() ^ old.to_local()  # grown or pruned at the last update
        assert changed.any() and torch.all(
            opt.state[lin.weight]["momentum_buffer"].to_local()[changed] == 0
        )
    st = dst.stats()
    assert st["density"] == sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)


def test_two_gloo_ranks_with_different_grads_derive_identical_masks():
    spawn(_check_identical_masks, 2)


def _batch(rank, step):
    return torch.randn(4, SHAPES[-1][1], generator=torch.Generator().manual_seed(100 * step + rank))


class Chain(nn.Module):
    """Linear layers chained (16 <- 32 <- 16 <- 32) so a forward runs through every target."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Linear(i, o, bias=False) for o, i in [(16, 32), (32, 16), (8, 32)]
        )

    def forward(self, x):
        h = torch.tanh(self.layers[0](x))
        return self.layers[2](torch.tanh(self.layers[1](h)))


def _check_fsdp2_matches_single_process(rank, world, compact=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moezoo.training.optim import CompactAdamW

    mesh = init_device_mesh("cpu", (world,))
    model = Chain()
    for lin in model.layers:
        fully_shard(lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    Opt, opts = (
        (CompactAdamW, dict(OPTS, compact_state=True)) if compact else (torch.optim.AdamW, OPTS)
    )
    opt = Opt(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(model, opt, **opts)

    ref = Chain()  # unsharded, gradient = mean of both ranks'
    ref_opt = Opt(ref.parameters(), lr=1e-2)
    ref_dst = DynamicSparsity(ref, ref_opt, **opts)  # its all-reduce only doubles identical grads
    for step in (1, 2, 3):
        model(_batch(rank, step)).square().sum().backward()
        opt.step()
        dst.step(step)
        opt.zero_grad()
        grads = []
        for r in range(world):
            ref.zero_grad()
            ref(_batch(r, step)).square().sum().backward()
            grads.append([lin.weight.grad.clone() for lin in ref.layers])
        for lin, *gs in zip(ref.layers, *grads):
            lin.weight.grad = sum(gs) / world
        ref_opt.step()
        ref_dst.step(step)
    for t, rt in zip(dst.targets, ref_dst.targets):
        lin, rl = t.module, rt.module
        assert lin.weight_mask.to_local().shape[0] == rl.weight_mask.shape[0] // world
        assert torch.equal(dst._mask(t, full=True), ref_dst._mask(rt))
        torch.testing.assert_close(lin.weight.full_tensor(), rl.weight, rtol=1e-5, atol=1e-6)
        if compact:  # each rank's compact block = its rows' active entries, in the 1-rank order
            k = int(dst._mask(t).sum())
            for name in ("exp_avg", "exp_avg_sq"):
                mine = opt.state[lin.weight][name].to_local()[:k].clone()
                blocks = [None] * world
                dist.all_gather_object(blocks, mine)
                kr = int(ref_dst._mask(rt).sum())
                torch.testing.assert_close(
                    torch.cat(blocks), ref_opt.state[rl.weight][name][:kr], rtol=1e-5, atol=1e-9
                )


@pytest.mark.parametrize("compact", [False, True])
def test_fsdp2_sharded_masks_equal_the_single_process_masks(compact):
    spawn(_check_fsdp2_matches_single_process, 2, compact)
