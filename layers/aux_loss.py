"""One sum for every layer's auxiliary loss (MoE balance and z-losses, neuron-router losses, ...).

Convention shared by the layers: a module with auxiliary objectives stores their weighted sum from
its last forward in ``module.aux_loss`` (a scalar tensor with grad, reset each forward). Such layers
derive from ``AuxLossModule``, so a copy of a model that has run forward works.
"""

from __future__ import annotations

import torch
from torch import nn


class AuxLossModule(nn.Module):
    """Base of the layers that keep ``aux_loss``: a copy of one (``copy.deepcopy``, pickling,
    ``torch.save`` of the whole module) carries that loss detached. The live attribute hangs from
    the last forward's autograd graph, and deepcopy refuses a non-leaf tensor: an EMA copy of the
    model taken after a training step (timm's ``ModelEmaV2``, a ``copy.deepcopy(model)`` in a user's
    loop) would fail."""

    def __getstate__(self):
        # already a copy of __dict__: the live module keeps its graph
        state = super().__getstate__()
        if isinstance(state.get("aux_loss"), torch.Tensor):
            state["aux_loss"] = state["aux_loss"].detach()
        return state


def sum_aux_losses(modules) -> torch.Tensor:
    """Sum of the ``aux_loss`` tensors of ``modules`` (0 when none), on the first one's device."""
    losses = [m.aux_loss for m in modules]
    if not losses:
        return torch.zeros(())
    return torch.stack([l.to(losses[0].device) for l in losses]).sum()


def total_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``aux_loss`` over every module of ``model`` that has one (0 when none)."""
    return sum_aux_losses(
        m for m in model.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)
    )
