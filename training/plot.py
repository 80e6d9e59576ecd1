"""Local pictures of a run, so an offline run needs no wandb UI: ``<out_dir>/plots/*.png``.

- ``metrics.png``: loss (train, validation), learning rate, throughput, and density (DST) or expert
  balance (MoE) when the run logs them, against the step, from ``<out_dir>/metrics.jsonl``;
- ``expert_load_step_<step>.png`` (MoE): the token share of every expert of every layer, on a fixed
  scale 0 .. 2/E centred on the uniform share 1/E, so pictures of different steps compare.

The trainer writes them at every evaluation (``logging.plots``); ``python -m moezoo.training.plot
runs/X`` redraws ``metrics.png`` of any run. matplotlib is imported when a picture is drawn (Agg: no
display).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from moezoo.zoo.pyplot import pyplot

PLOTS_DIR = "plots"


def heatmap_figure(
    matrix, xlabel: str, ylabel: str, title: str, vmax: float | None = None, cbar_label: str = ""
):
    """``matrix [rows, cols]`` with axes and a colour bar; with ``vmax`` the scale is fixed at 0 ..
    vmax, diverging around vmax / 2 (white), else it spans the matrix."""
    plt = pyplot()
    m = np.asarray(matrix, dtype=np.float64)
    rows, cols = m.shape
    fig, ax = plt.subplots(
        figsize=(min(12, 3 + 0.3 * cols), min(9, 2.4 + 0.3 * rows)), layout="constrained"
    )
    cmap, lo, hi = ("RdBu_r", 0.0, vmax) if vmax else ("viridis", m.min(), m.max())
    im = ax.imshow(m, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    from matplotlib.ticker import MaxNLocator

    for axis, n in ((ax.xaxis, cols), (ax.yaxis, rows)):
        axis.set_major_locator(MaxNLocator(integer=True, nbins=min(n, 16)))
    fig.colorbar(
        im, ax=ax, label=cbar_label, extend="max" if vmax and m.max() > vmax else "neither"
    )
    return fig


def expert_load_figure(load, step: int):
    """Expert load ``[layers, experts]`` (token shares, rows sum to 1) on the fixed scale 0 ..
    2/E."""
    E = np.asarray(load).shape[1]
    return heatmap_figure(
        load,
        "expert",
        "layer",
        f"expert load, step {step} (white = uniform 1/{E})",
        vmax=2.0 / E,
        cbar_label="token share",
    )


def save_figure(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def figure_array(fig):
    """RGB pixels ``[H, W, 3]`` uint8 of ``fig`` (what wandb.Image takes); closes the figure."""
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    pyplot().close(fig)
    return rgb


def read_metrics(path: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` from a metrics.jsonl; a step logged twice (resume, rollback) keeps
    its last value."""
    by_step: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    by_step.setdefault(k, {})[row["step"]] = v
    return {k: (sorted(d), [d[s] for s in sorted(d)]) for k, d in by_step.items()}


def metrics_figure(metrics: dict, title: str):
    """One panel per quantity the run logged: loss, lr, tokens/s, then density / expert balance."""
    plt = pyplot()
    panels = [
        ("loss", ["loss/total", "val/loss"]),
        ("learning rate", ["lr"]),
        ("tokens/s", ["tokens_per_s"]),
        ("weight density", ["dst/density", "dst/ever_active"]),
        ("busiest expert / uniform", ["moe/max_load_ratio", "moe/mean_max_load_ratio"]),
    ]
    panels = [(name, [k for k in keys if k in metrics]) for name, keys in panels]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(7, 1.9 * len(panels) + 0.6),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, (name, keys) in zip(axes[:, 0], panels):
        for k in keys:
            steps, values = metrics[k]
            ax.plot(steps, values, marker="o" if k == "val/loss" else None, markersize=3, label=k)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    return fig


def write_metrics_plot(out_dir: str, title: str | None = None) -> str | None:
    """``<out_dir>/plots/metrics.png`` from ``<out_dir>/metrics.jsonl``; None when there is nothing
    to draw."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    metrics = read_metrics(path)
    if not metrics:
        return None
    fig = metrics_figure(metrics, title or os.path.basename(os.path.normpath(out_dir)))
    return save_figure(fig, os.path.join(out_dir, PLOTS_DIR, "metrics.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moezoo.training.plot", description="Draw <run>/plots/metrics.png."
    )
    p.add_argument("run", help="run folder holding metrics.jsonl (runs/<name>)")
    a = p.parse_args(argv)
    try:
        out = write_metrics_plot(a.run)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out is None:
        print(
            f"error: --run: no metrics in {os.path.join(a.run, 'metrics.jsonl')}", file=sys.stderr
        )
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
