"""Checkpoints through torch.distributed.checkpoint (DCP): sharded under FSDP2/EP, plain on one process.

Layout: ``<dir>/step_00000100/`` holding the DCP shards of {model, optimizer} (DST masks are model
buffers, so they ride along), ``train_state.pt`` (step, scheduler, counters), ``rng_rank<r>.pt`` (python,
numpy, torch, cuda RNG of each rank) and ``config.yaml`` (the resolved config).

Atomicity: everything is written into ``<dir>/.tmp_step_...`` and renamed once complete, so a crash or
kill mid-write leaves only a temp dir that ``latest_checkpoint`` ignores (and the next save removes).
Expert-parallel tensors are stored as global ``[E, ...]`` views (``checkpoint_views``), so a checkpoint
saved at one ``ep`` loads at another. Resuming needs the same world size (``check_resumable`` says so
before anything is built): the per-rank RNG streams are saved per rank.
"""
from __future__ import annotations

import glob
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from configs import Config, save_config

from .parallel import checkpoint_views

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# One process without a process group is a supported DCP mode, not a problem worth a warning per save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first. Temp dirs of interrupted saves are skipped."""
    out = []
    for path in glob.glob(os.path.join(ckpt_dir, "step_*")):
        m = _STEP_DIR.match(os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, "train_state.pt")):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str) -> str | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1][1] if ckpts else None


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        out.update(_flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def check_resumable(path: str, cfg: Config, world_size: int, tokenizer_digest: str | None = None) -> None:
    """Before anything is built: the checkpoint's model config, world size and tokenizer must match
    this run's. Raises ConfigError naming the first key that differs."""
    import yaml
    from configs import ConfigError, to_dict
    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    old, new = _flatten(saved.get("model", {}), "model"), _flatten(to_dict(cfg)["model"], "model")
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ConfigError(key, f"is {new.get(key)!r} but checkpoint {path} was trained with {old.get(key)!r}")
    state = torch.load(os.path.join(path, "train_state.pt"), weights_only=False)
    if state.get("world_size", 1) != world_size:
        raise ConfigError("checkpoint", f"{path} was saved with world size {state['world_size']}, this run has "
                                        f"{world_size}; resume with the same number of ranks")
    saved_tok = state.get("tokenizer")
    if tokenizer_digest and saved_tok and saved_tok != tokenizer_digest:
        raise ConfigError("data.tokenizer", f"differs from the tokenizer checkpoint {path} was trained with "
                                            f"(digest {saved_tok} vs {tokenizer_digest})")


def save_checkpoint(ckpt_dir: str, step: int, model, optimizer, train_state: dict, cfg: Config,
                    keep_last: int = 3) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    rank = _rank()
    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = os.path.join(ckpt_dir, f".tmp_step_{step:08d}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(checkpoint_views({"model": model_sd, "optim": optim_sd}, model), checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        save_config(cfg, os.path.join(tmp, "config.yaml"))
        # train_state.pt is written last inside the temp dir: its presence marks a complete checkpoint.
        torch.save(train_state, os.path.join(tmp, "train_state.pt"))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(ckpt_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Collective: restore model, optimizer and this rank's RNG in place; return the train_state dict."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(checkpoint_views(state, model), checkpoint_id=path)   # the views share storage with state
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = os.path.join(path, f"rng_rank{_rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(os.path.join(path, "train_state.pt"), weights_only=False)
