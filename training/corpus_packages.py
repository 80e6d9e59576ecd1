"""``data.source: python_packages``: the ``.py`` files of every installed Python package, no
download.

One document per package (a top-level import name in a site-packages directory of the running
interpreter, or a ``site-packages`` / ``dist-packages`` entry of ``sys.path``): its ``.py`` files in
path order, each preceded by a ``# file: <path>`` line. Every file counts once in the whole corpus:
files are deduplicated by a hash of their content (vendored copies, identical ``__init__.py``
stubs), the first package in name order keeping it. A package found in two directories is read from
the first (import order). Documents are named by the package, so training.corpus's name-hash split
puts each package wholly in train or in validation, never in both.
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig

SOURCE = "python_packages"
_SKIP_SUFFIXES = (".dist-info", ".egg-info", ".data")


def site_dirs() -> list[str]:
    """The interpreter's site-packages directories, in import order, each once."""
    paths = sysconfig.get_paths()
    cands = [
        p
        for p in sys.path
        if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")
    ]
    cands += [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    out: list[str] = []
    for p in cands:
        p = os.path.realpath(p)
        if os.path.isdir(p) and p not in out:
            out.append(p)
    return out


def _package_files(site_dir: str) -> dict[str, list[str]]:
    """{package name: its .py files, sorted} for the top-level packages and modules of one
    directory."""
    out: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(site_dir)):
        path = os.path.join(site_dir, entry)
        if entry.startswith(".") or entry == "__pycache__" or entry.endswith(_SKIP_SUFFIXES):
            continue
        if os.path.isdir(path):
            files = sorted(
                os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")
            )
            if files:
                out[entry] = files
        elif entry.endswith(".py"):
            out[entry[:-3]] = [path]
    return out


def package_texts(dirs: list[str] | None = None) -> list[tuple[str, str]]:
    """[(package name, text)] over ``dirs`` (default ``site_dirs()``), sorted by name, files
    deduplicated."""
    packages: dict[str, tuple[str, list[str]]] = {}
    for d in dirs if dirs is not None else site_dirs():
        for name, files in _package_files(d).items():
            packages.setdefault(name, (d, files))
    seen: set[bytes] = set()
    out = []
    for name in sorted(packages):
        root, files = packages[name]
        parts = []
        for path in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue  # a broken link or unreadable file: not part of the corpus
            digest = hashlib.sha1(data).digest()
            if digest in seen or not data.strip():
                continue
            seen.add(digest)
            parts.append(
                f"# file: {os.path.relpath(path, root)}\n" + data.decode("utf-8", errors="replace")
            )
        if parts:
            out.append((name, "\n".join(parts)))
    return out
