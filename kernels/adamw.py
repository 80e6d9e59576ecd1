"""AdamW over float32 weights whose model copies are bfloat16: the update and the copy in one pass,
every tensor of a parameter group in one launch.

``adamw_(weights, grads, exp_avgs, exp_avg_sqs, params=None, *, lr, beta1, beta2, eps, weight_decay,
step, grad_scale=None, found_inf=None)``, per element, in float32 (torch.optim.AdamW's order of
operations)::

    g = grad * grad_scale      # grad of any float dtype; grad_scale: the clipping factor
    w = w * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    w = w - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
    param = w rounded to param's dtype     # when ``params`` is given (the model's bf16 copies)

``weights``, ``exp_avgs``, ``exp_avg_sqs``: float32 tensors, updated in place; ``grads`` and
``params`` match them in shape. ``step``: the step count after this update (>= 1), the same for
every tensor. ``grad_scale``: a float32 scalar tensor on the weights' device (read by the kernel: no
host sync). ``found_inf``: a scalar tensor there too; where it is nonzero nothing is written
(torch.amp.GradScaler's flag for torch's fused AdamW: a non-finite step skipped without the host
reading the flag; the torch path reads it on the host).

Why: with bf16 autocast and float32 parameters, every step casts each matmul weight to bf16
(forward), casts each bf16 weight gradient to float32 (autograd), and then reads those float32
gradients twice for clipping and once more in torch's fused AdamW: on the OLMoE-shaped model, ~41
ms of a 200 ms step goes to AdamW and clipping (BENCHMARKS.md, Against torchtitan).
Holding the matmul weights in bf16 (``training.optim.MasterAdamW``) leaves their gradients in bf16
and needs the bf16 copy written after each update; this kernel reads the bf16 gradient once, applies
the clipping factor on the fly, and writes the bf16 copy in the same pass (30 bytes a weight with
the norm's read, against ~52 before). The numbers are autocast's: the same bf16 weights and
gradients reach the GEMMs and the update.

On CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``): one Triton launch per (group, dtypes),
over a pointer table [tensors, 7] (weight, grad, exp_avg, exp_avg_sq, param, numel, first block) and
a block -> tensor map, so the launch count does not grow with the tensor count. Elsewhere
``adamw_reference_``: torch's foreach ops in AdamW's order (on CPU the same numbers as
``torch.optim.AdamW`` on float32 parameters given the same float32 gradients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .launch import jit, tl, to_device, triton, use_triton

# elements a program updates and its warps: 8 per thread and stream, which runs at the copy rate
# (bench/adamw.py sweeps others; BENCHMARKS.md, Against torchtitan); 4096 with 4 warps needs 218
# registers for sm_90
BLOCK, NUM_WARPS = 1024, 4
_blocks_cache: dict = {}  # (device, numels, block) -> int32 [blocks] tensor index of each block


def _adamw_kernel(
    table_ptr,
    block_tensor_ptr,
    scale_ptr,
    skip_ptr,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_sqrt,
    G_DTYPE: tl.constexpr,
    P_DTYPE: tl.constexpr,
    HAS_PARAM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid (blocks,): BLOCK elements of one tensor per program. The launcher checks every pointer is
    # 16-byte aligned: said here (a pointer read from memory has no known alignment), it lets a full
    # block use vector loads; the masked tail block of each tensor stays scalar.
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid).to(tl.int64)
    row = table_ptr + t * 7
    numel = tl.load(row + 5)
    start = (pid - tl.load(row + 6)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    w_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.float32)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(G_DTYPE)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32)), 16)
    p_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(P_DTYPE)), 16)
    if HAS_SKIP:
        # a skipped step sees every tensor as empty: the masked path with nothing in its mask (no
        # reads, no writes)
        numel = tl.where(tl.load(skip_ptr) == 0, numel, 0)
    full = start + BLOCK <= numel
    mask = offs < numel
    if full:
        g = tl.load(g_ptr + offs).to(tl.float32)
        w = tl.load(w_ptr + offs)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    w = w * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w - step_size * tl.div_rn(m, denom)
    if full:
        tl.store(w_ptr + offs, w)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if HAS_PARAM:
            tl.store(p_ptr + offs, w.to(P_DTYPE))
    else:
        tl.store(w_ptr + offs, w, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_PARAM:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


def _triton_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        dtype
    ]


def _block_map(
    device: torch.device, numels: tuple[int, ...], block: int
) -> tuple[torch.Tensor, list[int]]:
    """int32 [blocks]: the tensor each program updates (cached: it depends on the sizes only), and
    each tensor's first block."""
    firsts, total = [], 0
    for n in numels:
        firsts.append(total)
        total += triton.cdiv(n, block)
    key = (device, numels, block)
    if key not in _blocks_cache:
        counts = torch.tensor([triton.cdiv(n, block) for n in numels])
        _blocks_cache[key] = torch.repeat_interleave(
            torch.arange(len(numels), dtype=torch.int32), counts
        ).to(device)
    return _blocks_cache[key], firsts


