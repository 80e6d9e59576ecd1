"""The README's commands work in sequence on one machine, as a new user runs them: every
``python train.py`` and ``python -m moezoo.training.*`` command of its bash blocks, in order, then
the quickstart once more (issue 51, finding 1: after the quickstart every other documented command
exited 2 on a run folder holding another run's checkpoints).

They run in a temporary folder holding the checkout's ``train.py`` and ``zoo/`` (links) and the
files the commands name (a text file, a folder of markdown notes, a jsonl file: stdlib sources).
Each command is split as the shell would (shlex) and run in this process. A ``train.py`` command
that starts a run gets tiny overrides for the keys it does not set (a ~30k-parameter model, 4
steps); one that sets ``train.steps`` has it divided by 150 (tiny_dense's 600 steps -> 4); a
``--resume`` command gets nothing else: the checkpoint's config is its base.
"""

import importlib
import json
import os
import re
import shlex

import pytest

from helpers import ROOT, tiny_overrides

pytest.importorskip("transformers")  # export --hf and model.init_from

STEP_SCALE = 150
# helpers.tiny_overrides' model and batch, without its folders and corpus (the commands name them)
TINY = {
    k: v
    for k, v in (o.split("=", 1) for o in tiny_overrides("", ""))
    if k not in ("train.out_dir", "data.source", "data.cache_dir")
}
TINY.update(
    {
        "data.max_files": 20,
        "train.steps": 4,
        "train.eval_every": 2,
        "train.eval_batches": 1,
        "checkpoint.every": 0,
        "logging.log_every": 1,
    }
)
RUNNERS = ("python train.py", "python -m moezoo.training.")


def readme_commands() -> list[str]:
    """The runnable commands of the README's bash blocks in order (one line may chain several with
    ``&&``: the venv and pip steps are left out)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    parts = [p.strip() for block in blocks for line in block.splitlines() for p in line.split("&&")]
    return [p for p in parts if p.startswith(RUNNERS)]


def tiny(argv: list[str]) -> list[str]:
    """``train.py``'s arguments with the tiny overrides (see the module docstring)."""
    keys = {a.split("=", 1)[0] for a in argv if "=" in a}
    argv = [
        f"train.steps={int(a.split('=', 1)[1]) // STEP_SCALE}"
        if a.startswith("train.steps=")
        else a
        for a in argv
    ]
    if "--resume" in argv:
        return argv
    return argv + [f"{k}={v}" for k, v in TINY.items() if k not in keys]


def run_command(cmd: str) -> int:
    argv = shlex.split(cmd, comments=True)
    assert argv[0] == "python", cmd
    if argv[1] == "train.py":
        from moezoo.training.cli import main

        return main(tiny(argv[2:]))
    assert argv[1] == "-m", cmd
    return importlib.import_module(argv[2]).main(argv[3:])


def test_the_readme_documents_a_runs_whole_life():
    cmds = readme_commands()
    assert cmds[0] == "python train.py --config zoo/tiny_dense.yaml", cmds  # the quickstart
    sources = [c for c in cmds if "data.source=" in c]
    assert len(sources) == 3 and any(".jsonl" in c for c in sources), cmds
    for needle in ("training.generate", "training.export", "model.init_from=", "--resume"):
        assert any(needle in c for c in cmds), (needle, cmds)
    assert any("--resume" in c and "train.steps=" in c for c in cmds), cmds


def _user_files(folder, corpus_dir) -> None:
    """The files the README's commands name, from 12 of the test corpus' stdlib sources."""
    texts = []
    for name in sorted(os.listdir(corpus_dir))[:12]:
        with open(os.path.join(corpus_dir, name)) as f:
            texts.append(f.read())
    with open(os.path.join(folder, "shakespeare.txt"), "w") as f:
        f.write("\n".join(texts))
    for i, text in enumerate(texts):
        sub = os.path.join(folder, "notes", f"part{i % 3}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"note{i}.md"), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in texts)


def test_readme_commands_run_in_sequence(tmp_path, corpus_dir, monkeypatch, capfd):
    for name in ("train.py", "zoo"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    _user_files(tmp_path, corpus_dir)
    monkeypatch.chdir(tmp_path)
    cmds = readme_commands()
    runs = 0
    for cmd in cmds + cmds[:1]:  # the quickstart again at the end
        rc = run_command(cmd)
        out, err = capfd.readouterr()
        assert rc == 0, (cmd, out[-2000:], err[-2000:])
        assert "deprecat" not in (out + err).lower(), (cmd, out, err)
        if cmd.startswith("python train.py"):
            first = out.splitlines()[0]
            if "--resume" in cmd:
                assert first == f"run folder runs/tiny_dense/{runs} (resuming)", (cmd, first)
                resumed = runs
            else:
                runs += 1
                assert first.startswith(f"run folder runs/tiny_dense/{runs} (new;"), (cmd, first)
    assert runs == 6 and sorted(os.listdir("runs/tiny_dense")) == [str(n) for n in range(1, 7)]
    # the extension (4 -> 8 steps) continued from the lr the run had reached, never above it
    with open(f"runs/tiny_dense/{resumed}/metrics.jsonl") as f:
        lrs = {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    assert sorted(lrs) == list(range(1, 9))
    assert max(lrs[s] for s in range(5, 9)) <= lrs[4]
