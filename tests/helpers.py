"""Helpers shared by the tests (the one place they live; tests import them, never each other).

- the repository root ``ROOT``; training runs: ``tiny_overrides``, ``train_cli``, ``tiny_moe_cfg``;
  multi-process: ``spawn`` (forked gloo ranks);
- HF parity: ``TOL``, ``V``, ``randomize_``, ``tokens``, ``assert_same_logits``, ``HF_FAMILIES``,
  ``tiny_hf``;
- attention: ``BS``, ``plain_attention``, ``make_inputs``, ``fa_check``, ``run_criterion``,
  ``emulated_counts``, ``mask_mod_covers_whole_tiles``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from moezoo.configs import load_config
from moezoo.layers import pattern_mask, sparse_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def bench_script(name: str):
    """``bench/<name>.py`` as a module (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def subprocess_env(**extra) -> dict:
    """The environment for a child Python: this one's, with the checkout first on PYTHONPATH (kept,
    not replaced: dependencies installed with ``pip --target`` on a GPU box live there)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def tiny_overrides(tmp, corpus, **extra) -> list[str]:
    """Overrides that make any preset a ~30k-parameter model training on ``corpus`` under
    ``tmp``."""
    ov = {
        "model.vocab_size": 512,
        "model.dim": 32,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.ffn_hidden": 64,
        "model.max_seq_len": 64,
        "data.source": corpus,
        "data.cache_dir": f"{tmp}/cache",
        "data.max_files": 0,
        "train.seq_len": 32,
        "train.batch_size": 4,
        "train.steps": 20,
        "train.eval_every": 10,
        "train.eval_batches": 2,
        "train.out_dir": f"{tmp}/run",
        "logging.wandb": "disabled",
        "logging.log_every": 5,
        "logging.progress": False,
        "logging.plots": False,
        "optim.warmup_steps": 2,
        "optim.lr": 3e-3,
        "checkpoint.every": 10,
        # CPU tests stay CPU tests on a GPU machine (losses, tolerances and torchrun ranks as
        # written); the GPU tests set train.device=cuda themselves.
        "train.device": "cpu",
    }
    ov.update(extra)
    return [f"{k}={v}" for k, v in ov.items()]


def poison_loss(tr, bad) -> None:
    """Make the loss of every step index of Trainer ``tr`` for which ``bad(step)`` holds NaN."""
    real = tr.compute_loss

    def poisoned(x, y, w=None):
        loss, parts = real(x, y, w)
        return (loss * float("nan"), parts) if bad(tr.step) else (loss, parts)

    tr.compute_loss = poisoned


def train_cli(tmp, corpus, nproc, *extra, preset="zoo/tiny_dense.yaml", batch=4):
    """Run train.py (``nproc`` > 1: under torchrun) on a tiny model for 6 steps; the per-step total
    losses."""
    ov = tiny_overrides(
        tmp,
        corpus,
        **{
            "train.steps": 6,
            "logging.log_every": 1,
            "train.eval_every": 6,
            "train.batch_size": batch,
            "checkpoint.every": 3,
            "data.cache_dir": f"{os.path.dirname(tmp)}/cache",
        },
    )
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "train.py",
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        cmd + ["--config", preset, *ov, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [row["loss/total"] for row in rows if "loss/total" in row]


def tiny_moe_cfg(*overrides):
    """A 2-layer, 4-expert MoE config on CPU (parallel and checkpoint tests)."""
    return load_config(
        None,
        [
            "model.vocab_size=64",
            "model.dim=16",
            "model.n_layers=2",
            "model.n_heads=2",
            "model.ffn=moe",
            "model.moe.num_experts=4",
            "model.moe.top_k=2",
            "model.moe.hidden_dim=24",
            "model.moe.aux_loss_coef=0.1",
            "model.moe.z_loss_coef=0.01",
            "model.max_seq_len=16",
            "train.seq_len=8",
            "train.batch_size=2",
            "train.device=cpu",
            *overrides,
        ],
    )


def spawn(fn, world: int, *args) -> None:
    """Start ``world`` CPU ranks joined in a gloo process group; each runs ``fn(rank, world,
    *args)``. The one process-spawn helper of the multi-process tests.

    Forked (fast: no re-import of torch) on a machine without CUDA; spawned fresh where CUDA is
    available. There the parent has touched the driver whatever it ran
    (``torch.cuda.is_available()``, which every GPU test module's skip check calls at collection,
    initialises it), and a forked child cannot use CUDA: ``torch.optim.Adam.step`` asks whether the
    stream is capturing, and the child dies with "CUDA error: initialization error" (e.g.
    test_recluster_of_fsdp2_sharded_weights_matches_one_process, whenever its worker has run no GPU
    test before it). A CUDA backward in the parent also breaks a forked child's
    backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing")."""
    import tempfile

    import torch.multiprocessing as mp

    method = "spawn" if torch.cuda.is_available() else "fork"
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _spawn_entry,
            args=(fn, world, os.path.join(d, "store"), args),
            nprocs=world,
            join=True,
            start_method=method,
        )


