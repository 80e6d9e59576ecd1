"""The lr schedule: cosine and warmup-stable-decay shapes, and what a resumed run whose length
changed does with them (optim.extend): never a higher lr unless asked to re-warm."""

import pytest
import torch

from moezoo.configs import ConfigError, OptimConfig, load_config
from moezoo.training.loop import Trainer
from moezoo.training.optim import (
    build_scheduler,
    extend_schedule,
    lr_at,
    plan_schedule,
    schedule_targets,
)

# tiny_dense's optimizer: lr 3e-3, 30 warm-up steps, floor 3e-4, 600 steps
TINY = OptimConfig(lr=3e-3, warmup_steps=30)


def lrs(pieces, steps):
    return [lr_at(pieces, s) for s in steps]


@pytest.mark.parametrize("warmup,total", [(0, 40), (1, 40), (7, 40), (30, 600), (50, 10)])
def test_cosine_is_torchs_linear_warmup_then_cosine_annealing(warmup, total):
    """The independent reference: torch's LinearLR + CosineAnnealingLR in a SequentialLR."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    cfg = OptimConfig(lr=2e-3, warmup_steps=warmup, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    w = min(warmup, total - 1)
    cos = CosineAnnealingLR(opt, T_max=total - w, eta_min=cfg.lr * cfg.min_lr_ratio)
    ref = cos
    if w:
        ramp = LinearLR(opt, start_factor=1 / w, end_factor=1.0, total_iters=w)
        ref = SequentialLR(opt, [ramp, cos], milestones=[w])
    expected = []
    for _ in range(total):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    pieces = plan_schedule(schedule_targets(cfg, total))
    assert lrs(pieces, range(total)) == pytest.approx(expected, rel=1e-9, abs=0)


def test_wsd_warms_up_holds_the_lr_then_decays_linearly_over_the_last_fraction():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="wsd")
    pieces = plan_schedule(schedule_targets(cfg, 100))  # decay over the last 20 steps
    assert lr_at(pieces, 0) == pytest.approx(1e-4) and lr_at(pieces, 10) == 1e-3
    assert lrs(pieces, range(10, 81)) == [1e-3] * 71
    assert lr_at(pieces, 90) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(pieces, 100) == pytest.approx(1e-4)
    decay = lrs(pieces, range(80, 101))
    assert all(b < a for a, b in zip(decay, decay[1:]))


def test_extending_a_finished_600_step_run_to_1200_never_raises_the_lr():
    """Issue 51, finding 3: tiny_dense's 600-step run resumed with train.steps=1200 went 3.0e-4 ->
    1.70e-3 (its cosine rebuilt for 1200 steps). By default it now continues from the lr it
    reached: a finished cosine ends at its floor and holds it."""
    done = plan_schedule(schedule_targets(TINY, 600))
    reached = lr_at(done, 600)
    assert reached == pytest.approx(3.0e-4)
    ext = extend_schedule(done, 600, reached, schedule_targets(TINY, 1200), "continue")
    assert max(lrs(ext, range(600, 1201))) == reached
    assert lrs(ext, range(600)) == lrs(done, range(600))  # the trained-through steps are kept


def test_extending_mid_cosine_decays_from_the_reached_lr_to_the_floor_at_the_new_end():
    done = plan_schedule(schedule_targets(TINY, 600))
    reached = lr_at(done, 400)
    ext = extend_schedule(done, 400, reached, schedule_targets(TINY, 1200), "continue")
    ahead = lrs(ext, range(400, 1201))
    assert ahead[0] == reached and ahead[-1] == pytest.approx(3.0e-4)
    assert all(b <= a for a, b in zip(ahead, ahead[1:]))


def test_extending_during_the_warm_up_finishes_it_as_the_longer_run_would():
    short, long = schedule_targets(TINY, 600), schedule_targets(TINY, 1200)
    ext = extend_schedule(
        plan_schedule(short), 10, lr_at(plan_schedule(short), 10), long, "continue"
    )
    assert lrs(ext, range(1200)) == lrs(plan_schedule(long), range(1200))


def test_extending_a_stable_wsd_run_keeps_its_lr_and_moves_the_decay_to_the_new_end():
    cfg = OptimConfig(lr=3e-3, warmup_steps=30, schedule="wsd")
    short, long = schedule_targets(cfg, 600), schedule_targets(cfg, 1200)
    first = plan_schedule(short)
    ext = extend_schedule(first, 300, lr_at(first, 300), long, "continue")
    # the same lr at every step as a run planned for 1200 steps from the start
    assert lrs(ext, range(1201)) == pytest.approx(lrs(plan_schedule(long), range(1201)), abs=0)
    assert lrs(ext, range(300, 961)) == [3e-3] * 661


def test_extending_a_finished_wsd_run_holds_its_floor():
    cfg = OptimConfig(lr=3e-3, warmup_steps=30, schedule="wsd")
    first = plan_schedule(schedule_targets(cfg, 600))
    ext = extend_schedule(first, 600, lr_at(first, 600), schedule_targets(cfg, 1200), "continue")
    assert lrs(ext, range(600, 1201)) == pytest.approx([3e-4] * 601)


@pytest.mark.parametrize("shape", ["cosine", "wsd"])
def test_rewarm_is_explicit_up_to_the_peak_then_the_shapes_decay(shape):
    cfg = OptimConfig(lr=3e-3, warmup_steps=30, schedule=shape)
    first = plan_schedule(schedule_targets(cfg, 600))
    ext = extend_schedule(first, 600, lr_at(first, 600), schedule_targets(cfg, 1200), "rewarm")
    ramp = lrs(ext, range(600, 631))
    assert ramp[0] == pytest.approx(3e-4) and ramp[-1] == 3e-3
    assert all(b > a for a, b in zip(ramp, ramp[1:]))
    assert lr_at(ext, 1200) == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.schedule=linear", "optim.schedule"),
        ("optim.decay_fraction=0", "optim.decay_fraction"),
        ("optim.decay_fraction=1.5", "optim.decay_fraction"),
        ("optim.extend=restart", "optim.extend"),
        ("optim.init_from_lr=0", "optim.init_from_lr"),
        ("optim.init_from_warmup_steps=-1", "optim.init_from_warmup_steps"),
    ],
)
def test_a_bad_schedule_key_is_one_line_naming_it(override, key):
    with pytest.raises(ConfigError) as info:
        load_config("zoo/tiny_dense.yaml", [override])
    assert str(info.value).startswith(f"{key}: ") and "\n" not in str(info.value)


def test_trainer_extension_of_a_finished_run_holds_the_floor_and_says_so(run_copy, capsys):
    """The same through the trainer: the run of 10 steps resumed with train.steps=16."""
    tr = Trainer(
        load_config(
            "zoo/tiny_dense.yaml",
            run_copy.overrides(**{"checkpoint.resume": True, "train.steps": 16}),
        )
    )
    out = capsys.readouterr().out
    floor = tr.cfg.optim.lr * tr.cfg.optim.min_lr_ratio
    assert tr.step == 10 and "train.steps 10 -> 16: lr" in out and "optim.extend=continue" in out
    seen = []
    for _ in range(6):
        seen.append(tr.optimizer.param_groups[0]["lr"])
        tr.train_step()
    assert seen == pytest.approx([floor] * 6)


def test_a_resume_with_the_same_targets_follows_the_saved_schedule(run_copy):
    """Resumed at step 5 of 10: the lr of each step is the one a run never stopped would use."""
    import shutil

    shutil.rmtree(run_copy.step_dir(10))
    tr = Trainer(
        load_config("zoo/tiny_dense.yaml", run_copy.overrides(**{"checkpoint.resume": True}))
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=tr.cfg.optim.lr)
    ref = build_scheduler(opt, tr.cfg.optim, 10)
    expected = []
    for _ in range(10):
        expected.append(opt.param_groups[0]["lr"])
        ref.step()
    seen = []
    for _ in range(5):
        seen.append(tr.optimizer.param_groups[0]["lr"])
        tr.train_step()
    assert tr.step == 10 and seen == expected[5:]


def test_init_from_plans_continued_training_unless_its_keys_say_otherwise():
    t = schedule_targets(TINY, 100, init_from=True)
    assert (t["lr"], t["floor"], t["warmup"]) == pytest.approx((3e-4, 3e-5, 3))
    cfg = OptimConfig(lr=3e-3, warmup_steps=30, init_from_lr=1e-3, init_from_warmup_steps=0)
    t = schedule_targets(cfg, 100, init_from=True)
    assert (t["lr"], t["warmup"]) == (1e-3, 0) and lr_at(plan_schedule(t), 0) == 1e-3


def test_a_run_whose_warm_up_its_length_cut_short_is_not_re_warmed_when_extended():
    """4 steps of a 30-step warm-up: 3 warm-up steps, then the cosine reached the floor at 4."""
    short = plan_schedule(schedule_targets(TINY, 4))
    ext = extend_schedule(short, 4, lr_at(short, 4), schedule_targets(TINY, 8), "continue")
    assert max(lrs(ext, range(4, 9))) == lr_at(short, 4) == pytest.approx(3e-4)
