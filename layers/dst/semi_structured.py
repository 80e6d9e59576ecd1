"""2:4 DST layers on GPU: route every 2:4-masked ``nn.Linear`` target through
kernels.semi_sparse_linear.

``enable_semi_structured(targets, transposable)`` swaps the forward of each eligible Linear (CUDA,
fp16 / bf16, 2:4 mask along ``in``) for ``SemiSparseLinear``; ``disable_semi_structured`` undoes it.
Expect modest gains at best on Hopper (BENCHMARKS.md, Dynamic sparse training): packing costs a
pass over W per call.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from moezoo.configs import ConfigError
from moezoo.kernels.semi_sparse_linear import SemiSparseLinear, pack_semi_structured

from ..shapes import check_width

_OK_DTYPES = (torch.float16, torch.bfloat16)


def semi_structured_available(device: torch.device, dtype: torch.dtype, shape=(128, 128)) -> bool:
    """Probe once: CUDA, sm80+, fp16/bf16, and a 2:4 tensor of ``shape`` actually packs and
    multiplies."""
    if device.type != "cuda" or not torch.cuda.is_available() or dtype not in _OK_DTYPES:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        w = torch.tensor([1, 1, 0, 0], dtype=dtype, device=device).repeat(shape[0], shape[1] // 4)
        x = torch.ones(32, shape[1], dtype=dtype, device=device)
        torch.mm(x, pack_semi_structured(w).t())
        return True
    # capability probe: torch raises these when unsupported
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def check_semi_structured_device(device: torch.device) -> None:
    """``ConfigError`` on ``dst.semi_structured`` for a GPU without 2:4 tensor cores (before sm80);
    on CPU the layers run the masked dense reference (the fallback ``enable_semi_structured`` warns
    about)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(
            "dst.semi_structured",
            f"{torch.cuda.get_device_name(device)} (sm {cap}) has no 2:4 "
            "sparse tensor cores (needs sm80+); set it false",
        )


def _semi_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    check_width("Linear", x, self.in_features, "in_features")
    if not x.is_cuda:
        return F.linear(x, self.weight, self.bias)
    dtype = (
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.weight.dtype
    )
    if dtype not in _OK_DTYPES:
        return F.linear(x, self.weight, self.bias)
    y = SemiSparseLinear.apply(x, self.weight, dtype, self._dst_transposable)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def enable_semi_structured(targets, transposable: bool) -> list[str]:
    """Route every 2:4-masked ``nn.Linear`` target through ``SemiSparseLinear``; returns the names
    routed.

    Layers whose shape the kernels reject (probed) and 3-D expert weights stay on the dense path,
    with one warning listing them. Parameter names and state_dict keys are unchanged.
    """
    done, skipped, probed = [], [], {}
    for t in targets:
        mod = t.module
        w = t.param()
        if not (isinstance(mod, nn.Linear) and t.attr == "weight"):
            skipped.append(t.name)
            continue
        dtype = torch.bfloat16 if w.dtype == torch.float32 else w.dtype
        key = (w.device, dtype, tuple(w.shape))
        if key not in probed:
            probed[key] = semi_structured_available(w.device, dtype, tuple(w.shape)) and (
                not transposable or semi_structured_available(w.device, dtype, tuple(w.shape[::-1]))
            )
        if not probed[key]:
            skipped.append(t.name)
            continue
        mod._dst_transposable = transposable
        mod.forward = types.MethodType(_semi_forward, mod)
        done.append(t.name)
    if skipped:
        warnings.warn(
            f"dst.semi_structured: {len(skipped)} layer(s) stay dense-masked "
            f"(no CUDA 2:4 kernel for their device/shape/layout): "
            f"{', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}",
            stacklevel=2,
        )
    return done


def disable_semi_structured(targets) -> None:
    """Back to ``nn.Linear.forward`` (the dense finish: an unmasked weight is not 2:4)."""
    for t in targets:
        if "forward" in vars(t.module):
            del t.module.forward
