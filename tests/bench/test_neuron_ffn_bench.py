"""bench/neuron_ffn.py on CPU at its tiny shape: the sparse grouped path's check against the float32
loop runs and every eager contender is timed (the CUDA-graph contenders are CUDA-only)."""

import json
import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_tiny_shape_checks_and_times_every_eager_contender(tmp_path):
    out = tmp_path / "neuron.json"
    cmd = [
        sys.executable,
        "bench/neuron_ffn.py",
        "--shapes",
        "tiny",
        "--reps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["shapes"]["tiny"]
    assert res["within_2x_torch"], res["rel_err"]
    assert set(res["ms"]) == {
        f"{k}{q}" for k in ("dense", "neuron_sparse", "neuron_dense") for q in ("", "_queued")
    }
    assert res["speedup_vs_dense"]["dense"] == 1.0
