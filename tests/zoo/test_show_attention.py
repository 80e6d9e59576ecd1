"""zoo.show_attention: panel selection, densities at short and long lengths, the picture itself."""

import pytest

from moezoo.configs import load_config
from moezoo.zoo.show_attention import (
    default_heads,
    default_layers,
    layer_images,
    main,
    sparse_layers,
)

plt = pytest.importorskip("matplotlib.pyplot")


def test_default_selection_for_big_models_is_first_middle_last_layer_and_8_heads():
    assert default_layers([2, 3]) == [2, 3]
    assert default_layers(list(range(2, 80))) == [2, 41, 79]
    assert default_heads(16) == list(range(16))
    heads = default_heads(64)
    assert len(heads) == 8 and heads[0] == 0 and heads[-1] == 63
    # every layer sparse (issue 15)
    assert sparse_layers(load_config("zoo/sparse_attn_1b_64k.yaml").model) == list(range(16))


def test_long_lengths_title_block_density_short_ones_token_density():
    m = load_config("zoo/tiny_sparse_attn.yaml", ["model.max_seq_len=4096"]).model
    ((layer, heads),) = layer_images(m, 4096, layers=[3], heads=[0, 2])
    assert layer == 3 and [h for h, *_ in heads] == [0, 2]
    (_, img, dens, kind), (_, _, dense, dense_kind) = heads
    n = img.shape[0]
    assert img.shape == (n, n) and n == 4096 // 16
    assert dense == 1.0 and dense_kind == "dense" and kind == "block_topk"
    # computed / causal blocks
    assert dens == pytest.approx(float((img > 0).sum()) / (n * (n + 1) / 2))
    short = layer_images(m, 64, layers=[0], heads=[0])[0][1][0][2]
    assert 0 < short < 1  # token density (exact)


def test_picture_has_the_chosen_panels_and_a_legend(tmp_path, capsys):
    out = tmp_path / "a.png"
    assert (
        main(
            [
                "--config",
                "tiny_sparse_attn",
                "--length",
                "64",
                "--layers",
                "1-2",
                "--heads",
                "0,2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "layer 2 (2/2)" in capsys.readouterr().err  # progress line
    img = plt.imread(out)
    assert 20_000 < out.stat().st_size < 200_000 and img.shape[0] > 300 and img.shape[1] > 250
    assert main(["--config", "tiny_sparse_attn", "--layers", "7"]) == 2
    assert "--layers: range '7' outside 0..3" in capsys.readouterr().err
