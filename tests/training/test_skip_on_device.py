"""Non-finite steps skipped on the device (training.loop.skips_on_device, on by default on CUDA):
the same weights, MoE biases, optimizer state, counts and logs as steps checked on the host, with
the host learning of a skipped step one step later. On CPU with optim.implementation=fused (auto
takes foreach there)."""

import json
import os

import pytest
import torch

from helpers import poison_loss, tiny_overrides
from moezoo.configs import load_config
from moezoo.training import loop
from moezoo.training.cli import main
from moezoo.training.loop import Trainer


def _moe(tmp, corpus, on_device, param_dtype):
    ov = tiny_overrides(
        tmp,
        corpus,
        **{
            "model.moe.bias_update_rate": 0.01,
            "checkpoint.every": 0,
            "train.param_dtype": param_dtype,
            "train.dtype": "bfloat16",
            "optim.implementation": "fused",
        },
    )
    tr = Trainer(load_config("zoo/tiny_moe.yaml", ov))
    assert tr.skip_on_device  # fused AdamW or MasterAdamW, and ExpertBalancing can
    tr.skip_on_device = on_device
    return tr


# float32: torch's fused AdamW (step counts on the device); bfloat16: MasterAdamW (counts on the
# host, taken back when the trainer reads the flag)
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_steps_skipped_on_the_device_equal_steps_skipped_on_the_host(
    tmp_path, corpus_dir, param_dtype
):
    host = _moe(tmp_path / "h", corpus_dir, False, param_dtype)
    dev = _moe(tmp_path / "d", corpus_dir, True, param_dtype)
    for tr in (host, dev):
        poison_loss(tr, lambda step: step == 2)
    for step in range(5):
        a, b = host.train_step(), dev.train_step()
        assert bool(a["skipped"]) == bool(b["skipped"]) == (step == 2)
        assert isinstance(b["skipped"], torch.Tensor)  # read at the log steps, not now
        # the host has read every step but the newest: step 2's skip is counted once step 3 has run
        assert dev.bad_total == (1 if step >= 3 else 0) and host.bad_total == (
            1 if step >= 2 else 0
        )
    dev.settle()
    assert (
        host.bad_total == dev.bad_total == 1
        and host.bad_in_row == dev.bad_in_row == 0
        and dev.unread is None
    )
    sa, sb = host.model.state_dict(), dev.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # weights and the aux-loss-free biases
    assert any(sa[k].abs().sum() > 0 for k in sa if k.endswith("expert_bias"))
    oa, ob = host.optimizer.state_dict()["state"], dev.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys() and all(
        torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]
    )
    assert int(next(iter(ob.values()))["step"]) == 4  # the skipped step left the counts alone


def test_host_checks_each_step_where_the_device_cannot(tmp_path, corpus_dir):
    ov = tiny_overrides(tmp_path, corpus_dir)
    assert not Trainer(load_config("zoo/tiny_dense.yaml", ov)).skip_on_device  # CPU: foreach AdamW
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], fused=True)
    assert loop.skips_on_device(fused, [])
    assert not loop.skips_on_device(fused, [object()])  # a method that decides on the host (DST)


@pytest.mark.parametrize("max_bad", [1, 2])
def test_rollbacks_and_logs_are_those_of_host_checked_steps(
    tmp_path, corpus_dir, monkeypatch, max_bad
):
    """Steps from 5 on are non-finite: the rollbacks come at the same steps, and metrics.jsonl reads
    the same (but for the clock) whether the check stays on the device or not."""
    real_init = Trainer.__init__
    rows = {}
    for on_device in (False, True):

        def init(self, cfg, on_device=on_device):
            real_init(self, cfg)
            self.skip_on_device = on_device
            poison_loss(self, lambda step: step >= 5)

        monkeypatch.setattr(Trainer, "__init__", init)
        ov = tiny_overrides(
            tmp_path / str(on_device),
            corpus_dir,
            **{
                "train.steps": 12,
                "logging.log_every": 1,
                "checkpoint.every": 4,
                "train.max_bad_steps": max_bad,
                "train.max_rollbacks": 2,
                "optim.implementation": "fused",
            },
        )
        assert main(["--config", "zoo/tiny_dense.yaml", *ov]) == 1
        with open(os.path.join(tmp_path / str(on_device) / "run", "metrics.jsonl")) as f:
            rows[on_device] = [
                {k: v for k, v in json.loads(line).items() if "per_s" not in k and "mfu" not in k}
                for line in f
            ]
    assert rows[True] == rows[False]
    rollbacks = [r["step"] for r in rows[True] if r.get("rollback")]
    assert rollbacks == [5 + max_bad] * 3, rollbacks


