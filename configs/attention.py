"""``model.attention``: dense or sparse attention per layer and head (layers.Attention).

Pattern dicts are checked here (pure data checks, so a bad YAML fails at load time);
layers.SparsityPattern gives them meaning. Semantics are in docs/sparse_attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import ConfigError, check, check_choice
from .ranges import assign_ranges, parse_range

# No "triton" backend of our own: FlexAttention's Triton kernel already runs static patterns at the
# density limit forward (BENCHMARKS.md, Sparse attention layer).
ATTN_BACKENDS = ("auto", "reference", "flex", "flash_attn")

# type -> (required params, optional params). Every pattern also takes the COMMON_PARAMS:
# block_size, seed and dense_below (over T keys a head with T < dense_below is dense causal
# attention: MInference applies its estimated patterns to long inputs only; 0 = never).
PATTERN_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dense": ((), ()),
    "local": (("window",), ("sinks",)),
    "a_shape": (("sinks", "window"), ()),
    "bigbird": (("window", "sinks", "random_blocks"), ()),
    "vertical_slash": (("n_vertical", "n_slash"), ("last_q", "keep_columns", "keep_diagonals")),
    "block_topk": (
        ("top_k",),
        (
            "window",
            "sinks",
            "share_group",
            "query_max",
            "compress",
            "compress_block",
            "score_block",
            "token_select",
            "score_nope",
            "min_share",
            "union_blocks",
            "indexer",
        ),
    ),
}
COMMON_PARAMS = ("block_size", "seed", "dense_below")
DEFAULT_BLOCK_SIZE = 64
POSITIVE_PARAMS = ("window", "sinks", "n_vertical", "n_slash", "last_q", "top_k", "block_size")
NONNEG_PARAMS = (
    "random_blocks",
    "seed",
    "dense_below",
    "keep_columns",
    "keep_diagonals",
    "compress_block",
    "score_block",
    "union_blocks",
    "indexer",
)
FLAG_PARAMS = ("share_group", "compress", "score_nope")  # 0 or 1
# MInference's per-head JSON names its three kernels; what each entry computes in MInference's
# runtime (minference/modules/minference_forward.py), in our params:
# - vertical_and_slash: budgets raised to at least 30 columns / 50 diagonals, the first 30 key
#   columns and the 100 diagonals nearest the main one forced into the top-k (scores set to +inf
#   before it), last_q 64;
# - stream_llm: streaming_forward(n_init, n_local);
# - block_sparse: its kernel runs top-100 blocks of 64x64 per head whatever v_size / s_size say.
MINFERENCE_TYPES = {
    "vertical_and_slash": lambda v, s: {
        "type": "vertical_slash",
        "n_vertical": max(v, 30),
        "n_slash": max(s, 50),
        "last_q": 64,
        "keep_columns": 30,
        "keep_diagonals": 100,
        "block_size": 64,
    },
    "stream_llm": lambda v, s: {"type": "a_shape", "sinks": v, "window": s},
    "block_sparse": lambda v, s: {"type": "block_topk", "top_k": 100, "block_size": 64},
}
# FlexAttention kernels (``model.attention.flex_kernel``): auto = FLASH where the measured table in
# layers/attention/flex.py says it is faster and flash-attn-4 runs here, else Triton.
FLEX_KERNELS = ("auto", "triton", "flash")
MIN_FLEX_BLOCK = 16  # Triton's smallest tensor-core tile; smaller blocks run only on the reference
# FA4's Hopper/Blackwell tile: the FLASH kernel is tested with 128-token blocks only
FLASH_BLOCK = 128


def validate_pattern(pat: dict, key: str) -> None:
    """Check one pattern dict, e.g. ``{type: a_shape, sinks: 64, window: 1024}``."""
    if not hasattr(pat, "keys"):
        raise ConfigError(key, "must be a mapping like {type: local, window: 256}")
    pat = dict(pat)
    t = pat.get("type")
    check_choice(t, tuple(PATTERN_TYPES), f"{key}.type")
    required, optional = PATTERN_TYPES[t]
    for p in required:
        check(p in pat, f"{key}.{p}", f"required by pattern type {t!r}")
    for p, v in pat.items():
        if p == "type":
            continue
        check(
            p in required + optional + COMMON_PARAMS,
            f"{key}.{p}",
            f"unknown parameter for pattern type {t!r}",
        )
        check(
            isinstance(v, int) and not isinstance(v, bool),
            f"{key}.{p}",
            f"must be an integer, got {v!r}",
        )
        if p in POSITIVE_PARAMS:
            check(v > 0, f"{key}.{p}", f"must be > 0, got {v}")
        if p in NONNEG_PARAMS:
            check(v >= 0, f"{key}.{p}", f"must be >= 0, got {v}")
        if p in FLAG_PARAMS:
            check(v in (0, 1), f"{key}.{p}", f"must be 0 or 1, got {v}")
    for p in ("block_size", "compress_block", "score_block"):
        b = pat.get(p, 0)
        check(b & (b - 1) == 0, f"{key}.{p}", f"must be a power of two, got {b}")
    bs = pat.get("block_size", DEFAULT_BLOCK_SIZE)
    check(
        pat.get("score_block", 0) <= bs,
        f"{key}.score_block",
        f"pools keys within a selection block: must be <= block_size ({bs}), "
        f"got {pat.get('score_block')}",
    )
    check(
        pat.get("token_select", 0) in (0, 1, 2),
        f"{key}.token_select",
        f"must be 0 (per query block), 1 (per query token) or 2 (per token, attending its query "
        f"block's union), got {pat.get('token_select')}",
    )
    check(
        pat.get("query_max", 0) in (0, 1, 2),
        f"{key}.query_max",
        f"must be 0 (the pooled query block), 1 (its best query's score) or 2 (its best query's "
        f"share of its own attention), got {pat.get('query_max')}",
    )
    check(
        not (pat.get("token_select") and pat.get("query_max")),
        f"{key}.query_max",
        "token_select scores each query for itself; query_max applies to per-block selection",
    )
    check(
        0 <= pat.get("min_share", 0) < 100,
        f"{key}.min_share",
        f"a percent of a query's attention: must be in [0, 100), got {pat.get('min_share')}",
    )
    check(
        not pat.get("min_share") or pat.get("token_select"),
        f"{key}.min_share",
        "filters each query's own choices: set token_select: 1 or 2 too",
    )
    check(
        not pat.get("union_blocks") or pat.get("token_select") == 2,
        f"{key}.union_blocks",
        "caps the blocks a query block's union visits: set token_select: 2 too",
    )
    check(
        not pat.get("union_blocks") or pat["union_blocks"] >= pat.get("top_k", 0),
        f"{key}.union_blocks",
        f"a query block must fit one query's choices: must be >= top_k ({pat.get('top_k')}), "
        f"got {pat.get('union_blocks')}",
    )
    check(
        not pat.get("compress_block") or pat.get("compress"),
        f"{key}.compress_block",
        "sizes the compressed branch: set compress: 1 too",
    )
    check(
        not pat.get("indexer") or (pat.get("token_select") and pat.get("score_block") == 1),
        f"{key}.indexer",
        "scores single keys for per-token choices: set token_select: 1 or 2 and score_block: 1 too",
    )
    check(
        not (pat.get("indexer") and pat.get("score_nope")),
        f"{key}.indexer",
        "scores with its own projections: drop score_nope",
    )


def minference_patterns(
    data, n_layers: int, n_heads: int, key: str = "model.attention.minference_json"
) -> dict:
    """MInference's per-head config -> our ``{"<layer>:<head>": pattern dict}``.

    ``data`` is the parsed JSON (or a path to it): a list with one ``{head: [type, v_size, s_size,
    score]}`` dict per layer (MInference ``minference/configs/*.json``). Checked like YAML patterns.
    """
    if isinstance(data, str):
        import json

        try:
            with open(data) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(key, f"cannot read MInference JSON: {e}") from None
    check(
        isinstance(data, list),
        key,
        "must be a list with one {head: [type, v, s, score]} mapping per layer",
    )
    check(len(data) <= n_layers, key, f"has {len(data)} layers, the model {n_layers}")
    out = {}
    for li, heads in enumerate(data):
        check(
            hasattr(heads, "items"),
            f"{key}[{li}]",
            "must map head index -> [type, v_size, s_size, score]",
        )
        for h, entry in heads.items():
            k = f"{key}[{li}][{h}]"
            check(str(h).isdigit() and int(h) < n_heads, k, f"head outside 0..{n_heads - 1}")
            check(
                isinstance(entry, (list, tuple)) and len(entry) >= 3,
                k,
                "must be [type, v_size, s_size, score]",
            )
            check_choice(entry[0], tuple(MINFERENCE_TYPES), f"{k}.type")
            sizes = entry[1:3]
            check(
                all(
                    isinstance(x, (int, float))
                    and not isinstance(x, bool)
                    and float(x).is_integer()
                    for x in sizes
                ),
                k,
                f"v_size and s_size must be integers, got {list(sizes)}",
            )
            pat = MINFERENCE_TYPES[entry[0]](int(entry[1]), int(entry[2]))
            validate_pattern(pat, k)
            out[f"{li}:{int(h)}"] = pat
    return out


def dense_layer_ids(spec, n_layers: int, key: str = "model.attention.dense_layers") -> list[int]:
    """The layers ``dense_layers`` names: a range (``parse_range``), ``last:K`` or ``every:N``."""
    spec = str(spec if spec is not None else "").strip()
    if not spec:
        return []
    kind, sep, arg = spec.partition(":")
    if sep and kind in ("last", "every"):
        check(arg.strip().isdigit(), key, f"{kind}: takes a positive integer, got {spec!r}")
        n = int(arg)
        check(n >= 1, key, f"{kind}: takes a positive integer, got {spec!r}")
        if kind == "last":
            check(n <= n_layers, key, f"last:{n} asks for more layers than the model's {n_layers}")
            return list(range(n_layers - n, n_layers))
        check(n <= n_layers, key, f"every:{n} names no layer of the model's {n_layers}")
        return list(range(n - 1, n_layers, n))
    if sep:
        raise ConfigError(key, f"unknown form {spec!r}; use a layer range, last:K or every:N")
    return parse_range(spec, n_layers, key)


def split_key(spec: str) -> tuple[str, str]:
    """``"0-3:8-15"`` -> ("0-3", "8-15"); a key without ':' means every head."""
    layers, _, heads = str(spec).partition(":")
    return layers.strip(), (heads.strip() or "*")


@dataclass
class AttentionConfig:
    backend: str = "auto"
    # "<layers>:<heads>" -> pattern dict, e.g. {"0-3:*": {type: a_shape, sinks: 64, window: 1024}}.
    # Unlisted layers/heads are dense. A key without ":" means all heads of those layers.
    patterns: dict[str, Any] = field(default_factory=dict)
    # MInference per-head pattern file, applied under `patterns`
    minference_json: Optional[str] = None
    # backend "auto" runs the reference (same masked result) below this many keys; -1 = the measured
    # DENSE_CROSSOVER. Unlike the per-pattern ``dense_below``, which makes a head dense attention.
    reference_below: int = -1
    # FlexAttention kernel per layer: auto | triton | flash (FA4 through flex, Hopper/Blackwell),
    # and Triton tile options passed to every flex call of these layers (e.g. {BLOCK_M: 128,
    # num_stages: 3}).
    flex_kernel: str = "auto"
    kernel_options: dict[str, Any] = field(default_factory=dict)
    # SSMax (Nakanishi 2025, "Scalable-Softmax"): every query at position p is multiplied by max(0,
    # 1 + s_h * log(p + 1)), s_h learned per head and zero at init (plain softmax until training
    # moves it), meant to keep a head as sharp over 16k keys as over 1k (trained at 16k, heads learn
    # s < 0 instead: BENCHMARKS.md, Long-context quality). Every layer and head; not MLA.
    ssmax: bool = False
    # Hybrid layouts: layers whose every head is dense attention whatever ``patterns`` say. A
    # range ("15", "0,8", "12-15"), "last:K" (the last K layers) or "every:N" (layers N-1, 2N-1,
    # ..., every N-th counting from 1); "" = none. Long-context models keep a few full-attention
    # layers next to sparse ones for retrieval (MoBA keeps its last 3 dense).
    dense_layers: str = ""
    # Dense phases: fractions of train.steps at the start / end in which every sparse layer runs
    # dense causal attention (a warm-up in which the model learns where to look before the selection
    # must find it; MoBA's dense finish). 0 = none.
    dense_warmup: float = 0.0
    dense_finish: float = 0.0
    # Which heads the dense phases open: "all" (every head of a sparse layer dense), or "selecting"
    # (only the input-dependent heads, block top-k and vertical-slash; static heads such as
    # a_shape keep their pattern). A dense warm-up teaches copy heads wherever it can; with
    # "selecting" they can form only in heads that can still reach far once the phase ends.
    dense_phase_heads: str = "all"
    # Short causal convolution over each key channel (taps, 0 = none; 2-8): a key carries the
    # positions just before it, so one layer can match "the token after x" and a block selection
    # scores that match (FlashMoBA's key convolution). Every GQA attention layer; identity at init.
    key_conv: int = 0
    # Weight of the distillation loss of block top-k heads with ``indexer`` (their detached
    # learned scorer, trained towards the attention's own block mass); the trainer adds it to
    # the loss as layers' aux losses. >= 0; 0 leaves the indexer untrained.
    indexer_weight: float = 1.0

    def layer_head_patterns(
        self, n_layers: int, n_heads: int, key: str = "model.attention.patterns"
    ) -> list[list]:
        """``[layer][head] -> pattern dict or None`` (None = dense). Overlapping head ranges are
        errors."""
        grid: list[list] = [[None] * n_heads for _ in range(n_layers)]
        if self.minference_json:
            for spec, pat in minference_patterns(self.minference_json, n_layers, n_heads).items():
                li, h = (int(x) for x in spec.split(":"))
                grid[li][h] = pat
        by_layers: dict[str, dict] = {}
        for spec, pat in self.patterns.items():
            validate_pattern(pat, f"{key}.{spec}")
            layers, heads = split_key(spec)
            by_layers.setdefault(layers, {})[heads] = dict(pat)
        for layers, heads in by_layers.items():
            per_head = assign_ranges(heads, n_heads, f"{key}.{layers}")
            for li in parse_range(layers, n_layers, f"{key}.{layers}"):
                for h, p in enumerate(per_head):
                    if p is not None:
                        grid[li][h] = p
        for li in dense_layer_ids(
            self.dense_layers, n_layers, f"{key.rpartition('.')[0]}.dense_layers"
        ):
            grid[li] = [None] * n_heads
        for li, row in enumerate(grid):  # one block size per layer: kernels tile with it
            sizes = {
                p.get("block_size", DEFAULT_BLOCK_SIZE)
                for p in row
                if p is not None and p["type"] != "dense"
            }
            check(
                len(sizes) <= 1,
                f"{key}.{li}",
                f"heads of one layer must share block_size, got {sorted(sizes)}",
            )
            dims = {p.get("indexer", 0) for p in row if p is not None} - {0}
            check(
                len(dims) <= 1,
                f"{key}.{li}",
                f"a layer has one indexer: its heads must share indexer, got {sorted(dims)}",
            )
        return grid

    def validate(self, n_layers: int, n_heads: int, key: str = "model.attention") -> None:
        check_choice(self.backend, ATTN_BACKENDS, f"{key}.backend")
        check(
            self.key_conv == 0 or 2 <= self.key_conv <= 8,
            f"{key}.key_conv",
            f"taps of the key convolution: 0 (none) or 2..8, got {self.key_conv}",
        )
        check(
            self.indexer_weight >= 0,
            f"{key}.indexer_weight",
            f"weighs a distillation loss: must be >= 0, got {self.indexer_weight}",
        )
        for name in ("dense_warmup", "dense_finish"):
            v = getattr(self, name)
            check(0.0 <= v <= 1.0, f"{key}.{name}", f"must be a fraction in [0, 1], got {v}")
        check_choice(self.dense_phase_heads, ("all", "selecting"), f"{key}.dense_phase_heads")
        check(
            self.dense_warmup + self.dense_finish <= 1.0,
            f"{key}.dense_finish",
            f"dense_warmup + dense_finish = {self.dense_warmup + self.dense_finish} exceeds 1",
        )
        check_choice(self.flex_kernel, FLEX_KERNELS, f"{key}.flex_kernel")
        check(
            self.reference_below >= -1,
            f"{key}.reference_below",
            f"must be >= -1, got {self.reference_below}",
        )
        check(
            hasattr(self.kernel_options, "keys"),
            f"{key}.kernel_options",
            "must be a mapping of flex kernel options",
        )
        grid = self.layer_head_patterns(n_layers, n_heads, f"{key}.patterns")
        sizes = {
            p.get("block_size", DEFAULT_BLOCK_SIZE)
            for row in grid
            for p in row
            if p and p["type"] != "dense"
        }
        if self.backend == "flex":
            bad = sorted(b for b in sizes if b < MIN_FLEX_BLOCK)
            check(
                not bad,
                f"{key}.patterns",
                f"block_size {bad[0] if bad else 0} is below the {MIN_FLEX_BLOCK} tokens "
                f"flex tiles (use backend reference for smaller blocks)",
            )
        if self.flex_kernel == "flash":
            bad = sorted(b for b in sizes if b % FLASH_BLOCK)
            check(
                not bad,
                f"{key}.flex_kernel",
                f"flash tiles {FLASH_BLOCK}-token blocks; block_size {bad[0] if bad else 0} "
                f"cannot run on it",
            )

    def check_runtime(self, device_type: str, key: str = "model.attention") -> None:
        """Before any work: the fast paths this config asks for explicitly exist on this machine."""
        if self.backend == "flash_attn" or self.flex_kernel == "flash":
            k = f"{key}.backend" if self.backend == "flash_attn" else f"{key}.flex_kernel"
            why = fast_path_missing(device_type)
            check(why is None, k, f"needs flash-attn-4 on a Hopper/Blackwell GPU: {why}")


def fast_path_missing(device_type: str) -> Optional[str]:
    """None when flash-attn-4 (``flash_attn.cute``) imports and the GPU is sm90/sm100; else why
    not."""
    import importlib.util

    if device_type != "cuda":
        return f"device is {device_type}"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        return f"GPU compute capability {major}.x is not Hopper (9.x) or Blackwell (10.x)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else 'flash_attn.cute is not importable (pip install -e ".[gpu]")'
