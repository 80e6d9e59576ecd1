"""Bad config files, paths and sizes: one line naming the file or key, exit 2, before the corpus is
read or the model is built."""

import pytest

from helpers import tiny_overrides
from moezoo.training.cli import main


@pytest.fixture
def no_data(monkeypatch):
    """Every error here must come before the corpus is read (and so before the model is built)."""

    def boom(*a, **k):
        raise AssertionError("the corpus was read before the error")

    monkeypatch.setattr("moezoo.training.loop.prepare_data", boom)


def _one_line_error(capsys, argv, then_plan: bool = False) -> str:
    """The error line; ``then_plan``: a run that does not fit prints its plan below that line."""
    rc = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and err and err[0].startswith("error: "), (rc, err)
    assert len(err) == 1 or (then_plan and err[1].startswith("plan: ")), err
    return err[0]


FILES = {
    "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01", "not a YAML text file"),
    "include_int": (b"include: 5\nname: x\n", "include"),
    "duplicate_section": (b"train:\n  steps: 3\ntrain:\n  seed: 1\n", "duplicate key 'train'"),
    "section_int": (b"model: 5\n", "model: is a section"),
    "section_list": (b"model: [1, 2]\n", "model: is a section"),
    "nested_section_int": (b"model:\n  moe: 3\n", "model.moe: is a section"),
    "empty": (b"", "is empty"),
    "only_comments": (b"# nothing here\n", "is empty"),
    "python_tag": (b"train: !!python/object/apply:os.system [echo]\n", "invalid YAML"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_bad_config_file_is_one_line_naming_it(tmp_path, capsys, case):
    content, expect = FILES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(content)
    line = _one_line_error(capsys, ["--config", str(path)])
    assert expect in line, line
    if case not in ("section_int", "section_list", "nested_section_int", "include_int"):
        assert str(path) in line, line


@pytest.mark.parametrize("override", ["model=5", "model=[1,2]", "train=3"])
def test_override_replacing_a_section_names_it(capsys, override):
    line = _one_line_error(capsys, ["--config", "zoo/tiny_dense.yaml", override])
    assert line.startswith(f"error: {override.split('=')[0]}: is a section"), line


def _paths_cases(tmp):
    (tmp / "afile").write_text("x")
    (tmp / "not_spm.model").write_bytes(b"\x00\x01 certainly not a ModelProto")
    return {
        "tokenizer_not_spm": ({"data.tokenizer": tmp / "not_spm.model"}, "data.tokenizer: "),
        "tokenizer_missing": (
            {"data.tokenizer": tmp / "missing.model"},
            "data.tokenizer: file not found",
        ),
        "cache_dir_is_a_file": ({"data.cache_dir": tmp / "afile"}, "data.cache_dir: "),
        "out_dir_is_a_file": ({"train.out_dir": tmp / "afile"}, "train.out_dir: "),
        "out_dir_inside_a_file": ({"train.out_dir": tmp / "afile" / "run"}, "train.out_dir: "),
        "vocab_too_small": ({"model.vocab_size": 256}, "model.vocab_size: 256 is too small"),
        # ~3 TB of activations: no host or GPU
        "batch_too_big": ({"train.batch_size": 10_000_000}, "train.batch_size: "),
        "source_missing": ({"data.source": tmp / "nothing*.txt"}, "data.source: "),
    }


@pytest.mark.parametrize(
    "case",
    [
        "tokenizer_not_spm",
        "tokenizer_missing",
        "cache_dir_is_a_file",
        "out_dir_is_a_file",
        "out_dir_inside_a_file",
        "vocab_too_small",
        "batch_too_big",
        "source_missing",
    ],
)
def test_bad_path_or_size_is_one_line_before_the_corpus_is_read(
    tmp_path, corpus_dir, capsys, no_data, case
):
    extra, expect = _paths_cases(tmp_path)[case]
    argv = ["--config", "zoo/tiny_dense.yaml", *tiny_overrides(tmp_path, corpus_dir, **extra)]
    line = _one_line_error(capsys, argv, then_plan=case == "batch_too_big")
    assert line.startswith(f"error: {expect}"), line


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"dst.granularity": "block", "dst.block": "[3,7]"}, "dst.block"),
        ({"dst.granularity": "nm", "dst.n": 1, "dst.m": 5}, "dst.m"),
        ({"dst.include": "[nothing.*]"}, "dst.include"),
    ],
)
def test_dst_shape_errors_come_from_the_config_before_the_corpus_is_read(
    tmp_path, corpus_dir, capsys, no_data, extra, key
):
    line = _one_line_error(
        capsys, ["--config", "zoo/tiny_dst.yaml", *tiny_overrides(tmp_path, corpus_dir, **extra)]
    )
    assert line.startswith(f"error: {key}: "), line


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"model.moe.hidden_dim": 100}, "multiples of 16; got hidden_dim=100"),
        ({"train.device": "cpu"}, "cannot run here: device is cpu"),
    ],
    ids=["dims", "device"],
)
def test_fp8_experts_that_cannot_run_are_one_line_naming_the_key_before_the_corpus_is_read(
    tmp_path, corpus_dir, capsys, no_data, extra, expect
):
    argv = [
        "--config",
        "zoo/tiny_moe.yaml",
        *tiny_overrides(tmp_path, corpus_dir, **{"model.moe.precision": "fp8", **extra}),
    ]
    line = _one_line_error(capsys, argv)
    assert line.startswith("error: model.moe.precision: ") and expect in line, line
