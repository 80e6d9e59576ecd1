"""The project speaks of itself as it is now: no tracked text file narrates the work periods of
its development (history lives in git)."""

import os
import re
import subprocess

import pytest

from helpers import ROOT

# the word is spelled in two parts so that this file does not match itself; pytest's fixture scope
# is the one use the project has for it
WORD = "sess" + "ion"
ALLOWED = re.compile(rf"""scope=["']{WORD}["']""")
PERIOD = re.compile(rf"\b{WORD}s?\b", re.IGNORECASE)


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = []
    for name in out.stdout.decode().split("\0"):
        path = os.path.join(ROOT, name)
        if not name or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            head = f.read(8192)
        if b"\0" not in head:  # text, not a picture or archive
            files.append(name)
    return files


def test_no_tracked_text_file_mentions_a_development_session():
    hits = []
    for name in _tracked_text_files():
        with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if PERIOD.search(ALLOWED.sub("", line)):
                    hits.append(f"{name}:{i}: {line.strip()[:120]}")
    assert not hits, "development history in the project (state what is true now):\n" + "\n".join(
        hits
    )
