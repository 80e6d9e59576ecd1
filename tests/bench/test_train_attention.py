"""bench/train_attention.py's variants of the A-shape + tile top-k layout (bench/configs/) against
the zoo presets: BENCHMARKS.md's rows that measured the presets' recipe as a variant of that layout
(``union_all`` with ``--score-block 1 --union-blocks 8``, SSMax, the short dense phase) train the
very model the presets build."""

import os

import pytest

from helpers import ROOT, bench_script
from moezoo.configs import load_config


@pytest.fixture(scope="module")
def bench():
    return bench_script("train_attention")


def _grid(cfg):
    m = cfg.model
    return m.attention.layer_head_patterns(m.n_layers, m.n_heads)


@pytest.mark.parametrize(
    "preset,layout,top_k,phase",
    [
        ("sparse_attn_small_16k", "ashape_topk_small_16k", 0, (2048, 1800)),
        ("sparse_attn_1b_64k", "ashape_topk_1b_64k", 8, (8192, 1500)),
        ("sparse_attn_1b_128k", "ashape_topk_1b_128k", 8, (16384, 1500)),
    ],
)
def test_the_presets_are_the_capped_union_of_the_ashape_topk_layout(
    bench, tmp_path, preset, layout, top_k, phase
):
    """Same patterns in every layer and head, the same training otherwise."""
    extra = [
        f"train.short_seq_len={phase[0]}",
        f"train.short_steps={phase[1]}",
        "model.attention.ssmax=true",
    ]
    path = os.path.join(ROOT, "bench", "configs", f"{layout}.yaml")
    steps = load_config(path).train.steps
    rows = bench.variant_config(
        path,
        extra,
        "union_all@model.attention.dense_warmup=0.75",
        steps,
        str(tmp_path),
        score_block=1,
        union_blocks=8,
        top_k=top_k,
    )
    zoo = bench.variant_config(
        os.path.join(ROOT, "zoo", f"{preset}.yaml"), [], "preset", steps, str(tmp_path)
    )
    assert _grid(rows) == _grid(zoo)
    rows.model.attention.patterns = zoo.model.attention.patterns
    rows.name, rows.train.out_dir = zoo.name, zoo.train.out_dir
    assert rows == zoo
