"""training.plan / zoo.flops: parameter counts, FLOPs and memory plans built on the meta device."""

import os
import resource

import pytest

from helpers import ROOT
from moezoo.configs import ConfigError, load_config
from moezoo.training.plan import (
    EXIT_DOES_NOT_FIT,
    GPU_GB,
    PlanDoesNotFit,
    check_fits,
    format_plan,
    gpu_memory,
    plan,
)
from moezoo.zoo.flops import flops_per_token, param_counts

H200 = gpu_memory("h200")[0]


def preset(name, *overrides):
    path = os.path.join(ROOT, "zoo", name)
    if not os.path.exists(path):
        pytest.skip(f"{name} not present")
    return load_config(path, list(overrides))


def rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is KiB on Linux


def test_llama_65b_plan_reports_65_2b_params_without_allocating():
    before = rss_gb()
    p = plan(preset("llama_65b.yaml"), n_gpus=64)
    assert abs(p.counts.total - 65.2e9) / 65.2e9 < 0.01
    assert p.counts.active == p.counts.total and p.counts.expert == 0
    assert rss_gb() - before < 2.0  # 65B fp32 weights would be 260 GB
    text = format_plan(p)
    assert "65.29B" in text and "64 GPU(s)" in text


def test_dense_counts_match_llama_formula():
    cfg = preset("llama_65b.yaml").model
    D, H, L, V = cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.vocab_size
    assert H == 22016
    expected = L * (4 * D * D + 3 * D * H + 2 * D) + 2 * V * D + D
    assert param_counts(cfg).total == expected


def test_flops_per_token_is_6n_plus_attention():
    cfg = preset("llama_65b.yaml")
    c = param_counts(cfg.model)
    S = cfg.train.seq_len
    # causal pairs
    expected = 6 * (c.total - c.embedding) + 6 * cfg.model.n_layers * cfg.model.dim * (S + 1)
    assert flops_per_token(cfg.model, S, c) == pytest.approx(expected)


def test_moe_65b_plan_has_65b_active_and_1_4t_total():
    cfg = preset("moe_65b.yaml")
    m = cfg.model
    assert (m.moe.num_experts, m.moe.top_k, m.expert_hidden_dim) == (256, 8, 2752)
    before = rss_gb()
    p = plan(cfg, n_gpus=256)
    assert rss_gb() - before < 2.0
    D, L, E, K, He = m.dim, m.n_layers, 256, 8, 2752
    experts = L * E * 3 * D * He
    assert p.counts.expert == experts
    assert 1.35e12 < p.counts.total < 1.45e12
    assert 64e9 < p.counts.active < 67e9
    assert p.counts.active - (p.counts.total - experts) == L * K * 3 * D * He
    # 256 experts over 256 GPUs: one expert per GPU per layer, no expert gathering
    assert p.layout.ep == 256 and p.layout.dp_shard == 256
    assert "1.4" in format_plan(p)


def test_moe_65b_does_not_fit_on_one_gpu_and_says_why():
    p = plan(preset("moe_65b.yaml"), n_gpus=1)
    assert not p.fits
    assert any("does not fit" in n for n in p.notes)


def test_plan_without_gpu_count_picks_the_smallest_whole_node_count_that_fits():
    cfg = preset("llama_65b.yaml")
    p = plan(cfg)
    assert p.fits and p.n_gpus % 8 == 0 and p.available_gpus is None
    assert not plan(cfg, p.n_gpus - 8).fits


def test_config_layout_is_used_when_it_resolves():
    cfg = preset(
        "llama_65b.yaml", "parallel.dp_replicate=2", "parallel.activation_checkpointing=true"
    )
    p = plan(cfg, n_gpus=32)
    assert p.layout_source == "config"
    assert (p.layout.dp_replicate, p.layout.dp_shard, p.layout.ep) == (2, 16, 1)
    assert p.layout.activation_checkpointing


def test_check_fits_raises_config_error_with_the_plan():
    cfg = preset("llama_65b.yaml")
    with pytest.raises(PlanDoesNotFit) as e:
        check_fits(cfg, 1, "cpu")
    assert isinstance(e.value, ConfigError)
    first, *rest = str(e.value).splitlines()
    assert first.startswith("parallel: llama_65b needs") and "GB per device" in first
    assert any("memory/device" in line for line in rest)  # a CPU run is not planned in GPUs


def test_check_fits_passes_for_tiny_preset():
    p = check_fits(preset("tiny_dense.yaml"), 1, "cpu")
    assert p.fits


def test_config_layout_that_does_not_fit_is_reported_with_the_fix():
    cfg = preset(
        "moe_65b.yaml",
        "parallel.ep=8",
        "parallel.activation_checkpointing=false",
        "dst.enabled=false",
    )
    p = plan(cfg, n_gpus=256, device_bytes=H200)
    assert p.layout_source == "config" and p.layout.ep == 8 and not p.fits
    assert any("activation_checkpointing=true" in n for n in p.notes)
    assert any("the recommended layout fits on all 256 GPUs" in n for n in p.notes)
    ok = plan(
        preset("moe_65b.yaml", "parallel.ep=8", "dst.enabled=false"), n_gpus=256, device_bytes=H200
    )
    assert ok.fits


