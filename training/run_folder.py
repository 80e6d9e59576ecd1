"""Run folders: where a run writes metrics.jsonl, checkpoints/, tokenizer.model, plots/ and wandb/.

Naming. Without ``train.out_dir`` each new run gets a folder of its own, ``runs/<name>/<N>``:
``<name>`` is the config's ``name`` (a preset's file name unless set), N = 1, 2, 3, ... in the order
runs start, so any sequence of commands works and no run clobbers another's (as Lightning's
``version_N``). The first line a run prints names its folder. ``--resume`` continues the latest run
of the config's name: the highest N whose folder holds a checkpoint (else ``runs/<name>`` itself,
when a run was given that folder as its train.out_dir); ``--resume runs/<name>/3`` continues run 3.
generate and export read ``--run runs/<name>`` the same way (``latest_run``).

``train.out_dir=<path>`` is exactly that folder. Overrides keep the preset's name, so two runs given
one folder would mix their metrics.jsonl rows and rotate away each other's checkpoints: a fresh run
refuses a folder holding checkpoints, unless ``--resume`` (continue that run) or
``train.overwrite=true`` (delete it and start over). Each run gets a random ``run_id``, saved in its
checkpoints; rotation deletes only checkpoints of the same id.

Resume (``resume_config``, for train.py ``--resume``): the checkpoint holds the run's resolved
config; it is the base, and the command line's overrides apply on top, so a resumed run needs none
of the original overrides repeated; ``parallel`` comes from the command line instead when the world
size differs from the checkpoint's (its layout was for other ranks). The trainer checks what may
not change (the model section, the tokenizer, the global batch: ``checkpoint.check_resumable``).
"""

from __future__ import annotations

import json
import os
import uuid

from moezoo.configs import Config, ConfigError, load_config

from .checkpoint import (
    find_resumable,
    list_checkpoints,
    read_train_state,
    remove_checkpoint,
    scan_checkpoints,
)

RUNS = "runs"  # runs/<name>/<N>


def runs_root(cfg: Config) -> str:
    """The folder holding the numbered runs of ``cfg``'s name."""
    return os.path.join(RUNS, cfg.name)


def numbered_runs(root: str) -> list[tuple[int, str]]:
    """The run folders ``<root>/<N>`` as (N, path), oldest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    runs = [(int(n), os.path.join(root, n)) for n in names if n.isdigit() and n[0] != "0"]
    return sorted(r for r in runs if os.path.isdir(r[1]))


def latest_run(root: str) -> str | None:
    """The latest run under ``root`` that holds a complete checkpoint: the highest ``<root>/<N>``,
    else ``root`` itself (a folder given as train.out_dir), else None."""
    for _, path in reversed(numbered_runs(root)):
        if list_checkpoints(os.path.join(path, "checkpoints")):
            return path
    return root if list_checkpoints(os.path.join(root, "checkpoints")) else None


def new_run_folder(root: str) -> str:
    """Create and return ``<root>/<N>``, N one above the highest there (mkdir is atomic: two runs
    starting together get two folders)."""
    os.makedirs(root, exist_ok=True)
    n = max((k for k, _ in numbered_runs(root)), default=0) + 1
    while True:
        path = os.path.join(root, str(n))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def find_run(path: str, key: str = "--run") -> str:
    """The run folder a user's path names: a run folder (holding checkpoints/), its checkpoints/
    folder, or a folder of numbered runs (``runs/<name>``: the latest). ConfigError naming ``key``
    when it is none of these."""
    if not os.path.isdir(path):
        raise ConfigError(key, f"{path}: no such folder")
    if os.path.basename(os.path.normpath(path)) == "checkpoints" and list_checkpoints(path):
        return os.path.dirname(os.path.normpath(path))
    if list_checkpoints(os.path.join(path, "checkpoints")):
        return path
    latest = latest_run(path)
    if latest is None:
        raise ConfigError(
            key, f"{path} holds no checkpoint (nor does any run folder {path}/<N> under it)"
        )
    return latest


def choose_run_folder(cfg: Config, is_main: bool = True, share=lambda x: x) -> tuple[str, bool]:
    """Set ``train.out_dir`` when the config leaves it open: ``--resume`` takes the latest run of
    the config's name, a fresh run a new ``runs/<name>/<N>`` (made by rank 0; ``share`` hands its
    path to every rank). Returns the run's first line of output, naming the folder, and whether
    the folder is new."""
    if cfg.train.out_dir:
        return f"run folder {cfg.out_dir}" + (" (resuming)" if cfg.checkpoint.resume else ""), False
    root = runs_root(cfg)
    if cfg.checkpoint.resume:
        latest = latest_run(root)
        if latest is not None:
            cfg.train.out_dir = latest
            return f"run folder {latest} (the latest run of {cfg.name})", False
    cfg.train.out_dir = share(new_run_folder(root) if is_main else None)
    return f"run folder {cfg.out_dir} (new; --resume continues the latest run of {cfg.name})", True


def remove_if_empty(folder: str) -> None:
    """A new run folder left empty by a run that failed before writing anything."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


def resume_config(
    cfg: Config | None, overrides: list[str], run: str | None = None, trust: bool = False
) -> Config:
    """train.py ``--resume [RUN]``: the resolved config of the run's newest usable checkpoint with
    ``overrides`` applied on top (``train.out_dir`` set to the run's folder). The run is ``RUN``
    (a run folder or ``runs/<name>``: its latest run), else ``cfg``'s ``train.out_dir`` /
    ``checkpoint.dir`` when the command line set them, else the latest run of ``cfg``'s name. A
    folder without a checkpoint gives ``cfg`` back, resuming: the trainer warns and starts at
    step 0."""
    if run is not None:
        folder = find_run(run, "--resume")
        ckpt_dir = os.path.join(folder, "checkpoints")
    elif cfg.train.out_dir or cfg.checkpoint.dir:
        folder, ckpt_dir = cfg.train.out_dir, cfg.checkpoint_dir
    else:
        folder = latest_run(runs_root(cfg))
        ckpt_dir = folder and os.path.join(folder, "checkpoints")
    path = find_resumable(ckpt_dir, trust)[0] if ckpt_dir else None
    if path is not None:
        # optim.extend says how this resume re-plans its schedule: never inherited from the run
        saved = load_config(
            os.path.join(path, "config.yaml"), ["optim.extend=continue", *overrides]
        )
        # The parallel layout belongs to the launch: at another world size (resharding) the
        # saved one was for other ranks, so the command line's config gives it.
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if cfg is not None and read_train_state(path).get("world_size", 1) != world:
            saved.parallel = cfg.parallel
        cfg = saved
    cfg.checkpoint.resume, cfg.checkpoint.trust = True, trust
    if folder:
        cfg.train.out_dir = folder
    return cfg


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
            f"{os.path.basename(found[-1])}); --resume to continue it, no train.out_dir for a "
            f"new folder runs/{cfg.name}/<N>, or train.overwrite=true to delete it",
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
