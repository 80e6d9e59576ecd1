"""Text corpora: the embedded default (this interpreter's standard library) or user files.

``data.source``:
- ``stdlib``: every ``.py`` file of the running interpreter's standard library (no site-packages);
  always present, so the first command needs no download.
- ``python_packages``: every installed package's ``.py`` files, one document per package
  (training.corpus_packages: deduplicated by content; the split keeps each package on one side).
- a ``.jsonl`` file (one JSON object a line, text in ``data.jsonl_field``);
- a text file, a directory (its files, recursively) or a glob.

Documents are split into train/val by a hash of their name, so the split is deterministic and does
not move when files are added. A file's name is its path relative to the source's root (the
directory, the glob's fixed prefix, the standard library), so the split does not move with the
corpus either: a corpus copied to another place (a fresh clone, a test's temporary directory) splits
the same way. A corpus of one document is split by tokens instead (training.data).

Files of a path source that are not UTF-8 text (a NUL byte or invalid UTF-8 in their first 8 KB:
images, archives, compiled files, text in another encoding) are skipped and counted
(``Corpus.skipped``); the built-in corpora are read as they are (four standard-library files are
encoding tests in latin-1 or KOI8-R). ``check_source`` is the check a run makes before importing
torch: the source exists.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import re
import sysconfig
from dataclasses import dataclass, field

from moezoo.configs import ConfigError, DataConfig

# data.source values that name a built-in corpus rather than a path
BUILTIN_SOURCES = ("stdlib", "python_packages")
NO_MATCH = "(a file, directory, glob, .jsonl, 'stdlib' or 'python_packages')"
SNIFF_BYTES = 8192  # how much of a file the text check reads


@dataclass
class Document:
    name: str
    text: str


@dataclass
class Corpus:
    documents: list[Document]
    skipped: list[str] = field(default_factory=list)  # names of files that are not UTF-8 text


def check_source(cfg: DataConfig) -> None:
    """ConfigError on ``data.source`` unless it is a built-in corpus, an existing path or a glob
    with a file match; and on ``data.tokenizer`` when it names no file. Reads no file."""
    src = cfg.source
    if src not in BUILTIN_SOURCES and not os.path.exists(src):
        if not any(os.path.isfile(f) for f in glob.iglob(src, recursive=True)):
            raise ConfigError("data.source", f"no file matches {src!r} {NO_MATCH}")
    if cfg.tokenizer and not os.path.isfile(cfg.tokenizer):
        raise ConfigError("data.tokenizer", f"file not found: {cfg.tokenizer}")


def is_text(head: bytes) -> bool:
    """Whether a file that starts with ``head`` reads as UTF-8 text: no NUL byte, and valid UTF-8
    (a multi-byte character cut at the end of ``head`` is fine)."""
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f)


def _source_files(source: str) -> list[str]:
    if source == "python_packages":
        return []  # documents come from training.corpus_packages (load_documents)
    if source == "stdlib":
        return _stdlib_files()
    if os.path.isdir(source):
        return sorted(
            f
            for f in glob.glob(os.path.join(source, "**", "*"), recursive=True)
            if os.path.isfile(f)
        )
    if os.path.isfile(source):
        return [source]
    files = sorted(f for f in glob.glob(source, recursive=True) if os.path.isfile(f))
    if not files:
        raise ConfigError("data.source", f"no file matches {source!r} {NO_MATCH}")
    return files


def _name_root(source: str) -> str:
    """The directory that document names are relative to: the stdlib, the directory, or a glob's
    fixed prefix."""
    if source == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    if os.path.isdir(source):
        return source
    if os.path.isfile(source):
        return os.path.dirname(source) or "."
    fixed = re.split(r"[*?\[]", source, maxsplit=1)[0]  # the path up to the first glob character
    return os.path.dirname(fixed) or "."


def _hash01(name: str) -> float:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def load_documents(cfg: DataConfig) -> list[Document]:
    """All documents of the corpus, in a fixed order (sorted by name hash, then capped by
    max_files)."""
    return read_corpus(cfg).documents


def read_corpus(cfg: DataConfig) -> Corpus:
    """The corpus's documents (as ``load_documents``) and the files skipped as not text."""
    docs: list[Document] = []
    skipped: list[str] = []
    sniff = cfg.source not in BUILTIN_SOURCES
    if cfg.source == "python_packages":
        from .corpus_packages import package_texts

        docs = [Document(name, text) for name, text in package_texts()]
    root = _name_root(cfg.source)
    for path in _source_files(cfg.source):
        name = os.path.relpath(path, root)
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(
                            "data.source", f"{path}:{i + 1}: invalid JSON ({e.msg})"
                        ) from None
                    if cfg.jsonl_field not in rec:
                        raise ConfigError(
                            "data.jsonl_field", f"{path}:{i + 1} has no field {cfg.jsonl_field!r}"
                        )
                    docs.append(Document(f"{name}:{i}", str(rec[cfg.jsonl_field])))
        else:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ConfigError("data.source", f"cannot read {path}: {e.strerror}") from None
            if sniff and not is_text(data[:SNIFF_BYTES]):
                skipped.append(name)
                continue
            # as text-mode open() reads it: universal newlines
            text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            docs.append(Document(name, text))
    docs = [d for d in docs if d.text.strip()]
    # Hash order mixes packages, so max_files picks a varied subset rather than the alphabetically
    # first.
    docs.sort(key=lambda d: _hash01(d.name))
    if cfg.max_files:
        docs = docs[: cfg.max_files]
    if not docs:
        why = f" ({len(skipped)} file(s) skipped: not UTF-8 text)" if skipped else ""
        raise ConfigError("data.source", f"corpus {cfg.source!r} is empty{why}")
    return Corpus(docs, sorted(skipped))


def split_documents(
    docs: list[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """(train, val) by name hash; both non-empty whenever there are at least two documents."""
    salt = "moezoo-val"
    val = [d for d in docs if _hash01(salt + d.name) < val_fraction]
    train = [d for d in docs if _hash01(salt + d.name) >= val_fraction]
    if not val:
        val, train = train[-1:], train[:-1]
    if not train:
        raise ConfigError("data.source", "corpus needs at least two documents (one for validation)")
    return train, val