def test_dst_masks_are_counted_and_their_fix_suggested():
    dense_state = plan(
        preset("moe_65b.yaml", "dst.compact_state=false"), n_gpus=256, device_bytes=H200
    )
    without = plan(preset("moe_65b.yaml", "dst.enabled=false"), n_gpus=256, device_bytes=H200)
    # 2 B (mask + ever-active) + 4 B (EMA score) per masked weight, sharded over 256 ranks
    assert 30e9 < dense_state.memory.dst_masks < 36e9 and without.memory.dst_masks == 0
    assert not dense_state.fits and without.fits
    assert any("dst.compact_state=true" in n for n in dense_state.notes)


def test_compact_dst_state_fits_moe_65b_on_256_gpus_within_the_headroom():
    compact, dense_state = (
        plan(preset("moe_65b.yaml"), n_gpus=256, device_bytes=H200),
        plan(preset("moe_65b.yaml", "dst.compact_state=false"), n_gpus=256, device_bytes=H200),
    )
    masked = dense_state.memory.dst_masks / 6  # masked weights per GPU (6 B each when dense)
    # 1 bit mask + 1 bit ever-active + 2 B bf16 score; moments + int32 index for the active 55% (50%
    # + 10% margin)
    assert abs(compact.memory.dst_masks - 2.25 * masked) < 1e-3 * masked
    assert (
        abs((dense_state.memory.optimizer - compact.memory.optimizer) - masked * (8 - 12 * 0.55))
        < 1e-3 * masked
    )
    assert compact.fits and compact.memory.total <= 0.9 * compact.device_bytes
    assert any("EMA score (bf16, grad_ema) 2.00 B" in n for n in compact.notes)


def test_bf16_weights_hold_the_same_bytes_a_parameter_and_four_more_with_accumulation():
    # float32: 4 B weight + 4 B grad; bfloat16 weights: 2 B + 4 B master, 2 B grad (+ a 4 B float32
    # sum)
    base = plan(preset("olmoe_1b_7b.yaml"), n_gpus=1, device_type="cuda").memory
    low = plan(
        preset("olmoe_1b_7b.yaml", "train.param_dtype=bfloat16"), n_gpus=1, device_type="cuda"
    ).memory
    acc = plan(
        preset("olmoe_1b_7b.yaml", "train.param_dtype=bfloat16", "train.grad_accum=2"),
        n_gpus=1,
        device_type="cuda",
    ).memory
    assert low.weights + low.grads == pytest.approx(base.weights + base.grads)
    assert low.weights == pytest.approx(1.5 * base.weights)
    assert acc.grads == pytest.approx(1.5 * base.grads)


def run_plan_cli(capsys, *args):
    """``train.py --config zoo/moe_65b.yaml --plan ARGS`` in this process: (exit status, stdout)."""
    from moezoo.training.cli import main

    path = os.path.join(ROOT, "zoo", "moe_65b.yaml")
    rc = main(["--config", path, "--plan", *args])
    return rc, capsys.readouterr().out


def test_plan_for_an_h100_user_does_not_fit_on_256_gpus_and_exits_3(capsys):
    """Issue 51, finding 6: an H100 user was told ``118.8 GB -> fits`` (141 GB assumed)."""
    rc, out = run_plan_cli(capsys, "--gpus", "256", "--gpu", "h100")
    assert rc == EXIT_DOES_NOT_FIT == 3
    assert "gpu           H100 80 GB" in out
    assert "118.8 GB of 80 GB" in out and "DOES NOT FIT" in out
    assert "fits from 512 80 GB GPUs (64 nodes of 8)" in out
    rc, out = run_plan_cli(capsys, "--gpus", "256", "--gpu", "h200")
    assert rc == 0 and "118.8 GB of 141 GB (84%) -> fits" in out


def test_plan_on_300_gpus_uses_the_largest_count_that_fits(capsys):
    """Finding 6: ``--gpus 300`` failed where 256 fits (ep must divide 300 and 256: at most 4)."""
    rc, out = run_plan_cli(capsys, "--gpus", "300", "--gpu", "h200")
    assert rc == 0
    assert "296 of 300 GPU(s): dp_replicate=1 dp_shard=296 ep=8" in out and "-> fits" in out
    assert "ep=4: the largest count dividing both 300 GPUs and 256 experts" in out
    assert "this plan uses 296 of them (launch 296 ranks)" in out
    cfg = preset("moe_65b.yaml")
    on_296, on_297 = plan(cfg, 296, H200), plan(cfg, 297, H200)
    assert on_296.fits and on_296.available_gpus is None
    assert (on_297.n_gpus, on_297.available_gpus) == (296, 297)
    # no layout on any count up to 300 fits 80 GB GPUs: the plan says from which count one does
    rc, out = run_plan_cli(capsys, "--gpus", "300", "--gpu", "h100")
    assert rc == EXIT_DOES_NOT_FIT and "fits from 512 80 GB GPUs" in out


