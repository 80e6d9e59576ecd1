"""Own text: one plain text file trains, split by tokens (the last val_fraction is validation)."""

import glob
import json
import os

import numpy as np

from helpers import tiny_overrides
from moezoo.configs import load_config
from moezoo.training import run
from moezoo.training.data import prepare_data


def _one_file(tmp_path, corpus_dir) -> str:
    path = tmp_path / "book.txt"
    with open(path, "w") as out:
        for f in sorted(glob.glob(os.path.join(corpus_dir, "*.py")))[:12]:
            out.write(open(f).read())
    return str(path)


def test_single_text_file_is_split_by_tokens_at_the_end(tmp_path, corpus_dir):
    cfg = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(tmp_path, _one_file(tmp_path, corpus_dir), **{"data.val_fraction": 0.1}),
    )
    data = prepare_data(cfg)
    n_train, n_val = len(data.train), len(data.val)
    assert abs(n_val / (n_train + n_val) - 0.1) < 0.01
    # The two splits are the whole file's tokens, cut once: train is the start, val the end.
    whole = data.tokenizer.encode(open(cfg.data.source).read()) + [data.tokenizer.eos_id]
    assert np.array_equal(np.concatenate([data.train, data.val]), np.asarray(whole))


def test_single_text_file_trains(tmp_path, corpus_dir):
    cfg = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(
            tmp_path, _one_file(tmp_path, corpus_dir), **{"train.steps": 10, "checkpoint.every": 0}
        ),
    )
    summary = run(cfg)
    assert summary["step"] == 10 and len(summary["val_history"]) == 2
    rows = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    assert all(np.isfinite(r["val/loss"]) for r in rows if "val/loss" in r)
