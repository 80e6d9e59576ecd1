"""Tiny random Qwen3-MoE and DeepSeek-V3 models imported from HF train end to end.

The branch has no ``model.init_from`` yet (the user-workflow issue adds it), so the path is the
Python API: ``from_hf`` -> save the config (``configs.save_config``) and weights (``state_dict``) ->
train.py's ``main`` on the saved config, and the saved weights loaded into ``build_model`` and
trained a few AdamW steps.
"""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import tiny_hf, tiny_overrides, tokens  # noqa: E402
from moezoo.configs import load_config, save_config  # noqa: E402
from moezoo.training.cli import main as train_main  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402
from moezoo.zoo.hf import from_hf  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_imported_from_hf_saves_loads_and_trains(family, tmp_path, corpus_dir):
    imported = from_hf(tiny_hf(family, seed=9, vocab_size=512))
    weights = str(tmp_path / "weights.pt")
    torch.save(imported.state_dict(), weights)
    ov = [
        o
        for o in tiny_overrides(
            str(tmp_path),
            corpus_dir,
            **{
                "train.steps": 3,
                "train.eval_every": 3,
                "checkpoint.every": 3,
                "logging.log_every": 1,
                "data.cache_dir": f"{os.path.dirname(tmp_path)}/cache",
            },
        )
        if not o.startswith("model.")
    ]
    cfg = load_config(None, ov)
    cfg.model = imported.cfg
    path = str(tmp_path / "imported.yaml")
    save_config(cfg, path)
    # train.py's entry, in this process (no 10 s of imports)
    assert train_main(["--config", path]) == 0
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")

    model = build_model(load_config(path).model)  # the saved config rebuilds the imported model ...
    model.load_state_dict(torch.load(weights))  # ... and takes its weights
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = tokens(1, b=4, s=16) * 5, tokens(2, b=4, s=16) * 5
    losses = []
    for _ in range(4):
        loss, _ = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_minference_json_patterns_apply_to_imported_models(family, tmp_path):
    import copy
    import json

    imported = from_hf(tiny_hf(family, seed=10), moe_backend="torch")
    layer = {
        "0": ["stream_llm", 1, 3, 0.9],
        "1": ["vertical_and_slash", 2, 2, 0.8],
        "2": ["stream_llm", 2, 2, 0.7],
        "3": ["block_sparse", 1, 0, 0.6],
    }
    path = tmp_path / "minference.json"
    path.write_text(json.dumps([layer] * imported.cfg.n_layers))
    cfg = copy.deepcopy(imported.cfg)
    cfg.attention.minference_json = str(path)
    cfg.validate()
    sparse = build_model(cfg).eval()
    sparse.load_state_dict(imported.state_dict())
    x = tokens(3, b=2, s=13)
    with torch.no_grad():
        dense_out, sparse_out = imported(x), sparse(x)
    assert torch.isfinite(sparse_out).all() and (sparse_out - dense_out).abs().max() > 1e-2
    loss, _ = sparse.train().loss(x, tokens(4, b=2, s=13))
    loss.backward()
    assert torch.isfinite(loss)
