"""The short-context phase (``train.short_seq_len``, ``train.short_steps``): its steps train on
more, shorter windows of the same tokens, evaluation stays at ``train.seq_len``, passkey practice
fits its windows, sparse attention runs at its length, and MFU and attention density count its
length."""

import json
import math
import os

import pytest
import torch

from helpers import tiny_overrides
from moezoo.configs import load_config
from moezoo.layers import Attention, AttentionStats
from moezoo.layers.attention.density import attention_metrics
from moezoo.training.data import sample_batch
from moezoo.training.loop import Trainer
from moezoo.zoo.flops import flops_per_token

# A-shape heads whose window (128) is longer than the short windows (64), and block top-k heads
# choosing per token (their union per query block), keeping a far block only where it holds 10% of
# a query's softmax
SPARSE = (
    '{"0-1:0-1": {type: a_shape, sinks: 16, window: 128, block_size: 16}, '
    '"0-1:2-3": {type: block_topk, top_k: 2, block_size: 16, token_select: 2, score_block: 1, '
    "min_share: 10}}"
)


def trainer(tmp_path, corpus, **extra) -> Trainer:
    """Windows of 256 tokens, of 64 (4x as many) in steps 0 and 1."""
    ov = {
        "model.max_seq_len": 256,
        "train.seq_len": 256,
        "train.batch_size": 1,
        "train.short_seq_len": 64,
        "train.short_steps": 2,
        "train.steps": 4,
        "train.eval_every": 4,
        "train.eval_batches": 1,
        "logging.log_every": 1,
        **extra,
    }
    return Trainer(load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp_path, corpus, **ov)))


def test_short_phase_steps_draw_more_shorter_windows_and_evaluation_stays_full_length(
    tmp_path, corpus_dir
):
    tr = trainer(tmp_path, corpus_dir, **{"train.batch_size": 2})
    for step, split, shape in (
        (0, "train", (8, 64)),
        (1, "train", (8, 64)),
        (2, "train", (2, 256)),
        (3, "train", (2, 256)),
        (0, "val", (2, 256)),
    ):
        x, y, _ = tr.batch(step, 0, split)
        assert x.shape == y.shape == shape, (step, split)
    # the sampler's windows for that length and step: a pure function of the step, which resumes
    x = tr.batch(1, 0)[0]
    assert torch.equal(x, sample_batch(tr.data.train, 8, 64, tr.cfg.train.seed, 1)[0])


def test_passkey_practice_in_short_windows_keeps_the_shortest_segment_length(tmp_path, corpus_dir):
    tr = trainer(
        tmp_path,
        corpus_dir,
        **{
            "model.max_seq_len": 512,
            "train.seq_len": 512,
            "train.short_seq_len": 128,
            "data.passkey_mix": 1.0,
            "data.passkey_questions": 4,
            "data.passkey_answer_weight": 5.0,
        },
    )
    # 512 / 4 == 128 / 1 tokens: the closest needles as close in both phases
    assert tr.passkey_mix.counts == [1, 2, 4] and tr.short_passkey_mix.counts == [1]
    x, _, w = tr.batch(0, 0)
    want_x, _, want_w = sample_batch(
        tr.data.train, 4, 128, tr.cfg.train.seed, 0, passkey=tr.short_passkey_mix
    )
    assert torch.equal(x, want_x) and torch.equal(w, want_w) and (w == 5.0).any()
    x, _, w = tr.batch(2, 0)
    want_x, _, want_w = sample_batch(
        tr.data.train, 1, 512, tr.cfg.train.seed, 2, passkey=tr.passkey_mix
    )
    assert torch.equal(x, want_x) and torch.equal(w, want_w)


def test_sparse_attention_trains_through_the_short_phase_into_the_full_one(
    tmp_path, corpus_dir, capfd
):
    tr = trainer(tmp_path, corpus_dir, **{"model.attention.patterns": SPARSE})
    tr.peak_flops = 1e12  # MFU is logged for GPUs of a known peak: here on CPU too
    summary = tr.fit()
    assert summary["step"] == 4 and all(math.isfinite(v) for _, v in summary["val_history"])
    with open(os.path.join(tr.cfg.out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss/total" in r]
    assert [r["train/seq_len"] for r in rows] == [64, 64, 256, 256]
    for r in rows:
        assert math.isfinite(r["loss/total"]) and not r["skipped"]
        # the model FLOPs of the step's window length
        flops = flops_per_token(tr.cfg.model, r["train/seq_len"])
        assert r["mfu_model"] == pytest.approx(r["tokens_per_s"] * flops / 1e12)
    assert "short-context phase over at step 2: windows of 256 tokens from here" in (
        capfd.readouterr().out
    )


def test_density_of_layers_without_stats_counts_the_steps_window_length(tmp_path, corpus_dir):
    """Compiled blocks record no stats; their budget density is then counted at the length the
    last step trained on."""
    tr = trainer(tmp_path, corpus_dir, **{"model.attention.patterns": SPARSE})
    stats = next(m for m in tr.sparsity if isinstance(m, AttentionStats))
    for length in (64, 64, 256):
        tr.train_step()
        for m in tr.model.modules():
            if isinstance(m, Attention):
                m.attn_stats = {}  # as a compiled block leaves them
        got = float(stats.metrics()["attn/density"])
        assert got == pytest.approx(float(attention_metrics(tr.model, length)["attn/density"]))
    assert float(attention_metrics(tr.model, 64)["attn/density"]) != pytest.approx(got)
