"""flash-attn (optional, ``pip install -e ".[gpu]"``): dense causal layers and pure causal sliding
windows.

flash-attn-4 (``flash_attn.cute``, CuTe DSL, Hopper/Blackwell) first, flash-attn 2 (``flash_attn``)
if that is what is installed. Both take ``[B, S, H, D]`` and GQA natively; ``window_size=(W-1, 0)``
is exactly our window W (keys q-W+1 .. q). FA4 returns ``(out, lse)``, FA2 the output.
"""

from __future__ import annotations

import torch


def _flash_func():
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func

        return flash_attn_func
    except ImportError:
        raise ValueError(
            "backend 'flash_attn' needs flash-attn-4 (flash_attn.cute) or flash-attn"
        ) from None


def _call(q, k, v, window: int | None) -> torch.Tensor:
    """``q [B, Hq, T, D]``, ``k, v [B, Hk, T, D]`` -> ``[B, Hq, T, D]``; causal, window None =
    dense."""
    fn = _flash_func()
    kw = {} if window is None else {"window_size": (window - 1, 0)}
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def flash_attn_dense(q, k, v, q_offset: int = 0) -> torch.Tensor:
    """Dense causal attention through flash-attn (square inputs; decode rows go to SDPA)."""
    if q_offset or q.shape[2] != k.shape[2]:
        from .dense import dense_causal_attention

        return dense_causal_attention(q, k, v, q_offset)
    return _call(q, k, v, None)


def flash_attn_window(q, k, v, pats, square: bool) -> torch.Tensor:
    """One causal window shared by all heads (a head dense at these T keys is the window T)."""
    T = k.shape[2]
    windows = {T if p.is_dense_at(T) else p.window for p in pats}
    if (
        not square
        or len(windows) != 1
        or any(p.type != "local" or p.sinks for p in pats if not p.is_dense_at(T))
    ):
        raise ValueError(
            "backend 'flash_attn' runs one causal window without sinks shared by all heads, "
            "square inputs"
        )
    return _call(q, k, v, windows.pop())
