"""Checkpoints through torch.distributed.checkpoint (DCP): sharded under FSDP2/EP, plain on one
process.

Layout of ``<dir>/step_00000100/``:

- ``__<r>_0.distcp``, ``.metadata``: DCP shards of {model, optimizer state}, tensors only (DST
  masks are model buffers);
- ``optim_groups.json``: the optimizer's param-group hyper-parameters (lr, betas, ...);
- ``rng_rank<r>.pt``: python, numpy, torch, cuda RNG of rank r as tensors and plain numbers;
- ``train_state.json``: step, epoch, scheduler, counters, run id, world size, tokenizer digest;
- ``config.yaml``: the resolved config;
- ``manifest.json``: written last, every file above with its size.

Nothing in it is a pickled Python object, and every read goes through ``safe_load`` (allowlists), so
a checkpoint from someone else cannot run code on ``--resume``.

Complete = ``manifest.json`` present and every file it lists present at its size. Everything is
written into ``<dir>/.tmp_step_...`` and renamed once complete, and rotation renames a checkpoint to
``.trash_step_...`` before deleting it, so a kill at any point leaves nothing that looks complete
but is not. Expert-parallel tensors are stored as global ``[E, ...]`` views (``checkpoint_views``),
so a checkpoint saved at one ``ep`` loads at another. Resuming needs the same world size
(``check_resumable`` says so before anything is built): the per-rank RNG streams are saved per rank.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moezoo.configs import Config, ConfigError, save_config

from .parallel import checkpoint_views
from .safe_load import (
    CheckpointError,
    SafeLoadPlanner,
    SafeReader,
    UnsafeCheckpoint,
    load_dcp_metadata,
    load_tensors,
)

FORMAT = 2
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# One process without a process group is a supported DCP mode, not a problem worth a warning per
# save.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

__all__ = [
    "CheckpointError",
    "UnsafeCheckpoint",
    "check_resumable",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_train_state",
    "remove_checkpoint",
    "save_checkpoint",
    "scan_checkpoints",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---- RNG: tensors and plain numbers, so it loads with weights_only=True --------------------------
def _rng_state() -> dict:
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, torch.tensor(keys, dtype=torch.int64), gauss],
        "numpy": [
            name,
            torch.from_numpy(mt.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys.tolist()), gauss))
    name, mt, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, mt.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- small files ---------------------------------------------------------------------------------
def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _read_json(path: str, want: type = dict):
    try:
        with open(path) as f:
            obj = json.load(f)
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"damaged (not JSON: {e})") from None
    if not isinstance(obj, want):
        raise CheckpointError(path, f"damaged (expected a JSON {want.__name__})")
    return obj


def read_train_state(path: str) -> dict:
    """The checkpoint's train_state.json (step, epoch, scheduler, counters, run id, ...)."""
    f = os.path.join(path, "train_state.json")
    state = _read_json(f)
    if not isinstance(state.get("step"), int):
        raise CheckpointError(f, "damaged (no integer 'step')")
    return state


