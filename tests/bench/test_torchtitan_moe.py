"""bench/torchtitan_moe.py on CPU at its smoke shapes, our two precision layouts only (torchtitan is
a GPU-image dependency): both build the same model, train, and start from the same loss."""

import json
import math
import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_ours_and_ours_bf16_train_the_same_model(tmp_path):
    out = tmp_path / "titan.json"
    cmd = [
        sys.executable,
        "bench/torchtitan_moe.py",
        "--smoke",
        "--device",
        "cpu",
        "--only",
        "ours,ours_bf16",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-compile",
        "--out",
        str(out),
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    a, b = res["ours"], res["ours_bf16"]
    assert a["params"] == b["params"] and len(a["losses"]) == len(b["losses"]) == 3
    # the same init and batch: float32 (ours on CPU) and bf16 matmuls (ours_bf16) agree to bf16
    # rounding at step 1
    assert abs(a["losses"][0] - b["losses"][0]) < 1e-2 * a["losses"][0], (a["losses"], b["losses"])
    assert all(math.isfinite(v) for v in a["losses"] + b["losses"])
    # the last step's routing load per MoE layer: the busiest expert's rows over the mean (>= 1)
    assert len(a["expert_load_max_over_mean"]) == res["args"]["layers"]
    assert all(v >= 1.0 for v in a["expert_load_max_over_mean"])
    # ours fed as train.py feeds it
    assert a["batch_copy"] == b["batch_copy"] == "moezoo.kernels.launch.to_device"
