"""Checks a run makes from its config before any expensive work (reading the corpus, building the
model).

Each failure is a ConfigError naming the key: one line, exit 2 from train.py.
"""

from __future__ import annotations

import os

from moezoo.configs import Config, ConfigError

from .corpus import check_source
from .tokenizer import MIN_TRAINED_VOCAB, Tokenizer


def _check_dir(path: str, key: str) -> None:
    """``path`` is a directory or can be created as one: no file on it or on any of its parents."""
    p = os.path.abspath(path)
    while True:
        if os.path.exists(p):
            if not os.path.isdir(p):
                what = "is" if p == os.path.abspath(path) else f"is inside {p}, which is"
                raise ConfigError(key, f"{path} {what} a file, not a directory")
            return
        parent = os.path.dirname(p)
        if parent == p:
            return
        p = parent


def check_paths(cfg: Config) -> None:
    """Every path the run will read or write, from the config alone."""
    _check_dir(cfg.data.cache_dir, "data.cache_dir")
    _check_dir(cfg.out_dir, "train.out_dir")
    _check_dir(cfg.checkpoint_dir, "checkpoint.dir" if cfg.checkpoint.dir else "train.out_dir")
    check_source(cfg.data)
    if cfg.data.tokenizer:
        # a small file: loading it is the check that it is a model
        tok = Tokenizer(cfg.data.tokenizer)
        if tok.vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"is {cfg.model.vocab_size} but tokenizer {tok.path} has {tok.vocab_size} pieces",
            )
    elif cfg.model.vocab_size < MIN_TRAINED_VOCAB:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is too small for a byte-fallback tokenizer "
            f"(>= {MIN_TRAINED_VOCAB}); or give data.tokenizer",
        )


def check_runtime(cfg: Config, device, world_size: int = 1) -> None:
    """The fast paths the config asks for explicitly run on ``device`` (a torch.device):
    flash-attn-4 for attention, FP8 expert GEMMs (``model.moe.precision: fp8``), bf16 weights
    (``train.param_dtype``)."""
    cfg.model.attention.check_runtime(device.type)
    if cfg.train.param_dtype == "bfloat16" and world_size > 1:
        raise ConfigError(
            "train.param_dtype",
            f"bfloat16 weights with float32 masters are for one process "
            f"({world_size} here): FSDP2 computes in bfloat16 from float32 "
            f"shards already (its mixed precision); use float32",
        )
    if cfg.train.param_dtype == "bfloat16" and cfg.train.dtype == "auto" and device.type != "cuda":
        raise ConfigError(
            "train.param_dtype",
            f"bfloat16 weights need bf16 autocast, which train.dtype auto "
            f"gives on CUDA only (this run is on {device.type}): set "
            f"train.dtype bfloat16",
        )
    if "moe" in cfg.model.layer_ffn_types():
        cfg.model.moe.check_runtime(device)


def check_model(cfg: Config, meta_model) -> None:
    """Checks that need the model's shapes, on a meta-device build (no memory): DST targets and
    blocks."""
    if cfg.dst.enabled:
        from moezoo.layers import DynamicSparsity

        # The real constructor on the throwaway meta model: the same checks, run before anything is
        # allocated. No optimizer exists yet, so the compact optimizer state (checked when the
        # trainer builds it) is off.
        DynamicSparsity(
            meta_model, None, cfg=cfg.dst, total_steps=cfg.train.steps, compact_state=False
        )
