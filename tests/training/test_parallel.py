"""training.parallel: degree validation, and FSDP2 / EP / HSDP / DDP training gradients equal to one
process.

Multi-process tests fork P CPU processes (gloo) that each build the same tiny MoE Transformer, shard
it with ``parallelize`` and back-propagate the loss of their own batch; the reference is the
unsharded model on one process back-propagating the mean of the P per-rank losses (what data
parallelism computes). Every gradient (gathered from its shards) must match in float32.
"""

import copy

import pytest
import torch
import torch.distributed as dist

# forked gloo ranks: spawn(fn, world) runs fn(rank, world) on each
from helpers import spawn, tiny_moe_cfg
from moezoo.configs import ConfigError, ParallelConfig
from moezoo.training.parallel import (
    ParallelState,
    build_meshes,
    clip_grad_norm_,
    parallelize,
    setup_parallel,
)
from moezoo.zoo import build_model

TOL = dict(atol=1e-5, rtol=1e-5)


# ---- validation: one-line ConfigError before any process-group work ------------------------------


@pytest.mark.parametrize(
    "par,world,experts,key,needle",
    [
        (dict(ep=3), 6, 8, "parallel.ep", "does not divide model.moe.num_experts=8"),
        (dict(ep=4), 6, 8, "parallel.ep", "does not divide dp_shard=6 (world size 6"),
        (dict(dp_replicate=2, dp_shard=3), 4, 8, "parallel.dp_shard", "= 6 != world size 4"),
        (dict(dp_replicate=3), 4, 8, "parallel.dp_replicate", "does not divide the world size 4"),
        (dict(ep=2), 2, None, "parallel.ep", "the model has no MoE layer"),
        (dict(ep=2, fsdp=False), 2, 8, "parallel.fsdp", "needs fsdp: true"),
        (dict(ep=4, dp_replicate=2), 4, 8, "parallel.ep", "does not divide dp_shard=2"),
        (
            dict(fsdp=False, dp_shard=2),
            2,
            8,
            "parallel.dp_shard",
            "fsdp: false replicates every weight",
        ),
    ],
)
def test_bad_degrees_raise_one_line_config_error(par, world, experts, key, needle):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**par).resolve(world, experts)
    assert e.value.key == key and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_good_degrees_resolve():
    assert ParallelConfig().resolve(8) == (1, 8, 1)
    assert ParallelConfig(dp_replicate=2, ep=4).resolve(16, 8) == (2, 8, 4)
    assert ParallelConfig(dp_shard=4, ep=2).resolve(4, 8) == (1, 4, 2)


def test_setup_parallel_rejects_bad_layout_before_init_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="parallel.ep"):
        setup_parallel(tiny_moe_cfg("parallel.ep=3", "model.moe.num_experts=6"))
    assert not dist.is_initialized()


def test_setup_parallel_rejects_nccl_on_cpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="parallel.backend"):
        setup_parallel(tiny_moe_cfg("parallel.backend=nccl"))
    assert not dist.is_initialized()


def test_setup_parallel_rejects_more_local_ranks_than_gpus(monkeypatch):
    # torchrun --nproc_per_node 2 on a one-GPU node: one line naming train.device, not NCCL's
    # "Duplicate GPU detected" after the process group is up.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="train.device") as e:
        setup_parallel(tiny_moe_cfg("train.device=auto"))
    assert "2 ranks on this node" in str(e.value) and "\n" not in str(e.value)
    assert not dist.is_initialized()


