"""Device peak FLOPs for MFU (the sparsity methods report their own statistics:
layers.sparsity_method)."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (datasheet, no sparsity). MFU is reported only for known devices.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def mfu_metrics(
    tokens_per_s: float, model_flops: float, dense_attn_flops: float, attn_density, peak: float
) -> dict:
    """``mfu`` on the work done (hardware FLOPs: attention at ``attn_density``, zoo.flops) and
    ``mfu_model`` on the dense-equivalent model FLOPs per token. ``dense_attn_flops``: the attention
    part of ``model_flops`` at density 1. The same for a dense model; for a sparse one ``mfu``
    cannot exceed what the GPU did."""
    d = 1.0 if attn_density is None else float(attn_density)
    hw = model_flops - dense_attn_flops * (1.0 - d)
    return {"mfu": tokens_per_s * hw / peak, "mfu_model": tokens_per_s * model_flops / peak}
