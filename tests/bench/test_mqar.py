"""bench/mqar.py: the MQAR generator's layout (each asked key once before its query, with the asked
value; targets only at answers; a pure function of the generator), the selection recall against
BlockSelection.covers, and a two-step run of a block top-k variant."""

import json

import pytest
import torch

from helpers import bench_script


@pytest.fixture(scope="module")
def mqar():
    return bench_script("mqar")


def batch(mqar, seed=0, **kw):
    args = dict(batch=4, seq_len=256, n_pairs=24, n_queries=12, vocab=128)
    args.update(kw)
    return mqar.mqar_batch(generator=torch.Generator().manual_seed(seed), **args)


def test_each_answered_key_occurs_once_before_its_query_with_its_value(mqar):
    tokens, targets = batch(mqar)
    noise, keys, values = mqar.vocab_ranges(128)
    for row_t, row_y in zip(tokens.tolist(), targets.tolist()):
        answers = [p for p, y in enumerate(row_y) if y != -100]
        assert len(answers) == 12
        for p in answers:
            k = row_t[p]
            assert k in keys and row_y[p] in values
            before = [i for i in range(p) if row_t[i] == k]
            assert len(before) == 1, f"key {k} occurs {len(before)} times before its query"
            assert row_t[before[0] + 1] == row_y[p], "the pair's value is the answer"
            assert row_t[p + 1] == row_y[p], "a query reads like a pair: the value follows"
        # no key occurs more than twice (once in its pair, at most once asked)
        for k in set(row_t) & set(keys):
            assert row_t.count(k) <= 2


def test_targets_only_at_answers_in_the_query_region(mqar):
    tokens, targets = batch(mqar, query_frac=0.25)
    ans = targets != -100
    assert int(ans.sum()) == 4 * 12
    first_query_slot = 128 - int(128 * 0.25)
    assert not ans[:, : 2 * first_query_slot].any(), "queries come after the context"
    assert not ans[:, 1::2].any(), "answers sit at slot starts, where the key is"


def test_deterministic_from_the_generator(mqar):
    a, b, c = batch(mqar, seed=3), batch(mqar, seed=3), batch(mqar, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_too_many_queries_is_refused(mqar):
    with pytest.raises(ValueError, match="n_queries"):
        batch(mqar, n_pairs=8, n_queries=9)


def test_answer_sources_point_at_the_pairs(mqar):
    tokens, targets = batch(mqar)
    rows, q_pos, k_pos = mqar.answer_sources(tokens, targets)
    assert torch.equal(tokens[rows, k_pos], tokens[rows, q_pos])
    assert torch.equal(tokens[rows, k_pos + 1], targets[rows, q_pos])
    assert (k_pos < q_pos).all()


def test_variant_patterns_share_the_budget(mqar):
    attn = mqar.variant_attention("topk_qmax_sb", 3, block=32, top_k=4, window=64, sinks=16)
    ((spec, pat),) = attn.patterns.items()
    assert spec == "0-2"
    assert pat == dict(
        type="block_topk",
        query_max=1,
        score_block=8,
        block_size=32,
        top_k=4,
        window=64,
        sinks=16,
        share_group=1,
    )
    hybrid = mqar.variant_attention("hybrid_last_dense", 3, 32, 4, 64, 16)
    assert list(hybrid.patterns) == ["0-1"]
    a_shape = mqar.variant_attention("a_shape", 2, 32, 4, 64, 16).patterns["0-1"]
    assert a_shape == dict(type="a_shape", block_size=32, window=64, sinks=16)
    assert mqar.variant_attention("dense", 2, 32, 4, 64, 16).patterns == {}


@pytest.mark.parametrize("variant", ["topk_qmax", "topk_token", "topk_union"])
def test_selection_recall_counts_the_far_pairs_the_attention_mask_keeps(mqar, variant):
    """With a one-token window and sink, a query attends to its far pair's value token exactly when
    the selection holds that token's block: the recall counts what the plan's token mask allows."""
    args = mqar.parse_args(
        "--seq 256 --pairs 24 --queries 12 --vocab 128 --dim 32 --layers 2 --block 32 "
        "--top-k 2 --window 1 --sinks 1".split()
    )
    torch.manual_seed(0)
    model = mqar.build_model(mqar.model_config(args, variant))
    for m in model.modules():
        if isinstance(m, mqar.Attention):
            m.record_selection = True
    tokens, targets = batch(mqar, seq_len=256)
    with torch.no_grad():
        model(tokens)
    got = mqar.selection_recall(model, tokens, targets)
    rows, q_pos, k_pos = mqar.answer_sources(tokens, targets)
    for layer in model.layers:
        sel = layer.attention.attn_stats["selection"]
        mask = sel.plan.token_mask()  # [B, H, S, T]
        heads = list(sel.heads)
        hits = total = 0
        for r, q, k in zip(rows.tolist(), q_pos.tolist(), (k_pos + 1).tolist()):
            if k // 32 < q // 32:
                kept = mask[r, heads, q, k]
                hits, total = hits + int(kept.sum()), total + kept.numel()
        assert got[layer.attention.layer_id] == [hits, total]
        assert total > 0


def test_two_steps_of_a_sparse_variant_write_a_row(mqar, tmp_path):
    out = tmp_path / "mqar.jsonl"
    rows = mqar.main(
        "--variants topk_qmax --seq 256 --pairs 16 --queries 8 --vocab 128 --dim 32 "
        "--layers 2 --block 32 --top-k 2 --window 32 --warm=64:2 --steps 2 --batch 2 "
        f"--eval-batches 1 --log-every 0 --out {out}".split()
    )
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["variant"] == "topk_qmax" and row == json.loads(json.dumps(rows[0]))
    assert set(row["recall"]) == {"0", "1"}
    assert 0.0 <= row["accuracy"] <= 1.0 and row["loss"] > 0
    assert 0.0 < row["density"] < 1.0
