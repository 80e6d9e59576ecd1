"""Non-finite steps: rollback stops after train.max_rollbacks in a row, the step that triggers a
rollback is logged, and a skipped MoE step leaves no trace in the aux-loss-free bias."""

import json
import os

import torch

from helpers import poison_loss, tiny_overrides
from moezoo.configs import load_config
from moezoo.training.cli import main
from moezoo.training.loop import Trainer


def test_rollback_stops_after_max_rollbacks_in_a_row(run_copy, capsys, monkeypatch):
    """Every step after the checkpoint at 5 is non-finite: roll back twice, then stop with one line,
    exit 1."""
    real_init = Trainer.__init__

    def init(self, cfg):
        real_init(self, cfg)
        poison_loss(self, lambda step: step >= 5)

    monkeypatch.setattr(Trainer, "__init__", init)
    ov = run_copy.overrides(
        **{"train.overwrite": True, "train.max_bad_steps": 1, "train.max_rollbacks": 2}
    )
    rc = main(["--config", "zoo/tiny_dense.yaml", *ov])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        rc == 1
        and len(err) == 1
        and "2 rollbacks in a row" in err[0]
        and "train.max_rollbacks" in err[0]
    ), err
    with open(os.path.join(run_copy.out_dir, "metrics.jsonl")) as f:
        rollbacks = [json.loads(line) for line in f if '"rollback"' in line]
    # The bad step that triggered each rollback is on record, with its non-finite loss.
    assert [r["step"] for r in rollbacks] == [6, 6, 6] and all(r["skipped"] for r in rollbacks)


def _moe_trainer(tmp, corpus):
    ov = tiny_overrides(tmp, corpus, **{"model.moe.bias_update_rate": 0.01, "checkpoint.every": 0})
    return Trainer(load_config("zoo/tiny_moe.yaml", ov))


def test_moe_bias_after_a_skipped_step_equals_a_run_without_that_step(tmp_path, corpus_dir):
    skipped = _moe_trainer(tmp_path / "a", corpus_dir)
    poison_loss(skipped, lambda step: step == 2)
    without = _moe_trainer(tmp_path / "b", corpus_dir)
    for _ in range(2):
        skipped.train_step()
        without.train_step()
    assert skipped.train_step()["skipped"]  # step 2: routed, then skipped
    without.step += 1  # step 2 never ran: only the step count and schedule move
    without.scheduler.step()
    skipped.train_step()
    without.train_step()

    def bias(tr):
        return {k: v for k, v in tr.model.state_dict().items() if k.endswith("expert_bias")}

    a, b = bias(skipped), bias(without)
    assert a and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a), "no bias update happened: the test proves nothing"
