"""moezoo: MoE and sparse-attention layers, LLaMA-style models assembled from YAML, and their
trainer.

One import name, five subpackages: ``moezoo.layers``, ``moezoo.kernels``, ``moezoo.zoo``,
``moezoo.configs``, ``moezoo.training``. In a source checkout each subpackage's modules live in the
root folder of that name (``layers/``, ``kernels/``, ...), which holds no ``__init__.py``: a root
folder is then at most a namespace portion, so running from the checkout (``python train.py``,
``python -m``, ``pytest``) never shadows an installed package of the same name (Hugging Face's
``kernels``, a user's ``training``). Each subpackage's ``__init__.py`` lives here and adds its root
folder to ``__path__``; a built wheel places the modules beside it instead.
"""

from pathlib import Path

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent


def _checkout_path(path: list[str], name: str) -> list[str]:
    """``__path__`` of ``moezoo.<name>``: its own folder, plus ``<checkout>/<name>`` in a source
    tree."""
    folder = _CHECKOUT / name
    if (_CHECKOUT / "pyproject.toml").is_file() and folder.is_dir():
        return [*path, str(folder)]
    return path
