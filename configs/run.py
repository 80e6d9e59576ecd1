"""Run sections: ``data``, ``train``, ``optim``, ``logging``, ``checkpoint``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .errors import check, check_choice, check_positive


@dataclass
class DataConfig:
    # "stdlib" = this interpreter's standard-library .py files (always present, no download);
    # else a text file, a directory, a glob, or a .jsonl file (field `jsonl_field`).
    source: str = "stdlib"
    # a sentencepiece .model; None = train one on the corpus (cached)
    tokenizer: Optional[str] = None
    jsonl_field: str = "text"
    # share of files (or jsonl records) held out, chosen by a hash of the name;
    val_fraction: float = 0.05
    # a single document: the last val_fraction of its tokens
    cache_dir: str = ".cache/moezoo"  # tokenizer and token memmaps, keyed by corpus + vocab
    max_files: int = 0  # 0 = all documents; else the first N in name-hash order (a varied subset)
    # Retrieval practice (training.passkey.PasskeyMix): this share of training windows carries
    # passkeys, in 1, 2, 4, .. up to `passkey_questions` segments of a needle + one question;
    # validation text never does.
    passkey_mix: float = 0.0
    passkey_questions: int = 4
    # How the segment count m is drawn: P(m) ~ m ** -bias. 0 = uniform over the levels (nearly all
    # episodes short-range); 1 = the same expected episodes at every level, so more long-distance
    # ones, fewer in all (PasskeyMix's docstring has the numbers).
    passkey_distance_bias: float = 0.0
    # The bias applies to the windows of steps >= this one; earlier steps draw the unbiased mix. A
    # curriculum: the copy is learned at short range first (BENCHMARKS.md, Long-context quality),
    # the long range after it.
    passkey_bias_from_step: int = 0
    # The asked keys' tokens weigh this much in the training loss (1 = plain LM loss). A small model
    # sees the task in ~2% of its tokens at most; weighting them (20: BENCHMARKS.md, Long-context
    # quality) makes it learn the copy in minutes, at some cost in val loss. The logged training
    # loss and the validation loss stay the plain mean CE.
    passkey_answer_weight: float = 1.0

    def validate(self, key: str = "data") -> None:
        check(
            0.0 < self.val_fraction < 1.0,
            f"{key}.val_fraction",
            f"must be in (0, 1), got {self.val_fraction}",
        )
        check(self.max_files >= 0, f"{key}.max_files", f"must be >= 0, got {self.max_files}")
        check(
            0.0 <= self.passkey_mix <= 1.0,
            f"{key}.passkey_mix",
            f"must be in [0, 1], got {self.passkey_mix}",
        )
        check(
            self.passkey_questions >= 1,
            f"{key}.passkey_questions",
            f"must be >= 1, got {self.passkey_questions}",
        )
        check(
            math.isfinite(self.passkey_distance_bias) and self.passkey_distance_bias >= 0,
            f"{key}.passkey_distance_bias",
            f"must be a finite number >= 0, got {self.passkey_distance_bias}",
        )
        check(
            self.passkey_bias_from_step >= 0,
            f"{key}.passkey_bias_from_step",
            f"must be >= 0, got {self.passkey_bias_from_step}",
        )
        check(
            self.passkey_bias_from_step == 0 or self.passkey_distance_bias > 0,
            f"{key}.passkey_bias_from_step",
            "switches data.passkey_distance_bias on at a step, but the bias is 0",
        )
        check(
            self.passkey_answer_weight > 0,
            f"{key}.passkey_answer_weight",
            f"must be > 0, got {self.passkey_answer_weight}",
        )


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # sequences per micro-batch per rank
    seq_len: int = 256
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    # float32: parameters in float32, autocast casts the matmul weights at every use | bfloat16: the
    # matmul weights held in bfloat16, their float32 masters in the optimizer
    # (training.optim.MasterAdamW; needs bf16 autocast, one process, no DST)
    param_dtype: str = "float32"
    compile: bool = False  # torch.compile every transformer block (in place; names unchanged)
    # torch.compile's mode for those blocks: default | reduce-overhead (CUDA graphs: for small
    # models whose step is bound by kernel launches) | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    eval_every: int = 100
    eval_batches: int = 8
    # consecutive non-finite steps before rolling back to the last checkpoint
    max_bad_steps: int = 3
    max_rollbacks: int = 3  # rollbacks without a new checkpoint in between before the run stops
    # None = each new run gets runs/<name>/<N> (N = 1, 2, ...; --resume takes the latest:
    # training.run_folder); a path = exactly that folder
    out_dir: Optional[str] = None
    # start fresh in a train.out_dir holding another run's checkpoints, deleting them
    overwrite: bool = False
    threads: int = 0  # torch CPU threads; 0 = torch default
    # Short-context phase (sequence-length warm-up): steps < short_steps train on windows of
    # short_seq_len tokens, seq_len // short_seq_len times as many per micro-batch (the same tokens
    # a step); later steps and every evaluation use seq_len; 0 = off. A model learns its
    # induction/copy heads from a number of tokens, and short windows make dense attention cheap
    # while it does (long-context models are pretrained short, then extended); sparse heads learn
    # to point at what they look for while their windows hold few blocks.
    short_seq_len: int = 0
    short_steps: int = 0

    def windows(self, step: int) -> tuple[int, int]:
        """``(window length, windows per micro-batch)`` of training step ``step``:
        ``(short_seq_len, batch_size * seq_len // short_seq_len)`` before ``short_steps``, else
        ``(seq_len, batch_size)``."""
        if step < self.short_steps:
            return self.short_seq_len, self.batch_size * (self.seq_len // self.short_seq_len)
        return self.seq_len, self.batch_size

    def validate(self, key: str = "train") -> None:
        check_positive(
            self,
            key,
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "max_bad_steps",
            "max_rollbacks",
        )
        check_choice(self.device, ("auto", "cpu", "cuda"), f"{key}.device")
        check_choice(self.dtype, ("auto", "float32", "bfloat16"), f"{key}.dtype")
        check_choice(self.param_dtype, ("float32", "bfloat16"), f"{key}.param_dtype")
        if self.param_dtype == "bfloat16":
            check(
                self.dtype != "float32",
                f"{key}.param_dtype",
                f"bfloat16 weights need bf16 autocast: set {key}.dtype to bfloat16 "
                "(or auto on CUDA), not float32",
            )
        check_choice(
            self.compile_mode,
            ("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
            f"{key}.compile_mode",
        )
        check(self.threads >= 0, f"{key}.threads", f"must be >= 0, got {self.threads}")
        self._validate_short_phase(key)

    def _validate_short_phase(self, key: str) -> None:
        for n in ("short_seq_len", "short_steps"):
            v = getattr(self, n)
            check(v >= 0, f"{key}.{n}", f"must be >= 0 (0 = off), got {v}")
        S, n = self.short_seq_len, self.short_steps
        check(
            S > 0 or n == 0,
            f"{key}.short_seq_len",
            f"is 0 (off) but {key}.short_steps={n} asks for a short-context phase: set both",
        )
        check(
            n > 0 or S == 0,
            f"{key}.short_steps",
            f"is 0 (off) but {key}.short_seq_len={S} asks for a short-context phase: set both",
        )
        if not S:
            return
        check(
            S < self.seq_len and self.seq_len % S == 0,
            f"{key}.short_seq_len",
            f"must divide {key}.seq_len={self.seq_len} and be smaller, got {S}",
        )
        check(
            n <= self.steps, f"{key}.short_steps", f"must be <= {key}.steps={self.steps}, got {n}"
        )


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the schedule's floor (its end) as a fraction of lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    # The lr's shape (training.optim.plan_schedule): cosine = linear warm-up over warmup_steps,
    # then cosine to lr * min_lr_ratio at train.steps | wsd = warm-up, stable at lr, then a linear
    # decay to the floor over the last decay_fraction of train.steps (warmup-stable-decay: a run
    # extended while stable keeps training at lr, and its decay moves to the new end)
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    # A resumed run whose train.steps (or schedule keys) differ from its checkpoint's:
    # continue = from the lr it reached, never above it (a wsd run still stable stays at lr until
    # its moved decay; otherwise a decay from the reached lr to the floor over the remaining steps;
    # a finished cosine run holds the floor) | rewarm = warm up from the reached lr to lr over
    # warmup_steps again, then the schedule's shape to the new end
    extend: str = "continue"
    # A run starting from model.init_from is continued training: its peak lr and warm-up. None =
    # lr * min_lr_ratio (where a run of this config ends) and warmup_steps // 10.
    init_from_lr: Optional[float] = None
    init_from_warmup_steps: Optional[int] = None
    # torch's AdamW kernel, as torchtitan's optimizer.implementation: auto (fused on CUDA, where it
    # is one launch for all parameters; foreach on CPU, where it is the faster one) | fused |
    # foreach. train.param_dtype bfloat16 runs its own kernel (MasterAdamW) whatever this says.
    implementation: str = "auto"

    def validate(self, key: str = "optim") -> None:
        check_positive(self, key, "lr", "eps")
        check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"{key}.min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )
        check(
            self.warmup_steps >= 0, f"{key}.warmup_steps", f"must be >= 0, got {self.warmup_steps}"
        )
        check(
            self.weight_decay >= 0, f"{key}.weight_decay", f"must be >= 0, got {self.weight_decay}"
        )
        for n in ("beta1", "beta2"):
            check(
                0.0 <= getattr(self, n) < 1.0,
                f"{key}.{n}",
                f"must be in [0, 1), got {getattr(self, n)}",
            )
        check(self.grad_clip >= 0, f"{key}.grad_clip", f"must be >= 0, got {self.grad_clip}")
        check_choice(self.schedule, ("cosine", "wsd"), f"{key}.schedule")
        check(
            0.0 < self.decay_fraction <= 1.0,
            f"{key}.decay_fraction",
            f"must be in (0, 1], got {self.decay_fraction}",
        )
        check_choice(self.extend, ("continue", "rewarm"), f"{key}.extend")
        check_positive(self, key, "init_from_lr")
        check(
            self.init_from_warmup_steps is None or self.init_from_warmup_steps >= 0,
            f"{key}.init_from_warmup_steps",
            f"must be >= 0, got {self.init_from_warmup_steps}",
        )
        check(
            self.implementation in ("auto", "fused", "foreach"),
            f"{key}.implementation",
            f"must be auto, fused or foreach, got {self.implementation!r}",
        )


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # online | offline | disabled
    project: str = "moezoo"
    entity: Optional[str] = None
    run_name: Optional[str] = None  # default: the config name
    log_every: int = 10
    progress: bool = True  # rank 0: a tqdm bar on a terminal, plain lines when stdout is not one
    plots: bool = True  # <out_dir>/plots/*.png at every evaluation (training.plot)
    # torch.profiler over steps [profile_at, profile_at + profile_steps) into <out_dir>/profile
    # (training.profile: trace, op table, device-time shares by kind); 0 = off
    profile_at: int = 0
    profile_steps: int = 3

    def validate(self, key: str = "logging") -> None:
        check_choice(self.wandb, ("online", "offline", "disabled"), f"{key}.wandb")
        check(self.log_every > 0, f"{key}.log_every", f"must be > 0, got {self.log_every}")
        check(
            self.profile_at >= 0,
            f"{key}.profile_at",
            f"must be >= 0 (0 = off), got {self.profile_at}",
        )
        check(
            self.profile_steps >= 1,
            f"{key}.profile_steps",
            f"must be >= 1, got {self.profile_steps}",
        )


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default <out_dir>/checkpoints
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3
    resume: bool = False  # continue from the latest complete checkpoint (train.py --resume)
    # Lift the allowlists that keep checkpoint files from running code (train.py
    # --trust-checkpoint): only for a checkpoint whose author you trust.
    trust: bool = False

    def validate(self, key: str = "checkpoint") -> None:
        check(self.every >= 0, f"{key}.every", f"must be >= 0, got {self.every}")
        check(self.keep_last >= 1, f"{key}.keep_last", f"must be >= 1, got {self.keep_last}")
