"""The package layout's promises: one import name (moezoo) that no root folder of the checkout
shadows or is shadowed by; arrows point one way (kernels <- layers <- zoo <- training <- train.py,
configs imports none of them, no import cycle at all, function-level imports included); the library
imports and runs on CPU with triton absent."""

import ast
import os
import subprocess
import sys

from helpers import ROOT, subprocess_env

PACKAGES = ["configs", "kernels", "layers", "zoo", "training"]
# What each package may import (besides itself); everything may import configs.
ALLOWED = {
    "configs": set(),
    "kernels": {"configs"},
    "layers": {"configs", "kernels"},
    "zoo": {"configs", "kernels", "layers"},
    "training": {"configs", "kernels", "layers", "zoo"},
}


def _module_name(path: str) -> str:
    """``moezoo.<sub>...`` for a module file: a root folder's modules and moezoo/<sub>/__init__.py
    alike."""
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    return rel if rel.startswith("moezoo.") else f"moezoo.{rel}"


def _package(module: str) -> str:
    """The subpackage a ``moezoo.<sub>...`` module belongs to."""
    return module.split(".")[1]


def _imports(path: str) -> set[str]:
    """Every project module ``path`` imports, at any depth of the file (function-level imports
    too)."""
    mod = _module_name(path)
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in out if m.startswith("moezoo.") and _package(m) in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = {}
    for pkg in PACKAGES:
        for top in (os.path.join(ROOT, pkg), os.path.join(ROOT, "moezoo", pkg)):
            for d, _, names in os.walk(top):
                files.update(
                    {
                        _module_name(os.path.join(d, n)): os.path.join(d, n)
                        for n in names
                        if n.endswith(".py")
                    }
                )

    # an import of a package or a name inside a module points at the module that exists
    def resolve(m):
        while m and m not in files:
            m = m.rpartition(".")[0]
        return m

    return {m: {r for r in map(resolve, _imports(p)) if r and r != m} for m, p in files.items()}


def test_imports_point_downward_only():
    bad = [
        f"{m} imports {t}"
        for m, ts in _graph().items()
        for t in ts
        if _package(t) != _package(m) and _package(t) not in ALLOWED[_package(m)]
    ]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ re-exporting its modules is not a cycle of ideas; drop package ->
    # own-submodule edges
    edges = {
        m: {
            t
            for t in ts
            if not (t.startswith(m + ".") and os.path.isdir(os.path.join(ROOT, *m.split(".")[1:])))
        }
        for m, ts in graph.items()
    }
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


HIDE_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton hidden by the test")
sys.meta_path.insert(0, _NoTriton())
import torch
import moezoo.kernels.launch
assert not moezoo.kernels.launch.HAVE_TRITON
from moezoo.layers import RMSNorm, MoE, NeuronRoutedFFN, SwiGLU, sparse_attention, SparsityPattern
from moezoo.zoo import build_model
from moezoo.configs import load_config
torch.manual_seed(0)
moe = MoE(dim=16, hidden_dim=32, num_experts=4, top_k=2)
x = torch.randn(2, 5, 16, requires_grad=True)
moe(x).sum().backward()
ffn = NeuronRoutedFFN.from_dense(SwiGLU(16, 32), 4, 2)
ffn(torch.randn(3, 16)).sum().backward()
cfg = load_config(None, ["model.vocab_size=64", "model.dim=16", "model.n_layers=1",
                         "model.n_heads=2", "model.ffn=moe", "model.moe.num_experts=4",
                         "model.moe.top_k=2", "model.max_seq_len=16", "train.seq_len=8"])
model = build_model(cfg.model)
loss, _ = model.loss(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
loss.backward()
print("ok")
"""


def test_library_imports_and_trains_on_cpu_without_triton():
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(
        [sys.executable, "-c", HIDE_TRITON],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_test_files_have_unique_basenames():
    # pytest imports test files by basename (tests/ folders are not packages): two files of one name
    # in different folders stop collection with "import file mismatch".
    seen = {}
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                assert f not in seen, f"{f} in both {seen[f]} and {d}"
                seen[f] = d
