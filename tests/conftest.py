"""Shared fixtures: tiny configs and corpora so every training test runs in seconds on 2 CPU cores."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A small text corpus: 40 stdlib-like python files written from the running interpreter's stdlib."""
    import sysconfig
    src = sysconfig.get_paths()["stdlib"]
    names = ["textwrap.py", "shlex.py", "glob.py", "fnmatch.py", "heapq.py", "bisect.py", "colorsys.py",
             "keyword.py", "numbers.py", "operator.py", "queue.py", "sched.py", "string.py", "stat.py",
             "token.py", "tty.py", "uu.py", "wave.py", "abc.py", "copy.py", "getopt.py", "graphlib.py",
             "gettext.py", "linecache.py", "netrc.py", "ntpath.py", "posixpath.py", "pprint.py", "reprlib.py",
             "rlcompleter.py", "secrets.py", "shelve.py", "struct.py", "symtable.py", "timeit.py", "types.py"]
    d = tmp_path_factory.mktemp("corpus")
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f, open(d / n, "w") as g:
                g.write(f.read())
    return str(d)


def tiny_overrides(tmp, corpus, **extra) -> list[str]:
    """Overrides that make any preset a ~30k-parameter model training on ``corpus`` under ``tmp``."""
    ov = {
        "model.vocab_size": 512, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_hidden": 64, "model.max_seq_len": 64, "data.source": corpus, "data.cache_dir": f"{tmp}/cache",
        "data.max_files": 0, "train.seq_len": 32, "train.batch_size": 4, "train.steps": 20, "train.eval_every": 10,
        "train.eval_batches": 2, "train.out_dir": f"{tmp}/run", "logging.wandb": "disabled", "logging.log_every": 5,
        "logging.progress": False, "logging.plots": False, "optim.warmup_steps": 2, "optim.lr": 3e-3, "checkpoint.every": 10,
    }
    ov.update(extra)
    return [f"{k}={v}" for k, v in ov.items()]


def spawn(fn, world: int, *args) -> None:
    """Fork ``world`` CPU ranks joined in a gloo process group; each runs ``fn(rank, world, *args)``.
    The one process-spawn helper of the multi-process tests."""
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_spawn_entry, args=(fn, world, os.path.join(d, "store"), args), nprocs=world,
                           join=True, start_method="fork")


def _spawn_entry(rank, fn, world, store, args):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
