"""Corpus, tokenizer and batch sampling."""
import numpy as np
import pytest
import torch

from configs import ConfigError, DataConfig, load_config
from helpers import tiny_overrides
from training.corpus import load_documents, split_documents
from training.data import prepare_data, sample_batch


def test_stdlib_corpus_is_present_and_split_deterministically():
    docs = load_documents(DataConfig(source="stdlib", max_files=50))
    train, val = split_documents(docs, 0.1)
    assert len(docs) == 50 and train and val
    assert {d.name for d in train}.isdisjoint({d.name for d in val})
    assert [d.name for d in split_documents(load_documents(DataConfig(max_files=50)), 0.1)[1]] == [d.name for d in val]


def test_jsonl_and_glob_sources(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "hello world"}\n{"text": "second doc"}\n\n{"text": "third"}\n')
    assert [d.text for d in load_documents(DataConfig(source=str(p)))] != []
    assert len(load_documents(DataConfig(source=str(p)))) == 3
    (tmp_path / "a.txt").write_text("alpha")
    assert len(load_documents(DataConfig(source=str(tmp_path / "*.txt")))) == 1
    with pytest.raises(ConfigError, match="data.jsonl_field"):
        load_documents(DataConfig(source=str(p), jsonl_field="body"))


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
