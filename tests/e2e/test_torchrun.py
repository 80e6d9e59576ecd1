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
    shutil.rmtree(os.path.join(run, "run", "checkpoints", "step_00000006"))  # as if killed after step 3's save
    both = train_cli(run, corpus_dir, 2, "--resume")
    # The resume drops the rows logged after step 3's checkpoint and logs steps 4-6 again: the same losses.
    assert len(first) == 6 and both == first, (first, both)
