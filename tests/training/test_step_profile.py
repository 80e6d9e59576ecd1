"""logging.profile_at: a profiled run writes its trace and op table and logs where the time went."""

import json
import os

import pytest

from helpers import tiny_overrides
from moezoo.configs import ConfigError, load_config
from moezoo.training.loop import Trainer
from moezoo.training.profile import format_summary, kind_of, summarize


def test_profiled_steps_write_trace_table_and_shares(tmp_path, corpus_dir):
    cfg = load_config(
        "zoo/tiny_moe.yaml",
        tiny_overrides(
            tmp_path,
            corpus_dir,
            **{
                "train.steps": 5,
                "train.eval_every": 5,
                "checkpoint.every": 0,
                "logging.profile_at": 2,
                "logging.profile_steps": 2,
            },
        ),
    )
    Trainer(cfg).fit()
    folder = os.path.join(cfg.out_dir, "profile")
    with open(os.path.join(folder, "trace_rank0.json")) as f:
        assert json.load(f)["traceEvents"]  # a trace Perfetto / chrome://tracing opens
    assert "aten::" in open(os.path.join(folder, "ops_rank0.txt")).read()
    rows = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    prof = [r for r in rows if "profile/step_ms" in r]
    assert len(prof) == 1 and prof[0]["step"] == 3  # logged once, at the last profiled step
    shares = {k: v for k, v in prof[0].items() if k.endswith("_share")}
    assert set(shares) == {
        f"profile/{k}_share" for k in ("matmul", "attention", "communication", "optimizer", "other")
    }
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["profile/matmul_share"] > 0 and shares["profile/communication_share"] == 0
    assert prof[0]["profile/kernels_per_step"] > 10 and prof[0]["profile/step_ms"] > 0


def test_kinds_from_kernel_names():
    assert kind_of("ncclDevKernel_AllToAll_RING") == "communication"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert (
        kind_of("flash_fwd_kernel") == "attention"
        and kind_of("aten::_scaled_dot_product_flash_attention") == "attention"
    )
    assert (
        kind_of("void at::native::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>")
        == "optimizer"
    )
    assert kind_of("triton_poi_fused_add_mul_0") == "other"
    out = summarize([("aten::mm", 300.0, 4), ("aten::add", 100.0, 6)], steps=2, wall_s=0.01)
    assert (
        out["profile/matmul_share"] == 0.75
        and out["profile/kernels_per_step"] == 5
        and out["profile/step_ms"] == 5
    )
    assert format_summary(out, on_gpu=False) == (
        "5.0 ms a step, communication 0%, attention 0%, matmul 75%, "
        "optimizer 0%, other 25%; 5 ops a step"
    )


def test_gpu_scopes_are_not_counted_as_kernels():
    # a record_function scope on the GPU timeline spans kernels that are listed themselves
    from types import SimpleNamespace as E

    from moezoo.training.profile import _device_events

    events = [
        E(
            key="void multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            self_device_time_total=29.0,
            device_type="DeviceType.CUDA",
            count=2,
            is_user_annotation=False,
        ),
        E(
            key="Optimizer.step#AdamW.step",
            self_device_time_total=29.0,
            device_type="DeviceType.CUDA",
            count=1,
            is_user_annotation=True,
        ),
        E(
            key="aten::_fused_adamw_",
            self_device_time_total=29.0,
            device_type="DeviceType.CPU",
            count=1,
            self_cpu_time_total=3.0,
        ),
    ]
    rows = _device_events(E(key_averages=lambda: events), on_gpu=True)
    assert rows == [("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 29.0, 2)]


def test_device_gaps_are_the_idle_time_between_device_work_of_overlapping_streams():
    from types import SimpleNamespace as E

    from moezoo.training.profile import device_gaps, format_summary, summarize

    def ev(key, start, end, dev="DeviceType.CUDA", scope=False):
        return E(
            key=key, device_type=dev, is_user_annotation=scope, time_range=E(start=start, end=end)
        )

    events = [
        ev("gemm", 0, 100),
        ev("copy", 50, 130),  # a second stream overlaps the first
        ev("aten::mm", 10, 400, dev="DeviceType.CPU"),  # host ops are not device work
        ev("Optimizer.step#AdamW.step", 0, 1000, scope=True),
        ev("adam", 150, 200),
        ev("swiglu", 700, 710),
        ev("zero", 710, 710),
    ]
    span, idle, gaps = device_gaps(events, top=2)
    assert (span, idle) == (710, 20 + 500)
    assert gaps == [(500, "adam", "swiglu"), (20, "copy", "adam")]
    assert device_gaps([]) == (0.0, 0.0, [])
    out = summarize([("gemm", 300.0, 4)], steps=2, wall_s=0.01) | {"profile/idle_ms": 1.25}
    assert format_summary(out).endswith("; 2 kernels a step, the device idle 1.2 ms a step")


@pytest.mark.parametrize("key,value", [("profile_at", -1), ("profile_steps", 0)])
def test_bad_profile_settings_name_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"logging\.{key}"):
        load_config("zoo/tiny_dense.yaml", [f"logging.{key}={value}"])
