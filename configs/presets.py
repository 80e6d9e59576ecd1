"""Presets by name: ``--config tiny_dense`` finds ``zoo/tiny_dense.yaml`` wherever moezoo is
installed.

The preset folder is the zoo folder beside this package's own (``zoo/`` in a checkout,
``moezoo/zoo/`` in an installed wheel), found by path: configs imports no other moezoo package, and
importing zoo would import torch.
"""

from __future__ import annotations

import difflib
import glob
import os

from .errors import ConfigError


def presets_dir() -> str | None:
    d = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zoo")
    return d if os.path.isdir(d) else None


def preset_names() -> list[str]:
    d = presets_dir()
    return (
        sorted(
            os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(d, "*.yaml"))
        )
        if d
        else []
    )


def resolve_config_path(arg: str) -> str:
    """``arg`` itself when it is a file, else the shipped preset of that name (``tiny_dense`` or
    ``tiny_dense.yaml``); ConfigError naming ``--config`` with the closest preset otherwise."""
    if os.path.isfile(arg):
        return arg
    name = os.path.splitext(os.path.basename(arg))[0]
    names = preset_names()
    if name in names and os.path.dirname(arg) in ("", "zoo"):
        return os.path.join(presets_dir(), f"{name}.yaml")
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(
        "--config",
        f"file not found: {arg}, nor a preset of that name{hint}; presets: {', '.join(names)}",
    )
