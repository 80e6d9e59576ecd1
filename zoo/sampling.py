"""Autoregressive sampling through the KV cache: temperature, top-k and top-p (nucleus), as in
gpt-fast.

    ids = generate(model, prompt_ids, max_new_tokens=100, temperature=0.8, top_k=50, top_p=0.95,
                   seed=0)

The prompt is prefilled in one forward; each new token is then one forward of length 1 at
``start_pos``, attending to the cached keys and values. ``temperature=0`` is greedy decoding.
Shapes: B batch, S length, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row ``[B]`` from ``logits [B, V]``."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    logits = logits_BV.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already hold top_p of the mass (the first always
        # stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor | list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """``prompt [B, S]`` (or one list of ids) followed by up to ``max_new_tokens`` sampled ids:
    ``[B, S + n]``.

    Stops early once every row has produced ``eos_id``. The total length is capped at the model's
    ``cfg.max_seq_len`` (the RoPE tables and the cache are sized to it)."""
    param = next(model.parameters())
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=param.device)
    tokens = tokens[None] if tokens.dim() == 1 else tokens
    B, S = tokens.shape
    max_len = min(S + max_new_tokens, model.cfg.max_seq_len)
    if S >= max_len:
        raise ValueError(
            f"prompt of {S} tokens leaves no room under max_seq_len={model.cfg.max_seq_len}"
        )
    g = torch.Generator(param.device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    model.setup_cache(B, max_len, dtype=param.dtype, device=param.device)
    try:
        logits = model(tokens)[:, -1]
        out, done = [tokens], torch.zeros(B, dtype=torch.bool, device=param.device)
        for pos in range(S, max_len):
            nxt = sample_next(logits, temperature, top_k, top_p, g)
            out.append(nxt[:, None])
            if eos_id is not None:
                done |= nxt == eos_id
                if bool(done.all()):
                    break
            if pos + 1 < max_len:
                logits = model(nxt[:, None], start_pos=pos)[:, -1]
    finally:
        model.clear_cache()
        model.train(was_training)
    return torch.cat(out, dim=1)
