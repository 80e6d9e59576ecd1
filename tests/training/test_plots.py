"""Local pictures of a run: metrics.png and fixed-scale expert-load heatmaps under
<out_dir>/plots/."""

import os

import numpy as np
import pytest

from helpers import tiny_overrides
from moezoo.configs import load_config
from moezoo.training import run
from moezoo.training.plot import expert_load_figure, figure_array
from moezoo.training.plot import main as plot_main

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("plots")
    cfg = load_config(
        "zoo/tiny_moe.yaml",
        tiny_overrides(
            tmp,
            corpus_dir,
            **{
                "train.steps": 6,
                "train.eval_every": 3,
                "logging.log_every": 2,
                "checkpoint.every": 0,
                "logging.plots": True,
            },
        ),
    )
    run(cfg)
    return cfg


def test_run_writes_metrics_and_expert_load_pictures(moe_run):
    plots = os.path.join(moe_run.out_dir, "plots")
    assert sorted(os.listdir(plots)) == [
        "expert_load_step_00000003.png",
        "expert_load_step_00000006.png",
        "metrics.png",
    ]
    for name in os.listdir(plots):
        path = os.path.join(plots, name)
        assert 5_000 < os.path.getsize(path) < 200_000
        img = plt.imread(path)
        # drawn, not blank
        assert img.shape[0] > 150 and img.shape[1] > 300 and img[..., :3].std() > 0.05


def test_plot_command_redraws_metrics_png(moe_run, capsys):
    path = os.path.join(moe_run.out_dir, "plots", "metrics.png")
    os.remove(path)
    assert plot_main([moe_run.out_dir]) == 0 and os.path.isfile(path)
    assert plot_main([os.path.dirname(moe_run.out_dir) + "/nothing"]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_expert_load_scale_is_fixed_across_steps():
    """Uniform load is the colour bar's centre (white) whatever the step's spread; 2/E is the
    top."""
    E = 8
    uniform = np.full((2, E), 1 / E)
    skewed = np.array([[0.5] + [0.5 / 7] * 7, [1 / E] * E])
    px = [figure_array(expert_load_figure(m, step)) for step, m in ((1, uniform), (2, skewed))]
    assert px[0].shape == px[1].shape
    h, w, _ = px[0].shape
    # The uniform row looks the same in both pictures (a per-picture min/max scale would recolour
    # it).
    centre_uniform = px[0][int(h * 0.65), int(w * 0.3)]
    centre_skewed_row1 = px[1][int(h * 0.65), int(w * 0.3)]
    assert np.abs(centre_uniform.astype(int) - centre_skewed_row1.astype(int)).max() < 10
    assert centre_uniform.min() > 200  # near white
