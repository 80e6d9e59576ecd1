"""``ExpertBalancing``: the MoE layers of a model as one sparsity method (layers.sparsity_method).

After an applied step it updates every layer's aux-loss-free selection bias from the routed-token
counts (DeepSeek-V3: ``bias += rate * sign(mean load - load)``, counts summed over ``group`` so
every rank applies the same update); a skipped step drops its counts (otherwise the next update
would count two steps' load). ``metrics()`` are the load statistics of the last forward, averaged
over layers; ``expert_load()`` the ``[layers, experts]`` token shares for a heatmap.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layer import moe_modules, moe_reset_load, moe_update_bias


class ExpertBalancing:
    # the bias update multiplies by the step's applied flag (layers.sparsity_method)
    skips_on_device = True

    def __init__(self, model: nn.Module, group=None):
        self.model, self.layers = model, moe_modules(model)
        self.group = group

    def before_step(self, step: int) -> None:
        pass

    def after_optimizer_step(self, step: int, applied: Optional[torch.Tensor] = None) -> None:
        moe_update_bias(self.model, self.group, applied)

    def skipped_step(self) -> None:
        moe_reset_load(self.model)

    def _shares(self) -> list[torch.Tensor]:
        out = []
        for m in self.layers:
            if "tokens_per_expert" in m.stats:
                t = m.stats["tokens_per_expert"].detach().float()
                out.append(t / t.sum().clamp_min(1))
        return out

    def metrics(self) -> dict:
        """Scalars over the MoE layers of the last forward (one device-to-host copy each, not one
        per layer)."""
        loads = self._shares()
        if not loads:
            return {}
        stats = [m.stats for m in self.layers if "tokens_per_expert" in m.stats]
        shares = torch.cat(loads).cpu()
        per_layer_max = torch.stack([x.max() * x.numel() for x in loads]).cpu()
        return {
            # busiest expert vs perfectly even, worst layer
            "moe/max_load_ratio": per_layer_max.max(),
            "moe/mean_max_load_ratio": per_layer_max.mean(),
            "moe/dropped_frac": torch.stack([s["dropped_frac"].detach().float() for s in stats])
            .mean()
            .cpu(),
            "moe/router_entropy": torch.stack([s["router_entropy"].detach().float() for s in stats])
            .mean()
            .cpu(),
            "moe/min_expert_share": shares.min(),
        }

    def expert_load(self) -> Optional[torch.Tensor]:
        """``[layers, experts]`` token shares of the last forward (None without MoE or with unequal
        expert counts)."""
        loads = self._shares()
        if not loads or len({x.numel() for x in loads}) != 1:
            return None
        return torch.stack(loads).cpu()
