"""Launch helpers shared by the MoE kernels: when Triton runs, and compile-on-first-launch.

Kernels are wrapped with ``triton.jit`` at their first launch rather than at import, because Triton
decides between compiled and interpreted execution at decoration time: a test that sets
``TRITON_INTERPRET=1`` before its first launch then gets the interpreter even if the module was
imported earlier by another test.
"""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests)."""
    if t.is_cuda:
        return True
    return interpreting() and t.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _jit(fn, interpret: bool):
    import triton
    return triton.jit(fn)


def jit(fn):
    """The ``triton.jit`` of ``fn``, made on first use, once per interpret mode."""
    return _jit(fn, interpreting())
