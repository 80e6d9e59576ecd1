"""YAML -> typed Config, with includes and dotted command-line overrides (OmegaConf structured
configs).

    cfg = load_config("zoo/tiny_dense.yaml", overrides=["model.n_layers=2", "train.steps=50"])

A YAML file may start with ``include: [other.yaml, ...]`` (paths relative to the file); included
files merge first, the file itself next, overrides last. Any failure raises ConfigError naming the
key.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterable
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import Config
from .errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently,
    so two ``train:`` sections would merge into one without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: str, seen: tuple = ()) -> list:
    """The file's includes (depth first) followed by the file itself, as plain dicts."""
    if not os.path.isfile(path):
        raise ConfigError("--config" if not seen else "include", f"file not found: {path}")
    if path in seen:
        raise ConfigError("include", f"include cycle through {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise ConfigError(path, "not a YAML text file (not UTF-8)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(path, f"invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None or data == {}:
        # An empty file would silently train the defaults (LLaMA-7B).
        raise ConfigError(
            path, "is empty; a config needs at least one section (model:, train:, ...)"
        )
    if not isinstance(data, dict):
        raise ConfigError(path, "top level must be a mapping of sections")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(
            "include", f"in {path} must be a file name or a list of file names, got {includes!r}"
        )
    _check_sections(data, Config, "")
    layers = []
    for inc in includes:
        layers += _read_yaml(os.path.join(os.path.dirname(path), inc), seen + (path,))
    return layers + [data]


def _check_sections(data: dict, cls, prefix: str) -> None:
    """A key naming a section (a nested config dataclass) must hold a mapping: ``model: 5``
    otherwise reaches OmegaConf as "int is not a subclass of ModelConfig", without the key."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        sub = hints.get(key)
        if not (isinstance(sub, type) and dataclasses.is_dataclass(sub)):
            continue
        if isinstance(value, dict):
            _check_sections(value, sub, f"{prefix}{key}.")
        elif value is not None:
            raise ConfigError(
                f"{prefix}{key}",
                f"is a section (keys of {sub.__name__}), got {type(value).__name__} {value!r}",
            )


def _omegaconf_error(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0].strip()
    if "Key '" in msg and "not in" in msg:
        from .suggest import suggest

        close = suggest(key)
        msg = f"unknown key (did you mean {close}?)" if close else "unknown key"
    return ConfigError(key, msg)


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Load, merge, override and validate. ``path=None`` gives the defaults."""
    layers = _read_yaml(path) if path else []
    try:
        cfg = OmegaConf.structured(Config)
        for layer in layers:
            cfg = OmegaConf.merge(cfg, layer)
        for ov in overrides:
            k, eq, v = ov.partition("=")
            if not eq or not k.strip():
                raise ConfigError(ov, "override must look like section.key=value")
            try:
                node = OmegaConf.from_dotlist([f"{k.strip()}={v}"])
            except yaml.YAMLError as e:  # the value is parsed as YAML: "[1" or "{a: b" fail here
                raise ConfigError(
                    k.strip(), f"invalid value {v!r}: {getattr(e, 'problem', e)}"
                ) from None
            _check_sections(OmegaConf.to_container(node), Config, "")
            cfg = OmegaConf.merge(cfg, node)
        obj: Config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None
    if path and obj.name == "run":
        obj.name = os.path.splitext(os.path.basename(path))[0]
    return obj.validate()


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of the resolved config (for YAML beside checkpoints and wandb.init)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
