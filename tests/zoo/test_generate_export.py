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


def _export(trained, tmp_path):
    out = tmp_path / "hf"
    assert export_main(["--run", trained[0].out_dir, "--hf", str(out)]) == 0
    return out


def test_init_from_takes_the_exports_tokenizer_and_a_continued_training_schedule(
    trained, tmp_path, corpus_dir
):
    """Issue 51, finding 5: without data.tokenizer, init_from trained a new tokenizer (first val
    loss 8.58, worse than random init) and re-ran the preset's warm-up to its peak lr (val 3.62 ->
    3.81). The export's tokenizer.model is now the run's, and the schedule is continued training:
    at most lr * min_lr_ratio, after warmup_steps // 10 steps."""
    from moezoo.training.loop import Trainer

    _, summary, _ = trained
    out = _export(trained, tmp_path)
    ov = {"model.init_from": out, "train.steps": 6, "optim.warmup_steps": 30, "checkpoint.every": 0}
    tr = Trainer(load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp_path, corpus_dir, **ov)))
    assert tr.cfg.data.tokenizer == os.path.join(out, "tokenizer.model")
    peak = tr.cfg.optim.lr * tr.cfg.optim.min_lr_ratio
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(peak / 3)  # 3 warm-up steps
    lrs = []
    real = tr.train_step

    def step():
        lrs.append(tr.optimizer.param_groups[0]["lr"])
        return real()

    tr.train_step = step
    history = tr.fit()["val_history"]
    assert max(lrs) == pytest.approx(peak) and len(lrs) == 6
    assert history[0][1] == pytest.approx(summary["val_history"][-1][1], rel=1e-4)
    assert history[-1][1] < history[0][1]


def test_init_from_refuses_a_data_tokenizer_other_than_the_exports(trained, tmp_path, corpus_dir):
    from moezoo.configs import ConfigError
    from moezoo.training.loop import Trainer

    out = _export(trained, tmp_path)
    other = tmp_path / "other.model"
    other.write_bytes((out / "tokenizer.model").read_bytes() + b"\0")
    ov = tiny_overrides(tmp_path, corpus_dir, **{"model.init_from": out, "data.tokenizer": other})
    with pytest.raises(ConfigError, match=r"^data.tokenizer: .* differs from .*model.init_from="):
        Trainer(load_config("zoo/tiny_dense.yaml", ov))


@pytest.mark.parametrize("name", ["exported/nowhere", "nobody/no-such-model"])
def test_init_from_a_missing_folder_is_one_line_naming_the_key(
    name, tmp_path, corpus_dir, monkeypatch, capsys
):
    """Issue 51, finding 5: a missing folder was reported as a failed connection to the Hugging
    Face hub. It is a local path (or an id in the HF cache; nothing is downloaded)."""
    from moezoo.training.cli import main

    def boom(*a, **k):
        raise AssertionError("the corpus was read before the error")

    monkeypatch.setattr("moezoo.training.loop.prepare_data", boom)
    ov = tiny_overrides(tmp_path, corpus_dir, **{"model.init_from": name})
    assert main(["--config", "zoo/tiny_dense.yaml", *ov]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [
        f"error: model.init_from: {name}: no such folder, nor a model id in the Hugging Face "
        f"cache (nothing is downloaded: fetch it first, e.g. hf download {name})"
    ]


def test_init_from_prints_no_third_party_noise(trained, tmp_path, corpus_dir):
    """Issue 51, finding 5: transformers' "`torch_dtype` is deprecated!" on every run (and its
    loading bars). A fresh process, as the user runs it: transformers warns once per process."""
    import subprocess
    import sys

    from helpers import ROOT, subprocess_env

    out = _export(trained, tmp_path)
    ov = tiny_overrides(
        tmp_path, corpus_dir, **{"model.init_from": out, "train.steps": 1, "checkpoint.every": 0}
    )
    r = subprocess.run(
        [sys.executable, "train.py", "--config", "zoo/tiny_dense.yaml", *ov],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deprecat" not in (r.stdout + r.stderr).lower() and "Loading weights" not in r.stderr
