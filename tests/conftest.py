"""Shared fixtures: tiny configs and corpora so every training test runs in seconds on 2 CPU
cores."""

import importlib
import os

import pytest
import torch

# The repository root and tests/ are on sys.path through pyproject's ``[tool.pytest.ini_options]
# pythonpath``; nothing here changes process-wide state at import (a GPU run collects every test
# first).


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    """wandb prints banners unless told not to; per test, so no process state changes at
    collection."""
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Run Triton kernels through the interpreter on CPU tensors for this test only (kernels are
    jitted per interpret mode at first launch, kernels.launch), so GPU tests in the same run stay
    compiled."""
    if torch.cuda.is_available():
        # Triton picks interpreted or compiled when a function is decorated: inductor's module-level
        # ``@triton.jit`` helpers, first imported during an interpreted test, would stay interpreted
        # for the whole worker and break every later compiled flex kernel ("Unsupported function
        # referenced: InterpretedFunction"). Import them compiled first.
        importlib.import_module("torch._inductor.runtime.triton_helpers")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Each pytest-xdist worker gets its share of the cores for torch's intra-op threads (a
    configure hook, not test import: the worker's own process, before any test). By default every
    worker takes all of them: on a 16-core GPU box with 8 workers that is 128 threads on 16 cores,
    and the CPU tests run up to 2x their 2-core time (BENCHMARKS.md, Test suite on the GPU)."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(worker.get("workercount", 1))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # GPU tests last: the CPU tests that fork gloo ranks (helpers.spawn) then run before any
        # CUDA backward has started autograd's device threads, which a forked child cannot use.
        # stable: collection order within each group
        items.sort(key=lambda item: "gpu" in item.keywords)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A small text corpus: 36 python files copied from the running interpreter's stdlib.

    Documents are named relative to this folder, so the split is the same in every run: at the
    default data.val_fraction 0.05 the validation side is cmd.py (~15 KB), room for the passkey
    tests' haystacks.
    """
    import sysconfig

    src = sysconfig.get_paths()["stdlib"]
    names = [
        "textwrap.py",
        "shlex.py",
        "glob.py",
        "fnmatch.py",
        "heapq.py",
        "bisect.py",
        "colorsys.py",
        "keyword.py",
        "numbers.py",
        "operator.py",
        "queue.py",
        "sched.py",
        "string.py",
        "stat.py",
        "token.py",
        "tty.py",
        "uu.py",
        "wave.py",
        "abc.py",
        "copy.py",
        "getopt.py",
        "graphlib.py",
        "gettext.py",
        "linecache.py",
        "netrc.py",
        "ntpath.py",
        "posixpath.py",
        "pprint.py",
        "reprlib.py",
        "rlcompleter.py",
        "secrets.py",
        "shelve.py",
        "cmd.py",
        "symtable.py",
        "timeit.py",
        "types.py",
    ]
    d = tmp_path_factory.mktemp("corpus")
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f, open(d / n, "w") as g:
                g.write(f.read())
    return str(d)