def _manifest_problem(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None. Cheap: reads only manifest.json and
    sizes."""
    f = os.path.join(path, MANIFEST)
    if not os.path.isfile(f):
        return f"no {MANIFEST} (an interrupted save, or written by an older moezoo)"
    try:
        files = _read_json(f)["files"]
        items = sorted(files.items())
    except (CheckpointError, KeyError, AttributeError):
        return f"{MANIFEST} is damaged"
    for name, size in items:
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return f"{name} is missing"
        if os.path.getsize(p) != size:
            return (
                f"{name} is truncated or changed "
                f"({os.path.getsize(p)} bytes, {MANIFEST} says {size})"
            )
    return None


def _manifest(path: str) -> dict:
    try:
        return _read_json(os.path.join(path, MANIFEST))
    except CheckpointError:
        return {}


def _ends_schedule(path: str) -> bool:
    """Whether checkpoint ``path`` was saved at the last step of its run's ``train.steps``."""
    try:
        state = read_train_state(path)
    except CheckpointError:
        return False
    return state["step"] == state.get("total_steps")


def scan_checkpoints(ckpt_dir: str) -> list[tuple[int, str, str | None]]:
    """Every ``step_*`` directory as (step, path, problem), oldest first; problem None =
    complete."""
    out = []
    for path in glob.glob(os.path.join(ckpt_dir, "step_*")):
        m = _STEP_DIR.match(os.path.basename(path))
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path, _manifest_problem(path)))
    return sorted(out)


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first."""
    return [(s, p) for s, p, problem in scan_checkpoints(ckpt_dir) if problem is None]


def latest_checkpoint(ckpt_dir: str) -> str | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1][1] if ckpts else None


def _validate(path: str, trust: bool) -> None:
    """Read every small part of a complete checkpoint (not the shards): raises CheckpointError."""
    import yaml

    state = read_train_state(path)
    _read_json(os.path.join(path, "optim_groups.json"), list)
    cfg_file = os.path.join(path, "config.yaml")
    try:
        with open(cfg_file) as f:
            saved = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(cfg_file, f"damaged ({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise CheckpointError(cfg_file, "damaged (no model section)")
    load_dcp_metadata(os.path.join(path, ".metadata"), trust)
    for r in range(state.get("world_size", 1)):
        load_tensors(os.path.join(path, f"rng_rank{r}.pt"), trust)


def find_resumable(ckpt_dir: str, trust: bool = False) -> tuple[str | None, list[str]]:
    """The newest usable checkpoint and a line for every newer one skipped as damaged or incomplete.
    A file that asks to run code (UnsafeCheckpoint) stops the search: falling back past it would
    hide it."""
    skipped = []
    for _step, path, problem in reversed(scan_checkpoints(ckpt_dir)):
        if problem is None:
            try:
                _validate(path, trust)
                return path, skipped
            except UnsafeCheckpoint:
                raise
            except CheckpointError as e:
                problem = str(e)
        skipped.append(f"{path}: {problem}")
    return None, skipped


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        out.update(_flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def check_resumable(
    path: str, cfg: Config, world_size: int, tokenizer_digest: str | None = None
) -> None:
    """Before anything is built: the checkpoint's model config and tokenizer must match this run's,
    and at another world size the global batch (the data stays the same; DCP reshards the tensors).
    Raises ConfigError naming the first key that differs."""
    import yaml

    from moezoo.configs import to_dict

    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)  # _validate has read it once already: well-formed
    old, new = _flatten(saved.get("model", {}), "model"), _flatten(to_dict(cfg)["model"], "model")
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ConfigError(
                key, f"is {new.get(key)!r} but checkpoint {path} was trained with {old.get(key)!r}"
            )
    # bf16 weights keep their float32 masters in the optimizer state, float32 ones in the model
    # entries
    was = saved.get("train", {}).get("param_dtype", "float32")
    if was != cfg.train.param_dtype:
        raise ConfigError(
            "train.param_dtype",
            f"is {cfg.train.param_dtype!r} but checkpoint {path} was trained "
            f"with {was!r} (its float32 weights are kept in "
            f"{'the optimizer state' if was == 'bfloat16' else 'the model'}): "
            f"resume with the same setting",
        )
    state = read_train_state(path)
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        # Another world size reshards (DCP holds global tensors, experts included) and sees the same
        # data if the global batch is the same: each step's windows are split into (micro-batch,
        # rank) slices of one seeded draw (training.data.sample_batch), however many ranks take
        # them.
        t = cfg.train
        was, now = state.get("global_batch"), t.batch_size * t.grad_accum * world_size
        if cfg.dst.enabled and cfg.dst.compact_state:
            raise ConfigError(
                "dst.compact_state",
                f"compact DST moments are stored one block per rank; "
                f"checkpoint {path} resumes at world size {saved_world} only "
                f"(this run has {world_size})",
            )
        if was is None:
            raise ConfigError(
                "checkpoint",
                f"{path} was saved with world size {saved_world} before checkpoints "
                f"recorded their global batch; this run has {world_size}: resume "
                f"with {saved_world} ranks",
            )
        if was != now:
            per = t.batch_size * world_size
            fix = (
                f"train.grad_accum={was // per}"
                if was % per == 0
                else f"a train.batch_size dividing {was // world_size}"
            )
            raise ConfigError(
                "train.grad_accum",
                f"world size {world_size} x train.batch_size {t.batch_size} x "
                f"train.grad_accum {t.grad_accum} = {now} sequences a step, but "
                f"checkpoint {path} trained on {was} (world size {saved_world}); "
                f"keep the global batch ({fix})",
            )
    saved_tok = state.get("tokenizer")
    if tokenizer_digest and saved_tok and saved_tok != tokenizer_digest:
        raise ConfigError(
            "data.tokenizer",
            f"differs from the tokenizer checkpoint {path} was trained with "
            f"(digest {saved_tok} vs {tokenizer_digest})",
        )


# ---- save / load ---------------------------------------------------------------------------------
def remove_checkpoint(path: str) -> None:
    """Rename first, then delete: a kill mid-delete leaves a ``.trash_*`` dir, never a partial
    ``step_*``."""
    trash = os.path.join(os.path.dirname(path), ".trash_" + os.path.basename(path))
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _check_tensors_only(sd: dict, prefix: str = "") -> None:
    # DCP pickles any non-tensor leaf, and a pickle is what a safe reader must refuse.
    for k, v in sd.items():
        if isinstance(v, dict):
            _check_tensors_only(v, f"{prefix}{k}.")
        elif not isinstance(v, torch.Tensor):
            raise TypeError(
                f"checkpoint state {prefix}{k} is a {type(v).__name__}; only tensors go into DCP"
            )


def _split_optim(optim_sd: dict) -> tuple[dict, list[dict]]:
    """(tensor state for DCP, param-group hyper-parameters without the parameter names)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]]
    return {"state": optim_sd["state"]}, groups


