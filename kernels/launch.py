"""Launch helpers shared by the Triton kernels: whether Triton is here, when it runs,
compile-on-first-launch; and ``to_device``, the host-to-GPU copy that does not wait for the GPU
(kernel tables, index lists, batches).

Triton is optional (torch's CUDA wheels bring it; pyproject's gpu and dev extras install it):
whether it imports is decided once, here, at import. Without it every op runs its torch reference
(``use_triton`` is False) and the kernel modules still import (their ``triton`` / ``tl`` names are
None; kernel bodies are only compiled on a launch, which never happens then).

Kernels are wrapped with ``triton.jit`` at their first launch rather than at import, because Triton
decides between compiled and interpreted execution at decoration time: a test that sets
``TRITON_INTERPRET=1`` before its first launch then gets the interpreter even if the module was
imported earlier by another test.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = tl = None
    HAVE_TRITON = False


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, queued without waiting for the GPU. A blocking CUDA copy
    (``.to(device)``) waits until the stream has drained; a ``non_blocking`` one from pageable
    memory goes through the driver's staging buffer, asynchronous only as far as the driver makes
    it; from pinned memory the copy is queued behind the work before it (the caching host allocator
    keeps the pinned copy alive until it has run). When a training step starts with a copy that
    waits, the GPU idles while the host launches the step's first kernels (~2 ms of the OLMoE-shaped
    MoE step: BENCHMARKS.md, Against torchtitan)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    # one host copy into a contiguous pinned buffer: a strided source (a batch's x = windows[:,
    # :-1]) would otherwise be made contiguous in pageable memory by the copy to the GPU
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests);
    never without triton installed."""
    if not HAVE_TRITON:
        return False
    if t.is_cuda:
        return True
    return interpreting() and t.device.type == "cpu"


@functools.cache
def _jit(fn, interpret: bool):
    return triton.jit(fn)


def jit(fn):
    """The ``triton.jit`` of ``fn``, made on first use, once per interpret mode."""
    return _jit(fn, interpreting())
