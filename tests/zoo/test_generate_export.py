"""A tiny trained run: generate text from it, export it (HF folder, one file), and start a run from
the export."""

import os

import pytest
import torch

from helpers import tiny_overrides
from moezoo.configs import load_config
from moezoo.training import run
from moezoo.training.export import main as export_main
from moezoo.training.generate import main as generate_main
from moezoo.training.trained import load_run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    tmp = tmp_path_factory.mktemp("trained")
    cfg = load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp, corpus_dir, **{"train.steps": 10}))
    summary = run(cfg)
    return cfg, summary, tmp


def test_generate_prints_text_continuing_the_prompt(trained, capsys):
    cfg, _, _ = trained
    # the run folder keeps its tokenizer
    assert os.path.isfile(os.path.join(cfg.out_dir, "tokenizer.model"))
    assert (
        generate_main(
            ["--run", cfg.out_dir, "--prompt", "def ", "--max-new-tokens", "12", "--seed", "1"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > len("def \n")
    assert (
        generate_main(
            ["--run", cfg.out_dir, "--prompt", "def ", "--max-new-tokens", "12", "--seed", "1"]
        )
        == 0
    )
    assert capsys.readouterr().out == text  # seeded


def test_kv_cache_decoding_matches_full_forward(trained):
    from moezoo.zoo.sampling import generate

    model, tok, _, _ = load_run(trained[0].out_dir)
    prompt = tok.encode("import os\n")
    ids = generate(model, prompt, 10, temperature=0)  # greedy through the cache
    with torch.no_grad():
        full = model(ids[:, :-1]).argmax(-1)[:, len(prompt) - 1 :]
    assert torch.equal(full, ids[:, len(prompt) :])


def test_generate_names_a_run_without_checkpoints(tmp_path, capsys):
    assert generate_main(["--run", str(tmp_path)]) == 2
    assert "--run: no complete checkpoint" in capsys.readouterr().err


def test_exported_hf_folder_gives_the_same_logits(trained, tmp_path):
    cfg, _, _ = trained
    out = tmp_path / "hf"
    assert (
        export_main(
            ["--run", cfg.out_dir, "--hf", str(out), "--file", str(tmp_path / "m.safetensors")]
        )
        == 0
    )
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.model").is_file()
    model, _, _, _ = load_run(cfg.out_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-4, atol=1e-4)
    # The consolidated file loads into a freshly built model with the same result.
    from safetensors.torch import load_model

    from moezoo.zoo import build_model

    again = build_model(cfg.model).eval()
    load_model(again, str(tmp_path / "m.safetensors"))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_init_from_an_export_starts_where_the_run_ended(trained, tmp_path, corpus_dir):
    cfg, summary, _ = trained
    out = tmp_path / "hf"
    assert export_main(["--run", cfg.out_dir, "--hf", str(out)]) == 0
    tok = os.path.join(cfg.out_dir, "tokenizer.model")
    new = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(
            tmp_path,
            corpus_dir,
            **{
                "model.init_from": out,
                "data.tokenizer": tok,
                "train.steps": 1,
                "checkpoint.every": 0,
            },
        ),
    )
    first_val = run(new)["val_history"][0][1]
    assert first_val == pytest.approx(summary["val_history"][-1][1], rel=1e-4)


def test_init_from_a_different_shape_names_the_key(trained, tmp_path, corpus_dir):
    from moezoo.configs import ConfigError

    cfg, _, _ = trained
    out = tmp_path / "hf"
    export_main(["--run", cfg.out_dir, "--hf", str(out)])
    new = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(tmp_path, corpus_dir, **{"model.init_from": out, "model.dim": 64}),
    )
    with pytest.raises(ConfigError, match="model.dim: is 64 but model.init_from="):
        run(new)
