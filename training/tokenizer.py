"""SentencePiece tokenizer: a given ``.model``, or one trained on the training split once and
cached.

Trained as byte-fallback BPE with whitespace kept verbatim (code corpora need exact indentation), so
every string round-trips and no token is <unk>.
"""

from __future__ import annotations

import hashlib
import os
import random

import sentencepiece as spm

from moezoo.configs import ConfigError

# Caps the text sentencepiece trains on: the vocabulary barely changes past a few MB, training time
# does.
TRAIN_CHARS = 4_000_000
# 256 byte pieces + 3 specials must fit before a byte-fallback BPE can merge anything.
MIN_TRAINED_VOCAB = 300


class Tokenizer:
    """``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``, ``eos_id``."""

    # how the run got it (get_tokenizer): "given" (data.tokenizer), "cached" or "trained"
    origin = "given"

    def __init__(self, model_path: str):
        self.path = model_path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError):  # "could not parse ModelProto": any other file
            raise ConfigError(
                "data.tokenizer", f"{model_path} is not a sentencepiece .model file"
            ) from None
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        with open(model_path, "rb") as f:
            self.digest = hashlib.sha1(f.read()).hexdigest()[:12]

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


def train_tokenizer(texts: list[str], vocab_size: int, out_prefix: str, seed: int = 0) -> str:
    """Train a BPE model on (a sample of) ``texts``; returns the ``.model`` path."""
    rng = random.Random(seed)
    lines: list[str] = []
    budget = TRAIN_CHARS
    for t in rng.sample(texts, len(texts)):
        for line in t.splitlines():
            if line.strip() and budget > 0:
                lines.append(line)
                budget -= len(line)
    tmp = f"{out_prefix}.tmp{os.getpid()}"
    try:
        _train_spm(lines, tmp, vocab_size)
    except RuntimeError as e:
        raise ConfigError(
            "model.vocab_size",
            f"{vocab_size} is too small for this corpus: {str(e).split(']')[-1].strip()}",
        ) from None
    # Rename last: a concurrent or killed run never leaves a half-written cached model behind.
    os.replace(f"{tmp}.model", f"{out_prefix}.model")
    os.replace(f"{tmp}.vocab", f"{out_prefix}.vocab")
    return f"{out_prefix}.model"


def _train_spm(lines: list[str], tmp: str, vocab_size: int) -> None:
    with open(os.devnull, "w") as log:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=tmp,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            pad_id=-1,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            max_sentence_length=1 << 14,
            logstream=log,
        )


def get_tokenizer(
    model_path: str | None, texts: list[str], vocab_size: int, cache_dir: str, corpus_key: str
) -> Tokenizer:
    """The given tokenizer (checked against ``vocab_size``), or the cached/trained one for this
    corpus."""
    if model_path:
        if not os.path.isfile(model_path):
            raise ConfigError("data.tokenizer", f"file not found: {model_path}")
        tok = Tokenizer(model_path)
    else:
        os.makedirs(cache_dir, exist_ok=True)
        prefix = os.path.join(cache_dir, f"spm_{corpus_key}_v{vocab_size}")
        trained = not os.path.isfile(prefix + ".model")
        if trained:
            if vocab_size < MIN_TRAINED_VOCAB:
                raise ConfigError(
                    "model.vocab_size",
                    f"{vocab_size} is too small for a byte-fallback tokenizer "
                    f"(>= {MIN_TRAINED_VOCAB})",
                )
            train_tokenizer(texts, vocab_size, prefix)
        tok = Tokenizer(prefix + ".model")
        tok.origin = "trained" if trained else "cached"
    if tok.vocab_size != vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"is {vocab_size} but tokenizer {tok.path} has {tok.vocab_size} pieces",
        )
    return tok
