"""2:4 DST layers through torch's semi-structured sparse kernels (cuSPARSELt / CUTLASS), CUDA only.

``SemiSparseLinear.apply(x[..., in], weight[out, in], dtype, transposable) -> [..., out]`` computes
``F.linear(x, weight)`` for a weight whose zeros already form a 2:4 pattern along ``in`` (the DST mask):
  forward   y  = x W^T        with W packed by ``to_sparse_semi_structured`` (re-packed every call:
                               the weight changes every optimizer step)
  backward  gx = g W          sparse too when the mask is transposable (W^T is then 2:4 along ``out``),
                               else a dense matmul
            gW = g^T x        dense: RigL grows by |dL/dW| at masked positions, so the weight gradient
                               must stay dense.
The pure-torch reference is ``F.linear`` on the masked weight (what a DST layer computes without this
path). Hu et al. (ICML'24) and torchao's runtime 2:4 training follow the same split. Expect modest
gains at best on Hopper (see BENCHMARKS.md): packing costs a pass over W per call.
"""
from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

_OK_DTYPES = (torch.float16, torch.bfloat16)


def _pack(w: torch.Tensor):
    from torch.sparse import to_sparse_semi_structured
    return to_sparse_semi_structured(w)


class SemiSparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dtype, transposable):
        with torch.autocast("cuda", enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            w = weight.to(dtype)
            y = torch.mm(x2, _pack(w).t())
        ctx.save_for_backward(x2, w)
        ctx.transposable, ctx.wdtype, ctx.xdtype = transposable, weight.dtype, x.dtype
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        with torch.autocast("cuda", enabled=False):
            g2 = gy.reshape(-1, gy.shape[-1]).to(w.dtype)
            gx = torch.mm(g2, _pack(w.t().contiguous()).t()) if ctx.transposable else torch.mm(g2, w)
            gw = torch.mm(g2.t(), x2)
        return gx.view(*gy.shape[:-1], w.shape[1]).to(ctx.xdtype), gw.to(ctx.wdtype), None, None


def semi_structured_available(device: torch.device, dtype: torch.dtype, shape=(128, 128)) -> bool:
    """Probe once: CUDA, sm80+, fp16/bf16, and a 2:4 tensor of ``shape`` actually packs and multiplies."""
    if device.type != "cuda" or not torch.cuda.is_available() or dtype not in _OK_DTYPES:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        w = torch.tensor([1, 1, 0, 0], dtype=dtype, device=device).repeat(shape[0], shape[1] // 4)
        x = torch.ones(32, shape[1], dtype=dtype, device=device)
        torch.mm(x, _pack(w).t())
        return True
    except (RuntimeError, NotImplementedError, ValueError):  # capability probe: torch raises these when unsupported
        return False


def _semi_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return F.linear(x, self.weight, self.bias)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.weight.dtype
    if dtype not in _OK_DTYPES:
        return F.linear(x, self.weight, self.bias)
    y = SemiSparseLinear.apply(x, self.weight, dtype, self._dst_transposable)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def enable_semi_structured(targets, transposable: bool) -> list[str]:
    """Route every 2:4-masked ``nn.Linear`` target through ``SemiSparseLinear``; returns the names routed.

    Layers whose shape the kernels reject (probed) and 3-D expert weights stay on the dense path, with
    one warning listing them. Parameter names and state_dict keys are unchanged.
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
            probed[key] = semi_structured_available(w.device, dtype, tuple(w.shape)) and \
                (not transposable or semi_structured_available(w.device, dtype, tuple(w.shape[::-1])))
        if not probed[key]:
            skipped.append(t.name)
            continue
        mod._dst_transposable = transposable
        mod.forward = types.MethodType(_semi_forward, mod)
        done.append(t.name)
    if skipped:
        warnings.warn(f"dst.semi_structured: {len(skipped)} layer(s) stay dense-masked (no CUDA 2:4 kernel for "
                      f"their device/shape/layout): {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}")
    return done


def disable_semi_structured(targets) -> None:
    """Back to ``nn.Linear.forward`` (the dense finish: an unmasked weight is not 2:4)."""
    for t in targets:
        if "forward" in vars(t.module):
            del t.module.forward
