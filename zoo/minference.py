"""Import MInference's per-head pattern files (``minference/configs/*.json``) as moezoo patterns.

    python -m zoo.minference Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json \\
        --n-layers 32 --n-heads 32 > patterns.yaml

MInference stores one ``{head: [type, v_size, s_size, score]}`` mapping per layer. The mapping of its
three kernel types onto ours lives in ``configs.attention.MINFERENCE_TYPES`` (vertical_and_slash ->
vertical_slash, stream_llm -> a_shape, block_sparse -> block_topk). The same file can be named in a
config as ``model.attention.minference_json``; this tool writes the equivalent ``patterns`` section,
with runs of identical heads folded into head ranges, for editing by hand.
"""
from __future__ import annotations

import argparse
import sys

import yaml

from configs.attention import minference_patterns


def load_minference(path: str, n_layers: int, n_heads: int) -> dict:
    """``{"<layer>:<heads>": pattern dict}`` with consecutive identical heads of a layer folded into ranges."""
    per_head = minference_patterns(path, n_layers, n_heads)
    by_layer: dict[int, list] = {}
    for spec, pat in per_head.items():
        layer, head = (int(x) for x in spec.split(":"))
        by_layer.setdefault(layer, []).append((head, pat))
    out = {}
    for layer in sorted(by_layer):
        heads = sorted(by_layer[layer], key=lambda hp: hp[0])
        start = 0
        for i in range(1, len(heads) + 1):
            run_ends = i == len(heads) or heads[i][1] != heads[start][1] or heads[i][0] != heads[i - 1][0] + 1
            if run_ends:
                lo, hi = heads[start][0], heads[i - 1][0]
                out[f"{layer}:{lo}" if lo == hi else f"{layer}:{lo}-{hi}"] = heads[start][1]
                start = i
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="MInference per-head pattern file")
    ap.add_argument("--n-layers", type=int, required=True)
    ap.add_argument("--n-heads", type=int, required=True, help="query heads per layer")
    a = ap.parse_args(argv)
    pats = load_minference(a.json, a.n_layers, a.n_heads)
    yaml.safe_dump({"model": {"attention": {"patterns": pats}}}, sys.stdout, sort_keys=False, default_flow_style=None)


if __name__ == "__main__":
    main()
