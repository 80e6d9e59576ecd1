"""Import MInference's per-head pattern files (``minference/configs/*.json``) as moezoo patterns.

    python -m moezoo.zoo.minference Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json \\
        --n-layers 32 --n-heads 32 > patterns.yaml

MInference stores one ``{head: [type, v_size, s_size, score]}`` mapping per layer. The mapping of
its three kernel types onto ours lives in ``configs.attention.MINFERENCE_TYPES`` (vertical_and_slash
-> vertical_slash, stream_llm -> a_shape, block_sparse -> block_topk). The same file can be named in
a config as ``model.attention.minference_json``; this tool writes the equivalent ``patterns``
section, with runs of identical heads folded into head ranges, for editing by hand. ``--dense-below
N`` sets the pattern parameter ``dense_below`` on every imported head (dense attention below N
keys); by default it stays 0 (the patterns apply at every length).
"""

from __future__ import annotations

import argparse
import sys

import yaml

from moezoo.configs.attention import minference_patterns
from moezoo.configs.errors import check


def load_minference(path: str, n_layers: int, n_heads: int, dense_below: int = 0) -> dict:
    """``{"<layer>:<heads>": pattern dict}`` with consecutive identical heads of a layer folded into
    ranges; ``dense_below > 0`` is added to every head's pattern."""
    check(
        isinstance(dense_below, int) and dense_below >= 0,
        "dense_below",
        f"must be an integer >= 0, got {dense_below!r}",
    )
    per_head = minference_patterns(path, n_layers, n_heads)
    if dense_below:
        per_head = {spec: {**pat, "dense_below": dense_below} for spec, pat in per_head.items()}
    by_layer: dict[int, list] = {}
    for spec, pat in per_head.items():
        layer, head = (int(x) for x in spec.split(":"))
        by_layer.setdefault(layer, []).append((head, pat))
    out = {}
    for layer in sorted(by_layer):
        heads = sorted(by_layer[layer], key=lambda hp: hp[0])
        start = 0
        for i in range(1, len(heads) + 1):
            run_ends = (
                i == len(heads)
                or heads[i][1] != heads[start][1]
                or heads[i][0] != heads[i - 1][0] + 1
            )
            if run_ends:
                lo, hi = heads[start][0], heads[i - 1][0]
                out[f"{layer}:{lo}" if lo == hi else f"{layer}:{lo}-{hi}"] = heads[start][1]
                start = i
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="MInference per-head pattern file")
    ap.add_argument("--n-layers", type=int, required=True)
    ap.add_argument("--n-heads", type=int, required=True, help="query heads per layer")
    ap.add_argument(
        "--dense-below",
        type=int,
        default=0,
        help="keys below which every imported head runs dense attention (default 0: never)",
    )
    a = ap.parse_args(argv)
    pats = load_minference(a.json, a.n_layers, a.n_heads, a.dense_below)
    yaml.safe_dump(
        {"model": {"attention": {"patterns": pats}}},
        sys.stdout,
        sort_keys=False,
        default_flow_style=None,
    )


if __name__ == "__main__":
    main()
