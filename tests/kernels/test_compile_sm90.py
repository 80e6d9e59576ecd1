"""Every Triton kernel compiles for Hopper (sm_90), on any machine: each launcher runs on tiny CPU
inputs with its modules' ``jit`` swapped for one that compiles the launch (``triton.compile`` to a
cubin, the argument types taken from the real launch arguments) instead of running it.

The interpreter tests check what the kernels compute, but the interpreter runs the kernel body as
Python: it accepts what the compiler refuses. A variable given another shape in one branch of an
``if`` runs interpreted and fails to compile; this catches it before the kernel reaches a GPU. And
no kernel spills more than a few bytes of registers (ptxas's stack frame, read with cuobjdump): an
FP8 tile kernel at 128 x 128 on 8 warps spills up to 200 B a thread. Needs
triton with its NVIDIA backend (it ships ptxas); no GPU."""

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

MAX_STACK = 16  # bytes of per-thread stack frame a kernel may have

_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}


class _CompileOnly:
    """Stands in for ``kernels.launch.jit(fn)``: ``[grid](*args, **meta)`` compiles for sm_90,
    records it."""

    compiled: list = []

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kw):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
        names = list(inspect.signature(self.fn).parameters)
        sig, attrs = {}, {}
        for i, (name, a) in enumerate(zip(names, args)):
            # 16-divisible pointers and ints carry Triton's divisibility attribute, as a real
            # launch's do
            if isinstance(a, torch.Tensor):
                sig[name] = "*" + _TYPES[a.dtype]
                aligned = a.data_ptr() % 16 == 0
            elif isinstance(a, bool):
                sig[name], aligned = "i1", False
            elif isinstance(a, int):
                sig[name], aligned = ("i64" if abs(a) >= 2**31 else "i32"), a % 16 == 0
            else:
                sig[name], aligned = "fp32", False
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        sig.update({name: "constexpr" for name in kw})
        assert set(sig) == set(names), (self.fn.__name__, set(names) - set(sig))
        src = ASTSource(fn=JITFunction(self.fn), signature=sig, constexprs=dict(kw), attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        self.compiled.append((self.fn.__name__, dict(kw), _stack_bytes(kernel.asm["cubin"])))


def _stack_bytes(cubin: bytes):
    """The kernel's per-thread stack frame (register spills) from cuobjdump, which triton ships;
    None if absent."""
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = [int(w.split(":")[1]) for w in out.split() if w.startswith("STACK:")]
    return found[0] if found else None


def _launch_selection():
    """The sparse-attention selection's kernels at 512 and 1024 key blocks (64k / 128k tokens of
    128), with every flag, at their default tiles and those bench/attention.py's selection stages
    time."""
    from moezoo.kernels.key_block_max import key_block_max
    from moezoo.kernels.token_block_topk import token_block_topk

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 256, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    for tile in ({}, dict(block_q=128, num_warps=8), dict(block_k=64)):
        key_block_max(q, k, 0, 128, 0.1, **tile)
    for nk in (512, 1024):
        s = torch.randn(1, 2, 4, nk, generator=g)
        own = torch.randn(1, 2, 4, generator=g)
        bits = torch.empty(1, 2, 4, nk // 32, dtype=torch.int32)
        tile = torch.full((1, 2, 1, nk), float("-inf"))
        ks = torch.tensor([16, 8])
        token_block_topk(s, 0, 128, ks, bits)
        for shape in ({}, dict(rows=1, num_warps=1), dict(rows=1, num_warps=2)):
            acc = torch.zeros(2)
            token_block_topk(s, 0, 128, ks, bits, own, 10, tile, 0, acc, **shape)


def _launch_everything():
    from moezoo.kernels import adamw, moe_combine, moe_fp8, moe_permute, moe_swiglu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    offs = torch.tensor([100, 100, 250, 300], dtype=torch.int32)  # an empty expert included
    pends = torch.tensor([112, 128, 272, 336], dtype=torch.int32)
    moe_fp8.quantize_rows_triton(x)
    moe_fp8.quantize_groups_t_triton(x, offs, pends, 336)
    moe_fp8.quantize_dual_triton(x, offs, pends, 336)
    for dtype in (torch.bfloat16, torch.float32):  # bf16 and float32 master weights
        moe_fp8.quantize_weight_dual_triton(torch.randn(4, 96, 256, generator=g).to(dtype))
    inv = torch.randperm(64, generator=g).view(32, 2).int()
    rows = moe_permute.permute_rows(x[:32], inv, 64, zero_fill=False)
    w = torch.rand(32, 2, generator=g)
    moe_combine.combine_rows(rows, inv, w)
    moe_combine.combine_rows(rows, inv, None, ys2=rows)
    moe_combine.combine_rows_backward(x[:32], rows, inv, w, zero_fill=True)
    a, b = x[:64], x[64:128]
    for scale in (None, torch.rand(64, generator=g)):
        moe_swiglu.swiglu_rows_fwd(a, b, scale)
        moe_swiglu.swiglu_rows_bwd(a, a, b, scale)
    ws = [torch.randn(100, generator=g)]
    moments = [torch.zeros(100), torch.zeros(100)]
    adamw._adamw_triton(
        ws,
        [ws[0].bfloat16()],
        *[[m] for m in moments],
        [ws[0].bfloat16()],
        0.9,
        0.9,
        0.95,
        1e-8,
        1e-3,
        0.5,
        torch.tensor(1.0),
    )
    adamw._adamw_triton(
        ws,
        [ws[0].clone()],
        *[[m] for m in moments],
        None,
        0.9,
        0.9,
        0.95,
        1e-8,
        1e-3,
        0.5,
        None,
        torch.tensor(0.0),
    )


@pytest.mark.usefixtures("triton_interpreter")  # the launchers take the Triton path on CPU tensors
def test_every_triton_kernel_compiles_for_sm90(monkeypatch):
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton without its NVIDIA backend: {e}")
    from moezoo.kernels import (
        adamw,
        key_block_max,
        moe_combine,
        moe_fp8,
        moe_permute,
        moe_swiglu,
        token_block_topk,
    )

    modules = (
        adamw,
        moe_combine,
        moe_fp8,
        moe_permute,
        moe_swiglu,
        key_block_max,
        token_block_topk,
    )
    for module in modules:
        monkeypatch.setattr(module, "jit", _CompileOnly)
    monkeypatch.setattr(_CompileOnly, "compiled", [])
    _launch_everything()
    _launch_selection()
    names = {name for name, _, _ in _CompileOnly.compiled}
    kernel_fns = {
        n
        for m in modules
        for n, f in vars(m).items()
        if n.startswith("_") and n.endswith("_kernel") and callable(f)
    }
    assert names == kernel_fns, f"not launched here: {kernel_fns - names}"
    # no real register spills (a spilled FP8 tile kernel moved ~20x its tile's bytes through local
    # memory). A few bytes are allowed: triton 3.6's ptxas gives the FP8 cast pass's groups-only
    # variant at its default tile (32 x 128, 4 warps; 3.9's: none) an 8-byte frame, and that
    # variant runs as fast as the tiles with none (bench/fp8_quant.py's dy_cols; BENCHMARKS.md, FP8
    # experts).
    spills = [
        (name, meta, stack)
        for name, meta, stack in _CompileOnly.compiled
        if stack and stack > MAX_STACK
    ]
    assert not spills, spills
