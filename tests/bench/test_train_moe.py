"""bench/train_moe.py's equal-time runs: the LR on the steady-seconds clock (TimeSchedule) and a CPU
run of the ``smoke`` suite that stops at its time budget with the LR at the cosine floor."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, bench_script, subprocess_env
from moezoo.configs import OptimConfig, load_config
from moezoo.training.optim import build_scheduler


@pytest.fixture(scope="module")
def bench():
    return bench_script("train_moe")


def lrs(sched, opt, steps, dt=None):
    """The LR of each of ``steps`` steps and the one after them, in train_step's order; ``dt``:
    every step's steady seconds (TimeSchedule: the bench's ``advance`` once the step is timed)."""
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if dt is not None:
            sched.advance(dt)
    return out + [opt.param_groups[0]["lr"]]


@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_time_schedule_at_a_constant_step_time_is_the_trainers_step_schedule(bench, warmup):
    """Warm-up in steps, then the cosine over seconds: with every step taking dt, a budget of T * dt
    gives build_scheduler's LR for a T-step run at every step, ending at the floor."""
    cfg, T, dt = OptimConfig(lr=2e-3, warmup_steps=warmup, min_lr_ratio=0.1), 40, 0.25
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    ref = lrs(build_scheduler(ref_opt, cfg, T), ref_opt, T)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    # what the trainer built for its bound of steps, then replaced
    build_scheduler(opt, cfg, 10 * T)
    got = lrs(bench.TimeSchedule(opt, cfg, T * dt), opt, T, dt)
    assert got == pytest.approx(ref, rel=1e-9, abs=0)
    assert got[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)


def test_time_schedule_follows_seconds_not_steps(bench):
    """Steps left out of the clock (0 s) do not move the cosine; the floor comes with the budget."""
    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    build_scheduler(opt, cfg, 100)
    sched = bench.TimeSchedule(opt, cfg, seconds=10.0)
    # warm-up by step; cosine from 2 s
    assert lrs(sched, opt, 2, dt=1.0) == pytest.approx([0.5, 0.75, 1.0])
    sched.step()
    sched.advance(0.0)  # a compile step: no time, no decay
    assert opt.param_groups[0]["lr"] == 1.0
    sched.step()
    sched.advance(4.0)  # 6 of 10 s: half of the 8 s after the warm-up
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step()
    sched.advance(5.0)  # past the budget
    assert opt.param_groups[0]["lr"] == 0.0


def test_every_suite_run_config_loads(bench):
    """The suites' presets plus overrides validate (e.g. the top-1 layouts on a router that trains);
    the CUDA-graph suites only add a compile mode to these."""
    runs = {
        (preset, tuple(o for o in ov if not o.startswith("train.compile_mode=")))
        for suite in bench.SUITES.values()
        for preset, ov in suite.values()
    }
    for preset, ov in sorted(runs):
        load_config(preset, list(ov))


@pytest.mark.slow
def test_smoke_suite_trains_each_model_to_the_time_budget_with_the_lr_at_the_floor(
    bench, tmp_path, corpus_dir
):
    """dense and MoE train until their steady seconds reach --seconds (the step bound unused) and
    end at the cosine floor; the neuron-routed model keeps the probe's step count (its schedule is
    in steps)."""
    seconds, probe_steps = 1.5, 12
    # 1 thread: steady under xdist
    env = subprocess_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    tok, out = tmp_path / "tok", tmp_path / "out.json"
    # the tokens here (no process state: training.data's code, its cache under tmp_path), the runs
    # in a child (the script points the trainer's data at the token files process-wide)
    bench.prepare(str(tok), corpus_dir, 0, 2048, cache_dir=str(tmp_path / "cache"))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "train_moe.py"),
            "--tokens",
            str(tok),
            "--suite",
            "smoke",
            "--device",
            "cpu",
            "--seconds",
            str(seconds),
            "--seeds",
            "0",
            "--probe-steps",
            str(probe_steps),
            "--runs",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["smoke"]
    train_tokens = json.loads((tok / "meta.json").read_text())["tokens"]["train"]
    # epochs: the tokens seen over the folder's training tokens, in the table too
    for run in res.values():
        assert run["seeds"]["0"]["epochs"] == pytest.approx(
            run["seeds"]["0"]["tokens_seen"] / train_tokens
        )
    assert re.search(r"tokens\s+epochs\s+steady s", r.stdout)
    floor = load_config("zoo/tiny_dense.yaml").optim
    for name in ("dense", "moe"):
        probe, run = res[name]["probe"], res[name]["seeds"]["0"]
        estimate = max(probe_steps, int(seconds / probe["tail_median_s"]))
        assert run["budget_reached"] and run["budget_s"] == seconds, (name, run)
        assert run["steps"] < run["steps_bound"] == int(bench.STEP_BOUND * estimate)
        # the last step starts before the budget and counts only if it takes at most twice the
        # probe's step
        assert seconds <= run["steady_s"] < seconds + 2 * probe["tail_median_s"]
        assert run["tokens_seen"] == run["steps"] * 2 * 64
        assert run["lr_end"] == pytest.approx(floor.lr * floor.min_lr_ratio)
    probe, run = res["neuron"]["probe"], res["neuron"]["seeds"]["0"]
    assert "budget_s" not in run and run["steps"] == max(
        probe_steps, int(seconds / probe["tail_median_s"])
    )
    assert run["lr_end"] == pytest.approx(floor.lr * floor.min_lr_ratio)
