"""A trained run, loaded for inference: the latest checkpoint's model, its config and the run's
tokenizer.

    model, tokenizer, cfg, path = load_run("runs/tiny_dense")

``run`` is a run folder (``train.out_dir``, holding ``checkpoints/`` and the ``tokenizer.model`` the
trainer copies there), ``runs/<name>`` (its latest run), a checkpoint directory, or one ``step_*``
checkpoint. The tokenizer is the run folder's copy (checked against the digest the checkpoint
recorded), never a search through a cache.
"""

from __future__ import annotations

import os

from moezoo.configs import Config, ConfigError, load_config

TOKENIZER_FILE = "tokenizer.model"  # the run folder's copy of the tokenizer it trained with


def find_checkpoint(run: str) -> str:
    """The checkpoint ``run`` names: itself (a ``step_*`` dir), else the latest of a run folder, of
    the latest run under ``runs/<name>`` (training.run_folder.latest_run) or of a checkpoints/
    folder."""
    from .checkpoint import MANIFEST, latest_checkpoint
    from .run_folder import latest_run

    if os.path.isfile(os.path.join(run, MANIFEST)):
        return run
    folder = latest_run(run)
    path = latest_checkpoint(os.path.join(folder, "checkpoints") if folder else run)
    if path is None:
        raise ConfigError(
            "--run", f"no complete checkpoint in {run}, its checkpoints/ or a run {run}/<N>"
        )
    return path


def run_folder(ckpt: str, cfg: Config) -> str:
    """The run folder of checkpoint ``ckpt``: the folder above its ``checkpoints/`` (so a moved run
    still loads), else the config's ``train.out_dir`` (a custom ``checkpoint.dir``)."""
    ckpt_dir = os.path.dirname(os.path.abspath(ckpt))
    return os.path.dirname(ckpt_dir) if os.path.basename(ckpt_dir) == "checkpoints" else cfg.out_dir


def load_run(run: str, device: str = "cpu"):
    """``(model, tokenizer, cfg, checkpoint_path)``: the model in eval mode with the checkpoint's
    weights."""
    import torch

    from moezoo.zoo import build_model

    from .checkpoint import load_checkpoint, read_train_state
    from .optim import build_optimizer
    from .tokenizer import Tokenizer

    ckpt = find_checkpoint(run)
    cfg = load_config(os.path.join(ckpt, "config.yaml"))
    tok_path = os.path.join(run_folder(ckpt, cfg), TOKENIZER_FILE)
    if not os.path.isfile(tok_path):
        raise ConfigError("--run", f"{tok_path} not found (the trainer copies its tokenizer there)")
    tokenizer = Tokenizer(tok_path)
    state = read_train_state(ckpt)  # JSON: a checkpoint from elsewhere is data, never code
    if state.get("tokenizer") and state["tokenizer"] != tokenizer.digest:
        raise ConfigError("--run", f"{tok_path} is not the tokenizer {ckpt} was trained with")
    model = build_model(cfg.model, device)
    # The checkpoint's one public loader restores model and optimizer together; the optimizer is
    # dropped. A run with bf16 weights (train.param_dtype) keeps its float32 weights in the
    # optimizer's masters: load with the optimizer it trained with, then give the model those
    # float32 values back.
    optimizer = build_optimizer(
        model, cfg.optim, torch.device(device).type, param_dtype=cfg.train.param_dtype
    )
    load_checkpoint(ckpt, model, optimizer)
    if hasattr(optimizer, "masters_to_model"):
        optimizer.masters_to_model()
    return model.eval(), tokenizer, cfg, ckpt
