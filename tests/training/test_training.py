"""The training spine: a short run learns, resume is bit-exact, non-finite steps are skipped, wandb
modes."""

import glob
import os

import pytest
import torch

from helpers import poison_loss, tiny_overrides
from moezoo.configs import load_config
from moezoo.training.checkpoint import latest_checkpoint, list_checkpoints
from moezoo.training.loop import Trainer


def make_cfg(tmp_path, corpus, **extra):
    return load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp_path, corpus, **extra))


def test_short_run_validation_loss_falls(tmp_path, corpus_dir):
    cfg = make_cfg(tmp_path, corpus_dir, **{"train.steps": 40, "train.eval_every": 40})
    summary = Trainer(cfg).fit()
    (_, first), (_, last) = summary["val_history"][0], summary["val_history"][-1]
    assert last < first - 0.5, summary["val_history"]
    assert summary["step"] == 40 and latest_checkpoint(cfg.checkpoint_dir).endswith("step_00000040")


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "phase",
    [
        {},
        # a short-context phase (windows of 8 tokens, 4x as many) that the resumed run ends
        {"train.short_seq_len": 8, "train.short_steps": 15},
        # one that ended before the checkpoint
        {"train.short_seq_len": 8, "train.short_steps": 5},
    ],
    ids=["plain", "checkpoint_in_short_phase", "checkpoint_after_short_phase"],
)
def test_resume_is_bit_exact(tmp_path, corpus_dir, phase):
    straight = Trainer(make_cfg(tmp_path / "a", corpus_dir, **{"train.steps": 20, **phase}))
    losses_straight = [straight.train_step()["loss/total"].item() for _ in range(20)]

    first = Trainer(make_cfg(tmp_path / "b", corpus_dir, **{"train.steps": 20, **phase}))
    losses_resumed = [first.train_step()["loss/total"].item() for _ in range(10)]
    first.save()
    second = Trainer(
        make_cfg(
            tmp_path / "b", corpus_dir, **{"train.steps": 20, "checkpoint.resume": True, **phase}
        )
    )
    assert second.step == 10
    losses_resumed += [second.train_step()["loss/total"].item() for _ in range(10)]

    assert losses_resumed == losses_straight
    a, b = _params(straight.model), _params(second.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_injected_nan_step_is_skipped_and_training_continues(tmp_path, corpus_dir):
    tr = Trainer(make_cfg(tmp_path, corpus_dir))
    poison_loss(tr, lambda step: step == 3)
    before = None
    for _ in range(6):
        if tr.step == 3:
            before = _params(tr.model)
        m = tr.train_step()
        if tr.step == 4:
            assert m["skipped"] and tr.bad_total == 1
            after = _params(tr.model)
            assert all(torch.equal(before[k], after[k]) for k in before), (
                "a skipped step changed weights"
            )
    assert tr.step == 6 and tr.bad_total == 1 and tr.bad_in_row == 0


def test_repeated_nan_steps_roll_back_to_last_checkpoint(tmp_path, corpus_dir):
    cfg = make_cfg(
        tmp_path, corpus_dir, **{"train.steps": 30, "train.max_bad_steps": 2, "checkpoint.every": 5}
    )
    tr = Trainer(cfg)
    state = {"poison": True}
    poison_loss(tr, lambda step: step in (7, 8) and state["poison"])
    orig_rollback = tr.rollback

    def rollback():
        state["poison"] = False
        orig_rollback()

    tr.rollback = rollback
    summary = tr.fit()
    assert summary["step"] == 30 and summary["bad_steps"] == 2 and tr.epoch == 1


def test_checkpoint_write_is_atomic_and_keeps_last_k(tmp_path, corpus_dir):
    cfg = make_cfg(
        tmp_path,
        corpus_dir,
        **{"train.steps": 20, "checkpoint.every": 5, "checkpoint.keep_last": 2},
    )
    Trainer(cfg).fit()
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)] == [15, 20]
    # A save killed midway leaves only a temp dir (or a dir without manifest.json): never picked for
    # resume.
    os.makedirs(os.path.join(cfg.checkpoint_dir, ".tmp_step_00000025"))
    torn = os.path.join(cfg.checkpoint_dir, "step_00000030")
    os.makedirs(torn)
    open(os.path.join(torn, ".metadata"), "w").close()
    assert latest_checkpoint(cfg.checkpoint_dir).endswith("step_00000020")


