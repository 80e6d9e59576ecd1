"""Start from pretrained weights: ``model.init_from: <HF folder or model id already on disk>``.

    prepare_init_from(cfg)             # on disk? its tokenizer.model becomes data.tokenizer
    check_init_from(cfg.model)         # reads the HF config only: ConfigError naming a key
    load_init_from(model, cfg.model)   # copies the weights (zoo.hf.from_hf) into the model

transformers loads with ``local_files_only=True``: nothing is downloaded, and a path that is not
there is a one-line error naming ``model.init_from``. The run's ``model`` section must describe
the same architecture (the trainer builds the model from it, then copies the weights);
``--print-config`` of a run with ``init_from`` shows what it needs. Such a run is continued
training: its lr schedule is ``optim.init_from_lr`` / ``optim.init_from_warmup_steps``
(training.optim.schedule_targets).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch import nn

from moezoo.configs import Config, ConfigError, ModelConfig
from moezoo.configs.errors import require_extra

TOKENIZER_FILE = "tokenizer.model"  # what training.export writes beside the weights

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


@contextmanager
def quiet_transformers():
    """transformers' progress bars and info messages off (loading and saving a model prints
    "Loading weights: 100%|..." bars), restored after."""
    from transformers.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def local_folder(name: str) -> str:
    """The folder ``model.init_from`` names: the path itself, or a model id's snapshot in the
    Hugging Face cache. ConfigError naming ``model.init_from`` when it is neither (nothing is
    downloaded)."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(
                "model.init_from",
                f"{name} holds no config.json (not a transformers save_pretrained folder)",
            )
        return name
    if os.path.exists(name):
        raise ConfigError("model.init_from", f"{name} is a file; give the folder holding it")
    cached = None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):  # no hub client; a path that is no model id
        pass
    if not isinstance(cached, str):
        raise ConfigError(
            "model.init_from",
            f"{name}: no such folder, nor a model id in the Hugging Face cache (nothing is "
            f"downloaded: fetch it first, e.g. hf download {name})",
        )
    return os.path.dirname(cached)


def prepare_init_from(cfg: Config) -> str:
    """Before any work: check that ``model.init_from`` is on disk and give the run its tokenizer
    (a model's embeddings mean nothing under another one): the folder's ``tokenizer.model`` (the
    one training.export writes) when ``data.tokenizer`` is unset; a different ``data.tokenizer`` is
    refused, as ``--resume`` refuses one. Returns a line saying what the run starts from."""
    name = cfg.model.init_from
    tok = os.path.join(local_folder(name), TOKENIZER_FILE)
    given = cfg.data.tokenizer
    if not os.path.isfile(tok):
        if given is None:
            raise ConfigError(
                "model.init_from",
                f"{name} holds no sentencepiece {TOKENIZER_FILE}: give data.tokenizer=<the "
                f".model its vocabulary comes from> (a tokenizer trained here would not match "
                f"its embeddings)",
            )
        return f"model.init_from: {name}, tokenizer {given}"
    if given is None:
        cfg.data.tokenizer = tok
        return f"model.init_from: {name}, with its tokenizer {tok}"
    if not os.path.isfile(given):
        raise ConfigError("data.tokenizer", f"file not found: {given}")
    with open(tok, "rb") as a, open(given, "rb") as b:
        if a.read() != b.read():
            raise ConfigError(
                "data.tokenizer",
                f"{given} differs from {tok}, the tokenizer of model.init_from={name}; leave "
                f"data.tokenizer unset to use it",
            )
    return f"model.init_from: {name}, tokenizer {given}"


def _hf_config(name: str):
    require_extra("transformers", "hf", "model.init_from")
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(local_folder(name), local_files_only=True)
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
    require_extra("transformers", "hf", "model.init_from")
    import transformers

    from .hf import from_hf

    check_init_from(cfg)
    with quiet_transformers():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            local_folder(cfg.init_from), local_files_only=True, dtype=torch.float32
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
