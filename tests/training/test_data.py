"""Corpus, tokenizer and batch sampling."""

import numpy as np
import pytest
import torch

from helpers import tiny_overrides
from moezoo.configs import ConfigError, DataConfig, load_config
from moezoo.training.corpus import load_documents, split_documents
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
