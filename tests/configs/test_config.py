"""Config loading, includes, overrides, and one-line errors for bad input."""

import glob
import os
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env
from moezoo.configs import ConfigError, load_config

PRESETS = sorted(glob.glob(os.path.join(ROOT, "zoo", "*.yaml")))


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_every_preset_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.name == os.path.splitext(os.path.basename(path))[0]


def test_overrides_apply_last_and_are_typed():
    cfg = load_config(
        "zoo/tiny_dense.yaml", ["model.n_layers=2", "optim.lr=1e-3", "train.compile=true"]
    )
    assert cfg.model.n_layers == 2 and cfg.optim.lr == 1e-3 and cfg.train.compile is True


def test_include_merges_before_the_file(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  dim: 64\n  n_heads: 4\ntrain:\n  steps: 7\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(str(tmp_path / "top.yaml"))
    assert cfg.model.dim == 64 and cfg.train.steps == 9


def test_llama_ffn_hidden_sizes_follow_the_paper():
    assert load_config("zoo/llama_7b.yaml").model.hidden_dim == 11008
    assert load_config("zoo/llama_65b.yaml").model.hidden_dim == 22016


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.dimm=3", "model.dimm"),
        ("model.dim=abc", "model.dim"),
        ("model.dim=130", "model.dim"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.n_layers=-1", "model.n_layers"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.compile_mode=fast", "train.compile_mode"),
        ("optim.implementation=apex", "optim.implementation"),
        ("data.passkey_answer_weight=0", "data.passkey_answer_weight"),
        ("logging.wandb=maybe", "logging.wandb"),
        ("train.seq_len=100000", "train.seq_len"),
        ("model.ffn_layers={9: dense}", "model.ffn_layers.9"),
        ("train.steps=[1", "train.steps"),  # a value that is not valid YAML
        ("=3", "=3"),  # no key at all
    ],
)
def test_bad_values_raise_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("zoo/tiny_dense.yaml", [override])
    assert str(e.value).startswith(key + ":") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.short_seq_len=-32", "train.short_steps=5"], "train.short_seq_len: must be >= 0"),
        (["train.short_seq_len=32", "train.short_steps=-1"], "train.short_steps: must be >= 0"),
        (
            ["train.short_steps=5"],
            "train.short_seq_len: is 0 (off) but train.short_steps=5 asks for a short-context",
        ),
        (
            ["train.short_seq_len=32"],
            "train.short_steps: is 0 (off) but train.short_seq_len=32 asks for a short-context",
        ),
        (
            ["train.short_seq_len=48", "train.short_steps=5"],
            "train.short_seq_len: must divide train.seq_len=128 and be smaller, got 48",
        ),
        (
            ["train.short_seq_len=128", "train.short_steps=5"],
            "train.short_seq_len: must divide train.seq_len=128 and be smaller, got 128",
        ),
        (
            ["train.short_seq_len=32", "train.short_steps=601"],
            "train.short_steps: must be <= train.steps=600, got 601",
        ),
    ],
)
def test_bad_short_context_phase_raises_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("zoo/tiny_dense.yaml", overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def run_cli(*args, cwd=ROOT):
    # A CPU test on any machine: with CUDA hidden the child neither picks the GPU nor pays its
    # start-up.
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--config", "zoo/nope.yaml"], "file not found: zoo/nope.yaml"),
        (
            ["--config", "zoo/tiny_dense.yaml", "model.dim=130"],
            "model.dim: dim=130 is not divisible by n_heads=4",
        ),
        (["--config", "zoo/tiny_dense.yaml", "model.n_kv_heads=3"], "model.n_kv_heads:"),
        (["--config", "zoo/tiny_dense.yaml", "model.foo=1"], "model.foo: unknown key"),
        (["--config", "zoo/tiny_dense.yaml", "train.steps=ten"], "train.steps:"),
        (["--config", "zoo/tiny_dense.yaml", "--plan", "--gpus", "0"], "--gpus: must be >= 1"),
    ],
)
def test_cli_bad_input_prints_one_line_and_exits_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_cli_empty_corpus_and_tokenizer_vocab_mismatch(tmp_path, corpus_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    r = run_cli(
        "--config",
        "zoo/tiny_dense.yaml",
        f"data.source={empty}",
        f"data.cache_dir={tmp_path}/c",
        f"train.out_dir={tmp_path}/r",
        "logging.wandb=disabled",
    )
    assert r.returncode == 2 and "data.source:" in r.stderr and "empty" in r.stderr

    from moezoo.training.tokenizer import train_tokenizer

    model = train_tokenizer(
        ["def f(x):\n    return x\n" * 50, "class A:\n    pass\n" * 50], 300, str(tmp_path / "t")
    )
    r = run_cli(
        "--config",
        "zoo/tiny_dense.yaml",
        f"data.source={corpus_dir}",
        f"data.tokenizer={model}",
        f"data.cache_dir={tmp_path}/c",
        f"train.out_dir={tmp_path}/r",
        "logging.wandb=disabled",
    )
    assert r.returncode == 2 and "model.vocab_size: is 2048 but tokenizer" in r.stderr, r.stderr


def test_plan_reports_llama_65b_params_without_allocating():
    code = (
        "import resource, sys; "
        "sys.argv=['train.py','--config','zoo/llama_65b.yaml','--plan','--gpus','64'];"
        "from moezoo.training.cli import main; rc = main();"
        "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "65.29B" in r.stdout  # LLaMA paper: 65.2B
    rss_gb = int(r.stdout.split("MAXRSS_KB")[1].split()[0]) / 1e6
    assert rss_gb < 3, f"--plan used {rss_gb:.1f} GB: weights were allocated"


def test_cli_resume_with_a_changed_model_names_the_key(tmp_path, corpus_dir):
    common = [
        f"data.source={corpus_dir}",
        f"data.cache_dir={tmp_path}/c",
        f"train.out_dir={tmp_path}/r",
        "logging.wandb=disabled",
        "logging.progress=false",
        "model.vocab_size=512",
        "model.n_layers=1",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.batch_size=2",
    ]
    assert run_cli("--config", "zoo/tiny_dense.yaml", *common).returncode == 0
    r = run_cli("--config", "zoo/tiny_dense.yaml", *common, "model.dim=64", "--resume")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr
    assert (
        lines[0].startswith("error: model.dim: is 64 but checkpoint")
        and "trained with 128" in lines[0]
    )


@pytest.mark.parametrize(
    "script,args,needle",
    [
        (
            "bench/train_attention.py",
            ["--config", "zoo/tiny_dense.yaml", "--variants", "dense", "model.dimm=3"],
            "error: model.dimm: unknown key",
        ),
        (
            "bench/train_attention.py",
            ["--config", "zoo/tiny_dense.yaml", "--variants", "dense,foo"],
            "error: --variants: unknown 'foo'",
        ),
        (
            "bench/train_attention.py",
            ["--config", "zoo/tiny_sparse_attn_1k.yaml", "--variants", "union_all"]
            + ["--union-blocks", "2"],
            "error: model.attention.patterns.0-3:0-1.union_blocks: a query block must fit one "
            "query's choices: must be >= top_k (4), got 2",
        ),
        (
            "bench/train_moe.py",
            ["--tokens", "none", "--suite", "equal_time,nope"],
            "error: --suite: unknown suite 'nope'",
        ),
        (
            "bench/train_moe.py",
            ["--tokens", "none", "--suite", "equal_time_graphs"],
            "error: --suite: equal_time_graphs",
        ),
        (
            "bench/train_moe.py",
            ["--tokens", "none", "--wgrad-splits", "0"],
            "error: --wgrad-splits: must be >= 1",
        ),
        (
            "bench/attention.py",
            ["--patterns", "a_shape,topk_x"],
            "error: --patterns: unknown value 'topk_x'",
        ),
        ("bench/attention.py", ["--modes", "bwd"], "error: --modes: unknown value 'bwd'"),
        ("bench/attention.py", ["--kernels", "cudnn"], "error: --kernels: unknown value 'cudnn'"),
        (
            "bench/attention.py",
            ["--lengths", "64k"],
            "error: --lengths: '64k' is not a positive integer",
        ),
        ("bench/moe.py", ["--shapes", "mixtral,huge"], "error: --shapes: unknown value 'huge'"),
        ("bench/moe.py", ["--only", "ours,theirs"], "error: --only: unknown value 'theirs'"),
        ("bench/moe.py", ["--reps", "0"], "error: --reps: must be > 0"),
        (
            "bench/moe.py",
            ["--fp8-tiles", "128,64;128,64,16"],
            "error: --fp8-tiles: expected 'ar,ac,aw;cr,cc,cw'",
        ),
        ("bench/fp8_quant.py", ["--reps", "0"], "error: --reps: must be > 0"),
        ("bench/adamw.py", ["--numel", "0"], "error: --numel: must be > 0"),
    ],
)
def test_bench_scripts_report_a_bad_config_in_one_line_with_exit_2(script, args, needle, tmp_path):
    """The bench scripts: a bad override, variant or list is one line and exit 2 before any training
    or GPU work."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 2 and r.stderr.startswith(needle), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
