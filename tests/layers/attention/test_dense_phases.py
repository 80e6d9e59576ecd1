"""Dense phases of sparse attention (model.attention.dense_warmup / dense_finish): which steps run
dense, that a dense step is exactly the dense model, the logged phase, and the config checks."""

import dataclasses

import pytest
import torch

from moezoo.configs import ConfigError, load_config
from moezoo.layers.attention.density import AttentionStats, attention_metrics
from moezoo.zoo import build_model

PATS = (
    '{"0-1:0-1": {type: a_shape, sinks: 2, window: 8, block_size: 8}, '
    '"0-1:2-3": {type: block_topk, top_k: 2, token_select: 1, share_group: 1, block_size: 8}}'
)
TINY = [
    "model.vocab_size=64",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=64",
    "model.max_seq_len=64",
    "train.seq_len=64",
]


def _models(*extra):
    cfg = load_config(None, [*TINY, f"model.attention.patterns={PATS}", *extra])
    torch.manual_seed(0)
    sparse = build_model(cfg.model)
    dense = build_model(
        dataclasses.replace(
            cfg.model, attention=dataclasses.replace(cfg.model.attention, patterns={})
        )
    )
    dense.load_state_dict(sparse.state_dict())
    return cfg, sparse, dense


def test_dense_phase_steps_follow_the_warmup_and_finish_fractions():
    cfg, model, _ = _models("model.attention.dense_warmup=0.2", "model.attention.dense_finish=0.1")
    a = cfg.model.attention
    stats = AttentionStats(model, 64, 50, a.dense_warmup, a.dense_finish)
    phases = []
    for step in range(50):
        stats.before_step(step)
        phases.append(all(b.attention.dense_phase for b in model.layers))
        assert stats.metrics()["attn/dense_phase"] == float(phases[-1])
    assert phases == [True] * 10 + [False] * 35 + [True] * 5


def test_a_dense_phase_step_is_exactly_the_dense_model_and_a_sparse_step_is_not():
    cfg, sparse, dense = _models("model.attention.dense_warmup=0.5")
    stats = AttentionStats(sparse, 64, 10, 0.5, 0.0)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    stats.before_step(0)
    assert torch.equal(sparse(tokens), dense(tokens))
    stats.before_step(7)
    assert not torch.allclose(sparse(tokens), dense(tokens))


def test_no_phases_leave_the_layers_sparse_and_log_no_phase():
    _, model, _ = _models()
    stats = AttentionStats(model, 64, 10)
    stats.before_step(0)
    assert not any(b.attention.dense_phase for b in model.layers)
    model(torch.randint(0, 64, (1, 64)))
    assert "attn/dense_phase" not in stats.metrics()


def test_the_selection_sharpness_is_computed_in_the_logged_steps_only():
    """With the trainer's ``log_every``, the block top-k selection fills its entropy / top-k mass
    in the steps after which the trainer logs (every 4th and the last) and skips them elsewhere;
    the selection and the output are the same either way."""
    _, model, _ = _models()
    stats = AttentionStats(model, 64, 10, log_every=4)
    tokens = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(1))
    outs = {}
    for step in range(10):
        stats.before_step(step)
        with torch.no_grad():
            outs[step] = model(tokens)
        logged = (step + 1) % 4 == 0 or step + 1 == 10
        assert ("attn/topk_entropy" in stats.metrics()) == logged, step
    assert "attn/density" in stats.metrics()
    assert torch.equal(outs[0], outs[3]) and torch.equal(outs[0], outs[9])


def test_a_selecting_phase_keeps_the_static_heads_and_opens_the_block_topk_ones():
    """``dense_phase_heads: selecting``: a warm-up step is the model whose block top-k heads are
    written as dense heads (its A-shape heads as they are), not the all-dense model; after the
    warm-up the layers select again."""
    cfg, sparse, dense = _models(
        "model.attention.dense_warmup=0.5", "model.attention.dense_phase_heads=selecting"
    )
    hybrid_pats = PATS.replace(
        "{type: block_topk, top_k: 2, token_select: 1, share_group: 1, block_size: 8}",
        "{type: dense}",
    )
    hybrid = build_model(
        load_config(None, [*TINY, f"model.attention.patterns={hybrid_pats}"]).model
    )
    hybrid.load_state_dict(sparse.state_dict())
    a = cfg.model.attention
    stats = AttentionStats(sparse, 64, 10, a.dense_warmup, a.dense_finish, a.dense_phase_heads)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(2))
    stats.before_step(0)
    got = sparse(tokens)
    assert torch.equal(got, hybrid(tokens))
    assert not torch.allclose(got, dense(tokens))
    # the logged density is the hybrid's: A-shape heads sparse, the opened heads whole
    density = float(stats.metrics()["attn/density"])
    assert density == pytest.approx(float(attention_metrics(hybrid, 64)["attn/density"]))
    assert density < 1.0
    stats.before_step(7)
    assert not torch.allclose(sparse(tokens), hybrid(tokens))
    assert stats.metrics()["attn/dense_phase"] == 0.0


@pytest.mark.parametrize(
    "ov,key",
    [
        ("model.attention.dense_phase_heads=static", "dense_phase_heads"),
        ("model.attention.dense_warmup=-0.1", "dense_warmup"),
        ("model.attention.dense_finish=1.5", "dense_finish"),
        ("model.attention.dense_finish=0.6", "dense_finish"),
    ],
)
def test_bad_dense_phases_fail_at_load_naming_the_key(ov, key):
    with pytest.raises(ConfigError, match=f"model.attention.{key}"):
        load_config(None, [*TINY, "model.attention.dense_warmup=0.5", ov])
