"""Token streams as memmaps, and a stateless batch sampler (the batch of step s is a pure function
of (seed, s, epoch, dp_rank, dp_size)), so resuming at step s replays exactly the same data with no
loader state.

Layout in ``data.cache_dir``: ``tokens_<key>_{train,val}.bin`` (uint16 when the vocab fits, else
uint32), documents joined with EOS. ``<key>`` hashes the corpus names/sizes and the tokenizer.

A corpus of several documents is split by document (``corpus.split_documents``). A corpus of one
document (one text file, one jsonl record) is split by tokens as nanoGPT does: the last
``data.val_fraction`` of its tokens is the validation split, and the tokenizer is trained on the
rest.

Rank 0 prints one line about the corpus before training (``corpus_summary``): documents, the
train/val split, tokens per split, where the tokenizer and the token files came from; and a warning
naming the files skipped as not text (training.corpus).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from moezoo.configs import Config, ConfigError

from .corpus import BUILTIN_SOURCES, read_corpus, split_documents
from .tokenizer import Tokenizer, get_tokenizer


def _encode(tok: Tokenizer, texts: list[str]) -> list[int]:
    ids: list[int] = []
    for chunk in range(0, len(texts), 256):
        for doc in tok.encode_batch(texts[chunk : chunk + 256]):
            ids.extend(doc)
            ids.append(tok.eos_id)
    return ids


def _write_ids(ids: list[int], path: str, dtype) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    np.asarray(ids, dtype=dtype).tofile(tmp)
    os.replace(tmp, path)  # atomic: a killed run never leaves a truncated token file


@dataclass
class TokenData:
    tokenizer: Tokenizer
    train: np.ndarray  # [N_train] token ids
    val: np.ndarray  # [N_val]


def prepare_data(cfg: Config, is_main: bool = True, barrier=lambda: None) -> TokenData:
    """Load the corpus, get the tokenizer, and memmap the token files (rank 0 writes, others
    wait); rank 0 prints the corpus summary."""
    corpus = read_corpus(cfg.data)
    docs = corpus.documents
    val_fraction = cfg.data.val_fraction
    # split by tokens below, since a split by document would leave one side empty
    one_doc = len(docs) == 1
    if one_doc:
        train_texts = [docs[0].text[: int(len(docs[0].text) * (1 - val_fraction))]]
    else:
        train_docs, val_docs = split_documents(docs, val_fraction)
        train_texts = [d.text for d in train_docs]
    # Names are relative to the source, so a path source itself keys the cache too (two directories
    # with the same file names and sizes must not share token files).
    where = [] if cfg.data.source in BUILTIN_SOURCES else [os.path.abspath(cfg.data.source)]
    listing = "\n".join(where + [f"{d.name}:{len(d.text)}" for d in docs])
    corpus_key = hashlib.sha1(listing.encode()).hexdigest()[:12]
    cache = cfg.data.cache_dir
    if is_main:
        tok = get_tokenizer(
            cfg.data.tokenizer, train_texts, cfg.model.vocab_size, cache, corpus_key
        )
    barrier()
    if not is_main:
        tok = get_tokenizer(cfg.data.tokenizer, [], cfg.model.vocab_size, cache, corpus_key)
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    key = f"{corpus_key}_{tok.digest}" + (f"_tail{val_fraction}" if one_doc else "")
    paths = {s: os.path.join(cache, f"tokens_{key}_{s}.bin") for s in ("train", "val")}
    encoded = not all(os.path.isfile(p) for p in paths.values())
    if is_main and encoded:
        os.makedirs(cache, exist_ok=True)
        if one_doc:
            ids = _encode(tok, [docs[0].text])
            cut = int(len(ids) * (1 - val_fraction))
            splits = {"train": ids[:cut], "val": ids[cut:]}
        else:
            splits = {
                "train": _encode(tok, train_texts),
                "val": _encode(tok, [d.text for d in val_docs]),
            }
        for split, ids in splits.items():
            _write_ids(ids, paths[split], dtype)
    barrier()
    arrays = {s: np.memmap(p, dtype=dtype, mode="r") for s, p in paths.items()}
    need = cfg.train.seq_len + 1
    for s, a in arrays.items():
        if len(a) < need:
            raise ConfigError(
                "data.source",
                f"{s} split has {len(a)} tokens, fewer than train.seq_len+1={need}"
                + (" (raise data.val_fraction or add text)" if s == "val" else ""),
            )
    if is_main:
        if corpus.skipped:
            shown = ", ".join(corpus.skipped[:5]) + (" ..." if len(corpus.skipped) > 5 else "")
            print(
                f"warning: data.source: skipped {len(corpus.skipped)} file(s) that are not UTF-8 "
                f"text (binary or another encoding): {shown}",
                file=sys.stderr,
            )
        split = (1, 1) if one_doc else (len(train_docs), len(val_docs))
        print(corpus_summary(cfg, len(docs), split, arrays, tok, encoded), flush=True)
    return TokenData(tok, arrays["train"], arrays["val"])


def _count(n: int) -> str:
    for unit, s in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= unit:
            return f"{n / unit:.1f}{s}"
    return str(n)


def corpus_summary(
    cfg: Config, n_docs: int, split: tuple[int, int], arrays: dict, tok: Tokenizer, encoded: bool
) -> str:
    """``data: <source>: N documents (a train / b val), x train / y val tokens; tokenizer ...;
    tokens ...``. ``split``: documents per side (one document: split by tokens)."""
    d = cfg.data
    if n_docs == 1:
        docs = f"1 document (split by tokens: the last {d.val_fraction:g} is val)"
    else:
        docs = f"{n_docs} documents ({split[0]} train / {split[1]} val)"
    tokens = f"{_count(len(arrays['train']))} train / {_count(len(arrays['val']))} val tokens"
    how = {"given": "given", "cached": "cached", "trained": "trained on the train split"}
    return (
        f"data: {d.source}: {docs}, {tokens}; tokenizer {how[tok.origin]} ({tok.path}, "
        f"{tok.vocab_size} pieces); tokens {'encoded to' if encoded else 'cached in'} {d.cache_dir}"
    )


def sample_batch(
    tokens: np.ndarray,
    batch: int,
    seq_len: int,
    seed: int,
    step: int,
    rank: int = 0,
    world: int = 1,
    epoch: int = 0,
    passkey=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s share ``(x[B, S], y[B, S], w)`` (int64, y = x shifted by one) of the global
    batch of ``B * world`` random windows drawn for ``(seed, step, epoch)``. So a run's data depends
    only on the global batch, not on how many ranks split it: 2 ranks x B equals 1 rank x 2B.
    ``passkey``: a training.passkey.PasskeyMix that writes needles into some windows (drawn per
    global window too); ``w`` float32 [B, S] is the loss weight of each target (the mix's
    ``answer_weight`` on the asked keys' tokens, 1 elsewhere), None when every target weighs the
    same."""
    g = torch.Generator().manual_seed(hash((seed, step, epoch)) & 0x7FFFFFFFFFFF)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch * world,), generator=g)[
        rank * batch : (rank + 1) * batch
    ]
    windows = np.stack(
        [np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts.numpy()]
    )
    w = None
    if passkey is not None:
        answers = passkey.apply_(
            windows, [(seed, step, epoch, r) for r in range(rank * batch, (rank + 1) * batch)]
        )
        if passkey.answer_weight != 1.0:
            w = torch.from_numpy(
                np.where(answers[:, 1:], np.float32(passkey.answer_weight), np.float32(1.0))
            )
    t = torch.from_numpy(windows)
    return t[:, :-1], t[:, 1:], w


