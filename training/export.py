"""Export a trained run: ``python -m moezoo.training.export --run runs/X --hf out_dir`` and/or
``--file model.safetensors``.

- ``--hf DIR``: a transformers ``save_pretrained`` folder (config.json + model.safetensors, through
  ``zoo.hf.to_hf``) plus the run's ``tokenizer.model``;
  ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it, and ``model.init_from: DIR`` starts a new
  run from it.
- ``--file PATH``: one consolidated file of the zoo state dict (zoo parameter names):
  ``.safetensors`` (resolved config as YAML in the metadata) or anything else as a ``torch.save`` of
  ``{"model": state_dict, "config": dict}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import yaml

from moezoo.configs import Config, ConfigError, to_dict
from moezoo.configs.errors import require_extra


def export_hf(model, tokenizer_path: str, out_dir: str) -> None:
    from moezoo.zoo.hf import to_hf
    from moezoo.zoo.pretrained import quiet_transformers

    with quiet_transformers():
        to_hf(model).save_pretrained(out_dir, safe_serialization=True)
    shutil.copyfile(tokenizer_path, os.path.join(out_dir, "tokenizer.model"))


def export_file(model, cfg: Config, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        from safetensors.torch import save_model

        # save_model, not save_file: it drops the tied output weight that shares the embedding's
        # storage.
        save_model(model, path, metadata={"config": yaml.safe_dump(to_dict(cfg), sort_keys=False)})
    else:
        import torch

        torch.save({"model": model.state_dict(), "config": to_dict(cfg)}, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moezoo.training.export", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--run",
        required=True,
        help="runs/<name> (its latest run), a run folder (runs/<name>/<N>), its checkpoints/ or "
        "one step_* checkpoint",
    )
    p.add_argument("--hf", default=None, help="write a transformers save_pretrained folder here")
    p.add_argument(
        "--file", default=None, help="write one consolidated .safetensors (or torch.save) file here"
    )
    a = p.parse_args(argv)
    try:
        if not (a.hf or a.file):
            raise ConfigError("export", "give --hf DIR and/or --file PATH")
        if a.hf:
            require_extra("transformers", "hf", "--hf")
        from .trained import load_run

        model, tok, cfg, ckpt = load_run(a.run)
        if a.hf:
            export_hf(model, tok.path, a.hf)
        if a.file:
            export_file(model, cfg, a.file)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {', '.join(x for x in (a.hf, a.file) if x)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
