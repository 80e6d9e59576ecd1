"""Draw each head's block pattern: ``python -m moezoo.zoo.show_attention --config tiny_sparse_attn
[--length N]``.

One panel per (layer, head): white = block skipped, grey = partial block (the token mask applies
inside), black = full block, at the layer's block size (the legend says so). Input-dependent heads
(vertical_slash, block_topk) are drawn with their budgets placed as
``layers.attention.plan.budget_plan`` places them (columns and diagonals first, recent blocks),
since the real picks depend on the input. A head that is dense at this length (e.g. below its
``dense_below``) is drawn and titled dense.

Titles give each head's density: up to ``TOKEN_DENSITY_MAX`` tokens the token density (allowed /
causal pairs, exact, as ``attention_density`` logs it), beyond it the block density (full + partial
/ causal blocks: what a block-sparse kernel computes), which the block layout gives at any length in
O(heads x blocks^2), where counting tokens would take minutes per layer at 64k.

``--layers`` / ``--heads`` pick panels (``"0-3,8"``); by default every sparse layer when there are
at most four, else the first, a middle and the last one, and every head up to 16, else 8 spread
evenly. ``--length`` defaults to the preset's ``train.seq_len``.
"""

from __future__ import annotations

import argparse
import sys

from moezoo.configs import ConfigError, load_config, parse_range
from moezoo.configs.presets import resolve_config_path

# pattern_density is exact (and takes < 1 s a layer) up to its max_rows=2048
TOKEN_DENSITY_MAX = 2048


def sparse_layers(cfg_model) -> list[int]:
    """Layers with at least one non-dense head (read from the config, nothing built)."""
    grid = cfg_model.attention.layer_head_patterns(cfg_model.n_layers, cfg_model.n_heads)
    return [i for i, heads in enumerate(grid) if any(p is not None for p in heads)]


def default_layers(sparse: list[int]) -> list[int]:
    return sparse if len(sparse) <= 4 else sorted({sparse[0], sparse[len(sparse) // 2], sparse[-1]})


def default_heads(n_heads: int) -> list[int]:
    return (
        list(range(n_heads))
        if n_heads <= 16
        else sorted({round(i * (n_heads - 1) / 7) for i in range(8)})
    )


def layer_images(
    cfg_model,
    length: int,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    progress=None,
) -> list[tuple[int, list]]:
    """``[(layer, [(head, image[n, n] float, density, type), ...])]`` for the sparse layers among
    ``layers`` (default: all), heads ``heads`` (default: all); ``progress(i, n, layer)`` is called
    before each layer."""
    from moezoo.layers.attention.density import pattern_density
    from moezoo.layers.attention.pattern import head_patterns
    from moezoo.layers.attention.plan import budget_plan
    from moezoo.zoo.model import build_attention_pattern

    grid = cfg_model.attention.layer_head_patterns(cfg_model.n_layers, cfg_model.n_heads)
    H = cfg_model.n_heads
    heads = list(range(H)) if heads is None else heads
    todo = [i for i in sparse_layers(cfg_model) if layers is None or i in layers]
    out = []
    for i, layer in enumerate(todo):
        if progress:
            progress(i, len(todo), layer)
        pattern = build_attention_pattern(cfg_model, layer, grid)
        partial, full = budget_plan(pattern, H, length, layer).block_layout()
        partial, full = partial[0].float(), full[0].float()
        img = full + 0.5 * partial
        if length <= TOKEN_DENSITY_MAX:
            dens = pattern_density(pattern, H, length, layer)
        else:
            n = img.shape[-1]
            dens = (full + partial).sum((-1, -2)).double() / (n * (n + 1) / 2)
        pats = head_patterns(pattern, H)
        kinds = [
            f"{p.type} (dense)" if p.type != "dense" and p.is_dense_at(length) else p.type
            for p in pats
        ]
        out.append((layer, [(h, img[h], float(dens[h]), kinds[h]) for h in heads]))
    return out


def draw(images: list, title: str, density_of: str):
    """The figure: one row per layer, one column per head, a legend of the three shades below."""
    from matplotlib.patches import Patch

    from moezoo.zoo.pyplot import pyplot

    plt = pyplot()
    n_rows, n_cols = len(images), len(images[0][1])
    fig, axes = plt.subplots(
        n_rows,
        n_cols,
        figsize=(max(5.5, 0.4 + 1.45 * n_cols), 1.1 + 1.75 * n_rows),
        squeeze=False,
        layout="constrained",
    )
    for row, (layer, heads) in enumerate(images):
        for col, (h, img, dens, kind) in enumerate(heads):
            ax = axes[row][col]
            ax.imshow(img.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="antialiased")
            ax.set_title(
                f"L{layer} H{h}\n{kind.replace(' (dense)', '*')}\n{100 * dens:.1f}%",
                fontsize=7,
                linespacing=1.1,
            )
            ax.set_xticks([])
            ax.set_yticks([])
    shades = [
        Patch(facecolor=c, edgecolor="0.5", label=label)
        for c, label in (
            ("white", "skipped block"),
            ("0.5", "partial block (token mask inside)"),
            ("black", "full block"),
        )
    ]
    fig.legend(handles=shades, loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    # The legend and title carry the reading key; the width above leaves them room even for one
    # head.
    fig.suptitle(
        f"{title}\nrows: query blocks, columns: key blocks\n"
        f"% = {density_of}; * = dense at this length",
        fontsize=8,
    )
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m moezoo.zoo.show_attention", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--config", required=True, help="preset YAML path or name, e.g. sparse_attn_1b_64k"
    )
    ap.add_argument(
        "--length", type=int, default=None, help="sequence length to draw (default: train.seq_len)"
    )
    ap.add_argument(
        "--layers", default=None, help="layers to draw, e.g. '2,7,13' or '2-5' (default: see above)"
    )
    ap.add_argument(
        "--heads", default=None, help="heads to draw, e.g. '0-3,8' (default: all up to 16, else 8)"
    )
    ap.add_argument("--out", default=None, help="PNG path (default attention_<name>_<length>.png)")
    ap.add_argument("--dpi", type=int, default=120)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(resolve_config_path(a.config), a.overrides)
        m = cfg.model
        length = a.length or cfg.train.seq_len
        if length < 1:
            raise ConfigError("--length", f"must be >= 1, got {length}")
        sparse = sparse_layers(m)
        if not sparse:
            raise ConfigError("--config", f"{cfg.name}: every layer is dense; nothing to draw")
        layers = (
            parse_range(a.layers, m.n_layers, "--layers") if a.layers else default_layers(sparse)
        )
        if not set(layers) & set(sparse):
            raise ConfigError(
                "--layers", f"none of {a.layers} has a sparse head; sparse layers: {sparse}"
            )
        heads = parse_range(a.heads, m.n_heads, "--heads") if a.heads else default_heads(m.n_heads)
        from moezoo.zoo.pyplot import pyplot

        pyplot()  # fail on a missing matplotlib before the patterns are computed
    except (ConfigError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def progress(i, n, layer):
        print(
            f"\rlayer {layer} ({i + 1}/{n}) at {length} tokens ...",
            end="",
            file=sys.stderr,
            flush=True,
        )

    images = layer_images(m, length, layers, heads, progress)
    print(file=sys.stderr)
    density_of = (
        "allowed / causal token pairs"
        if length <= TOKEN_DENSITY_MAX
        else "computed / causal blocks (full + partial)"
    )
    fig = draw(images, f"{cfg.name}: block patterns at {length} tokens", density_of)
    out = a.out or f"attention_{cfg.name}_{length}.png"
    fig.savefig(out, dpi=a.dpi)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