def test_setup_parallel_rejects_megablocks_backend_under_ep(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = tiny_moe_cfg("parallel.ep=2")
    # set after loading: validation would want megablocks installed
    cfg.model.moe.backend = "megablocks"
    with pytest.raises(ConfigError, match="model.moe.backend"):
        setup_parallel(cfg)
    assert not dist.is_initialized()


def test_single_process_state_has_no_groups():
    state = setup_parallel(tiny_moe_cfg())
    assert (state.world_size, state.rank, state.distributed, state.ep_group) == (1, 0, False, None)
    assert state.device == torch.device("cpu")


# ---- multi-process gradient parity ---------------------------------------------------------------


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_grads_match_one_process(rank, world, overrides):
    cfg = tiny_moe_cfg(*overrides)
    rep, shard, ep = cfg.parallel.resolve(world, cfg.model.moe.num_experts)
    mesh, dense = build_meshes("cpu", rep, shard, ep)
    state = ParallelState(world, rank, rank, torch.device("cpu"), rep, shard, ep, mesh, dense)
    torch.manual_seed(0)
    ref = build_model(cfg.model)
    model = parallelize(copy.deepcopy(ref), cfg, state)
    g = torch.Generator().manual_seed(7)
    B, S, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    batches = [
        (torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g))
        for _ in range(world)
    ]

    # One process over the global batch: the balance loss is global (MoEConfig.global_balance) and
    # the mean cross-entropy / z-loss of equal-size rank batches average to the global mean.
    ref.loss(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))[0].backward()
    assert model is not ref
    loss, _ = model.loss(*batches[rank])
    loss.backward()

    norm = clip_grad_norm_(model.parameters(), 0.0, state)  # measure only
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(norm, want_norm, **TOL)

    L = cfg.model.moe.num_experts // ep
    ref_params = dict(ref.named_parameters())
    # names unchanged (checkpoints, HF)
    assert set(ref_params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        got, want = _full(p.grad), ref_params[name].grad
        if ".experts." in name:
            want = want[state.ep_rank * L : (state.ep_rank + 1) * L]
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, ["parallel.ep=2"]),  # EP over both ranks, experts not FSDP-sharded
        (4, ["parallel.ep=2"]),  # EP 2 x expert-FSDP 2, dense FSDP over 4
        # HSDP 2 x 2 with EP 2 inside each replica
        (4, ["parallel.ep=2", "parallel.dp_replicate=2"]),
        (2, []),  # FSDP2, experts sharded over 2 ranks
        (2, ["parallel.fsdp=false"]),  # replicate (DDP semantics)
        (2, ["parallel.ep=2", "parallel.activation_checkpointing=true"]),
    ],
)
def test_parallel_gradients_match_one_process(world, overrides):
    spawn(_check_grads_match_one_process, world, overrides)


def _check_clipping_scales_every_shard(rank, world, overrides):
    cfg = tiny_moe_cfg(*overrides)
    rep, shard, ep = cfg.parallel.resolve(world, cfg.model.moe.num_experts)
    state = ParallelState(
        world, rank, rank, torch.device("cpu"), rep, shard, ep, *build_meshes("cpu", rep, shard, ep)
    )
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), cfg, state)
    x = torch.randint(
        0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank)
    )
    model.loss(x, x)[0].backward()
    before = clip_grad_norm_(model.parameters(), 0.1, state)
    assert before > 0.1
    after = clip_grad_norm_(model.parameters(), 0.0, state)
    torch.testing.assert_close(after, torch.tensor(0.1), atol=1e-5, rtol=1e-4)


def test_clip_grad_norm_spans_dense_and_expert_meshes():
    spawn(_check_clipping_scales_every_shard, 4, ["parallel.ep=2", "parallel.dp_replicate=2"])


def _check_meta_init(rank, world, overrides):
    from moezoo.training.parallel import model_init_device

    cfg = tiny_moe_cfg(*overrides)
    rep, shard, ep = cfg.parallel.resolve(world, cfg.model.moe.num_experts)
    state = ParallelState(
        world, rank, rank, torch.device("cpu"), rep, shard, ep, *build_meshes("cpu", rep, shard, ep)
    )
    assert model_init_device(cfg, state) == state.device  # tiny: every rank builds it in full
    model = parallelize(build_model(cfg.model, "meta"), cfg, state)
    experts = _full(model.layers[0].feed_forward.experts.w1.detach())  # this ep rank's experts
    wq = _full(model.layers[0].attention.wq.weight.detach())
    assert abs(wq.std().item() - cfg.model.init_std) < 0.005
    # shards drew different values
    assert not torch.equal(wq[: wq.shape[0] // 2], wq[wq.shape[0] // 2 :])
    everyone = [torch.empty_like(experts) for _ in range(world)]
    dist.all_gather(everyone, experts.contiguous())
    # ranks r and r + dp_shard are replicas (identical); ep peers hold different experts
    assert torch.equal(everyone[rank], everyone[(rank + shard) % world])
    assert not torch.equal(everyone[rank], everyone[rank ^ 1])
    x = torch.randint(0, cfg.model.vocab_size, (2, 8))
    assert torch.isfinite(model.loss(x, x)[0])
    assert torch.equal(model.rope.inv_freq, build_model(cfg.model).rope.inv_freq)


def test_meta_built_model_initialises_distinct_shards_and_identical_replicas():
    spawn(_check_meta_init, 4, ["parallel.ep=2", "parallel.dp_replicate=2"])
