"""Trainer: data, tokenizer, optimizer and schedule, checkpoints, parallelism, logging, the loop."""


def run(cfg):
    """Train ``cfg`` (a configs.Config). Alone or under torchrun; see training.loop."""
    from .loop import run as _run
    return _run(cfg)


__all__ = ["run"]
