"""A run folder belongs to one run; resume continues it without repeating rows or restarting the
schedule; Ctrl-C saves a checkpoint first."""

import json
import os
import signal

import pytest
import torch

from helpers import spawn
from moezoo.configs import load_config
from moezoo.training.checkpoint import list_checkpoints, save_checkpoint
from moezoo.training.cli import main, parse_args
from moezoo.training.loop import Interrupted, Trainer
from moezoo.training.optim import build_scheduler


def _cfg(run, **extra):
    return load_config("zoo/tiny_dense.yaml", run.overrides(**extra))


def _no_data(monkeypatch):
    """Fail the test if the run gets as far as reading the corpus."""

    def boom(*a, **k):
        raise AssertionError("the corpus was read before the error")

    monkeypatch.setattr("moezoo.training.loop.prepare_data", boom)


def test_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(run_copy, capsys, monkeypatch):
    _no_data(monkeypatch)
    rc = main(["--config", "zoo/tiny_dense.yaml", *run_copy.overrides(), "model.n_layers=1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        rc == 2
        and len(err) == 1
        and err[0].startswith("error: train.out_dir:")
        and "--resume" in err[0]
    ), err
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [5, 10]


def test_overwrite_replaces_the_previous_run_and_its_metrics(run_copy):
    tr = Trainer(_cfg(run_copy, **{"train.overwrite": True, "train.steps": 5}))
    assert list_checkpoints(run_copy.ckpt_dir) == [] and not os.path.exists(tr.metrics_path)
    tr.fit()
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [5]
    with open(tr.metrics_path) as f:
        assert max(json.loads(line)["step"] for line in f) == 5


def test_rotation_never_deletes_another_runs_checkpoint(tmp_path):
    cfg = load_config(None, ["model.vocab_size=512"])
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    d = str(tmp_path / "ckpt")
    save_checkpoint(d, 100, model, opt, {"step": 100, "run_id": "other"}, cfg, keep_last=1)
    for step in (1, 2, 3):
        save_checkpoint(d, step, model, opt, {"step": step, "run_id": "mine"}, cfg, keep_last=1)
    assert [s for s, _ in list_checkpoints(d)] == [3, 100]


def test_extended_resume_follows_the_schedule_of_the_new_length(run_copy, capsys):
    tr = Trainer(_cfg(run_copy, **{"checkpoint.resume": True, "train.steps": 16}))
    assert tr.step == 10 and "schedule rebuilt for 16 steps" in capsys.readouterr().out
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=tr.cfg.optim.lr)
    ref = build_scheduler(ref_opt, tr.cfg.optim, 16)
    lrs, ref_lrs = [], []
    for i in range(16):
        if i >= 10:
            lrs.append(tr.optimizer.param_groups[0]["lr"])
            ref_lrs.append(ref_opt.param_groups[0]["lr"])
            tr.train_step()
        ref_opt.step()
        ref.step()
    assert lrs == pytest.approx(ref_lrs, rel=1e-12, abs=0)
    assert all(b <= a for a, b in zip(lrs, lrs[1:])), "the cosine climbed after the resume"


def test_resuming_a_finished_run_says_it_is_already_complete(run_copy, capsys):
    tr = Trainer(_cfg(run_copy, **{"checkpoint.resume": True}))
    assert "already complete" in capsys.readouterr().out
    assert tr.fit()["step"] == 10


def test_metrics_have_no_repeated_steps_after_resume(run_copy):
    """Interrupted after step 10 was logged but before its checkpoint: resume at 5 drops rows
    6-10."""
    os.rename(run_copy.step_dir(10), os.path.join(run_copy.ckpt_dir, "gone"))
    Trainer(_cfg(run_copy, **{"checkpoint.resume": True})).fit()
    with open(os.path.join(run_copy.out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for kind in ("loss/total", "val/loss"):
        steps = [r["step"] for r in rows if kind in r]
        assert len(steps) == len(set(steps)), (kind, steps)
    assert sorted(r["step"] for r in rows if "loss/total" in r) == list(range(1, 11))


def test_resume_without_a_checkpoint_warns_on_stderr(tmp_path, trained_run, capsys):
    ov = trained_run.overrides(**{"train.out_dir": tmp_path / "new", "train.steps": 1})
    Trainer(load_config("zoo/tiny_dense.yaml", ov + ["checkpoint.resume=true"]))
    captured = capsys.readouterr()
    assert "warning: no checkpoint" in captured.err and "no checkpoint" not in captured.out


def test_argument_prefixes_are_not_taken_for_flags():
    with pytest.raises(SystemExit):
        parse_args(["--config", "zoo/tiny_dense.yaml", "--resum"])


@pytest.fixture
def default_sigint():
    """Python's own Ctrl-C handling for the test (restored after): a pytest started in the
    background from a non-interactive shell inherits SIGINT ignored, and the trainer then leaves
    Ctrl-C alone, as it should."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _interrupt_at(tr, steps):
    """Send SIGINT to this process inside train_step at each step in ``steps`` (a real Ctrl-C)."""
    real = tr.train_step

    def step():
        if tr.step in steps:
            os.kill(os.getpid(), signal.SIGINT)
        return real()

    tr.train_step = step


def test_ctrl_c_saves_a_checkpoint_before_exiting(run_copy, default_sigint):
    tr = Trainer(
        _cfg(run_copy, **{"train.overwrite": True, "train.steps": 8, "checkpoint.every": 0})
    )
    _interrupt_at(tr, {2})
    with pytest.raises(Interrupted, match="step 3"):
        tr.fit()
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed = Trainer(
        _cfg(run_copy, **{"checkpoint.resume": True, "train.steps": 8, "checkpoint.every": 0})
    )
    assert resumed.step == 3


def test_second_ctrl_c_exits_at_once(run_copy, default_sigint):
    tr = Trainer(
        _cfg(run_copy, **{"train.overwrite": True, "train.steps": 8, "checkpoint.every": 0})
    )
    real = tr.train_step

    def step():
        if tr.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # asks for a checkpoint at the end of the step
            os.kill(os.getpid(), signal.SIGINT)  # does not wait for it
        return real()

    tr.train_step = step
    with pytest.raises(KeyboardInterrupt) as info:
        tr.fit()
    assert not isinstance(info.value, Interrupted) and list_checkpoints(run_copy.ckpt_dir) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _ctrl_c_on_rank_1(rank, world, overrides):
    """One of two gloo ranks (the trainer joins spawn's process group) is asked to stop inside step
    2."""
    # this child only
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    tr = Trainer(load_config("zoo/tiny_dense.yaml", overrides))
    real = tr.train_step

    def step():
        if rank == 1 and tr.step == 2:
            tr.stop_requested = True  # what the SIGINT handler sets, on this rank alone
        return real()

    tr.train_step = step
    with pytest.raises(Interrupted, match="step 3"):
        tr.fit()


def test_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(run_copy):
    """The flag travels in the step's loss all-reduce (no collective of its own): both ranks stop
    after step 3 and save it together."""
    spawn(
        _ctrl_c_on_rank_1,
        2,
        run_copy.overrides(**{"train.overwrite": True, "train.steps": 8, "checkpoint.every": 0}),
    )
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [3]
