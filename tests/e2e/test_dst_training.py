"""DST wired into the trainer (cfg.dst.enabled): densities logged, masks checkpointed, resume
bit-exact, with dense or compact (dst.compact_state: CompactAdamW) optimizer state."""

import pytest
import torch

from helpers import tiny_overrides
from moezoo.configs import load_config
from moezoo.layers import DynamicSparsity
from moezoo.training.loop import Trainer

DST = {
    "dst.enabled": True,
    "dst.sparsity": 0.8,
    "dst.update_every": 3,
    "dst.stop_fraction": 1.0,
    "train.steps": 16,
}


def dst_of(trainer):
    """The trainer's DynamicSparsity among its sparsity methods."""
    return next(m for m in trainer.sparsity if isinstance(m, DynamicSparsity))


def make_cfg(tmp_path, corpus, **extra):
    return load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp_path, corpus, **{**DST, **extra}))


@pytest.mark.parametrize("compact", [False, True])
def test_trainer_with_dst_keeps_density_and_resumes_bit_exactly(tmp_path, corpus_dir, compact):
    if compact:
        DST_C = {"dst.compact_state": True, "dst.grad_ema": 0.5}
        make = lambda d, **kw: make_cfg(d, corpus_dir, **DST_C, **kw)  # noqa: E731
    else:
        make = lambda d, **kw: make_cfg(d, corpus_dir, **kw)  # noqa: E731
    straight = Trainer(make(tmp_path / "a"))
    losses_straight = [straight.train_step()["loss/total"].item() for _ in range(16)]
    st = dst_of(straight).stats()
    assert abs(st["density"] - 0.2) < 1e-2 and st["ever_active"] > st["density"]
    for t in dst_of(straight).targets:
        assert torch.all(t.param()[~dst_of(straight)._mask(t)] == 0)
    assert type(straight.optimizer).__name__ == ("CompactAdamW" if compact else "AdamW")

    first = Trainer(make(tmp_path / "b"))
    losses_resumed = [first.train_step()["loss/total"].item() for _ in range(8)]
    first.save()
    second = Trainer(make(tmp_path / "b", **{"checkpoint.resume": True}))
    assert second.step == 8
    losses_resumed += [second.train_step()["loss/total"].item() for _ in range(8)]

    assert losses_resumed == losses_straight
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert any(k.endswith("_mask") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_with_dst_on_the_moe_preset_masks_experts_per_expert(tmp_path, corpus_dir):
    cfg = load_config(
        "zoo/tiny_moe.yaml", tiny_overrides(tmp_path, corpus_dir, **{**DST, "train.steps": 6})
    )
    tr = Trainer(cfg)
    for _ in range(6):
        tr.train_step()
    names = {t.name for t in dst_of(tr).targets}
    assert any(n.endswith("experts.w1") for n in names) and not any("gate" in n for n in names)
    for t, k in zip(dst_of(tr).targets, dst_of(tr)._counts(0.8)):
        m = t.buf("mask")
        assert (m.flatten(1).sum(1) == k).all() if m.dim() == 3 else int(m.sum()) == k
        assert torch.all(t.param()[~m] == 0)
