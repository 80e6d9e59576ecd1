"""Which weights DST masks, on any ``nn.Module``: ``dst_parameters(model, include, exclude)``.

Default (``include=None``): every 2-D ``weight`` of an ``nn.Linear`` and every parameter of 3 or
more dims held by a module that is not a convolution (stacked MoE experts ``[E, out, in]``, HF
layout), except the embeddings and the output head. The head is ``model.get_output_embeddings()``
where the model defines it (HF ``PreTrainedModel``), else a Linear whose weight is an
``nn.Embedding``'s (tied) or whose ``out_features`` is an embedding's vocabulary; a model with no
embedding (a plain MLP) has its last Linear as the head (unless it is the only one). With
``include`` given: every >= 2-D parameter whose name matches an ``include`` fnmatch pattern. Either
way, names matching an ``exclude`` pattern (routers, by default) are skipped.

A target ``[out, in]`` is one slice ``[1, out, in]``; ``[E, out, in]`` is E slices, each its own
top-k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Optional

import torch
from torch import nn

_CONV = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _head_and_embeddings(model: nn.Module) -> set[int]:
    """ids of the embedding weights and the output head's weight (not masked by default)."""
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    skip = {id(e.weight) for e in embeds}
    head = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        head = get_out()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if head is None and embeds:
        vocab = {e.num_embeddings for e in embeds}
        head = next(
            (m for m in reversed(linears) if id(m.weight) in skip or m.out_features in vocab), None
        )
    if head is None and not embeds and len(linears) > 1:
        head = linears[-1]  # a one-Linear model's only layer is what the user means to mask
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        skip.add(id(head.weight))
    return skip


def dst_parameters(
    model: nn.Module, include: Optional[Sequence[str]], exclude: Sequence[str]
) -> list:
    """``[(name, parameter)]`` DST masks, in ``named_parameters`` order (see the module
    docstring)."""
    excluded = lambda name: any(fnmatch(name, pat) for pat in exclude)  # noqa: E731
    if include is not None:
        return [
            (n, p)
            for n, p in model.named_parameters()
            if p.dim() >= 2 and any(fnmatch(n, pat) for pat in include) and not excluded(n)
        ]
    skip = _head_and_embeddings(model)
    owner = {}
    for mod in model.modules():
        for attr, p in mod.named_parameters(recurse=False):
            owner.setdefault(id(p), (mod, attr))
    out = []
    for name, p in model.named_parameters():
        mod, attr = owner[id(p)]
        if id(p) in skip or excluded(name) or isinstance(mod, (nn.Embedding, *_CONV)):
            continue
        if (isinstance(mod, nn.Linear) and attr == "weight" and p.dim() == 2) or p.dim() >= 3:
            out.append((name, p))
    return out


@dataclass
class Target:
    """One masked parameter ``module.<attr>``, viewed as slices ``[S, R, C]``."""

    name: str
    module: nn.Module
    attr: str
    shape: tuple

    @classmethod
    def of(cls, model: nn.Module, name: str, p: torch.Tensor) -> Target:
        mod_name, _, attr = name.rpartition(".")
        shape = (1, *p.shape) if p.dim() == 2 else (p.shape[0], p.shape[1], math.prod(p.shape[2:]))
        return cls(name, model.get_submodule(mod_name), attr, shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def param(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def buf(self, kind: str) -> Optional[torch.Tensor]:
        return getattr(self.module, f"{self.attr}_{kind}", None)
