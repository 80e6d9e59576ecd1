"""Passkey retrieval (needle in a haystack; Mohtashami & Jaggi 2023, as in LongLoRA / RULER's NIAH).

A sample of length L is validation text (the haystack) with a needle inserted at a depth, and a
question at the end; the answer is the passkey's tokens, scored teacher-forced: a sample passes when
the model's argmax at every answer position is the answer token (exactly what greedy decoding of the
answer would produce). Tokens: ``haystack[:i] + needle + haystack[i:] + question + key`` with

    needle   = " The pass key is" KEY ". Remember it." KEY " is the pass key."
    question = " What is the pass key? The pass key is" KEY

``KEY`` = the tokens of a random 5-digit number (encoded once, the same ids everywhere). Samples are
a pure function of (seed, length, index): the same haystack offsets, depths and keys in every run,
so dense and sparse models are scored on identical inputs. Depths go evenly from 0 to 1 over a
length's samples. A model trained on text without such tasks retrieves by induction (copying what
followed "The pass key is" before), which is what this probes: attention that cannot reach the
needle fails.

A model trained from scratch for minutes has no reason to have learned that copy. ``PasskeyMix``
(``data.passkey_mix``) puts the task into training: a share of the training windows carries needles
with fresh keys, each asked once at distances up to the window, so what the eval then measures is
whether the attention pattern can *learn* to reach back to the needle (a static window cannot,
beyond its span). The eval's haystacks are validation text, which never carries a training needle.

For models with block top-k heads the eval also says whether the *selection* found the needle
(needle recall): for each sample whose needle lies in a key block before the question's query block,
the share of (layer, block top-k head) selections for the query that predicts the first answer token
that hold a block of the needle's key. Accuracy without recall means the heads never chose the
needle's block; recall without accuracy means they chose it and the model did not copy from it.
Recorded in eager forwards only (compiled blocks keep no stats).

``passkey_eval(model, tokenizer, val_tokens, lengths, samples)`` -> ``PasskeyResult`` (accuracy and
recall per length); ``format_passkey_table`` prints it, ``passkey_metrics`` names it for the logs;
``training.evaluate.run_passkey(cfg)`` is ``train.py --config X --resume --eval passkey``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

NEEDLE = (" The pass key is", ". Remember it.", " is the pass key.")
QUESTION = " What is the pass key? The pass key is"


def _random_key(tokenizer, rng: np.random.Generator) -> list[int]:
    return tokenizer.encode(f" {int(rng.integers(10000, 100000))}")


def _encoded_parts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """The token ids of NEEDLE's three pieces and of QUESTION (the same for every key)."""
    return [tokenizer.encode(t) for t in NEEDLE], tokenizer.encode(QUESTION)


def _needle_and_ask(parts, question: list[int], key: list[int]) -> tuple[list[int], list[int]]:
    """``(needle, question + key)`` for one key: the layout the eval and the training mix share."""
    a, b, c = parts
    return a + key + b + key + c, question + key


def passkey_sample(
    tokenizer, haystack: np.ndarray, length: int, depth: float, seed: int
) -> tuple[list[int], int, list[int]]:
    """``(tokens[length], n_answer, key_pos)``: one sample; its last ``n_answer`` tokens are the
    key, and ``key_pos`` are the positions of the needle's two copies of it."""
    rng = np.random.default_rng(seed)
    key = _random_key(tokenizer, rng)
    parts, question = _encoded_parts(tokenizer)
    needle, tail = _needle_and_ask(parts, question, key)
    n_hay = length - len(needle) - len(tail)
    if n_hay < 1 or len(haystack) <= n_hay:
        raise ValueError(
            f"passkey length {length} leaves no room for haystack text (or the validation split "
            f"has only {len(haystack)} tokens)"
        )
    start = int(rng.integers(0, len(haystack) - n_hay))
    hay = [int(t) for t in haystack[start : start + n_hay]]
    at = int(round(depth * n_hay))
    first = at + len(parts[0])  # after " The pass key is"
    second = first + len(key) + len(parts[1])  # after ". Remember it."
    key_pos = list(range(first, first + len(key))) + list(range(second, second + len(key)))
    return hay[:at] + needle + hay[at:] + tail, len(key), key_pos


