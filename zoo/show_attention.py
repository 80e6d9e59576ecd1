"""Draw each head's block pattern at a given length: ``python -m zoo.show_attention --config X --length N``.

One panel per (layer, head) for layers with a sparse head: white = block skipped, grey = partial block
(the token mask applies inside), black = full block, at the layer's block size. Input-dependent heads
(vertical_slash, block_topk) are drawn with their budgets placed as ``layers.attention.plan.budget_plan``
places them (columns and diagonals first, recent blocks), since the real picks depend on the input.
Titles give each head's token density (allowed / causal pairs), as ``attention_density`` logs it; a
head that is dense at this length (e.g. below its ``dense_below``) is drawn and titled dense.
"""
from __future__ import annotations

import argparse

from configs import load_config
from layers.attention.plan import budget_plan
from layers.attention.pattern import head_patterns
from layers.attention.density import pattern_density
from zoo.model import build_attention_pattern


def layer_images(cfg_model, length: int) -> list[tuple[int, list]]:
    """``[(layer, [(head, image[n, n] float, density, type), ...])]`` for layers with a sparse head."""
    grid = cfg_model.attention.layer_head_patterns(cfg_model.n_layers, cfg_model.n_heads)
    out = []
    for layer in range(cfg_model.n_layers):
        pattern = build_attention_pattern(cfg_model, layer, grid)
        if pattern is None:
            continue
        H = cfg_model.n_heads
        plan = budget_plan(pattern, H, length, layer)
        partial, full = plan.block_layout()
        img = (full.float() + 0.5 * partial.float())[0]
        dens = pattern_density(pattern, H, length, layer)
        pats = head_patterns(pattern, H)
        kinds = [f"{p.type} (dense)" if p.type != "dense" and p.is_dense_at(length) else p.type for p in pats]
        out.append((layer, [(h, img[h], float(dens[h]), kinds[h]) for h in range(H)]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--length", type=int, required=True, help="sequence length to draw")
    ap.add_argument("--out", default=None, help="PNG path (default attention_<name>_<length>.png)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = layer_images(cfg.model, a.length)
    if not layers:
        raise SystemExit(f"{a.config}: every layer is dense; nothing to draw")
    H = cfg.model.n_heads
    fig, axes = plt.subplots(len(layers), H, figsize=(1.6 * H, 1.8 * len(layers)), squeeze=False)
    for row, (layer, heads) in enumerate(layers):
        for h, img, dens, kind in heads:
            ax = axes[row][h]
            ax.imshow(img.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"L{layer} H{h} {kind}\n{100 * dens:.1f}%", fontsize=6)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"{cfg.name}: block patterns at {a.length} tokens (density = allowed / causal pairs)", fontsize=8)
    fig.tight_layout()
    out = a.out or f"attention_{cfg.name}_{a.length}.png"
    fig.savefig(out, dpi=150)
    print(out)


if __name__ == "__main__":
    main()
