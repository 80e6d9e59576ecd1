"""A run folder (``train.out_dir``, default ``runs/<name>``) belongs to one run.

Overrides keep the preset's name, so ``--config zoo/tiny_dense.yaml model.n_layers=2`` would land in
the preset's folder: a fresh run there would mix metrics.jsonl rows of two runs and rotate away the
other run's checkpoints. So a fresh run refuses a folder holding checkpoints, unless ``--resume``
(continue that run) or ``train.overwrite=true`` (delete it and start over). Each run gets a random
``run_id``, saved in its checkpoints; rotation deletes only checkpoints of the same id.
"""

from __future__ import annotations

import json
import os
import uuid

from moezoo.configs import Config, ConfigError

from .checkpoint import remove_checkpoint, scan_checkpoints


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]  # os.urandom: the seeded RNG streams are untouched


def check_fresh_start(cfg: Config) -> list[str]:
    """For a run not resuming: the checkpoints of another run it would replace (only with
    ``train.overwrite``); raises ConfigError if there are some and overwriting was not asked for."""
    found = [path for _, path, _ in scan_checkpoints(cfg.checkpoint_dir)]
    if found and not cfg.train.overwrite:
        key = "checkpoint.dir" if cfg.checkpoint.dir else "train.out_dir"
        raise ConfigError(
            key,
            f"{cfg.checkpoint_dir} holds {len(found)} checkpoint(s) of another run (newest "
            f"{os.path.basename(found[-1])}); --resume to continue it, train.out_dir=<new "
            f"folder> (or name=...) for a separate run, or train.overwrite=true to delete it",
        )
    return found


def clear_previous_run(cfg: Config, checkpoints: list[str]) -> None:
    """Rank 0, once the new run is built: delete the replaced run's checkpoints and its metrics."""
    for path in checkpoints:
        remove_checkpoint(path)
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        os.remove(metrics)


def trim_metrics(path: str, step: int) -> int:
    """Drop the rows after ``step`` (logged after the checkpoint a resumed run restarts from, so the
    resumed run would repeat them). Returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue  # a line torn by a kill mid-write
        if isinstance(row_step, int) and row_step <= step:
            keep.append(line)
    if len(keep) != len(lines):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(lines) - len(keep)
