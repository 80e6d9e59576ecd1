"""One import name: moezoo installs the top-level package ``moezoo`` alone, and its checkout's root
folders (layers/, kernels/, zoo/, configs/, training/) never shadow, nor are shadowed by, packages
of those names: Hugging Face's ``kernels`` (which transformers requires), a user's own ``training``
or ``configs``."""

import os
import subprocess
import sys
import zipfile

import pytest

from helpers import ROOT, subprocess_env, tiny_overrides

SUBPACKAGES = ("layers", "kernels", "zoo", "configs", "training")


def _python(code, cwd, **env):
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _own_packages(where, names):
    """A package of each name under ``where`` whose ``ORIGIN`` says it is the user's."""
    for name in names:
        os.makedirs(where / name)
        (where / name / "__init__.py").write_text(f"ORIGIN = 'user:{name}'\n")


def test_no_root_folder_is_a_regular_package():
    # a root folder with an __init__.py would win over an installed package of its name from the
    # root
    assert [n for n in SUBPACKAGES if os.path.exists(os.path.join(ROOT, n, "__init__.py"))] == []


def test_installed_packages_of_the_root_folders_names_win_from_the_checkout_root(tmp_path):
    # as a run from the root sees it: the root first on sys.path, site-packages (here: tmp_path)
    # after it
    _own_packages(tmp_path, SUBPACKAGES)
    code = (
        "import moezoo.layers, moezoo.training, moezoo.configs, moezoo.zoo, moezoo.kernels\n"
        f"import {', '.join(SUBPACKAGES)}\n"
        f"print(*[m.ORIGIN for m in ({', '.join(SUBPACKAGES)})])"
    )
    # the caller's PYTHONPATH stays last: a GPU box's ``pip --target`` dependencies live there
    path = [ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]
    out = _python(code, ROOT, PYTHONPATH=os.pathsep.join(p for p in path if p))
    assert out.split() == [f"user:{n}" for n in SUBPACKAGES]


def test_moezoo_layers_import_beside_a_users_own_packages(tmp_path):
    _own_packages(tmp_path, ("configs", "training", "layers", "zoo"))
    code = (
        "from moezoo.layers import MoE, Attention, SparsityPattern, RotaryEmbedding, "
        "DynamicSparsity\n"
        "import training, configs\n"
        "print(training.ORIGIN, configs.ORIGIN, MoE.__module__)"
    )
    assert _python(code, tmp_path).split() == [
        "user:training",
        "user:configs",
        "moezoo.layers.moe.layer",
    ]


def test_transformers_imports_from_the_checkout_root_after_moezoo():
    pytest.importorskip("transformers")
    code = (
        "import moezoo.layers, transformers\n"
        "from transformers import LlamaConfig, AutoModelForCausalLM\n"
        "print(LlamaConfig.__module__)"
    )
    assert "transformers" in _python(code, ROOT)


def test_old_top_level_names_are_not_importable_outside_the_checkout(tmp_path):
    code = (
        "import importlib\n"
        "for n in ('layers', 'kernels', 'zoo', 'configs', 'training'):\n"
        "    try:\n"
        "        importlib.import_module(n + '.__nothing__')\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(e.name)\n"
    )
    # each fails at its top-level name (no shim package of the old names exists), or at the
    # submodule when an unrelated installed distribution owns the name (Hugging Face's kernels)
    names = _python(code, tmp_path, PYTHONPATH="").split()
    assert len(names) == len(SUBPACKAGES)
    assert all(n.split(".")[0] in SUBPACKAGES for n in names)


@pytest.mark.slow
def test_wheel_holds_one_top_level_package_and_its_script_trains_anywhere(tmp_path, corpus_dir):
    pytest.importorskip("hatchling")
    dist = tmp_path / "dist"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("moezoo-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"moezoo", next(t for t in tops if t.endswith(".dist-info"))}
    names = zipfile.ZipFile(wheel).namelist()
    assert "moezoo/zoo/tiny_dense.yaml" in names and "moezoo/layers/moe/layer.py" in names

    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_SILENT": "true"}
    ov = tiny_overrides(
        tmp_path, corpus_dir, **{"train.steps": 2, "train.eval_every": 2, "checkpoint.every": 2}
    )
    r = subprocess.run(
        [str(site / "bin" / "moezoo-train"), "--config", "tiny_dense", *ov],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "done: 2 steps" in r.stdout
    loaded = subprocess.run(
        [sys.executable, "-c", "import moezoo.zoo; print(moezoo.zoo.__file__)"],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.stdout.strip().startswith(str(site)), loaded.stderr[-2000:]
