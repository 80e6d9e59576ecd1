"""``eval``: evaluations beside the validation loss (training.passkey)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import check


@dataclass
class EvalConfig:
    # Passkey retrieval (needle in a haystack of validation text) at these lengths, at every
    # validation (train.eval_every) and from ``train.py --config X --resume --eval passkey``; empty
    # = off.
    passkey_lengths: list[int] = field(default_factory=list)
    passkey_samples: int = 10  # per length; needle depths spread evenly from the start to the end

    def validate(self, max_seq_len: int, key: str = "eval") -> None:
        check(
            self.passkey_samples > 0,
            f"{key}.passkey_samples",
            f"must be > 0, got {self.passkey_samples}",
        )
        for n in self.passkey_lengths:
            check(
                isinstance(n, int) and 64 <= n <= max_seq_len,
                f"{key}.passkey_lengths",
                f"each length must be an integer in 64..model.max_seq_len={max_seq_len}, got {n!r}",
            )
