"""Device peak FLOPs for MFU (the sparsity methods report their own statistics: layers.sparsity_method)."""
from __future__ import annotations

import torch

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
