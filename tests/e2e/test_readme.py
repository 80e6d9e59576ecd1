"""The README's Python example runs as written (users copy it first)."""
import re

from helpers import ROOT


def test_readme_layer_example_runs():
    with open(f"{ROOT}/README.md") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
    assert scope["y"].shape == scope["x"].shape and scope["out"].shape == scope["x"].shape
    assert scope["loss"].requires_grad
