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


# ---- numbered run folders, resume from the saved config -----------------------------------------
def _folderless(run, **extra) -> list[str]:
    """The run's overrides without train.out_dir: runs go to runs/<name>/<N> under the cwd."""
    return [o for o in run.overrides(**extra) if not o.startswith("train.out_dir=")]


def _first_line(capsys) -> str:
    return capsys.readouterr().out.splitlines()[0]


def test_each_new_run_gets_a_numbered_folder_named_in_its_first_line(
    trained_run, tmp_path, monkeypatch, capsys
):
    """Issue 51, finding 1: after the quickstart, every other documented command (and the
    quickstart again) exited 2 on train.out_dir holding another run's checkpoints. Each new run now
    gets runs/<name>/<N>; --resume continues the latest, and generate / export read runs/<name> as
    its latest run."""
    from moezoo.training.export import main as export_main

    monkeypatch.chdir(tmp_path)
    ov = _folderless(trained_run, **{"train.steps": 2, "checkpoint.every": 0})
    for n in (1, 2):
        assert main(["--config", "tiny_dense", *ov]) == 0
        assert _first_line(capsys) == (
            f"run folder runs/tiny_dense/{n} (new; --resume continues the latest run of tiny_dense)"
        )
        assert [s for s, _ in list_checkpoints(f"runs/tiny_dense/{n}/checkpoints")] == [2]
    assert main(["--config", "tiny_dense", "--resume", "train.steps=3"]) == 0
    assert _first_line(capsys) == "run folder runs/tiny_dense/2 (resuming)"
    assert [s for s, _ in list_checkpoints("runs/tiny_dense/2/checkpoints")] == [2, 3]
    assert export_main(["--run", "runs/tiny_dense", "--file", "m.safetensors"]) == 0
    assert "runs/tiny_dense/2/checkpoints/step_00000003 ->" in capsys.readouterr().out


def test_a_new_run_that_fails_before_writing_leaves_no_folder(trained_run, tmp_path, monkeypatch):
    from moezoo.configs import ConfigError

    def fail(*a, **k):
        raise ConfigError("data.source", "too small")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("moezoo.training.loop.prepare_data", fail)
    assert main(["--config", "tiny_dense", *_folderless(trained_run)]) == 2
    assert os.listdir("runs/tiny_dense") == []


def test_resume_restores_the_checkpoints_config_with_overrides_on_top(run_copy, capsys):
    """Issue 51, finding 4: --resume needed every original override repeated (leaving one out:
    model.n_layers: is 4 but checkpoint ... was trained with 2). The checkpoint's resolved config is
    now the base: the run folder alone and the overrides that change something."""
    assert main(["--resume", run_copy.out_dir, "train.steps=12"]) == 0
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)][-1] == 12
    saved = load_config(os.path.join(run_copy.step_dir(12), "config.yaml"))
    assert saved.model.n_layers == 2 and saved.model.dim == 32 and saved.train.steps == 12
    # an architecture override is still checked against the checkpoint: one line, exit 2
    capsys.readouterr()
    assert main(["--resume", run_copy.out_dir, "model.n_layers=4"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: model.n_layers: is 4 but checkpoint ")
    assert err[0].endswith("was trained with 2")


def test_overrides_parse_before_between_and_after_the_flags():
    """Issue 51, finding 4: ``name=rf_a --resume train.steps=60`` was "unrecognized arguments"."""
    a = parse_args(["--config", "tiny_dense", "name=rf_a", "--resume", "train.steps=60"])
    assert a.resume is True and a.overrides == ["name=rf_a", "train.steps=60"]
    a = parse_args(["name=rf_a", "--resume", "runs/rf_a/3", "--config", "tiny_dense", "x.y=1"])
    assert a.resume == "runs/rf_a/3" and a.overrides == ["name=rf_a", "x.y=1"]
    a = parse_args(["--resume", "runs/rf_a/3"])  # the saved config: --config may be left out
    assert a.config is None and a.resume == "runs/rf_a/3"
    with pytest.raises(SystemExit):
        parse_args(["train.steps=3"])


def test_resume_of_an_explicit_out_dir_and_of_a_missing_run_folder(run_copy, capsys, tmp_path):
    assert main(["--config", "tiny_dense", *run_copy.overrides(), "--resume"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert main(["--resume", str(tmp_path / "nothing")]) == 2
    assert "error: --resume: " in capsys.readouterr().err


def test_rotation_keeps_the_newest_checkpoint_of_a_completed_schedule(tmp_path):
    cfg = load_config(None, ["model.vocab_size=512"])
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    d = str(tmp_path / "ckpt")
    for step, total in ((5, 10), (10, 10), (11, 20), (12, 20), (13, 20)):
        state = {"step": step, "total_steps": total, "run_id": "r"}
        save_checkpoint(d, step, model, opt, state, cfg, keep_last=2)
    assert [s for s, _ in list_checkpoints(d)] == [10, 12, 13]
    for step in (19, 20):
        save_checkpoint(
            d, step, model, opt, {"step": step, "total_steps": 20, "run_id": "r"}, cfg, 2
        )
    assert [s for s, _ in list_checkpoints(d)] == [19, 20]  # the newer finished run replaces it


def test_ctrl_c_saves_of_an_extension_keep_the_finished_runs_checkpoint(run_copy, default_sigint):
    """Issue 51, finding 4: with keep_last 2, two Ctrl-C saves after an extension deleted the
    finished run's final checkpoint."""
    for stop in (10, 11):
        tr = Trainer(
            _cfg(
                run_copy,
                **{
                    "checkpoint.resume": True,
                    "train.steps": 20,
                    "checkpoint.keep_last": 2,
                    "checkpoint.every": 0,
                },
            )
        )
        _interrupt_at(tr, {stop})
        with pytest.raises(Interrupted):
            tr.fit()
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [10, 11, 12]
