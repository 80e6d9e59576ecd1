"""Top-1 routing with a renormalising router: refused for a run (its one weight is always 1.0, so
the router gets no gradient from the loss), still imported from HF (which computes that same 1.0)
with exact logits."""

import os
import subprocess
import sys

import pytest

from helpers import HF_BASE, ROOT, assert_same_logits, randomize_, subprocess_env, tiny_hf
from moezoo.configs import ConfigError, load_config


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.moe.top_k=1"],  # softmax: top-1 then softmax of one
        ["model.moe.top_k=1", "model.moe.softmax_before_topk=true"],  # p / p
        ["model.moe.top_k=1", "model.moe.router=noisy_topk"],
        ["model.moe.top_k=1", "model.moe.router=sigmoid"],  # s / s
        # one MoE layer is enough
        ["model.ffn=dense", "model.ffn_layers={'1': moe}", "model.moe.top_k=1"],
    ],
)
def test_top1_with_a_renormalising_router_is_one_config_error_naming_top_k(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("zoo/tiny_moe.yaml", overrides)
    msg = str(e.value)
    assert e.value.key == "model.moe.top_k" and "\n" not in msg
    assert "router: switch" in msg and "norm_topk: false" in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.moe.top_k=1", "model.moe.router=switch"],
        ["model.moe.top_k=1", "model.moe.norm_topk=false"],
        ["model.moe.top_k=1", "model.moe.norm_topk=false", "model.moe.softmax_before_topk=true"],
        ["model.moe.top_k=1", "model.moe.router=sigmoid", "model.moe.norm_topk=false"],
        ["model.moe.top_k=2"],
        ["model.ffn=dense", "model.moe.top_k=1"],  # no MoE layer: moe is not read
    ],
)
def test_top1_routers_that_train_load(overrides):
    assert load_config("zoo/tiny_moe.yaml", overrides).model.moe.top_k in (1, 2)


def test_train_cli_refuses_top1_softmax_in_one_line_before_any_work():
    # --print-config: the config is loaded (and refused) first; were it not, the test would not
    # train
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            "zoo/tiny_moe.yaml",
            "model.moe.top_k=1",
            "--print-config",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith("error: model.moe.top_k: top_k=1 with router=softmax")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_top1_renormalised_models_import_with_the_same_logits(family):
    """HF's num_experts_per_tok=1 with norm_topk_prob (Mixtral always renormalises) is a constant
    weight 1.0 there too: the import describes a function, not a run, and must match it exactly."""
    transformers = pytest.importorskip("transformers")
    from moezoo.zoo.hf import from_hf

    if family == "mixtral":  # not one of helpers.HF_FAMILIES
        hf = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**HF_BASE, num_local_experts=4, num_experts_per_tok=1)
        ).eval()
        randomize_(hf, 8)
    else:
        hf = tiny_hf("qwen3_moe", seed=8, num_experts_per_tok=1, norm_topk_prob=True)
    model = from_hf(hf, moe_backend="torch")
    m = model.cfg.moe
    assert (m.top_k, m.router, m.norm_topk) == (1, "softmax", True)
    assert_same_logits(hf, model, seed=8)
