"""A checkpoint from someone else cannot run code on --resume: a payload planted in any file it
reads (with the manifest updated to match, as an attacker would) does not run, and the run stops
with one line."""

import json
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from moezoo.training.cli import main


class Payload:
    """Unpickling it creates the marker file: proof that the file's code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _fix_manifest(ckpt: str) -> None:
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"] = {
        n: os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n != "manifest.json"
    }
    with open(path, "w") as f:
        json.dump(manifest, f)


def _plant_and_resume(run, capsys, write) -> tuple[int, list[str]]:
    """``write(ckpt_dir)`` plants files in the newest checkpoint; the manifest is then fixed to
    match (an attacker controls every file) and the run resumed through the command line."""
    ckpt = run.step_dir(10)
    write(ckpt)
    _fix_manifest(ckpt)
    rc = main(["--config", "zoo/tiny_dense.yaml", *run.overrides(), "--resume"])
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _assert_refused(rc, err, marker, culprit):
    assert not os.path.exists(marker), "the planted payload ran"
    assert rc == 2 and len(err) == 1, err
    assert culprit in err[0] and "--trust-checkpoint" in err[0], err[0]


def test_payload_in_rng_state_does_not_run(run_copy, tmp_path, capsys):
    marker = str(tmp_path / "pwned")
    rc, err = _plant_and_resume(
        run_copy,
        capsys,
        lambda ckpt: torch.save({"python": Payload(marker)}, os.path.join(ckpt, "rng_rank0.pt")),
    )
    _assert_refused(rc, err, marker, "rng_rank0.pt")


def test_payload_in_dcp_metadata_does_not_run(run_copy, tmp_path, capsys):
    marker = str(tmp_path / "pwned")

    def write(ckpt):
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(Payload(marker), f)

    rc, err = _plant_and_resume(run_copy, capsys, write)
    _assert_refused(rc, err, marker, ".metadata")


def test_payload_as_a_dcp_byte_entry_does_not_run(run_copy, tmp_path, capsys):
    """DCP's default planner torch.loads byte entries with weights_only=False: a shard whose
    metadata declares a weight as bytes must be refused, not unpickled (and training must not go
    on)."""
    from moezoo.configs import load_config
    from moezoo.training.loop import Trainer

    marker = str(tmp_path / "pwned")
    tr = Trainer(
        load_config("zoo/tiny_dense.yaml", run_copy.overrides(**{"checkpoint.resume": True}))
    )
    model_sd, optim_sd = get_state_dict(tr.model, tr.optimizer)
    name = next(iter(model_sd))
    crafted = {"model": {**model_sd, name: Payload(marker)}, "optim": {"state": optim_sd["state"]}}
    rc, err = _plant_and_resume(
        run_copy, capsys, lambda ckpt: dcp.save(crafted, checkpoint_id=ckpt)
    )
    _assert_refused(rc, err, marker, name)


def test_pickled_train_state_beside_the_checkpoint_is_never_read(run_copy, tmp_path, capsys):
    """A train_state.pt (a pickle) is not part of a checkpoint: a planted one is ignored."""
    marker = str(tmp_path / "pwned")
    rc, err = _plant_and_resume(
        run_copy,
        capsys,
        lambda ckpt: torch.save({"step": Payload(marker)}, os.path.join(ckpt, "train_state.pt")),
    )
    assert rc == 0 and not os.path.exists(marker)
