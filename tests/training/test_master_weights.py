"""``train.param_dtype: bfloat16``: matmul weights held in bf16 with float32 masters in the
optimizer (training.optim.MasterAdamW) train the same model as bf16 autocast over float32
parameters, resume bit-exactly, and refuse the settings they cannot honour with one line."""

import pytest
import torch

from helpers import tiny_overrides
from moezoo.configs import ConfigError, load_config
from moezoo.training.loop import Trainer
from moezoo.training.optim import MasterAdamW, autocast_weights

BF16 = {"train.dtype": "bfloat16"}


def make(tmp, corpus, preset="zoo/tiny_moe.yaml", **extra):
    return Trainer(load_config(preset, tiny_overrides(tmp, corpus, **{**BF16, **extra})))


def _by_name(trainer) -> dict:
    """Every parameter's float32 value: the master for bf16 ones."""
    opt = trainer.optimizer
    return {
        n: opt.state[p].get("master", p).detach().clone()
        if isinstance(opt, MasterAdamW)
        else p.detach().clone()
        for n, p in trainer.model.named_parameters()
    }


@pytest.mark.parametrize(
    "preset, accum",
    [("zoo/tiny_moe.yaml", 1), ("zoo/tiny_neuron.yaml", 1), ("zoo/tiny_moe.yaml", 3)],
)
def test_bf16_weights_train_the_same_model_as_autocast_over_float32(
    tmp_path, corpus_dir, preset, accum
):
    # accum 3: the bf16 gradients of the three backward passes are summed in float32, as autograd
    # sums the float32 parameters' gradients
    ref = make(tmp_path / "ref", corpus_dir, preset, **{"train.grad_accum": accum})
    low = make(
        tmp_path / "low",
        corpus_dir,
        preset,
        **{"train.param_dtype": "bfloat16", "train.grad_accum": accum},
    )
    names = {id(p): n for n, p in low.model.named_parameters()}
    held = {names[id(p)] for p in autocast_weights(low.model)}
    # the matmul weights, not the embedding, norms or routers (read with autocast off)
    assert any(".experts.w1" in n for n in held) and any(".attention.wq." in n for n in held)
    assert not any(
        "tok_embeddings" in n or "norm" in n or ".gate." in n or ".router." in n for n in held
    )
    for n, p in low.model.named_parameters():
        assert p.dtype == (torch.bfloat16 if n in held else torch.float32), n
    # On CPU the update is torch's AdamW op for op, and the bf16 weights and gradients are
    # autocast's: bit for bit the same run (on CUDA the fused kernel rounds differently:
    # tests/kernels/test_adamw.py).
    for _ in range(6):
        a, b = ref.train_step(), low.train_step()
        assert a["loss/total"].item() == b["loss/total"].item()
        assert a["grad_norm"].item() == b["grad_norm"].item()
    pa, pb = _by_name(ref), _by_name(low)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    for n, p in low.model.named_parameters():  # the model's bf16 copy is the master, rounded
        if n in held:
            assert torch.equal(p, pb[n].to(torch.bfloat16)), n


def test_bf16_weights_resume_bit_exactly(tmp_path, corpus_dir):
    kw = {"train.param_dtype": "bfloat16", "train.steps": 12, "checkpoint.every": 100}
    straight = make(tmp_path / "a", corpus_dir, **kw)
    losses_straight = [straight.train_step()["loss/total"].item() for _ in range(12)]
    first = make(tmp_path / "b", corpus_dir, **kw)
    losses = [first.train_step()["loss/total"].item() for _ in range(6)]
    first.save()
    second = make(tmp_path / "b", corpus_dir, **kw, **{"checkpoint.resume": True})
    assert second.step == 6
    losses += [second.train_step()["loss/total"].item() for _ in range(6)]
    assert losses == losses_straight
    a, b = _by_name(straight), _by_name(second)
    assert all(torch.equal(a[n], b[n]) for n in a)
    for (n, p), q in zip(straight.model.named_parameters(), second.model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), n
    sa, sb = straight.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_resuming_with_another_param_dtype_names_the_key(tmp_path, corpus_dir):
    first = make(tmp_path, corpus_dir, **{"train.steps": 4})
    first.train_step()
    first.save()
    with pytest.raises(ConfigError, match=r"^train.param_dtype: .*trained with 'float32'"):
        make(
            tmp_path,
            corpus_dir,
            **{"train.steps": 4, "checkpoint.resume": True, "train.param_dtype": "bfloat16"},
        )


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"train.dtype": "float32"}, r"^train.param_dtype: bfloat16 weights need bf16 autocast"),
        ({"dst.enabled": True}, r"^train.param_dtype: bfloat16 weights with dst.enabled"),
        (
            {"train.dtype": "auto"},
            r"^train.param_dtype: .*auto gives on CUDA only \(this run is on cpu\)",
        ),
    ],
)
def test_bf16_weights_refuse_what_they_cannot_do(tmp_path, corpus_dir, extra, match):
    with pytest.raises(ConfigError, match=match):
        make(tmp_path, corpus_dir, **{"train.param_dtype": "bfloat16", **extra})


def test_a_bf16_weights_run_loads_for_inference_with_its_float32_masters(tmp_path, corpus_dir):
    from moezoo.training.trained import load_run

    run = make(tmp_path, corpus_dir, **{"train.param_dtype": "bfloat16", "train.steps": 3})
    for _ in range(3):
        run.train_step()
    run.save()
    masters = _by_name(run)
    model, _, cfg, _ = load_run(str(tmp_path / "run"))
    assert cfg.train.param_dtype == "bfloat16"
    # float32 again, the masters' values (not their bf16 rounding)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[n]), n
