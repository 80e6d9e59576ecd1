"""Start from pretrained weights: ``model.init_from: <HF folder or model id already on disk>``.

    check_init_from(cfg.model)          # cheap: reads the HF config only; ConfigError naming the
    first key that differs load_init_from(model, cfg.model)    # copies the HF weights (through
    zoo.hf.from_hf) into the built model

transformers loads with ``local_files_only=True``: nothing is downloaded. The run's ``model``
section must describe the same architecture (the trainer builds the model from it, then copies the
weights); ``--print-config`` of a run with ``init_from`` shows what it needs.
"""

from __future__ import annotations

import torch
from torch import nn

from moezoo.configs import ConfigError, ModelConfig

# The fields that decide the weights' names and shapes.
_SHAPE_KEYS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "hidden_dim",
    "tie_embeddings",
    "attn_bias",
)


def _hf_config(name: str):
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            "model.init_from", f"cannot load {name!r} from disk ({str(e).splitlines()[0]})"
        ) from None


def check_init_from(cfg: ModelConfig) -> None:
    from .hf_config import config_from_hf

    theirs = config_from_hf(_hf_config(cfg.init_from))
    for k in _SHAPE_KEYS + ("ffn",):
        mine, other = getattr(cfg, k), getattr(theirs, k)
        if mine != other:
            key = {"kv_heads": "n_kv_heads", "hidden_dim": "ffn_hidden"}.get(k, k)
            raise ConfigError(
                f"model.{key}", f"is {mine!r} but model.init_from={cfg.init_from} has {other!r}"
            )


@torch.no_grad()
def load_init_from(model: nn.Module, cfg: ModelConfig) -> None:
    """Copy the weights of ``cfg.init_from`` into ``model`` (built from ``cfg``), in ``model``'s
    dtype."""
    import transformers

    from .hf import from_hf

    check_init_from(cfg)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        cfg.init_from, local_files_only=True, torch_dtype=torch.float32
    )
    source = from_hf(hf_model).state_dict()
    own = model.state_dict()
    for k, v in source.items():
        if k not in own or own[k].shape != v.shape:
            raise ConfigError(
                "model.init_from",
                f"{cfg.init_from}: weight {k} {tuple(v.shape)} does not fit this "
                f"model ({tuple(own[k].shape) if k in own else 'absent'})",
            )
    model.load_state_dict(source, strict=False)