def test_wandb_offline_writes_a_run_and_disabled_writes_nothing(tmp_path, corpus_dir):
    pytest.importorskip("wandb")
    cfg = make_cfg(tmp_path / "off", corpus_dir, **{"logging.wandb": "offline", "train.steps": 10})
    Trainer(cfg).fit()
    runs = glob.glob(os.path.join(cfg.out_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0

    cfg = make_cfg(tmp_path / "dis", corpus_dir, **{"logging.wandb": "disabled", "train.steps": 10})
    Trainer(cfg).fit()
    assert not os.path.exists(os.path.join(cfg.out_dir, "wandb"))


@pytest.mark.slow
def test_train_compile_runs_compiled_blocks_with_the_same_losses(tmp_path, corpus_dir):
    eager = Trainer(make_cfg(tmp_path / "e", corpus_dir, **{"train.steps": 2}))
    compiled = Trainer(
        make_cfg(tmp_path / "c", corpus_dir, **{"train.steps": 2, "train.compile": True})
    )
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.layers)
    assert eager.model.state_dict().keys() == compiled.model.state_dict().keys()
    for _ in range(2):
        a, b = eager.train_step()["loss/total"], compiled.train_step()["loss/total"]
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "phase,graphs",
    [({}, 2), ({"train.short_seq_len": 8, "train.short_steps": 1}, 3)],
    ids=["one_length", "short_phase"],
)
def test_train_compile_cache_holds_a_training_and_an_evaluation_graph_of_every_block(
    tmp_path, corpus_dir, phase, graphs
):
    """Evaluation (no_grad, eval mode) recompiles every block; past dynamo's limit a block would run
    eagerly, and the step-0 validation comes first, so the limit must cover both graphs of every
    distinct block, on top of what earlier models in the process hold in the same cache (the block
    class's forward). A short-context phase's windows are a third shape, so a third graph."""
    # restored by hand: monkeypatch's undo deletes the name, which recent torch keeps as an alias
    # of recompile_limit, and the next compiling trainer in this process would not find it
    limit, torch._dynamo.config.cache_size_limit = torch._dynamo.config.cache_size_limit, 8
    try:
        for run in range(2):
            before = torch._dynamo.config.cache_size_limit
            Trainer(
                make_cfg(
                    tmp_path / str(run),
                    corpus_dir,
                    **{"train.steps": 2, "train.compile": True, "model.n_layers": 12, **phase},
                )
            )
            assert torch._dynamo.config.cache_size_limit >= before + graphs * 12
    finally:
        torch._dynamo.config.cache_size_limit = limit


def test_expert_load_heatmap_is_logged_at_every_eval_step(tmp_path, corpus_dir):
    cfg = load_config(
        "zoo/tiny_moe.yaml",
        tiny_overrides(
            tmp_path,
            corpus_dir,
            **{
                "train.steps": 6,
                "train.eval_every": 3,
                "logging.log_every": 4,
                "checkpoint.every": 0,
            },
        ),
    )
    tr = Trainer(cfg)
    heatmaps = []
    tr.logger.log_heatmap = lambda name, matrix, step, *a: heatmaps.append(
        (name, step, matrix.shape)
    )
    tr.fit()
    L, E = cfg.model.n_layers, cfg.model.moe.num_experts
    assert heatmaps == [("moe/expert_load", 3, (L, E)), ("moe/expert_load", 6, (L, E))]


def test_kill_during_checkpoint_write_leaves_the_previous_checkpoint_resumable(
    tmp_path, corpus_dir
):
    """SIGKILL a real run while it writes its second checkpoint; --resume then picks the first
    one."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    ov = tiny_overrides(tmp_path, corpus_dir, **{"train.steps": 20, "checkpoint.every": 5})
    # Slow down the write of step 10's manifest.json (the last file of a checkpoint) to kill inside
    # it.
    code = f"""
import sys, time
import moezoo.training.checkpoint as ck
real_write = ck._write_json
def slow_write(path, obj):
    if str(path).endswith(ck.MANIFEST) and obj["step"] == 10:
        print("WRITING", flush=True); time.sleep(60)
    return real_write(path, obj)
ck._write_json = slow_write
from moezoo.configs import load_config
from moezoo.training.loop import Trainer
Trainer(load_config("zoo/tiny_dense.yaml", {ov!r})).fit()
"""
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and "WRITING" not in line:
        line = p.stdout.readline()
    assert "WRITING" in line, "the run never reached the slowed checkpoint write"
    p.send_signal(signal.SIGKILL)
    p.wait()
    cfg = load_config("zoo/tiny_dense.yaml", ov)
    assert latest_checkpoint(cfg.checkpoint_dir).endswith("step_00000005")
    resumed = Trainer(load_config("zoo/tiny_dense.yaml", ov + ["checkpoint.resume=true"]))
    assert resumed.step == 5
    assert resumed.fit()["step"] == 20


def test_gradient_accumulation_equals_one_large_batch(tmp_path, corpus_dir):
    big = Trainer(make_cfg(tmp_path / "big", corpus_dir, **{"train.batch_size": 8}))
    acc = Trainer(
        make_cfg(tmp_path / "acc", corpus_dir, **{"train.batch_size": 4, "train.grad_accum": 2})
    )
    for _ in range(4):
        a, b = big.train_step()["loss/total"].item(), acc.train_step()["loss/total"].item()
        assert abs(a - b) < 1e-5, (a, b)
    pa, pb = _params(big.model), _params(acc.model)
    assert all(torch.allclose(pa[k], pb[k], atol=1e-5) for k in pa)
