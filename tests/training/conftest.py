"""One short trained run shared by the checkpoint / resume / run-folder tests: each test copies
it."""

import os
import shutil
from dataclasses import dataclass

import pytest

from helpers import tiny_overrides

STEPS, EVERY = 10, 5  # checkpoints at steps 5 and 10


@dataclass
class Run:
    root: str  # holds run/ (out_dir) and cache/
    corpus: str

    @property
    def out_dir(self) -> str:
        return os.path.join(self.root, "run")

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")

    def step_dir(self, step: int) -> str:
        return os.path.join(self.ckpt_dir, f"step_{step:08d}")

    def overrides(self, **extra) -> list[str]:
        ov = tiny_overrides(
            self.root,
            self.corpus,
            **{
                "train.steps": STEPS,
                "checkpoint.every": EVERY,
                "logging.log_every": 1,
                "train.eval_every": EVERY,
            },
        )
        # The tokenizer and token files of the original run: copies need not rebuild them.
        return ov + [f"data.cache_dir={self.cache}"] + [f"{k}={v}" for k, v in extra.items()]

    cache: str = ""


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus_dir) -> Run:
    from moezoo.configs import load_config
    from moezoo.training.loop import Trainer

    root = str(tmp_path_factory.mktemp("trained"))
    run = Run(root, corpus_dir, cache=os.path.join(root, "cache"))
    Trainer(load_config("zoo/tiny_dense.yaml", run.overrides())).fit()
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Run:
    """A private copy of the trained run's folder (checkpoints at 5 and 10, metrics.jsonl)."""
    shutil.copytree(trained_run.out_dir, tmp_path / "run")
    return Run(str(tmp_path), trained_run.corpus, cache=trained_run.cache)
