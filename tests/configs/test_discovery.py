"""Config discovery: --print-config, did-you-mean for unknown keys, presets by name, a torch-free
CLI start."""

import os
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, subprocess_env
from moezoo.configs import ConfigError, load_config, to_dict
from moezoo.configs.presets import resolve_config_path
from moezoo.configs.suggest import suggest, valid_keys
from moezoo.training.cli import main


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in valid_keys():
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_print_config_prints_every_key_and_reloads_to_the_same_config(tmp_path, capsys):
    assert main(["--config", "tiny_moe", "train.steps=7", "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = yaml.safe_load(text)
    assert set(_flat(printed)) == set(valid_keys())
    # an override and a default
    assert printed["train"]["steps"] == 7 and printed["optim"]["beta2"] == 0.95
    (tmp_path / "resolved.yaml").write_text(text)
    assert to_dict(load_config(str(tmp_path / "resolved.yaml"))) == to_dict(
        load_config("zoo/tiny_moe.yaml", ["train.steps=7"])
    )


@pytest.mark.parametrize(
    "bad,close",
    [
        ("train.stepz", "train.steps"),
        ("lr", "optim.lr"),
        ("model.moe.topk", "model.moe.top_k"),
        ("trian.steps", "train"),
        ("data.sorce", "data.source"),
    ],
)
def test_unknown_key_suggests_the_closest_valid_key(bad, close):
    with pytest.raises(ConfigError, match=f"unknown key \\(did you mean {close}\\?\\)"):
        load_config("zoo/tiny_dense.yaml", [f"{bad}=1"])


def test_no_suggestion_for_a_key_unlike_any():
    assert suggest("zzzzqqq") is None


def test_presets_resolve_by_name_from_any_directory(tmp_path):
    assert resolve_config_path("tiny_dense") == os.path.join(ROOT, "zoo", "tiny_dense.yaml")
    with pytest.raises(ConfigError, match="did you mean tiny_dense"):
        resolve_config_path("tiny_dens")
    # As the installed moezoo-train runs it: another working directory, training.cli:main.
    code = (
        "import sys; from moezoo.training.cli import main; "
        "sys.exit(main(['--config', 'tiny_dense', '--print-config']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["name"] == "tiny_dense", r.stderr


def test_help_and_config_errors_do_not_import_torch():
    code = (
        "import sys; from moezoo.training.cli import main; "
        "rc = main(['--config', 'tiny_dense', 'train.stepz=1']);"
        "print('torch' in sys.modules, rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.stdout.split() == ["False", "2"], r.stderr
    assert "train.stepz: unknown key (did you mean train.steps?)" in r.stderr