class PasskeyMix:
    """Passkeys written into training windows (``data.passkey_mix``, ``data.passkey_questions``).

    ``apply_(windows, draws) -> answers bool [N, S+1]``: ``windows int64 [N, S+1]`` (token windows
    before the input/target shift), changed in place; ``answers`` marks the asked keys' tokens (the
    positions ``answer_weight`` weighs in the training loss, ``training.data.sample_batch``). Row
    ``i`` is drawn from ``draws[i]`` alone (training.data.sample_batch passes ``(seed, step, epoch,
    index in the global batch)``), so which windows carry keys, and where, does not depend on how
    ranks or accumulation split the batch, and a resumed run sees the same data.

    A chosen window is cut into ``m`` equal segments, ``m`` drawn from the powers of two up to
    ``questions`` (1, 2, 4, .. 64 for 64); each segment gets, over its own text, a needle with its
    own fresh key at a uniform position and one ``question + key`` at the segment's end. So the
    distance from question to needle spans every scale up to the whole window (the eval's depths do
    too), and the most recent "The pass key is" before a question is always its own needle: an
    answer can only be copied from the needle, never from an earlier question (which, with several
    questions about one key, lets a model learn a short copy that does not reach back: a 31M model
    trained that way at 16k scored 0%).

    ``distance_bias`` (``data.passkey_distance_bias``) weighs how ``m`` is drawn: ``P(m) ~ m **
    -bias``. A segment's distances are uniform up to its length ``window / m``, so long distances
    come only from windows with few segments, and a window holds at most one episode farther back
    than half of it: more long episodes cost short ones. 0 (the default) draws ``m`` uniformly over
    the levels, which puts nearly all episodes at short range; 1 gives every level (segment lengths
    an octave apart) the same expected number of episodes. Expected per window at ``questions`` 256
    and 16k tokens (zoo/sparse_attn_small_16k.yaml; "far" = farther back than a quarter of the
    window, 4k, where its dense model stops retrieving; the last column with its 6-token keys and
    ``answer_weight`` 20):

        bias   P(m=1)   episodes   far episodes   far share   answers' share of the loss weight
        0      0.111    56.8       0.194          0.3%        30%
        0.5    0.306    16.0       0.447          2.8%        11%
        1      0.501    4.51       0.626          13.9%       3.2%
        2      0.750    1.50       0.750          50%         1.1%

    (2400 steps x 2 windows: 930 far episodes against 272k short ones at 0, 3000 against 19k at 1).
    No bias gets more than 0.75 far episodes a window (every window one segment); what it trades is
    the short-range practice and the answers' weight in the loss, which ``answer_weight`` may then
    make up. From step 0, the bias-1 mix teaches a 31M dense model at 16k no retrieval in 2400 steps
    where the unbiased one does (BENCHMARKS.md, Long-context quality): the copy is learned at short
    range first. ``bias_from_step`` (``data.passkey_bias_from_step``) draws the unbiased mix for the
    windows of earlier steps (``draws[i][1]``) and the biased one from that step on.

    ``length_key``: the config key that sets ``seq_len`` (``train.short_seq_len`` for the mix of
    the short-context phase's windows), named when the segments do not fit.
    """

    def __init__(
        self,
        tokenizer,
        share: float,
        questions: int,
        seq_len: int,
        answer_weight: float = 1.0,
        distance_bias: float = 0.0,
        bias_from_step: int = 0,
        length_key: str = "train.seq_len",
    ):
        self.tokenizer, self.share, self.answer_weight = tokenizer, share, answer_weight
        self.bias_from_step = bias_from_step
        # segments a window: 1, 2, 4, ..
        self.counts = [1 << i for i in range(questions.bit_length())]
        # Unbiased, m is one rng.integers call, the draw that keeps an unbiased run's windows (and
        # its resumes) bit-identical across versions (tests/training/test_passkey.py pins them).
        # Biased: one rng.random() against the cumulative P(m) ~ m ** -bias; the bounds stop before
        # the last level, so a sum that rounds below 1 still ends on it.
        self.count_bounds = None
        if distance_bias:
            weights = np.array(self.counts, dtype=np.float64) ** -distance_bias
            self.count_bounds = (np.cumsum(weights) / weights.sum())[:-1]
        self.parts, self.question = _encoded_parts(tokenizer)
        needle, ask = _needle_and_ask(
            self.parts, self.question, _random_key(tokenizer, np.random.default_rng(0))
        )
        need = self.counts[-1] * (len(needle) + len(ask))
        if need >= seq_len:
            from moezoo.configs import ConfigError

            # the short-context phase's mix is fixed by its window length, the full one's by fewer
            # questions
            raise ConfigError(
                "data.passkey_questions" if length_key == "train.seq_len" else length_key,
                f"{self.counts[-1]} segments of a needle and a question "
                f"take ~{need} tokens, more than {length_key}={seq_len}",
            )

    def _count_level(self, rng: np.random.Generator, step: int) -> int:
        """Index into ``counts`` of a window's segment count in training step ``step``."""
        if self.count_bounds is None or step < self.bias_from_step:
            return int(rng.integers(0, len(self.counts)))
        return int(np.searchsorted(self.count_bounds, rng.random(), side="right"))

    def apply_(self, windows: np.ndarray, draws) -> np.ndarray:
        S1 = windows.shape[1]
        answers = np.zeros(windows.shape, dtype=bool)
        for w, a, draw in zip(windows, answers, draws):
            rng = np.random.default_rng([int(v) & 0x7FFFFFFF for v in draw] + [0x9A55])
            if rng.random() >= self.share:
                continue
            m = self.counts[self._count_level(rng, int(draw[1]))]
            seg = S1 // m
            for s in range(m):
                key = _random_key(self.tokenizer, rng)
                needle, ask = _needle_and_ask(self.parts, self.question, key)
                free = seg - len(needle) - len(ask)
                # a key that tokenizes longer than the init check's: leave this segment's text
                if free < 0:
                    continue
                at = s * seg + int(rng.integers(0, free + 1))
                w[at : at + len(needle)] = needle
                end = (s + 1) * seg
                w[end - len(ask) : end] = ask
                a[end - len(key) : end] = True
        return answers