@dataclass
class PackedBatch:
    """Documents packed into rows: ``tokens, targets, document_ids [N, S]`` int64.

    ``targets`` is the next token of the same document, -100 (no loss) on each document's last token
    and on padding; ``document_ids`` numbers the documents of a row 0, 1, ... (padding: -1, its own
    document). Feed ``model(tokens, targets, document_ids=document_ids)``: attention stays inside a
    document and RoPE positions restart at each (zoo.Transformer.forward).
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor


def pack_documents(docs, seq_len: int, pad_id: int = 0) -> PackedBatch:
    """Greedy first-fit in order: each token list of ``docs`` goes into the current row if it fits,
    else starts a new row; a document longer than ``seq_len`` is cut into ``seq_len`` pieces (each
    its own document: the later pieces lose the context before the cut). Rows are padded with
    ``pad_id``."""
    if seq_len <= 0:
        raise ValueError(f"seq_len: must be > 0, got {seq_len}")
    pieces = [
        list(d[i : i + seq_len]) for d in docs for i in range(0, max(len(d), 1), seq_len) if len(d)
    ]
    rows: list[list[list[int]]] = []
    for p in pieces:
        if not rows or sum(map(len, rows[-1])) + len(p) > seq_len:
            rows.append([])
        rows[-1].append(p)
    N = len(rows)
    tokens = torch.full((N, seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((N, seq_len), -100, dtype=torch.int64)
    ids = torch.full((N, seq_len), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for j, p in enumerate(row):
            t = torch.tensor(p, dtype=torch.int64)
            tokens[r, at : at + len(p)] = t
            targets[r, at : at + len(p) - 1] = t[1:]
            ids[r, at : at + len(p)] = j
            at += len(p)
    return PackedBatch(tokens, targets, ids)
