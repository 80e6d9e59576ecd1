"""Reading checkpoint files without running code from them.

A checkpoint directory may come from someone else, and ``pickle`` executes whatever a file asks for.
So:

- small files are JSON, or ``torch.save`` of tensors and plain numbers read back with
  ``torch.load(weights_only=True)`` (``load_tensors``);
- DCP's ``.metadata`` is a pickle of its own dataclasses: ``SafeReader`` unpickles it with an
  allowlist of exactly those classes (plus ``torch.Size``, dtypes, paths), refusing any other
  global;
- DCP would ``torch.load(weights_only=False)`` every non-tensor entry: our DCP state holds only
  tensors, so ``SafeLoadPlanner`` refuses such an entry outright.

Every refusal is an ``UnsafeCheckpoint`` (a ConfigError: one line, exit 2) naming the file and what
it asked for. ``trust=True`` (``--trust-checkpoint``) lifts the allowlists, for files the user
vouches for.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from moezoo.configs import ConfigError

TRUST_HINT = (
    "pass --trust-checkpoint only if you trust whoever wrote it (the file can then run code)"
)


class CheckpointError(ConfigError):
    """A checkpoint file that cannot be used: ``<file>: <what is wrong>``."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file asks to run or import something a checkpoint never needs."""


def _allowed_global(module: str, name: str):
    """The object a DCP ``.metadata`` pickle may reference, or None."""
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        # Its own dataclasses and enums: no functions, nothing it merely imported.
        return obj if isinstance(obj, type) and obj.__module__ == module else None
    if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # maps a layout name to torch.strided & co.
    if module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if module == "pathlib" and name in (
        "Path",
        "PosixPath",
        "PurePosixPath",
        "WindowsPath",
        "PureWindowsPath",
    ):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        obj = _allowed_global(module, name)
        if obj is None:
            raise UnsafeCheckpoint(
                self.path,
                f"refused to unpickle {module}.{name}, which DCP metadata never "
                f"holds; {TRUST_HINT}",
            )
        return obj


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    # torch's messages go on for a paragraph; the first sentence says what happened.
    return f"{type(e).__name__}: {text[0].split('. ')[0]}" if text else type(e).__name__


def load_dcp_metadata(path: str, trust: bool = False):
    """The ``Metadata`` of a DCP checkpoint file, through the allowlist unless ``trust``."""
    try:
        with open(path, "rb") as f:
            md = pickle.load(f) if trust else _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    except Exception as e:  # garbage or truncated bytes: any unpickling error
        raise CheckpointError(path, f"not a DCP metadata file ({_first_line(e)})") from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise CheckpointError(path, f"holds a {type(md).__name__}, not DCP metadata")
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` goes through ``load_dcp_metadata``."""

    def __init__(self, path: str, trust: bool = False):
        super().__init__(path)
        self.trust = trust

    def read_metadata(self, *args, **kwargs):
        # per-rank metadata files exist only in newer torch; ours is the global one
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        md = load_dcp_metadata(os.path.join(str(self.path), name), self.trust)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that will not unpickle a non-tensor entry (ours are all tensors)."""

    def __init__(self, path: str, trust: bool = False):
        super().__init__()
        self.path, self.trust = path, trust

    def load_bytes(self, read_item, value) -> None:
        if not self.trust:
            raise UnsafeCheckpoint(
                self.path,
                f"entry {read_item.dest_index.fqn} is a pickled object where a "
                f"tensor belongs; {TRUST_HINT}",
            )
        super().load_bytes(read_item, value)


def load_tensors(path: str, trust: bool = False):
    """``torch.load`` of a file of tensors and plain containers/numbers (``weights_only`` unless
    ``trust``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            m = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = m.group(1) if m else "a Python object"
            raise UnsafeCheckpoint(
                path,
                f"refused to unpickle {what}: it holds more than tensors and numbers; {TRUST_HINT}",
            ) from None
        raise CheckpointError(path, f"damaged ({_first_line(e)})") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    except Exception as e:  # truncated zip archive, bad magic number, ...
        raise CheckpointError(path, f"damaged ({_first_line(e)})") from None
