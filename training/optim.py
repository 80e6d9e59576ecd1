"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay (torch schedulers)."""
from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from configs import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    """Weight decay on >= 2-D parameters (linears, embeddings, stacked experts); none on norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused CUDA kernel is one launch for all parameters; on CPU the foreach path is the fast one.
    fused = device_type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up from lr/warmup to lr over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    cosine = CosineAnnealingLR(opt, T_max=max(total_steps - warmup, 1), eta_min=cfg.lr * cfg.min_lr_ratio)
    if warmup == 0:
        return cosine
    ramp = LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    return SequentialLR(opt, [ramp, cosine], milestones=[warmup])
