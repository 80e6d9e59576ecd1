"""The README's Python example runs as written (users copy it first)."""

import re

from helpers import ROOT


def test_readme_layer_example_runs():
    with open(f"{ROOT}/README.md") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "README has no python example"
    scopes = []
    for code in blocks:
        scopes.append({})
        exec(compile(code, "README.md", "exec"), scopes[-1])
    scope = next(s for s in scopes if "out" in s)  # the layer example
    dst = next((s["dst"] for s in scopes if "dst" in s), None)  # the DST-on-any-model example
    assert dst is None or abs(dst.stats()["density"] - 0.1) < 0.01
    assert scope["y"].shape == scope["x"].shape and scope["out"].shape == scope["x"].shape
    assert scope["loss"].requires_grad