@dataclass
class PasskeyResult:
    """``accuracy``: per length, the share of samples whose answer the model gives. ``recall``: per
    length, the needle recall of the block top-k heads (module docstring), over the samples whose
    needle is in an earlier key block than the question; ``recall_layers``: the same per layer
    (``layer_id``). Lengths with no such sample, and models without block top-k heads, have no
    recall entry."""

    accuracy: dict[int, float]
    recall: dict[int, float] = field(default_factory=dict)
    recall_layers: dict[int, dict[int, float]] = field(default_factory=dict)


@contextmanager
def _recording_selection(model):
    """The model's attention layers with block top-k heads, set to keep each forward's selection."""
    from moezoo.layers.attention import Attention
    from moezoo.layers.attention.pattern import head_patterns

    layers = [
        m
        for m in model.modules()
        if isinstance(m, Attention)
        and m.pattern is not None
        and any(p.type == "block_topk" for p in head_patterns(m.pattern, m.n_heads))
    ]
    before = [m.record_selection for m in layers]
    for m in layers:
        m.record_selection = True
    try:
        yield layers
    finally:
        for m, b in zip(layers, before):
            m.record_selection = b
            # drop the blocks
            m.attn_stats = {k: v for k, v in m.attn_stats.items() if k != "selection"}


@torch.no_grad()
def passkey_eval(
    model,
    tokenizer,
    val_tokens: np.ndarray,
    lengths,
    samples: int = 10,
    seed: int = 0,
    device=None,
    autocast=None,
) -> PasskeyResult:
    """Accuracy (and needle recall) per length over ``samples`` needles at depths ``0, 1/(n-1), ..,
    1`` (one forward each)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    res = PasskeyResult({})
    with _recording_selection(model) as layers:
        for L in lengths:
            hits = 0
            found: dict[int, list[torch.Tensor]] = {}  # layer -> per far sample, bool [heads]
            for i in range(samples):
                depth = i / max(samples - 1, 1)
                toks, n, key_pos = passkey_sample(
                    tokenizer, val_tokens, L, depth, seed * 1_000_003 + L * 1009 + i
                )
                x = torch.tensor(toks, device=device)[None]
                # as Trainer.compute_loss (CUDA-graphed blocks)
                torch.compiler.cudagraph_mark_step_begin()
                with autocast() if autocast else torch.autocast(device.type, enabled=False):
                    logits = model(x)
                pred = logits[0, -n - 1 : -1].argmax(-1)
                hits += int(torch.equal(pred, x[0, -n:]))
                q_pos = len(toks) - n - 1  # the query that predicts the answer's first token
                for m in layers:
                    sel = m.attn_stats.get("selection")
                    if sel is not None and max(key_pos) // sel.block_size < q_pos // sel.block_size:
                        found.setdefault(m.layer_id, []).append(sel.covers(q_pos, key_pos)[0])
            res.accuracy[L] = hits / samples
            if found:
                per_layer = {
                    lid: torch.stack(v).float().mean().item() for lid, v in sorted(found.items())
                }
                res.recall_layers[L] = per_layer
                res.recall[L] = (
                    torch.cat([torch.stack(v).flatten() for v in found.values()])
                    .float()
                    .mean()
                    .item()
                )
    model.train(was_training)
    return res


def format_passkey_table(results: PasskeyResult, title: str = "passkey") -> str:
    rows = [
        f"{title:>10} | " + " | ".join(f"{L:>7}" for L in results.accuracy),
        f"{'accuracy':>10} | " + " | ".join(f"{a:>7.0%}" for a in results.accuracy.values()),
    ]
    # block top-k heads: did the selection hold the needle (blank: no far needle)
    if results.recall:
        rows.append(
            f"{'recall':>10} | "
            + " | ".join(
                f"{results.recall[L]:>7.0%}" if L in results.recall else " " * 7
                for L in results.accuracy
            )
        )
    return "\n".join(rows)


def passkey_metrics(results: PasskeyResult) -> dict:
    """wandb / metrics.jsonl keys: ``passkey/<length>`` and their mean ``passkey/mean``; with block
    top-k heads ``passkey_recall/<length>`` and ``passkey_recall/<length>/layer<i>``."""
    out = {f"passkey/{L}": a for L, a in results.accuracy.items()}
    if results.accuracy:
        out["passkey/mean"] = sum(results.accuracy.values()) / len(results.accuracy)
    for L, r in results.recall.items():
        out[f"passkey_recall/{L}"] = r
        out.update({f"passkey_recall/{L}/layer{i}": v for i, v in results.recall_layers[L].items()})
    return out
