"""The presets of the HF families have their published sizes (params counted on the meta device, as
``train.py --plan`` does): Qwen3-30B-A3B 30.5B / 3.3B, OLMoE-1B-7B 6.9B / 1.3B, DeepSeek-V3 671B /
37B."""

import pytest

from moezoo.configs import load_config
from moezoo.zoo.flops import attention_flops_per_token, param_counts


@pytest.mark.parametrize(
    "preset, total, active",
    [
        ("qwen3_moe_30b_a3b", 30.5e9, 3.3e9),
        ("olmoe_1b_7b", 6.9e9, 1.3e9),
        ("deepseek_v3_671b", 671e9, 37e9),
    ],
)
def test_preset_parameter_counts_match_the_published_ones_within_2_percent(preset, total, active):
    c = param_counts(load_config(f"zoo/{preset}.yaml").model)
    assert abs(c.total / total - 1) < 0.02 and abs(c.active / active - 1) < 0.02, (
        c.total,
        c.active,
    )


def test_mla_attention_flops_count_qk_and_v_head_dims_apart():
    cfg = load_config("zoo/deepseek_v3_671b.yaml").model
    assert attention_flops_per_token(cfg, 1) == 6.0 * 61 * 128 * (192 + 128)
