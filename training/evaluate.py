"""Evaluation without training (``train.py --config X --resume --eval passkey``): a Trainer restores
the latest checkpoint, the evaluation runs on its model and data, the result is printed and
logged."""

from __future__ import annotations

from .loop import Trainer
from .passkey import PasskeyResult, format_passkey_table, passkey_eval, passkey_metrics


def run_passkey(cfg) -> PasskeyResult:
    """``train.py --config X --resume --eval passkey``: restore the latest checkpoint (no training
    step), score ``eval.passkey_lengths`` (default: train.seq_len), print the table, log it at the
    checkpoint's step."""
    if not cfg.eval.passkey_lengths:
        cfg.eval.passkey_lengths = [cfg.train.seq_len]
    t = Trainer(cfg)
    res = passkey_eval(
        t.model,
        t.data.tokenizer,
        t.data.val,
        cfg.eval.passkey_lengths,
        cfg.eval.passkey_samples,
        cfg.train.seed,
        t.device,
        t.autocast,
    )
    t.logger.log(passkey_metrics(res), step=t.step)
    t.print(format_passkey_table(res, f"step {t.step}"))
    t.logger.finish()
    return res
