"""train.py under torchrun on CPU (gloo) with expert parallelism: zoo/tiny_moe.yaml at ep=2.

The balance loss is taken over the global batch (``model.moe.global_balance``, the default), so 2
ranks reproduce 1 rank's losses with it on; with ``global_balance=false`` (each rank's own tokens,
as in megablocks and torchtitan) they differ by the balance term.
"""

import os
import shutil

import pytest

from helpers import train_cli


@pytest.mark.slow
# fused: steps checked on the device (skips_on_device)
@pytest.mark.parametrize("adamw", ["auto", "fused"])
def test_two_rank_ep2_run_matches_one_rank_with_the_same_global_batch(tmp_path, corpus_dir, adamw):
    impl = f"optim.implementation={adamw}"
    one = train_cli(str(tmp_path / "one"), corpus_dir, 1, impl, preset="zoo/tiny_moe.yaml", batch=8)
    two = train_cli(
        str(tmp_path / "two"),
        corpus_dir,
        2,
        "parallel.ep=2",
        impl,
        preset="zoo/tiny_moe.yaml",
        batch=4,
    )
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)


@pytest.mark.slow
def test_two_rank_ep2_resume_replays_the_same_losses(tmp_path, corpus_dir):
    run = str(tmp_path / "r")
    first = train_cli(run, corpus_dir, 2, "parallel.ep=2", preset="zoo/tiny_moe.yaml")
    # as if killed after step 3's save
    shutil.rmtree(os.path.join(run, "run", "checkpoints", "step_00000006"))
    both = train_cli(run, corpus_dir, 2, "parallel.ep=2", "--resume", preset="zoo/tiny_moe.yaml")
    # The resume drops the rows logged after step 3's checkpoint and logs steps 4-6 again: the same
    # losses.
    assert len(first) == 6 and both == first, (first, both)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank_with_the_same_global_batch(tmp_path, corpus_dir):
    """Resharding: saved by 2 ranks at ep=2 (batch 4 each), resumed by 1 rank with grad_accum 2."""
    run = str(tmp_path / "r")
    two = train_cli(run, corpus_dir, 2, "parallel.ep=2", preset="zoo/tiny_moe.yaml")
    # continue from step 3's save
    shutil.rmtree(os.path.join(run, "run", "checkpoints", "step_00000006"))
    with pytest.raises(
        AssertionError,
        match=r"train\.grad_accum: .* = 4 sequences a step, but checkpoint .* "
        r"trained on 8 \(world size 2\); keep the global batch \(train\.grad_accum=2\)",
    ):
        train_cli(run, corpus_dir, 1, "--resume", preset="zoo/tiny_moe.yaml")
    one = train_cli(
        run, corpus_dir, 1, "train.grad_accum=2", "--resume", preset="zoo/tiny_moe.yaml"
    )
    assert len(two) == len(one) == 6 and one[:3] == two[:3]
    # the same data and weights; fp32 sums in another order (two micro-batches on one rank, no
    # all-reduce), which top-2 routing can amplify when a token's two best experts nearly tie:
    # 2.5e-5 and 1.5e-4 seen on losses of ~6.2. Another batch or stale weights move a step's loss by
    # ~1e-2 (steps differ by 0.05).
    assert max(abs(a - b) for a, b in zip(one[3:], two[3:])) < 1e-3, (two, one)