def _adamw_triton(
    weights,
    grads,
    exp_avgs,
    exp_avg_sqs,
    params,
    decay,
    beta1,
    beta2,
    eps,
    step_size,
    bc2_sqrt,
    grad_scale,
    found_inf=None,
    block: int = 0,
    num_warps: int = 0,
) -> None:
    """The launcher; ``block`` / ``num_warps``: BLOCK / NUM_WARPS unless given (bench/adamw.py times
    others)."""
    block, num_warps = block or BLOCK, num_warps or NUM_WARPS
    device = weights[0].device
    numels = tuple(w.numel() for w in weights)
    blocks, firsts = _block_map(device, numels, block)
    # the table's 7 columns (the kernel's row stride): weight, grad, exp_avg, exp_avg_sq, param (0:
    # none), numel, first block
    rows = [
        [
            w.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            p.data_ptr() if params else 0,
            n,
            f,
        ]
        for w, g, m, v, p, n, f in zip(
            weights, grads, exp_avgs, exp_avg_sqs, params or weights, numels, firsts
        )
    ]
    # queued behind the backward, no wait
    table = to_device(torch.tensor(rows, dtype=torch.int64), device)
    p_dtype = params[0].dtype if params else torch.float32
    scale = grad_scale if grad_scale is not None else weights[0]  # unread without HAS_SCALE
    skip = found_inf if found_inf is not None else weights[0]  # unread without HAS_SKIP
    jit(_adamw_kernel)[(blocks.numel(),)](
        table,
        blocks,
        scale,
        skip,
        decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        step_size,
        bc2_sqrt,
        G_DTYPE=_triton_dtype(grads[0].dtype),
        P_DTYPE=_triton_dtype(p_dtype),
        HAS_PARAM=bool(params),
        HAS_SCALE=grad_scale is not None,
        HAS_SKIP=found_inf is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


def adamw_reference_(
    weights,
    grads,
    exp_avgs,
    exp_avg_sqs,
    params,
    decay,
    beta1,
    beta2,
    eps,
    step_size,
    bc2_sqrt,
    grad_scale,
    found_inf=None,
) -> None:
    """torch.optim.AdamW's foreach update (non-capturable), on float32 copies of the gradients;
    nothing where ``found_inf`` is nonzero (read on the host)."""
    if found_inf is not None and bool(found_inf):
        return
    g = [x.float() for x in grads]
    if grad_scale is not None:
        torch._foreach_mul_(g, grad_scale)
    torch._foreach_mul_(weights, decay)
    torch._foreach_lerp_(exp_avgs, g, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(weights, exp_avgs, denom, -step_size)
    if params:
        torch._foreach_copy_(params, weights)


def adamw_(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    params: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """See the module docstring. Every list holds tensors of one dtype each (one launch)."""
    if not weights:
        return
    for name, ts in (("weights", weights), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if any(t.dtype != torch.float32 for t in ts):
            raise TypeError(f"adamw_: {name} must be float32")
    if len({g.dtype for g in grads}) > 1 or (params and len({p.dtype for p in params}) > 1):
        raise TypeError("adamw_: one gradient dtype and one parameter dtype per call")
    args = (
        1.0 - lr * weight_decay,
        beta1,
        beta2,
        eps,
        lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
        grad_scale,
        found_inf,
    )
    tensors = [t for ts in (weights, grads, exp_avgs, exp_avg_sqs, params or ()) for t in ts]
    # the kernel takes every tensor as contiguous and 16-byte aligned (vector loads): fresh storages
    # are
    if use_triton(weights[0]) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors
    ):
        _adamw_triton(weights, grads, exp_avgs, exp_avg_sqs, params, *args)
    else:
        adamw_reference_(weights, grads, exp_avgs, exp_avg_sqs, params, *args)
