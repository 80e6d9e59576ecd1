"""DCP checkpoints (training.checkpoint) under FSDP2 + expert parallelism.

Two forked gloo ranks train one step of a tiny MoE Transformer with ep=2, save, and resume into a
model built from another seed: every weight and AdamW moment comes back. The checkpoint holds the
global ``[E, ...]`` expert tensors (not one ep rank's half), so one process without a process group
loads it too and gets the experts in the right order, and the same ranks load it at another ep
degree.
"""

import os
import tempfile

import torch
import torch.distributed as dist

from helpers import spawn, tiny_moe_cfg
from moezoo.training.checkpoint import load_checkpoint, save_checkpoint
from moezoo.training.parallel import ParallelState, build_meshes, parallelize
from moezoo.zoo import build_model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _global_experts(t, state):
    """Full tensor of this ep rank's experts, gathered over the ep group into ``[E, ...]``."""
    local = _full(t)
    parts = [torch.empty_like(local) for _ in range(state.ep)]
    dist.all_gather(parts, local.contiguous(), group=state.ep_group)
    return torch.cat(parts)


def _make(cfg, world, rank, seed):
    rep, shard, ep = cfg.parallel.resolve(world, cfg.model.moe.num_experts)
    state = ParallelState(
        world, rank, rank, torch.device("cpu"), rep, shard, ep, *build_meshes("cpu", rep, shard, ep)
    )
    torch.manual_seed(seed)
    model = parallelize(build_model(cfg.model), cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return state, model, opt


def _one_step(model, opt, cfg, rank):
    x = torch.randint(
        0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank)
    )
    model.loss(x, x)[0].backward()
    opt.step()


def _snapshot(model, opt, state):
    out = {}
    for name, p in model.named_parameters():
        g = (lambda t: _global_experts(t, state)) if ".experts." in name else _full
        out[name] = g(p.detach())
        out[name + ":exp_avg"] = g(opt.state[p]["exp_avg"])
    return out


def _train_save_resume(rank, world, ckpt_dir, overrides):
    cfg = tiny_moe_cfg(*overrides)
    state, model, opt = _make(cfg, world, rank, seed=0)
    _one_step(model, opt, cfg, rank)
    want = _snapshot(model, opt, state)
    save_checkpoint(ckpt_dir, 1, model, opt, {"step": 1}, cfg, keep_last=1)

    state2, model2, opt2 = _make(cfg, world, rank, seed=5)
    assert load_checkpoint(os.path.join(ckpt_dir, "step_00000001"), model2, opt2)["step"] == 1
    got = _snapshot(model2, opt2, state2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
    if rank == 0:
        torch.save(want, os.path.join(ckpt_dir, "want.pt"))


def _save_ep2_load_ep1(rank, world, ckpt_dir):
    cfg = tiny_moe_cfg("parallel.ep=2")
    state, model, opt = _make(cfg, world, rank, seed=0)
    _one_step(model, opt, cfg, rank)
    want = _snapshot(model, opt, state)
    save_checkpoint(ckpt_dir, 1, model, opt, {"step": 1}, cfg, keep_last=1)
    # same 2 ranks, ep=1 (experts FSDP-sharded)
    state1, model1, opt1 = _make(tiny_moe_cfg(), world, rank, seed=5)
    load_checkpoint(os.path.join(ckpt_dir, "step_00000001"), model1, opt1)
    for name, p in model1.named_parameters():
        torch.testing.assert_close(
            _full(p.detach()), want[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}"
        )
        torch.testing.assert_close(
            _full(opt1.state[p]["exp_avg"]), want[name + ":exp_avg"], atol=0, rtol=0
        )


def test_ep2_checkpoint_loads_at_ep1_on_the_same_ranks():
    with tempfile.TemporaryDirectory() as d:
        spawn(_save_ep2_load_ep1, 2, d)


def test_ep_checkpoint_resumes_under_ep_and_loads_on_one_process():
    overrides = ["parallel.ep=2"]
    with tempfile.TemporaryDirectory() as d:
        spawn(_train_save_resume, 2, d, overrides)
        want = torch.load(os.path.join(d, "want.pt"))
        cfg = tiny_moe_cfg(*overrides)
        torch.manual_seed(9)
        model = build_model(cfg.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_checkpoint(os.path.join(d, "step_00000001"), model, opt)
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                p.detach(), want[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}"
            )
            torch.testing.assert_close(
                opt.state[p]["exp_avg"], want[name + ":exp_avg"], atol=0, rtol=0
            )