def _spawn_entry(rank, fn, world, store, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# --- MoE experts
def grouped_grads_eager_and_compiled(
    ex, tokens: int, top_k: int, align: int = 1, backend: str = "aot_eager"
):
    """GroupedExperts ``ex`` (bfloat16, ``ex.w1 [E, H, D]``) on its grouped path over a random top-k
    dispatch plan of ``tokens`` rows, eager and ``torch.compile(fullgraph=True)``: two lists [dx,
    dw1, dw2, dw3] of the same weighted-sum loss (rows past the last group left out)."""
    from moezoo.layers.moe.experts import make_plan

    E, _, D = ex.w1.shape
    plan = make_plan(
        torch.stack([torch.randperm(E)[:top_k] for _ in range(tokens)]), E, align=align
    )
    x = torch.randn(tokens, D).bfloat16()
    dy = torch.randn(plan.num_rows, D)
    rows = plan.inv.reshape(-1).long()

    def step(xi):
        y = ex._grouped(xi, plan.group_sizes, None, plan)
        return (y[rows].float() * dy[rows]).sum()

    outs = []
    for fn in (step, torch.compile(step, backend=backend, fullgraph=True)):
        ex.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        fn(xi).backward()
        outs.append([xi.grad, ex.w1.grad, ex.w2.grad, ex.w3.grad])
    return outs


# --- HF parity

TOL = 1e-4


V = 96


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Fresh random weights: matrices and biases N(0, std), 1-D norm weights 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else std * noise)


def tokens(seed: int, b: int = 2, s: int = 13) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def decode_layer(layer, x, cos, sin, prefix: int) -> torch.Tensor:
    """An attention layer's output ``[B, S, D]`` through its KV cache: ``x[:, :prefix]`` in one
    call, then one token a call (no grad); the cache is left set up for the caller to inspect."""
    B, S = x.shape[:2]
    with torch.no_grad():
        layer.setup_cache(B, S)
        outs = [layer(x[:, :prefix], cos[:prefix], sin[:prefix])]
        outs += [
            layer(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], start_pos=t)
            for t in range(prefix, S)
        ]
    return torch.cat(outs, 1)


def tiny_attention_model(attention, seed: int = 0, mla: bool = False):
    """A 2-layer GQA (4 / 2 heads, dim 32) or MLA model in eval mode with ``attention`` (an
    AttentionConfig) and fresh random weights (``randomize_``): the model the attention options'
    tests (SSMax, the key convolution) compare."""
    from moezoo.configs import MLAConfig, ModelConfig
    from moezoo.zoo import build_model

    cfg = ModelConfig(
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=40,
        max_seq_len=64,
        rope_theta=500.0,
        attention=attention,
    )
    if mla:
        cfg.attention_type = "mla"
        cfg.mla = MLAConfig(
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        )
    cfg.validate()
    m = build_model(cfg).eval()
    randomize_(m, seed)
    return m


def assert_same_logits(hf_model, model, seed: int = 0) -> None:
    x = tokens(seed)
    with torch.no_grad():
        ref = hf_model(x).logits.float()
        out = model(x)
    assert ref.std() > 0.1, "logits too small for the tolerance to mean anything"
    assert (out - ref).abs().max().item() < TOL


# tiny configs of the HF families beyond Llama / Mixtral / Qwen2-MoE (zoo.hf): class prefix, extra
# fields
HF_BASE = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=500.0,
    intermediate_size=40,
)
HF_FAMILIES = {
    "mistral": ("Mistral", dict(head_dim=12, sliding_window=5)),
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("Qwen3", dict(head_dim=12, attention_bias=False)),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            head_dim=12,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            moe_intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=2,
        ),
    ),
    "olmoe": ("Olmoe", dict(num_experts=6, num_experts_per_tok=2, intermediate_size=16)),
    "deepseek_v3": (
        "DeepseekV3",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
        ),
    ),
}


def tiny_hf(family: str, seed: int = 0, **kw):
    """A tiny random ``<family>ForCausalLM`` in eval mode, weights (and DeepSeek's selection bias)
    re-drawn."""
    import transformers

    name, extra = HF_FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{name}Config")(**{**HF_BASE, **extra, **kw})
    m = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    randomize_(m, seed)
    # the selection bias is a buffer: draw it too, large enough to change choices
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(
                    0, 0.3, generator=torch.Generator().manual_seed(seed)
                )
    return m


# --- attention

BS = 16


