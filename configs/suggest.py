"""Every valid dotted key of the schema, and "did you mean ...?" for one that is not.

valid_keys()                  # ["name", "model.vocab_size", ..., "checkpoint.resume"]
suggest("train.stepz")        # "train.steps"
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing

from .config import Config


@functools.cache
def valid_keys(schema: type = Config) -> tuple[str, ...]:
    """Dotted paths of every leaf field (nested dataclass sections recursed; dict fields are
    leaves)."""
    out: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            out += [f"{f.name}.{k}" for k in valid_keys(hints[f.name])]
        else:
            out.append(f.name)
    return tuple(out)


def suggest(key: str) -> str | None:
    """The valid key closest to ``key``: first among keys with the same last name (a misplaced key:
    ``lr`` -> ``optim.lr``), else by spelling over the whole path (``trian.steps`` ->
    ``train.steps``)."""
    keys = valid_keys()
    last = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same_leaf:
        return difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)[0]
    # Sections too: an unknown section (``trian``) is reported without the key below it.
    sections = sorted({k.rsplit(".", 1)[0] for k in keys if "." in k})
    match = difflib.get_close_matches(key, list(keys) + sections, n=1, cutoff=0.6)
    return match[0] if match else None