def _dst(tmp, corpus, on_device, compact):
    ov = tiny_overrides(
        tmp,
        corpus,
        **{
            "dst.update_every": 3,
            "dst.grad_ema": 0.5,
            "dst.compact_state": compact,
            "checkpoint.every": 0,
            "optim.implementation": "fused",
        },
    )
    tr = Trainer(load_config("zoo/tiny_dst.yaml", ov))
    assert tr.skip_on_device  # fused (Compact)AdamW; DST decides its update steps on the host
    tr.skip_on_device = on_device
    return tr


@pytest.mark.parametrize("compact", [False, True])
def test_dst_steps_skipped_on_the_device_equal_steps_skipped_on_the_host(
    tmp_path, corpus_dir, compact
):
    """Mask updates every 3 steps with a gradient EMA: step 3 (an update, checked on the host) and
    step 4 (checked on the device) are non-finite; weights, masks, scores and optimizer state stay
    equal."""
    host = _dst(tmp_path / "h", corpus_dir, False, compact)
    dev = _dst(tmp_path / "d", corpus_dir, True, compact)
    for tr in (host, dev):
        poison_loss(tr, lambda step: step in (3, 4))
    for step in range(8):
        a, b = host.train_step(), dev.train_step()
        assert bool(a["skipped"]) == bool(b["skipped"]) == (step in (3, 4))
        # step 3's check ran on the host (a mask update), step 4's on the device: read in step 5
        assert isinstance(b["skipped"], torch.Tensor) == (step % 3 != 0 or step == 0)
    dev.settle()
    assert host.bad_total == dev.bad_total == 2
    sa, sb = host.model.state_dict(), dev.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # weights, masks, ever-active, EMA scores
    assert any(k.endswith("_score") for k in sa) and any(k.endswith("_mask") for k in sa)
    oa, ob = host.optimizer.state_dict()["state"], dev.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys() and all(
        torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_a_step_skipped_on_cuda_changes_no_weight_state_or_count(tmp_path, corpus_dir, param_dtype):
    """On CUDA the check stays on the device by default (torch's fused AdamW; MasterAdamW's Triton
    kernel with found_inf; the flags through pinned memory and an event): the skipped step leaves
    every weight, MoE bias, moment and step count as it was, and the host counts it when it reads
    the flag."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ov = tiny_overrides(
        tmp_path,
        corpus_dir,
        **{
            "model.dim": 256,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.ffn_hidden": 512,
            "model.moe.hidden_dim": 256,
            "train.seq_len": 256,
            "model.max_seq_len": 256,
            "train.batch_size": 2,
            "train.device": "cuda",
            "train.param_dtype": param_dtype,
            "model.moe.bias_update_rate": 0.01,
            "checkpoint.every": 0,
        },
    )
    tr = Trainer(load_config("zoo/tiny_moe.yaml", ov))
    assert tr.skip_on_device
    poison_loss(tr, lambda step: step == 2)

    def snapshot():
        opt = {
            id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for p, st in tr.optimizer.state.items()
        }
        return {k: v.clone() for k, v in tr.model.state_dict().items()}, opt

    for _ in range(2):
        tr.train_step()
    before = snapshot()
    m = tr.train_step()  # step 2: non-finite
    assert bool(m["skipped"]) and tr.bad_total == 0  # not read yet
    tr.settle()
    assert tr.bad_total == 1 and tr.bad_in_row == 1
    after = snapshot()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1].keys() == after[1].keys()
    assert all(
        torch.equal(before[1][i][k].cpu(), after[1][i][k].cpu())
        for i in before[1]
        for k in before[1][i]
    )
    m = tr.train_step()
    assert not bool(m["skipped"])
    tr.settle()
    assert tr.bad_total == 1 and tr.bad_in_row == 0
    moved = snapshot()[0]
    assert any(not torch.equal(moved[k], after[0][k]) for k in moved if k.endswith("expert_bias"))
    assert any(not torch.equal(moved[k], after[0][k]) for k in moved if k.endswith("weight"))