def save_checkpoint(
    ckpt_dir: str, step: int, model, optimizer, train_state: dict, cfg: Config, keep_last: int = 3
) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path. Rotation keeps the newest
    ``keep_last`` checkpoints of this run (``train_state["run_id"]``), and the newest one saved at
    the end of its schedule (step == ``total_steps``), and never touches another run's."""
    rank = _rank()
    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = os.path.join(ckpt_dir, f".tmp_step_{step:08d}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(ckpt_dir, ".trash_step_*")) + [tmp]:
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_tensors, groups = _split_optim(optim_sd)
    state = {"model": model_sd, "optim": optim_tensors}
    _check_tensors_only(state)
    dcp.save(checkpoint_views(state, model), checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        save_config(cfg, os.path.join(tmp, "config.yaml"))
        _write_json(os.path.join(tmp, "optim_groups.json"), groups)
        _write_json(os.path.join(tmp, "train_state.json"), train_state)
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        run_id = train_state.get("run_id")
        # Written last inside the temp dir: a checkpoint without it is never loaded.
        _write_json(
            os.path.join(tmp, MANIFEST),
            {"format": FORMAT, "step": step, "run_id": run_id, "files": files},
        )
        if os.path.isdir(final):
            remove_checkpoint(final)
        os.replace(tmp, final)
        ours = [p for _, p in list_checkpoints(ckpt_dir) if _manifest(p).get("run_id") == run_id]
        # The newest checkpoint that ended its schedule (a finished run's last step) stays too:
        # the saves of an extension rotate their own checkpoints, never the finished run away.
        finished = [p for p in ours if _ends_schedule(p)][-1:]
        for old in ours[:-keep_last]:
            if old not in finished:
                remove_checkpoint(old)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer, trust: bool = False) -> dict:
    """Collective: restore model, optimizer and this rank's RNG in place; return the train_state
    dict. A damaged or crafted file raises CheckpointError (one line naming it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_tensors, _ = _split_optim(optim_sd)
    state = {"model": model_sd, "optim": optim_tensors}
    try:
        # The views share storage with state.
        dcp.load(
            checkpoint_views(state, model),
            checkpoint_id=path,
            storage_reader=SafeReader(path, trust),
            planner=SafeLoadPlanner(path, trust),
        )
    except CheckpointError:
        raise
    # a shard that is short, garbled or of another shape
    except (Exception, CheckpointException) as e:
        # DCP wraps each rank's exception (ours among them) into one CheckpointException (a
        # BaseException).
        for failure in getattr(e, "failures", {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise inner from None
        msg = str(e).strip().splitlines()
        raise CheckpointError(
            path,
            f"cannot load the model/optimizer shards ({type(e).__name__}: "
            f"{msg[0][:200] if msg else ''})",
        ) from None
    saved_groups = _read_json(os.path.join(path, "optim_groups.json"), list)
    if len(saved_groups) != len(optim_sd["param_groups"]):
        raise CheckpointError(
            os.path.join(path, "optim_groups.json"),
            f"has {len(saved_groups)} param groups, the optimizer {len(optim_sd['param_groups'])}",
        )
    for group, saved in zip(optim_sd["param_groups"], saved_groups):
        # JSON turns tuples (betas) into lists: keep the type the optimizer built.
        group.update(
            {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}
        )
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={
            "state": state["optim"]["state"],
            "param_groups": optim_sd["param_groups"],
        },
    )
    rng_file = os.path.join(path, f"rng_rank{_rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(load_tensors(rng_file, trust))
    return read_train_state(path)
