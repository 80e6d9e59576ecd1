"""Optional dependencies (issue 51, finding 8): on a CPU machine Triton (999 MB) was installed
though the README calls it optional, and ``export --hf`` failed with a traceback without
transformers, which only ``[dev]`` installed. Triton is in the ``gpu`` and ``dev`` extras only,
transformers in ``hf`` (and ``dev``); a command that needs a missing extra says which, in one line,
and exits 2 before any work."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_triton_and_transformers_are_extras_not_base_dependencies():
    project = pyproject()
    base, extras = names(project["dependencies"]), project["optional-dependencies"]
    assert "triton" not in base and "transformers" not in base
    assert names(extras["hf"]) == {"transformers"}
    # dev: the CPU interpreter tests need triton, the HF tests transformers (through moezoo[hf])
    assert "moezoo[hf]" in extras["dev"] and "triton" in names(extras["dev"])
    assert "triton" in names(extras["gpu"])


def run_without_transformers(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in which ``import transformers`` fails as if absent."""
    hide = "import sys; sys.modules['transformers'] = None; "
    return subprocess.run(
        [sys.executable, "-c", hide + code, *args],
        cwd=ROOT,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_hf_without_transformers_names_the_extra_in_one_line(tmp_path):
    r = run_without_transformers(
        "from moezoo.training.export import main; rc = main(sys.argv[1:]); "
        "print(rc, 'torch' in sys.modules)",
        "--run",
        str(tmp_path / "no_run_needed"),
        "--hf",
        str(tmp_path / "out"),
    )
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert r.stderr == "error: --hf: needs transformers: pip install 'moezoo[hf]'\n"


def test_init_from_without_transformers_names_the_extra_before_torch(tmp_path):
    r = run_without_transformers(
        "from moezoo.training.cli import main; rc = main(sys.argv[1:]); "
        "print(rc, 'torch' in sys.modules)",
        "--config",
        "tiny_dense",
        f"model.init_from={tmp_path}",
        f"train.out_dir={tmp_path}/out",
    )
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert r.stderr == "error: model.init_from: needs transformers: pip install 'moezoo[hf]'\n"


def test_to_hf_without_transformers_raises_an_import_error_naming_the_extra():
    r = run_without_transformers(
        "from moezoo.configs import ConfigError, load_config\n"
        "from moezoo.zoo import build_model\n"
        "from moezoo.zoo.hf import to_hf\n"
        "model = build_model(load_config('zoo/tiny_dense.yaml').model)\n"
        "try:\n"
        "    to_hf(model)\n"
        "except ImportError as e:\n"
        "    print(isinstance(e, ConfigError), e)\n"
    )
    assert r.stdout == "True zoo.hf.to_hf: needs transformers: pip install 'moezoo[hf]'\n", r.stderr
