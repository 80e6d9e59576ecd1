"""train.py under torchrun on CPU (gloo): 2 ranks x B train like 1 rank x 2B, and resume works."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides


def _train(tmp, corpus, nproc, *extra, preset="zoo/tiny_dense.yaml", batch=4):
    ov = tiny_overrides(tmp, corpus, **{"train.steps": 6, "logging.log_every": 1, "train.eval_every": 6,
                                        "train.batch_size": batch, "checkpoint.every": 3,
                                        "data.cache_dir": f"{os.path.dirname(tmp)}/cache"})
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd + ["--config", preset, *ov, *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [row["loss/total"] for row in rows if "loss/total" in row]


@pytest.mark.slow
def test_two_rank_fsdp_run_matches_one_rank_with_the_same_global_batch(tmp_path, corpus_dir):
    one = _train(str(tmp_path / "one"), corpus_dir, 1, batch=8)
    two = _train(str(tmp_path / "two"), corpus_dir, 2, batch=4)
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)


@pytest.mark.slow
def test_two_rank_resume_replays_the_same_losses(tmp_path, corpus_dir):
    import shutil
    run = str(tmp_path / "r")
    first = _train(run, corpus_dir, 2)
    shutil.rmtree(os.path.join(run, "run", "checkpoints", "step_00000006"))  # as if killed after step 3's save
    both = _train(run, corpus_dir, 2, "--resume")
    # The resume drops the rows logged after step 3's checkpoint and logs steps 4-6 again: the same losses.
    assert len(first) == 6 and both == first, (first, both)
