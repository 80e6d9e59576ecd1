"""One selection per checkpointed forward: the activation-checkpointing recompute reuses the block
lists its forward estimated instead of scoring the keys again.

Input-dependent patterns (block top-k, vertical-slash) estimate their blocks from q and k on every
call; under activation checkpointing a block's forward runs twice (forward, then the recompute in
backward), so the estimate (for ``score_block: 1`` a causal QK^T per KV group) is paid twice.
``SelectionReplay.run(forward, ...)`` runs one checkpointed forward: its first run records each
estimate (``replayed``), the recompute returns them in the same order. Besides the time, this makes
the recompute's mask the forward's by construction, not by the estimate's determinism.

A recorded entry holds its key (the call's layer, shapes and patterns) and is used only if the
recompute asks for the same key at the same position; anything else is computed afresh. Inside a
torch.compile trace nothing is recorded (training.parallel checkpoints compiled blocks without a
replay).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Optional

import torch

_ACTIVE: contextvars.ContextVar[Optional[SelectionReplay]] = contextvars.ContextVar(
    "moezoo_selection_replay", default=None
)


class SelectionReplay:
    """The estimates of one checkpointed forward, kept from its first run for its recompute."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, Any, dict]] = []
        self.replaying = False
        self.pos = 0

    def run(self, forward: Callable, *args, **kwargs):
        """``forward(*args, **kwargs)`` with this replay active: the first call records, later
        calls (the recompute) replay; after a replay the entries are dropped."""
        token = _ACTIVE.set(self)
        try:
            return forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            if self.replaying:
                self.saved.clear()
            self.replaying, self.pos = True, 0


def replayed(key: Any, compute: Callable[[], Any], stats: Optional[dict] = None) -> Any:
    """``compute()``, or what it returned in this checkpointed forward's first run. ``key``
    identifies the call (layer, shapes, patterns); ``stats``: the call's stats dict, whose entries
    ``compute`` filled are restored on a replay."""
    if torch.compiler.is_compiling():  # checked first: a trace never reads the context variable
        return compute()
    r = _ACTIVE.get()
    if r is None:
        return compute()
    if r.replaying:
        if r.pos < len(r.saved) and r.saved[r.pos][0] == key:
            _, value, filled = r.saved[r.pos]
            r.pos += 1
            if stats is not None:
                stats.update(filled)
            return value
        with torch.no_grad():  # as the first run computed it
            return compute()
    before = dict(stats) if stats is not None else {}
    if not torch.is_grad_enabled():  # no graph, no recompute: nothing to keep
        return compute()
    # without autograd: a selection needs no gradient, and ops the replay skips must not save
    # tensors for backward (checkpointing checks that both runs saved the same number)
    with torch.no_grad():
        value = compute()
    filled = {k: v for k, v in (stats or {}).items() if k not in before or before[k] is not v}
    r.saved.append((key, value, filled))
    return value
