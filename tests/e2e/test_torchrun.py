"""train.py under torchrun on CPU (gloo): 2 ranks x B train like 1 rank x 2B, and resume works."""

import os

import pytest

from helpers import train_cli


@pytest.mark.slow
def test_two_rank_fsdp_run_matches_one_rank_with_the_same_global_batch(tmp_path, corpus_dir):
    one = train_cli(str(tmp_path / "one"), corpus_dir, 1, batch=8)
    two = train_cli(str(tmp_path / "two"), corpus_dir, 2, batch=4)
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)


@pytest.mark.slow
def test_two_rank_resume_replays_the_same_losses(tmp_path, corpus_dir):
    import shutil

    run = str(tmp_path / "r")
    first = train_cli(run, corpus_dir, 2)
    # as if killed after step 3's save
    shutil.rmtree(os.path.join(run, "run", "checkpoints", "step_00000006"))
    both = train_cli(run, corpus_dir, 2, "--resume")
    # The resume drops the rows logged after step 3's checkpoint and logs steps 4-6 again: the same
    # losses.
    assert len(first) == 6 and both == first, (first, both)


@pytest.mark.slow
def test_two_rank_dst_run_with_steps_skipped_on_the_device_matches_one_rank(tmp_path, corpus_dir):
    """Compact DST under FSDP2 with the fused AdamW: the non-finite check stays on the device but at
    the mask updates (every 2 steps), where DST reads it on the host; 2 ranks x 4 sequences = 1 rank
    x 8."""
    extra = ["optim.implementation=fused", "dst.update_every=2", "dst.compact_state=true"]
    one = train_cli(
        str(tmp_path / "one"), corpus_dir, 1, *extra, preset="zoo/tiny_dst.yaml", batch=8
    )
    two = train_cli(
        str(tmp_path / "two"), corpus_dir, 2, *extra, preset="zoo/tiny_dst.yaml", batch=4
    )
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
