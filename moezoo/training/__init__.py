"""Trainer: data, tokenizer, optimizer and schedule, checkpoints, parallelism, logging, the loop."""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "training")


def run(cfg):
    """Train ``cfg`` (a configs.Config). Alone or under torchrun; see training.loop."""
    from .loop import run as _run

    return _run(cfg)


__all__ = ["run"]
