"""Corpus, tokenizer and batch sampling."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT, tiny_overrides
from moezoo.configs import ConfigError, DataConfig, load_config
from moezoo.training.corpus import is_text, load_documents, read_corpus, split_documents
from moezoo.training.data import prepare_data, sample_batch


def test_stdlib_corpus_is_present_and_split_deterministically():
    docs = load_documents(DataConfig(source="stdlib", max_files=50))
    train, val = split_documents(docs, 0.1)
    assert len(docs) == 50 and train and val
    assert {d.name for d in train}.isdisjoint({d.name for d in val})
    assert [d.name for d in split_documents(load_documents(DataConfig(max_files=50)), 0.1)[1]] == [
        d.name for d in val
    ]


def test_jsonl_and_glob_sources(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "hello world"}\n{"text": "second doc"}\n\n{"text": "third"}\n')
    assert [d.text for d in load_documents(DataConfig(source=str(p)))] != []
    assert len(load_documents(DataConfig(source=str(p)))) == 3
    (tmp_path / "a.txt").write_text("alpha")
    assert len(load_documents(DataConfig(source=str(tmp_path / "*.txt")))) == 1
    with pytest.raises(ConfigError, match="data.jsonl_field"):
        load_documents(DataConfig(source=str(p), jsonl_field="body"))


def test_a_corpus_splits_the_same_wherever_it_lives(tmp_path):
    # Names are relative to the source (directory, glob prefix or file's folder): the split of a
    # copied corpus must not depend on the copy's absolute path (CI's temporary folders differ run
    # to run).
    names = [f"doc{i:02d}.txt" for i in range(40)]
    for where in ("a", "b/deeper"):
        (tmp_path / where / "sub").mkdir(parents=True)
        for n in names:
            (tmp_path / where / "sub" / n).write_text(f"text of {n}\n" * 3)
    splits = []
    for source in (
        tmp_path / "a",
        tmp_path / "b/deeper",
        tmp_path / "a/sub/*.txt",
        tmp_path / "b/deeper/sub/doc*.txt",
    ):
        docs = load_documents(DataConfig(source=str(source)))
        assert len(docs) == 40 and not any(str(tmp_path) in d.name for d in docs)
        train, val = split_documents(docs, 0.2)
        splits.append(sorted(d.name for d in val))
        assert val and train
    # directory names keep "sub/", glob names don't
    assert splits[0] == splits[1] and splits[2] == splits[3]
    one = load_documents(DataConfig(source=str(tmp_path / "a/sub/doc00.txt")))
    assert [d.name for d in one] == ["doc00.txt"]


def test_token_caches_of_two_directories_with_the_same_listing_stay_apart(tmp_path):
    # Same file names and sizes, different text: the shared cache dir must not serve one's tokens to
    # the other.
    rng = np.random.default_rng(0)
    words = [rng.integers(0, 13, size=rng.integers(2, 8)) for _ in range(3000)]
    for where, first in (("a", "a"), ("b", "n")):  # letters a-m in one corpus, n-z in the other
        (tmp_path / where).mkdir()
        for i in range(3):
            text = " ".join(
                "".join(chr(ord(first) + int(c)) for c in w)
                for w in words[i * 1000 : (i + 1) * 1000]
            )
            (tmp_path / where / f"f{i}.txt").write_text(text)
    seen = []
    for where in ("a", "b"):
        cfg = load_config(
            "zoo/tiny_dense.yaml",
            tiny_overrides(
                tmp_path,
                str(tmp_path / where),
                **{"data.val_fraction": 0.4, "model.vocab_size": 300},
            ),
        )
        data = prepare_data(cfg)
        seen.append(set(data.tokenizer.decode(np.asarray(data.train[:200]).tolist())) - {" "})
    assert seen[0] <= set("abcdefghijklm") and seen[1] <= set("nopqrstuvwxyz"), seen


def test_tokenizer_round_trips_code_and_tokens_are_cached(tmp_path, corpus_dir):
    cfg = load_config("zoo/tiny_dense.yaml", tiny_overrides(tmp_path, corpus_dir))
    data = prepare_data(cfg)
    text = "def f(x):\n\treturn  x ** 2  # ünïcode\n"
    assert data.tokenizer.decode(data.tokenizer.encode(text)) == text
    assert data.train.dtype == np.uint16 and data.train.max() < cfg.model.vocab_size
    again = prepare_data(cfg)  # second call reads the caches
    assert np.array_equal(np.asarray(again.train), np.asarray(data.train))


def test_batches_are_a_pure_function_of_seed_step_and_rank():
    tokens = np.arange(10_000, dtype=np.uint16)
    x1, y1, _ = sample_batch(tokens, 4, 16, seed=0, step=7, rank=0, world=2)
    x2, _, _ = sample_batch(tokens, 4, 16, seed=0, step=7, rank=0, world=2)
    x3, _, _ = sample_batch(tokens, 4, 16, seed=0, step=7, rank=1, world=2)
    assert (x1 == x2).all() and not (x1 == x3).all()
    assert (y1[:, :-1] == x1[:, 1:]).all()
    # Two ranks of 4 see exactly the global batch one rank of 8 sees.
    x_all, _, _ = sample_batch(tokens, 8, 16, seed=0, step=7)
    assert (torch.cat([x1, x3]) == x_all).all()


def write_mixed_folder(root, n_text: int = 12):
    """``n_text`` text files under ``sub/``, a PNG, a binary blob and a latin-1 text beside them."""
    words = "the quick brown fox jumps over a lazy dog while alpha beta gamma delta wait".split()
    rng = np.random.default_rng(0)
    (root / "sub").mkdir(parents=True)
    for i in range(n_text):
        lines = (" ".join(rng.choice(words, 12)) for _ in range(150))
        (root / "sub" / f"doc{i:02d}.txt").write_text("\n".join(lines))
    # a real PNG header: signature, then an IHDR chunk whose length field starts with NUL bytes
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (root / "blob.bin").write_bytes(rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    (root / "latin1.txt").write_bytes("café naïve\n".encode("latin-1") * 20)


def test_folder_with_a_png_and_a_binary_file_skips_and_counts_them(tmp_path):
    """Issue 51, finding 7: a folder with a PNG and a binary file trained on them (read with
    errors="replace")."""
    write_mixed_folder(tmp_path / "corpus")
    corpus = read_corpus(DataConfig(source=str(tmp_path / "corpus")))
    assert corpus.skipped == ["blob.bin", "latin1.txt", "logo.png"]
    assert sorted(d.name for d in corpus.documents) == [f"sub/doc{i:02d}.txt" for i in range(12)]
    assert not any("\ufffd" in d.text for d in corpus.documents)
    # a multi-byte character cut at the end of the sniffed bytes is still text
    assert is_text("é".encode()[:1]) and not is_text(b"text\0") and not is_text(b"\xff\xfe")
    # nothing but non-text files: the corpus is empty, and the error says why
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ConfigError, match=r"is empty \(1 file\(s\) skipped: not UTF-8 text\)"):
        read_corpus(DataConfig(source=str(tmp_path / "bin")))


def test_builtin_corpus_is_read_as_it_is():
    # the standard library's encoding tests (latin-1, KOI8-R) stay in the default corpus, as the
    # split and the caches users already hold expect
    assert read_corpus(DataConfig(source="stdlib")).skipped == []


def test_data_loading_prints_a_corpus_summary_and_a_skipped_files_warning(tmp_path, capfd):
    """Finding 7: no corpus summary (documents, tokens, tokenizer trained or cached)."""
    write_mixed_folder(tmp_path / "corpus")
    cfg = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(tmp_path, str(tmp_path / "corpus"), **{"model.vocab_size": 300}),
    )
    data = prepare_data(cfg)
    out, err = capfd.readouterr()
    assert err.splitlines() == [
        "warning: data.source: skipped 3 file(s) that are not UTF-8 text (binary or another "
        "encoding): blob.bin, latin1.txt, logo.png"
    ]
    (line,) = out.splitlines()
    n_val = len(split_documents(read_corpus(cfg.data).documents, cfg.data.val_fraction)[1])
    assert line.startswith(
        f"data: {tmp_path / 'corpus'}: 12 documents ({12 - n_val} train / {n_val} val), "
    )
    assert f"{len(data.train) / 1e3:.1f}K train / " in line
    assert "tokenizer trained on the train split (" in line and "tokens encoded to" in line
    prepare_data(cfg)
    line = capfd.readouterr().out.strip()
    assert "tokenizer cached (" in line and "tokens cached in" in line
    given = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(
            tmp_path,
            str(tmp_path / "corpus"),
            **{"model.vocab_size": 300, "data.tokenizer": data.tokenizer.path},
        ),
    )
    prepare_data(given)
    assert f"tokenizer given ({data.tokenizer.path}, 300 pieces)" in capfd.readouterr().out


def test_a_single_file_corpus_summary_says_it_is_split_by_tokens(tmp_path, capfd):
    write_mixed_folder(tmp_path / "corpus", n_text=1)
    cfg = load_config(
        "zoo/tiny_dense.yaml",
        tiny_overrides(
            tmp_path,
            str(tmp_path / "corpus" / "sub" / "doc00.txt"),
            **{"model.vocab_size": 300, "data.val_fraction": 0.2, "train.seq_len": 32},
        ),
    )
    prepare_data(cfg)
    assert ": 1 document (split by tokens: the last 0.2 is val), " in capfd.readouterr().out


def test_missing_data_source_is_one_line_before_torch_is_imported(tmp_path):
    """Finding 7: a missing data.source took 7-10 s to report (torch imported first)."""
    code = (
        "import sys; from moezoo.training.cli import main; "
        "rc = main(['--config', 'tiny_dense', *sys.argv[1:]]); print(rc, 'torch' in sys.modules)"
    )
    for override, key in (
        (f"data.source={tmp_path}/missing", "data.source"),
        (f"data.source={tmp_path}/none*.txt", "data.source"),
        (f"data.tokenizer={tmp_path}/none.model", "data.tokenizer"),
    ):
        r = subprocess.run(
            [sys.executable, "-c", code, override, f"train.out_dir={tmp_path}/out"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"error: {key}: ")
