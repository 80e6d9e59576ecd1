"""Damaged checkpoints: --resume falls back to the previous complete one with a warning naming what
it skipped, or stops with one line; never a traceback. Rotation never leaves a partial
checkpoint."""

import os
import shutil

import pytest

from moezoo.configs import load_config
from moezoo.training.checkpoint import list_checkpoints, remove_checkpoint
from moezoo.training.cli import main
from moezoo.training.loop import Trainer


def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def _same_size_garbage(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write((b"\x00garbage" * (size // 8 + 1))[:size])


def _python_tag_same_size(path):
    """A config.yaml with a python tag, the same size as before (so only reading it can tell)."""
    size = os.path.getsize(path)
    text = "model: !!python/object/apply:os.system [echo]\n"
    with open(path, "w") as f:
        f.write(text + "#" * (size - len(text) - 1) + "\n")


DAMAGE = {
    "truncated_shard": ("__0_0.distcp", _truncate),
    "garbage_metadata": (".metadata", _same_size_garbage),
    "missing_shard": ("__0_0.distcp", os.remove),
    "truncated_train_state": ("train_state.json", _truncate),
    "missing_config": ("config.yaml", os.remove),
    "truncated_rng": ("rng_rank0.pt", _truncate),
    "python_tag_config": ("config.yaml", _python_tag_same_size),
    "missing_manifest": ("manifest.json", os.remove),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(
    run_copy, capsys, damage
):
    name, spoil = DAMAGE[damage]
    spoil(os.path.join(run_copy.step_dir(10), name))
    tr = Trainer(
        load_config("zoo/tiny_dense.yaml", run_copy.overrides(**{"checkpoint.resume": True}))
    )
    assert tr.step == 5
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "step_00000010" in warnings[0], warnings
    assert name in warnings[0] or "manifest" in warnings[0], warnings[0]


def test_every_checkpoint_damaged_stops_with_one_line(run_copy, capsys):
    for step in (5, 10):
        _truncate(os.path.join(run_copy.step_dir(step), "__0_0.distcp"))
    rc = main(["--config", "zoo/tiny_dense.yaml", *run_copy.overrides(), "--resume"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "no usable checkpoint" in err[0], err
    assert "step_00000010" in err[0] and "step_00000005" in err[0]


def test_garbled_shard_of_the_right_size_stops_with_one_line_naming_the_checkpoint(
    run_copy, capsys
):
    """Only loading the shards can find this one, after the model is built: one line, not a
    traceback."""
    _same_size_garbage(os.path.join(run_copy.step_dir(10), "__0_0.distcp"))
    rc = main(["--config", "zoo/tiny_dense.yaml", *run_copy.overrides(), "--resume"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "step_00000010" in err[0] and "shards" in err[0], err


def test_checkpoint_without_every_part_is_not_complete(run_copy):
    """Killed while rotating out an old checkpoint: a step dir with its small files but no shards
    is not a checkpoint."""
    os.remove(os.path.join(run_copy.step_dir(5), "__0_0.distcp"))
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [10]


def test_kill_during_rotation_leaves_no_partial_checkpoint(run_copy, monkeypatch):
    """remove_checkpoint renames before deleting: a kill inside the delete leaves only a .trash_
    dir."""

    def killed_rmtree(path, ignore_errors=False):
        if ".trash_" in str(path) and os.path.exists(path):
            # part of the delete happened, then the kill
            os.remove(os.path.join(path, "__0_0.distcp"))
            raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(SystemExit):
        remove_checkpoint(run_copy.step_dir(5))
    monkeypatch.undo()
    assert not os.path.exists(run_copy.step_dir(5))
    assert [s for s, _ in list_checkpoints(run_copy.ckpt_dir)] == [10]
