"""flash-attn (optional): pure causal sliding windows."""
from __future__ import annotations

import torch


def flash_attn_window(q, k, v, pats, square: bool) -> torch.Tensor:
    """flash-attn's ``window_size=(W-1, 0)`` is exactly our window W (keys q-W+1 .. q); a head dense at
    these T keys is the window T."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        raise ValueError("backend 'flash_attn' needs the flash-attn package") from None
    T = k.shape[2]
    windows = {T if p.is_dense_at(T) else p.window for p in pats}
    if not square or len(windows) != 1 or any(p.type != "local" or p.sinks for p in pats if not p.is_dense_at(T)):
        raise ValueError("backend 'flash_attn' runs one causal window without sinks shared by all heads, square inputs")
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                          window_size=(windows.pop() - 1, 0))
    return out.transpose(1, 2)
