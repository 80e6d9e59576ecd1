"""One source of truth for MoE / NeuronRoutedFFN options: the config dataclass; the layers take
``cfg`` plus keyword overrides and keep their own copy, so speed switches are per instance."""

import dataclasses

import pytest
import torch

from moezoo.configs import ConfigError, MoEConfig, NeuronConfig
from moezoo.layers import MoE, NeuronRoutedFFN


def test_keywords_and_cfg_build_the_same_layer_and_overrides_win():
    a = MoE(16, 24, 6, 3, router="sigmoid", aux_loss_coef=0.0)
    b = MoE(
        16,
        cfg=MoEConfig(hidden_dim=24, num_experts=6, top_k=2, router="sigmoid", aux_loss_coef=0.0),
        top_k=3,
    )
    assert a.cfg == b.cfg
    assert (b.num_experts, b.top_k, b.hidden_dim) == (6, 3, 24)
    assert b.experts.w1.shape == (6, 24, 16) and hasattr(b, "expert_bias")


def test_the_layer_copies_its_cfg_so_one_config_builds_independent_layers():
    cfg = MoEConfig(num_experts=4, top_k=2)
    a, b = MoE(8, 16, cfg=cfg), MoE(8, 16, cfg=cfg)
    a.cfg.compile_routing = None
    a.cfg.fold_weights = False
    assert cfg.compile_routing == "inductor" and b.cfg.fold_weights and cfg.hidden_dim is None


def test_every_layer_default_is_the_config_default():
    # the constructor declares no option of its own: MoE(dim, H) == MoEConfig() with H filled in
    assert MoE(8, 16).cfg == dataclasses.replace(MoEConfig(), hidden_dim=16)
    assert NeuronRoutedFFN(8, 32).cfg == NeuronConfig()


def test_unknown_keyword_raises_type_error_and_missing_hidden_dim_config_error():
    with pytest.raises(TypeError, match="top_kk"):
        MoE(8, 16, top_kk=2)
    with pytest.raises(TypeError, match="groups"):
        NeuronRoutedFFN(8, 32, groups=2)
    with pytest.raises(ConfigError) as e:
        MoE(8, num_experts=4)
    assert e.value.key == "moe.hidden_dim"
    with pytest.raises(ConfigError) as e:
        MoE(8, 16, 4, 2, group_align=0)
    assert e.value.key == "moe.group_align"


@pytest.mark.parametrize(
    "switch",
    [
        dict(fold_weights=False),
        dict(fuse_permute=False),
        dict(group_align=4),
        dict(low_precision_router=False),
        dict(compile_routing=None),
    ],
    ids=str,
)
def test_speed_switches_do_not_change_the_reference_path(switch):
    torch.manual_seed(0)
    a = MoE(16, 24, 6, 2, capacity_factor=0.9)
    b = MoE(16, 24, 6, 2, capacity_factor=0.9, **switch)
    b.load_state_dict(a.state_dict())
    x = torch.randn(20, 16)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


def test_neuron_cfg_with_overrides():
    m = NeuronRoutedFFN(
        8, 32, cfg=NeuronConfig(num_groups=8, top_k_groups=2, activation="relu2"), top_k_groups=4
    )
    assert (m.num_groups, m.top_k_groups, m.activation, m.experts.w3) == (8, 4, "relu2", None)