def test_plan_without_gpus_finds_a_count_that_is_not_a_power_of_two(capsys):
    rc, out = run_plan_cli(capsys, "--gpu", "b200")
    assert rc == 0 and "layout        192 GPU(s)" in out and "-> fits" in out
    assert "the smallest count that fits (1 to 8 GPUs, then whole 8-GPU nodes" in out
    assert not plan(preset("moe_65b.yaml"), 184, gpu_memory("b200")[0]).fits


def test_gpu_names_and_sizes_resolve_and_a_bad_one_is_one_line(capsys):
    assert gpu_memory("h100") == (80e9, "H100 80 GB")
    assert gpu_memory("H200")[0] == 141e9 and gpu_memory("b200")[0] == GPU_GB["b200"] * 1e9
    assert gpu_memory("96")[0] == gpu_memory("96GB")[0] == 96e9
    for bad in ("a100x", "0", "-5", "nan"):
        with pytest.raises(ConfigError, match="^--gpu: expected h100, h200, b200 or a memory"):
            gpu_memory(bad)


def test_default_gpu_without_cuda_is_an_h100_and_the_report_says_so():
    import torch

    if torch.cuda.is_available():
        size, name = gpu_memory(None)
        assert size == torch.cuda.get_device_properties(0).total_memory and "this machine" in name
        return
    assert gpu_memory(None) == (
        80e9,
        "H100 80 GB (no GPU here: the default; --gpu h100|h200|b200|<GB> to choose)",
    )


def test_bad_plan_flags_exit_2_before_importing_torch():
    import subprocess
    import sys

    code = (
        "import sys; from moezoo.training.cli import main; "
        f"rc = main(['--config', {os.path.join(ROOT, 'zoo', 'moe_65b.yaml')!r}, '--plan', "
        "*sys.argv[1:]]); print(rc, 'torch' in sys.modules)"
    )
    for args in (["--gpu", "a100x"], ["--gpus", "0"]):
        r = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT
        )
        assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"error: {args[0]}: ")


def test_sparse_attention_plan_counts_the_work_its_budget_does_and_dense_layers_add_to_it():
    sparse = plan(load_config("zoo/sparse_attn_1b_64k.yaml", []), n_gpus=1)
    hybrid = plan(
        load_config("zoo/sparse_attn_1b_64k.yaml", ["model.attention.dense_layers=last:2"]),
        n_gpus=1,
    )
    d, done, n_dense, n = sparse.attention
    assert (n_dense, n) == (0, 16) and 0.03 < d < 0.1
    model_flops = flops_per_token(
        load_config("zoo/sparse_attn_1b_64k.yaml", []).model, 65536, sparse.counts
    )
    assert done < model_flops == sparse.flops_per_token
    hd, hdone, h_dense, _ = hybrid.attention
    assert h_dense == 2 and abs(hd - (14 * d + 2) / 16) < 1e-9 and hdone > done
    assert "sparse in 14 of 16 layers" in format_plan(hybrid)
    assert plan(load_config("zoo/tiny_dense.yaml", []), n_gpus=1).attention is None


def test_plan_names_the_dense_phases():
    p = plan(preset("sparse_attn_small_16k.yaml"), n_gpus=1)
    assert p.dense_phases == (1800, 2400, 2400, "all")
    assert "dense phases  steps 0-1799: every head of the sparse layers dense" in format_plan(p)
    both = ["model.attention.dense_finish=0.1", "model.attention.dense_phase_heads=selecting"]
    p = plan(preset("sparse_attn_small_16k.yaml", *both), n_gpus=1)
    line = "dense phases  steps 0-1799 and steps 2160-2399: the selecting heads dense"
    assert line in format_plan(p) and p.dense_phases[:2] == (1800, 2160)
    off = ["model.attention.dense_warmup=0"]
    assert plan(preset("sparse_attn_small_16k.yaml", *off), n_gpus=1).dense_phases is None


def test_plan_names_the_short_context_phase_and_keeps_the_full_length_memory():
    short = ["train.short_seq_len=2048", "train.short_steps=1200"]
    cfg = preset("sparse_attn_small_16k.yaml", *short)
    off = ["train.short_seq_len=0", "train.short_steps=0"]
    p, full = plan(cfg, n_gpus=1), plan(preset("sparse_attn_small_16k.yaml", *off), n_gpus=1)
    # 2 windows of 16384 tokens a micro-batch -> 16 of 2048
    assert p.short_phase[:3] == (1200, 2048, 16)
    assert p.short_phase.flops_per_token == flops_per_token(cfg.model, 2048, p.counts)
    assert p.short_phase.flops_per_token < p.flops_per_token == full.flops_per_token
    assert p.memory == full.memory and full.short_phase is None
    assert "short phase   steps 0-1199: windows of 2048 tokens, 16 a micro-batch" in format_plan(p)
