"""Throughput, MFU and per-layer sparsity statistics for logging."""
from __future__ import annotations

import torch
from torch import nn

# Dense bf16 tensor-core peaks (datasheet, no sparsity). MFU is reported only for known devices.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def moe_metrics(model: nn.Module) -> tuple[dict, torch.Tensor | None]:
    """Scalars averaged over MoE layers, and the expert load matrix ``[layers, experts]`` (token shares)."""
    loads, dropped, entropy = [], [], []
    for m in model.modules():
        stats = getattr(m, "stats", None)
        if isinstance(stats, dict) and "tokens_per_expert" in stats:
            t = stats["tokens_per_expert"].detach().float()
            loads.append(t / t.sum().clamp_min(1))
            dropped.append(stats["dropped_frac"].detach().float())
            entropy.append(stats["router_entropy"].detach().float())
    if not loads:
        return {}, None
    # One device-to-host copy each, not one per layer.
    load = torch.stack(loads).cpu() if len({x.numel() for x in loads}) == 1 else None
    shares = torch.cat(loads).cpu() if load is None else load
    per_layer_max = torch.stack([x.max() * x.numel() for x in loads]).cpu()
    out = {
        "moe/max_load_ratio": per_layer_max.max(),       # busiest expert vs perfectly even, worst layer
        "moe/mean_max_load_ratio": per_layer_max.mean(),
        "moe/dropped_frac": torch.stack(dropped).mean().cpu(),
        "moe/router_entropy": torch.stack(entropy).mean().cpu(),
        "moe/min_expert_share": shares.min(),
    }
    return out, load


def mfu_metrics(tokens_per_s: float, model_flops: float, dense_attn_flops: float, attn_density, peak: float) -> dict:
    """``mfu`` on the work done (hardware FLOPs: attention at ``attn_density``, zoo.flops) and ``mfu_model``
    on the dense-equivalent model FLOPs per token. ``dense_attn_flops``: the attention part of ``model_flops``
    at density 1. The same for a dense model; for a sparse one ``mfu`` cannot exceed what the GPU did."""
    d = 1.0 if attn_density is None else float(attn_density)
    hw = model_flops - dense_attn_flops * (1.0 - d)
    return {"mfu": tokens_per_s * hw / peak, "mfu_model": tokens_per_s * model_flops / peak}
