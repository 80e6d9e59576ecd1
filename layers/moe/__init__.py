"""Mixture of experts: ``MoE`` and what it is made of.

- ``layer``: ``MoE`` (router + routing stage + dispatch + experts), ``moe_modules``,
  ``moe_aux_loss``.
- ``router``: scores, top-k, balance / z-losses, the router matmul.
- ``routing_stage``: the whole routing computation as one (compilable) function of the logits.
- ``experts``: the token -> expert-sorted ``DispatchPlan`` and ``GroupedExperts`` (stacked expert
  FFNs).
- ``expert_parallel``: all-to-all dispatch over an EP process group.
- ``megablocks``: the optional megablocks dMoE backend.
- ``balancing``: ``ExpertBalancing``, the MoE layers as one sparsity method for the trainer (bias
  updates, load stats).
"""

from .balancing import ExpertBalancing
from .layer import MoE, moe_aux_loss, moe_modules, moe_reset_load, moe_update_bias

__all__ = [
    "ExpertBalancing",
    "MoE",
    "moe_aux_loss",
    "moe_modules",
    "moe_reset_load",
    "moe_update_bias",
]
