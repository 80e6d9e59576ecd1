"""DST on any model with default options, and compact DST state (dst.compact_state): bit-packed
masks, a bf16 EMA score and AdamW moments for active weights only (training.optim.CompactAdamW)
match the dense state at every active entry, resume bit-exactly through DCP, and cost <= 0.5x the
bytes per masked weight."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moezoo.configs import ConfigError, ModelConfig
from moezoo.layers import DynamicSparsity
from moezoo.layers.dst.bits import pack_bits, unpack_bits
from moezoo.training.optim import CompactAdamW
from moezoo.zoo import build_model


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5)
    )


def zoo_model(seed=0, tie=False):
    torch.manual_seed(seed)
    return build_model(
        ModelConfig(
            vocab_size=64,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=64,
            max_seq_len=32,
            tie_embeddings=tie,
        )
    )


def mlp_steps(model, opt, dst, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(77 + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
        (model(x) - y).square().mean().backward()
        opt.step()
        dst.step(step)
        opt.zero_grad(set_to_none=True)


def test_default_options_work_on_a_plain_torch_mlp():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(model, opt, total_steps=20)
    assert [t.name for t in dst.targets] == ["0.weight", "2.weight"]  # the last Linear is the head
    mlp_steps(model, opt, dst, 20)
    st = dst.stats()
    assert abs(st["density"] - 0.2) < 0.01 and torch.all(
        model[0].weight[~model[0].weight_mask] == 0
    )


def test_total_steps_is_needed_only_by_schedules_in_fractions_of_training():
    with pytest.raises(ConfigError) as e:
        DynamicSparsity(mlp(), None)  # default: cosine drop fraction until 75% of training
    assert e.value.key == "dst.total_steps" and "\n" not in str(e.value)
    dst = DynamicSparsity(mlp(), None, drop_schedule="constant", stop_fraction=1.0, update_every=3)
    assert dst.schedule.is_update(3_000_000)


def test_default_targets_are_the_block_linears_of_a_zoo_model_tied_or_not():
    for tie in (False, True):
        model = zoo_model(tie=tie)
        names = [t.name for t in DynamicSparsity(model, None, total_steps=10).targets]
        want = [n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
        assert names == want


def test_unknown_override_names_the_key():
    with pytest.raises(ConfigError) as e:
        DynamicSparsity(mlp(), None, total_steps=10, sparsty=0.5)
    assert e.value.key == "dst.sparsty"


def test_bits_round_trip_on_odd_widths():
    m = torch.rand(3, 5, 13) < 0.3
    p = pack_bits(m)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 2)
    assert torch.equal(unpack_bits(p, 13), m)


def test_compact_state_needs_an_optimizer_it_can_wrap():
    model = mlp()
    with pytest.raises(ConfigError) as e:
        DynamicSparsity(
            model, torch.optim.AdamW(model.parameters()), total_steps=10, compact_state=True
        )
    assert e.value.key == "dst.compact_state"


def _pair(opts, seed=0):
    """(dense-state DST, compact-state DST) on identical MLPs."""
    out = []
    for compact in (False, True):
        model = mlp(seed)
        opt = (CompactAdamW if compact else torch.optim.AdamW)(
            model.parameters(), lr=1e-2, weight_decay=0.1
        )
        out.append((model, opt, DynamicSparsity(model, opt, compact_state=compact, **opts)))
    return out


OPTS = dict(sparsity=0.7, update_every=3, total_steps=12, stop_fraction=1.0)


def test_compact_adamw_matches_dense_adamw_at_every_active_weight():
    (rm, ro, rd), (cm, co, cd) = _pair(OPTS)
    for step in range(12):
        mlp_steps(rm, ro, rd, 1, start=step)
        mlp_steps(cm, co, cd, 1, start=step)
        for rt, ct in zip(rd.targets, cd.targets):
            mask = cd._mask(ct)
            assert torch.equal(rt.buf("mask"), mask), (ct.name, step)
            torch.testing.assert_close(ct.param(), rt.param(), rtol=1e-6, atol=1e-7)
            assert torch.all(ct.param()[~mask] == 0)
            st, rs = co.state[ct.param()], ro.state[rt.param()]
            k = int(mask.sum())
            for name in ("exp_avg", "exp_avg_sq"):
                assert st[name].shape[0] >= k
                torch.testing.assert_close(st[name][:k], rs[name][mask], rtol=1e-6, atol=1e-9)
                assert torch.all(st[name][k:] == 0)
    # unmasked parameters (the head, biases) take the plain AdamW path
    assert torch.equal(rm[4].weight, cm[4].weight) and torch.equal(rm[0].bias, cm[0].bias)


def test_compact_state_resumes_bit_exactly_through_dcp(tmp_path):
    opts = dict(OPTS, grad_ema=0.5)

    def fresh():
        model = mlp()
        opt = CompactAdamW(model.parameters(), lr=1e-2)
        return model, opt, DynamicSparsity(model, opt, compact_state=True, **opts)

    model, opt, dst = fresh()
    mlp_steps(model, opt, dst, 5)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    mlp_steps(model, opt, dst, 6, start=5)

    model2, opt2, dst2 = fresh()
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    mlp_steps(model2, opt2, dst2, 6, start=5)
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p2][k]), k


def _state_bytes(model, opt, dst):
    per = 0
    for t in dst.targets:
        per += sum(
            v.numel() * v.element_size() for v in opt.state[t.param()].values() if v.dim() > 0
        )
        per += sum(
            b.numel() * b.element_size()
            for b in map(t.buf, ("mask", "ever", "score"))
            if b is not None
        )
        c = getattr(opt, "_compact", {}).get(t.param())
        if c is not None:  # the gathered leaves hold storage only inside step()
            per += c.idx.numel() * c.idx.element_size() + sum(
                x.untyped_storage().nbytes() for x in (c.leaf, c.leaf.grad)
            )
    return per / sum(t.numel for t in dst.targets)


def test_compact_state_costs_at_most_half_the_bytes_per_masked_weight_at_20_percent_density():
    opts = dict(
        sparsity=0.8,
        distribution="uniform",
        update_every=2,
        total_steps=4,
        stop_fraction=1.0,
        grad_ema=0.9,
    )
    (rm, ro, rd), (cm, co, cd) = _pair(opts)
    mlp_steps(rm, ro, rd, 3)
    mlp_steps(cm, co, cd, 3)
    dense, compact = _state_bytes(rm, ro, rd), _state_bytes(cm, co, cd)
    assert dense == 14.0 and compact <= 0.5 * dense, (dense, compact)


def test_default_targets_on_a_hf_llama_skip_embeddings_and_lm_head():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    dst = DynamicSparsity(model, None, total_steps=10)
    names = [t.name for t in dst.targets]
    want = [n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2]
    assert names == want and len(names) == 2 * 7