def plain_attention(q, k, v, mask):
    """Textbook softmax(q k^T / sqrt(D) + mask) v in the inputs' dtype; KV repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def make_inputs(B, H, Hk, T, D=16, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(device, dtype) for h in (H, Hk, Hk))
    return q, k, v


def fa_check(name, got, ref32, plain):
    """FlashAttention acceptance: |got - ref32| <= 2 |plain - ref32| (plus float noise)."""
    err = (got.float() - ref32).abs().max().item()
    base = (plain.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-5, f"{name}: error {err:.3g} vs plain-torch {base:.3g}"


def run_criterion(pattern, backend, B, H, Hk, T, grads=True, D=16, device="cpu"):
    q, k, v = make_inputs(B, H, Hk, T, D=D, device=device)
    mask = pattern_mask(pattern, T, T, H, q=q, k=k)  # estimation sees the same bf16 values
    if mask.dim() == 3:
        mask = mask[None]
    leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
    leaves16 = [t.clone().requires_grad_() for t in (q, k, v)]
    leavesb = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    ref32 = plain_attention(*leaves32, mask)
    plain = plain_attention(*leaves16, mask)
    got = sparse_attention(*leavesb, pattern, backend=backend)
    fa_check("out", got, ref32.detach(), plain.detach())
    if not grads:
        return
    do = torch.randn(ref32.shape, generator=torch.Generator().manual_seed(1)).to(ref32.device)
    for out in (ref32, plain, got):
        out.backward(do.to(out.dtype))
    for name, a, b, c in zip(("dq", "dk", "dv"), leavesb, leaves32, leaves16):
        fa_check(name, a.grad, b.grad, c.grad)


def emulated_counts(bm, T, slots=None):
    """How often each (q, key) pair is attended when a kernel visits only the listed blocks (full:
    every element, partial: through mask_mod), per batch element: ``[B, H, T, T]``. ``slots [B or 1,
    H, NVp]``: the keys are ``cat(K[slots], K)`` (layers.sparse_attention.gather_columns); slots map
    back to their positions."""
    pn, pi, fn, fi = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
    QB, KB = bm.BLOCK_SIZE
    if slots is None:
        slots = torch.zeros(1, pn.shape[1], 0, dtype=torch.int32)
    B, H = max(pn.shape[0], slots.shape[0]), pn.shape[1]
    nvp = slots.shape[-1]
    L = nvp + T
    qi, ki = torch.arange(T)[:, None], torch.arange(L)[None, :]
    counts = torch.zeros(B, H, T, T, dtype=torch.int64)
    for b in range(B):
        pb, fb = min(b, pn.shape[0] - 1), min(b, fn.shape[0] - 1)
        for h in range(H):
            mm = bm.mask_mod(torch.tensor(b), torch.tensor(h), qi, ki)
            seen = torch.zeros(T, L, dtype=torch.bool)
            for qb in range(pn.shape[2]):
                rows = slice(qb * QB, (qb + 1) * QB)
                for kb in pi[pb, h, qb, : pn[pb, h, qb]].tolist():
                    seen[rows, kb * KB : (kb + 1) * KB] |= mm[rows, kb * KB : (kb + 1) * KB]
                for kb in fi[fb, h, qb, : fn[fb, h, qb]].tolist():
                    seen[rows, kb * KB : (kb + 1) * KB] = True
            pos = torch.cat([slots[min(b, slots.shape[0] - 1), h].long(), torch.arange(T)])
            real = pos < T  # empty slots must never be attended
            assert not seen[:, ~real].any()
            counts[b, h].index_add_(1, pos[real], seen[:, real].long())
    return counts


def mask_mod_covers_whole_tiles(bm, T, kv_len=None):
    """Kernels evaluate mask_mod over whole tiles, past the sequence end: every table read stays in
    bounds (eager indexing raises where a GPU kernel would read out of bounds)."""
    QB, KB = bm.BLOCK_SIZE
    qi = torch.arange(-(-T // QB) * QB)[:, None]
    ki = torch.arange(-(-(kv_len or T) // KB) * KB)[None, :]
    for b in range(bm.kv_num_blocks.shape[0]):
        for h in range(bm.kv_num_blocks.shape[1]):
            bm.mask_mod(torch.tensor(b), torch.tensor(h), qi, ki)


def _interpreter_loops_over_runtime_values() -> bool:
    """Triton 3.6's interpreter runs ``range()`` over a runtime value through ``int()`` of a
    1-element array, which numpy >= 2.4 refuses (Triton 3.9 is fine). Kernels whose loops run to a
    value read at run time (a group size from memory, a query tile's last key block) cannot take a
    constexpr bound."""
    import numpy as np

    try:
        import triton
    except ImportError:
        return True  # no triton: the test skips on its fixture's import anyway
    version = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    return version(triton.__version__) >= (3, 7) or version(np.__version__) < (2, 4)


needs_interpreter_loops = pytest.mark.skipif(
    not _interpreter_loops_over_runtime_values(),
    reason="Triton < 3.7's interpreter with numpy >= 2.4 cannot "
    "loop to a runtime bound; the compiled kernels' GPU test covers them",
)
