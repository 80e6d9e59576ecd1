"""The training loop: ``run(cfg)`` = seed, mesh, data, model, optimizer, DST, resume, steps, eval,
logging.

Each step is a pure function of (checkpointed state, step index): batches come from
``data.sample_batch(seed, step, dp_rank, epoch)``, so ``--resume`` continues bit-exactly. A step
whose loss or gradient norm is not finite is skipped and counted; ``train.max_bad_steps`` of them in
a row roll the run back to the last checkpoint and move the data stream to a new epoch;
``train.max_rollbacks`` rollbacks without a new checkpoint in between stop the run. Ctrl-C saves a
checkpoint and stops.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from moezoo.configs import Config, ConfigError
from moezoo.kernels.launch import to_device
from moezoo.layers import (
    AttentionStats,
    DynamicSparsity,
    ExpertBalancing,
    NeuronSchedule,
    attention_density,
)
from moezoo.zoo import build_model
from moezoo.zoo.model import mean_cross_entropy

from .checkpoint import (
    CheckpointError,
    check_resumable,
    find_resumable,
    load_checkpoint,
    save_checkpoint,
)
from .data import prepare_data, sample_batch
from .logger import append_metrics, make_logger, to_python
from .metrics import device_peak_flops, mfu_metrics
from .optim import (
    Schedule,
    build_optimizer,
    build_scheduler,
    describe_schedule,
    extend_schedule,
    lr_at,
    plan_schedule,
)
from .parallel import (
    all_reduce_mean,
    clip_coef,
    clip_grad_norm_,
    model_init_device,
    parallelize,
    setup_parallel,
)
from .preflight import check_model, check_paths, check_runtime
from .profile import StepProfiler, format_summary
from .run_folder import (
    check_fresh_start,
    choose_run_folder,
    clear_previous_run,
    new_run_id,
    remove_if_empty,
    trim_metrics,
)
from .trained import TOKENIZER_FILE


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def skips_on_device(optimizer: torch.optim.Optimizer, methods: list) -> bool:
    """Whether a step with a non-finite loss or gradient norm can be skipped without the host
    knowing: an optimizer that takes ``found_inf`` (torch's fused AdamW, as torch.amp.GradScaler
    uses it, FSDP2's sharded parameters included; MasterAdamW) and every sparsity method
    ``skips_on_device`` (layers.sparsity_method). Else the trainer reads the check each step (one
    host sync). Under torchrun every rank decides alike: the flags are all-reduced values."""
    fused_adamw = type(optimizer) is torch.optim.AdamW and bool(optimizer.defaults.get("fused"))
    return (fused_adamw or getattr(optimizer, "skips_on_device", False)) and all(
        getattr(m, "skips_on_device", False) for m in methods
    )


class TrainingDiverged(RuntimeError):
    """Non-finite steps with nothing (left) to roll back to (train.py: one line, exit 1)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after the checkpoint of the step it stopped at was saved; ``str`` says where."""


# schedule_targets' keys, as the resume line names them
_TARGET_NAMES = {
    "schedule": "optim.schedule",
    "lr": "peak lr",
    "floor": "floor lr",
    "warmup": "warm-up steps",
    "decay_fraction": "optim.decay_fraction",
    "steps": "train.steps",
}


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg, self.init_from_line = cfg, None
        if cfg.model.init_from and not cfg.checkpoint.resume:
            from moezoo.zoo.pretrained import prepare_init_from

            # a local folder (or HF cache id) and its tokenizer, before the paths are checked
            self.init_from_line = prepare_init_from(cfg)
        check_paths(cfg)
        self.par = setup_parallel(cfg)
        self.device = self.par.device
        # e.g. flash-attn-4 or FP8 asked for, unavailable
        check_runtime(cfg, self.device, self.par.world_size)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        from .plan import check_fits

        # One meta-device model (no memory) for the plan, the FLOPs per token for MFU and the shape
        # checks.
        meta_model = build_model(cfg.model, "meta")
        fits = check_fits(cfg, self.par.world_size, self.device, meta_model)
        self.flops_per_token = fits.flops_per_token
        check_model(cfg, meta_model)
        from moezoo.zoo.flops import attention_flops_per_token

        # mfu: the work done
        self.dense_attn_flops = attention_flops_per_token(cfg.model, cfg.train.seq_len)
        # (model FLOPs, dense attention FLOPs) per token of each window length a step trains on:
        # the short-context phase's attention costs less per token
        self.flops_at = {cfg.train.seq_len: (self.flops_per_token, self.dense_attn_flops)}
        if fits.short_phase:
            S = fits.short_phase.seq_len
            self.flops_at[S] = (
                fits.short_phase.flops_per_token,
                attention_flops_per_token(cfg.model, S),
            )
        del meta_model
        # A new runs/<name>/<N> unless train.out_dir names one (training.run_folder); removed again
        # if the run fails before writing anything into it.
        first_line, created = choose_run_folder(cfg, self.par.is_main, self._share)
        self.print(first_line)
        try:
            self._build()
        except BaseException:
            if created and self.par.is_main:
                remove_if_empty(cfg.out_dir)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.resume_path, replaced = None, []
        if cfg.checkpoint.resume:
            self.resume_path = self._find_resume()
        else:
            replaced = check_fresh_start(cfg)
        # a resumed run has its own weights
        init_from = cfg.model.init_from and not self.resume_path
        if init_from:
            from moezoo.zoo.pretrained import check_init_from, prepare_init_from

            if self.init_from_line is None:  # --resume found no checkpoint
                self.init_from_line = prepare_init_from(cfg)
            # reads the HF config only: a mismatch fails before the data work
            check_init_from(cfg.model)
            self.print(self.init_from_line)
        # Same seed on every rank: identical initial weights before sharding.
        seed_everything(cfg.train.seed)
        self.data = prepare_data(cfg, self.par.is_main, self.barrier)
        self.passkey_mix = self.short_passkey_mix = None
        # retrieval practice in the training windows (training/passkey.py)
        if cfg.data.passkey_mix > 0:
            from .passkey import PasskeyMix

            d, t = cfg.data, cfg.train

            def mix(seq_len: int, questions: int, length_key: str) -> PasskeyMix:
                return PasskeyMix(
                    self.data.tokenizer,
                    d.passkey_mix,
                    questions,
                    seq_len,
                    d.passkey_answer_weight,
                    distance_bias=d.passkey_distance_bias,
                    bias_from_step=d.passkey_bias_from_step,
                    length_key=length_key,
                )

            self.passkey_mix = mix(t.seq_len, d.passkey_questions, "train.seq_len")
            if t.short_seq_len:
                # as many fewer segments as the window is shorter: the shortest segment (the
                # closest needles) is as long as at seq_len
                questions = max(1, d.passkey_questions * t.short_seq_len // t.seq_len)
                self.short_passkey_mix = mix(t.short_seq_len, questions, "train.short_seq_len")
        if self.resume_path:
            check_resumable(self.resume_path, cfg, self.par.world_size, self.data.tokenizer.digest)
        # "meta" when too big to build whole
        model = build_model(cfg.model, model_init_device(cfg, self.par))
        if init_from:
            if next(model.parameters()).is_meta:
                raise ConfigError(
                    "model.init_from",
                    "needs a model built whole on each rank (this one is built "
                    "on the meta device and sharded)",
                )
            from moezoo.zoo.pretrained import load_init_from

            load_init_from(model, cfg.model)
        # in place (FSDP2 / EP): still the Transformer
        self.model = parallelize(model, cfg, self.par)
        if cfg.train.compile:
            # Per block and in place, as torchtitan does: parameter names, FSDP2 units and
            # checkpoints unchanged. Static shapes (a run's batch and length are fixed): automatic
            # dynamic shapes would turn the per-layer ints (layer id, pattern sizes) into symbols
            # once a second block recompiles, which compiles slower and runs slower. Two graphs per
            # distinct block (training; evaluation, whose no_grad and eval mode are guards), so the
            # cache must hold them all: past the limit a block runs eagerly, and validation at step
            # 0 fills the cache before the first training step. The blocks of every model in the
            # process share one cache (their class's forward code), so each trainer adds room for
            # its own graphs to what earlier ones (a notebook, a bench suite) already hold. A
            # short-context phase (train.short_seq_len) adds a training graph of its shape.
            graphs = 3 if cfg.train.short_seq_len else 2
            torch._dynamo.config.cache_size_limit += graphs * len(model.layers) + 8
            for block in model.layers:
                block.compile(dynamic=False, mode=cfg.train.compile_mode)
            # The loss too (as torchtitan's compile.components "loss"): the logits' upcast fuses
            # into it. Default mode whatever compile_mode says: a graph of a few large kernels, no
            # launches for CUDA graphs to save.
            model.cross_entropy = torch.compile(mean_cross_entropy, dynamic=False)
        self.optimizer = build_optimizer(
            self.model,
            cfg.optim,
            self.device.type,
            compact=cfg.dst.enabled and cfg.dst.compact_state,
            param_dtype=cfg.train.param_dtype,
            grad_accum=cfg.train.grad_accum,
        )
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optim, cfg.train.steps, init_from=bool(cfg.model.init_from)
        )
        if init_from:
            self.print(
                f"continued training: lr {describe_schedule(self.scheduler.pieces, 0)} "
                "(optim.init_from_lr, optim.init_from_warmup_steps)"
            )
        self.sparsity = self._sparsity_methods()
        # Skip non-finite steps on the device (no host sync a step) where the optimizer and every
        # method can; the host then learns of a skipped step one step later (train_step, settle).
        self.skip_on_device = skips_on_device(self.optimizer, self.sparsity)
        # (host flags [finite, stop], event) of the last step, until the host reads it
        self.unread = None
        self.autocast = self._autocast()
        self.step, self.epoch, self.bad_total, self.bad_in_row, self.rollbacks_in_row = (
            0,
            0,
            0,
            0,
            0,
        )
        self.best_val, self.wandb_id, self.run_id = float("inf"), None, new_run_id()
        self.val_history: list[tuple[int, float]] = []
        self.saved_step, self.stop_requested, self.stop_agreed = -1, False, False
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        # Different per-rank stream for anything stochastic in the model (router noise on different
        # tokens).
        seed_everything(cfg.train.seed + 1000 * self.par.rank)
        if self.par.is_main:
            if self.resume_path is None:
                # metrics.jsonl rows of an earlier attempt would mix in
                clear_previous_run(cfg, replaced)
            os.makedirs(cfg.out_dir, exist_ok=True)
        if cfg.checkpoint.resume and self.resume_path is None:
            self.warn(f"no checkpoint in {cfg.checkpoint_dir}; starting from step 0")
        elif self.resume_path:
            replanned = self._restore(self.resume_path)
            self.saved_step = self.step
            if self.par.is_main:
                trim_metrics(self.metrics_path, self.step)
            if self.step >= cfg.train.steps:
                self.print(
                    f"{cfg.name} is already complete: "
                    f"step {self.step} of train.steps={cfg.train.steps} "
                    "(raise train.steps to train further)"
                )
            else:
                self.print(f"resumed from {self.resume_path} at step {self.step}")
                if replanned:
                    self.print(replanned)
        self.logger = make_logger(cfg, cfg.out_dir, self.par.rank, self.wandb_id)
        self.wandb_id = getattr(self.logger.run, "id", None)
        self.tokens_per_step = (
            cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum * self.par.dp_size
        )
        self.peak_flops = device_peak_flops(self.device)
        lg = cfg.logging
        self.profiler = StepProfiler(
            lg.profile_at,
            lg.profile_steps,
            os.path.join(cfg.out_dir, "profile"),
            self.par.rank,
            self.device,
        )
        if self.par.is_main:
            # The run folder keeps its tokenizer, so generate/export find it there
            # (training.trained).
            shutil.copyfile(self.data.tokenizer.path, os.path.join(cfg.out_dir, TOKENIZER_FILE))

    # ---- setup helpers -------------------------------------------------------------------------
    def _autocast(self):
        dt = self.cfg.train.dtype
        if dt == "bfloat16" or (dt == "auto" and self.device.type == "cuda"):
            return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext

    def _sparsity_methods(self) -> list:
        """What acts between steps (layers.sparsity_method): MoE bias balancing and load stats, the
        neuron FFN schedule, DST. The trainer calls each the same way and knows none of them."""
        c, out = self.cfg, []
        ffn_types = c.model.layer_ffn_types()
        if "moe" in ffn_types:
            # Aux-loss-free balancing: every rank applies the same bias update from the global load.
            out.append(
                ExpertBalancing(self.model, dist.group.WORLD if self.par.distributed else None)
            )
        if any(layer.attention.pattern is not None for layer in self.model.layers):
            # density (for mfu) and selection stats
            a = c.model.attention
            out.append(
                AttentionStats(
                    self.model,
                    c.train.seq_len,
                    c.train.steps,
                    a.dense_warmup,
                    a.dense_finish,
                    a.dense_phase_heads,
                    c.logging.log_every,
                )
            )
        if "neuron" in ffn_types:
            out.append(NeuronSchedule(self.model, c.train.steps, self.optimizer))
        if c.dst.enabled:
            out.append(
                DynamicSparsity.from_config(
                    self.model, c.dst, self.optimizer, total_steps=c.train.steps
                )
            )
        return out

    def print(self, msg: str) -> None:
        if self.par.is_main:
            tqdm.write(msg)

    def warn(self, msg: str) -> None:
        if self.par.is_main:
            tqdm.write(f"warning: {msg}", file=sys.stderr)

    def _find_resume(self) -> str | None:
        """The newest usable checkpoint (before anything is built); damaged newer ones are named and
        skipped."""
        c = self.cfg
        path, skipped = find_resumable(c.checkpoint_dir, c.checkpoint.trust)
        if path is None and skipped:
            raise CheckpointError(
                c.checkpoint_dir, f"no usable checkpoint to resume from ({'; '.join(skipped)})"
            )
        for line in skipped:
            self.warn(f"skipped damaged checkpoint {line}")
        if path:
            check_resumable(path, c, self.par.world_size)
        return path

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _share(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.par.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---- state -----------------------------------------------------------------------------------
    def train_state(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "bad_total": self.bad_total,
            "best_val": self.best_val,
            "val_history": self.val_history,
            "scheduler": self.scheduler.state_dict(),
            "wandb_id": self.wandb_id,
            "world_size": self.par.world_size,
            "global_batch": self.tokens_per_step
            // self.cfg.train.seq_len,  # sequences a step (resharding)
            "tokenizer": self.data.tokenizer.digest,
            "run_id": self.run_id,
            "total_steps": self.cfg.train.steps,
        }

    def _restore(self, path: str) -> str | None:
        """Load checkpoint ``path`` into the trainer; returns a line describing the lr schedule
        when it was re-planned (``_restore_schedule``)."""
        state = load_checkpoint(path, self.model, self.optimizer, self.cfg.checkpoint.trust)
        self.step, self.epoch, self.bad_total = state["step"], state["epoch"], state["bad_total"]
        self.best_val = state["best_val"]
        self.val_history = [tuple(v) for v in state["val_history"]]
        self.wandb_id, self.run_id = state.get("wandb_id"), state.get("run_id", self.run_id)
        self.bad_in_row = 0
        # e.g. the MoE load routed since the last bias update belongs to dropped steps
        for method in self.sparsity:
            method.skipped_step()
        return self._restore_schedule(state)

    def _restore_schedule(self, state: dict) -> str | None:
        """The checkpoint's lr schedule when it was planned for this run's targets (length, peak,
        shape; optim.schedule_targets); else the steps ahead re-planned from the lr the checkpoint
        reached, as ``optim.extend`` says (optim.extend_schedule), and a line saying so."""
        saved, targets = state["scheduler"], self.scheduler.targets
        if "targets" not in saved:  # a schedule planned for the run's length by torch schedulers
            old = {**targets, "steps": state.get("total_steps", targets["steps"])}
            saved = {"pieces": plan_schedule(old), "targets": old}
        if saved["targets"] == targets:
            self.scheduler.load_state_dict({**saved, "step": self.step})
            return None
        mode, reached = self.cfg.optim.extend, lr_at(saved["pieces"], self.step)
        pieces = extend_schedule(saved["pieces"], self.step, reached, targets, mode)
        self.scheduler = Schedule(self.optimizer, pieces, targets, self.step)
        changed = ", ".join(
            f"{_TARGET_NAMES[k]} {saved['targets'].get(k)} -> {v}"
            for k, v in targets.items()
            if saved["targets"].get(k) != v
        )
        hint = f"; optim.extend=rewarm warms up to {targets['lr']:.2e} first"
        return (
            f"{changed}: lr {describe_schedule(pieces, self.step)} "
            f"(optim.extend={mode}{hint if mode == 'continue' else ''})"
        )

    def save(self) -> str:
        self.settle()
        path = save_checkpoint(
            self.cfg.checkpoint_dir,
            self.step,
            self.model,
            self.optimizer,
            self.train_state(),
            self.cfg,
            self.cfg.checkpoint.keep_last,
        )
        self.saved_step, self.rollbacks_in_row = self.step, 0
        return path

    # ---- steps -----------------------------------------------------------------------------------
    def batch(self, step: int, micro: int, split: str = "train"):
        c = self.cfg.train
        train = split == "train"
        tokens = self.data.train if train else self.data.val
        # The step's global batch (batch_size x grad_accum x dp_size windows) is split into (micro,
        # rank) slices, so how it is split between accumulation and ranks does not change the data.
        accum = c.grad_accum if train else 1
        # training steps of the short-context phase: shorter windows, more of them; evaluation
        # always at seq_len
        seq_len, batch = c.windows(step) if train else (c.seq_len, c.batch_size)
        mix = self.passkey_mix if seq_len == c.seq_len else self.short_passkey_mix
        x, y, w = sample_batch(
            tokens,
            batch,
            seq_len,
            c.seed,
            step,
            micro * self.par.dp_size + self.par.dp_rank,
            accum * self.par.dp_size,
            self.epoch if train else -1,
            mix if train else None,
        )
        # pinned copies, queued: a pageable one would make the host wait for the previous step to
        # finish and leave the GPU idle while it launches this one's first kernels
        # (kernels.launch.to_device)
        return (
            to_device(x, self.device),
            to_device(y, self.device),
            None if w is None else to_device(w, self.device),
        )

    def compute_loss(
        self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict]:
        # a new step for CUDA graphs (train.compile_mode=reduce-overhead): the last replay's outputs
        # are done with, so the next replay may reuse their memory (a no-op without CUDA graphs)
        torch.compiler.cudagraph_mark_step_begin()
        with self.autocast():
            return self.model(x, y, loss_weights=w)

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches; returns detached metrics."""
        c = self.cfg
        self.model.train()
        seq_len = c.train.windows(self.step)[0]
        for method in self.sparsity:
            if isinstance(method, AttentionStats):
                # the budget density of layers without recorded stats is this step's length's
                method.seq_len = seq_len
            method.before_step(self.step)
        parts_sum: dict[str, torch.Tensor] = {}
        for micro in range(c.train.grad_accum):
            x, y, w = self.batch(self.step, micro)
            loss, parts = self.compute_loss(x, y, w)
            (loss / c.train.grad_accum).backward()
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v / c.train.grad_accum
        # A plain tensor, the same on every rank: the norm spans the dense and expert meshes'
        # shards. An optimizer that scales gradients itself (MasterAdamW) takes the clipping factor
        # instead of a pass.
        fused_scale = getattr(self.optimizer, "scales_gradients", False)
        # where the step finds them (MasterAdamW's float32 sums), in model order
        grads = (
            [g for p in self.model.parameters() if (g := self.optimizer.gradient(p)) is not None]
            if fused_scale
            else None
        )
        grad_norm = clip_grad_norm_(
            self.model.parameters(), c.optim.grad_clip, self.par, apply=not fused_scale, grads=grads
        )
        # One all-reduce for every loss part (the total is their sum) and, last, the Ctrl-C flag:
        # its mean is > 0 when any rank asked to stop, so the ranks agree on the step without a
        # collective of its own.
        detached = [v.detach().float() for v in parts_sum.values()]
        # a fill kernel, not torch.tensor(..., device=): no host-to-device copy on the step's path
        stop = torch.full(
            (), float(self.stop_requested), dtype=torch.float32, device=detached[0].device
        )
        reduced = all_reduce_mean(torch.stack([*detached, stop]), self.par)
        parts_mean = reduced[:-1]
        loss_val = parts_mean.sum()
        ok = torch.isfinite(loss_val) & torch.isfinite(grad_norm)
        metrics = {f"loss/{k}": v for k, v in zip(parts_sum, parts_mean)}
        metrics.update(
            {
                "loss/total": loss_val,
                "grad_norm": grad_norm.detach(),
                "lr": self.optimizer.param_groups[0]["lr"],
                "train/seq_len": seq_len,  # the window length: which phase the step was in
            }
        )

        def optimizer_step():
            if fused_scale and c.optim.grad_clip > 0:
                self.optimizer.step(grad_scale=clip_coef(grad_norm, c.optim.grad_clip))
            else:
                self.optimizer.step()

        # the previous step's flag, if it was left on the device (see below)
        self.settle()
        # A method may need to know this step's outcome on the host now (DST's mask updates): a sync
        # this step.
        deferred = self.skip_on_device and not any(
            m.decides_on_host(self.step) for m in self.sparsity if hasattr(m, "decides_on_host")
        )
        if deferred:
            # No host sync: the optimizer leaves weights, moments and step counts alone where
            # found_inf is 1, the methods take the same flag, and the host reads it a step later
            # (settle), while the device runs this step's update and the next step is queued behind
            # it. The previous step's flag was read above: it is ready once the device has begun
            # this step's forward, and if the device is not there yet the host waits with this
            # step's forward and backward queued (the device never idles; the host stays at most a
            # step ahead). An optimizer with host-side step counts (MasterAdamW) has taken them back
            # for a skipped step before it counts this one.
            self.optimizer.found_inf = (~ok).float()
            optimizer_step()
            applied = ok.float()
            for method in self.sparsity:
                method.after_optimizer_step(self.step, applied)
            flags = torch.stack([ok, reduced[-1] > 0])
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=flags.is_cuda)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event() if flags.is_cuda else None
            if event is not None:
                event.record()
            self.unread = (host, event)
            metrics["skipped"] = ~ok  # a device tensor: logged at the log steps
        else:
            self.optimizer.found_inf = None
            finite, self.stop_agreed = torch.stack([ok, reduced[-1] > 0]).tolist()  # one host sync
            if finite:
                optimizer_step()
                for method in self.sparsity:
                    method.after_optimizer_step(self.step)
            else:
                for method in self.sparsity:
                    method.skipped_step()
            self._count_step(finite)
            metrics["skipped"] = not finite
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        metrics["bad_steps"] = self.bad_total
        return metrics

    def _count_step(self, finite: bool) -> None:
        if finite:
            self.bad_in_row = 0
        else:
            self.bad_total += 1
            self.bad_in_row += 1

    def settle(self) -> None:
        """Read the outcome of the last step if its non-finite check stayed on the device
        (``skip_on_device``): ``bad_total``, ``bad_in_row`` and the Ctrl-C agreement are then up to
        date (the next step, log steps, checkpoints and rollbacks call it; a no-op otherwise)."""
        if self.unread is None:
            return
        (host, event), self.unread = self.unread, None
        if event is not None:
            event.synchronize()
        finite, self.stop_agreed = host.tolist()
        self._count_step(finite)
        if not finite and hasattr(self.optimizer, "uncount_last_step"):
            self.optimizer.uncount_last_step()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for i in range(self.cfg.train.eval_batches):
            x, y, _ = self.batch(i, 0, "val")
            losses.append(self.compute_loss(x, y)[1]["ce"].float())  # compute_loss enters autocast
        self.model.train()
        return float(all_reduce_mean(torch.stack(losses).mean(), self.par))

    def rollback(self) -> None:
        c = self.cfg
        path = find_resumable(c.checkpoint_dir, c.checkpoint.trust)[0]
        if path is None:
            raise TrainingDiverged(
                f"{self.bad_in_row} non-finite steps in a row at step {self.step} and no "
                f"checkpoint in {c.checkpoint_dir} to roll back to; lower optim.lr or "
                f"set checkpoint.every"
            )
        if self.rollbacks_in_row >= c.train.max_rollbacks:
            raise TrainingDiverged(
                f"non-finite steps at step {self.step} after {self.rollbacks_in_row} rollbacks "
                f"in a row to {path} (train.max_rollbacks={c.train.max_rollbacks}); lower optim.lr"
            )
        self.rollbacks_in_row += 1
        epoch, bad_total, rollbacks = self.epoch, self.bad_total, self.rollbacks_in_row
        self._restore(path)
        self.rollbacks_in_row = rollbacks
        # Same weights, new data order: replaying the batches that blew up would blow up again.
        self.epoch, self.bad_total = epoch + 1, bad_total
        self.print(f"rolled back to {path} (step {self.step}), data epoch {self.epoch}")

    def validate(self) -> float:
        """Evaluate, record the loss (history, wandb, metrics.jsonl, console) and return it."""
        v = self.evaluate()
        self.val_history.append((self.step, v))
        self.logger.log({"val/loss": v}, step=self.step)
        if self.par.is_main:
            append_metrics(self.metrics_path, {"val/loss": v}, self.step)
        self.print(f"step {self.step}: val loss {v:.4f}")
        if self.cfg.eval.passkey_lengths:  # retrieval at several lengths (training/passkey.py)
            from .passkey import format_passkey_table, passkey_eval, passkey_metrics

            e = self.cfg.eval
            pk = passkey_eval(
                self.model,
                self.data.tokenizer,
                self.data.val,
                e.passkey_lengths,
                e.passkey_samples,
                self.cfg.train.seed,
                self.device,
                self.autocast,
            )
            self.logger.log(passkey_metrics(pk), step=self.step)
            if self.par.is_main:
                append_metrics(self.metrics_path, passkey_metrics(pk), self.step)
            self.print(format_passkey_table(pk, f"step {self.step}"))
        return v

    def write_plots(self, expert_load) -> None:
        """``<out_dir>/plots/``: metrics.png and this step's expert load (rank 0,
        ``logging.plots``)."""
        if not (self.par.is_main and self.cfg.logging.plots):
            return
        from . import plot

        try:
            plot.write_metrics_plot(self.cfg.out_dir, self.cfg.name)
            if expert_load is not None:
                plot.save_figure(
                    plot.expert_load_figure(expert_load.numpy(), self.step),
                    os.path.join(
                        self.cfg.out_dir, plot.PLOTS_DIR, f"expert_load_step_{self.step:08d}.png"
                    ),
                )
        # pictures are a convenience: a run without matplotlib still trains
        except ImportError as e:
            self.print(f"no plots: {e}")
            self.cfg.logging.plots = False

    # ---- main loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``train.steps``. The first Ctrl-C stops after the current step with a checkpoint
        (``Interrupted``); a second one stops at once."""

        def on_sigint(signum, frame):
            self.stop_requested = True
            # the next Ctrl-C raises KeyboardInterrupt right away
            signal.signal(signal.SIGINT, previous)

        previous = signal.getsignal(signal.SIGINT)
        # Only the main thread may set handlers (a Trainer driven from another thread keeps Ctrl-C
        # as it is).
        handle = (
            previous is signal.default_int_handler
            and threading.current_thread() is threading.main_thread()
        )
        if handle:
            signal.signal(signal.SIGINT, on_sigint)
        progress = self.par.is_main and self.cfg.logging.progress
        # A bar on a terminal; in a log file (not a TTY) its redraws are noise, so plain lines
        # instead.
        self.log_lines = progress and not sys.stdout.isatty()
        bar = tqdm(
            total=self.cfg.train.steps,
            initial=self.step,
            dynamic_ncols=True,
            desc=self.cfg.name,
            unit="step",
            disable=not progress or self.log_lines,
        )
        try:
            self._fit(bar)
        finally:
            bar.close()  # before any message: it then starts on a fresh line
            if handle:
                signal.signal(signal.SIGINT, previous)
            self.logger.finish()
        return {
            "step": self.step,
            "val_history": self.val_history,
            "bad_steps": self.bad_total,
            "rank": self.par.rank,
        }

    def _stop_requested(self) -> bool:
        """Ctrl-C on any rank (all ranks must agree on the step they stop and save at): alone, the
        flag itself; under torchrun, what the last step's all-reduce carried (a Ctrl-C after it
        counts a step later)."""
        return self.stop_agreed if self.par.distributed else self.stop_requested

    def _fit(self, bar) -> None:
        c = self.cfg
        if self.step >= c.train.steps:
            return
        if self.step == 0 or not self.val_history:
            if any(layer.attention.pattern is not None for layer in self.model.layers):
                dens = attention_density(self.model, c.train.seq_len)
                self.logger.log(
                    {f"attn_density/{k}": v for k, v in dens.items() if "/head" not in k}, step=0
                )
                self.print(f"attention density at seq_len {c.train.seq_len}: {dens['mean']:.3f}")
            self.validate()
        t0, tokens_since = time.perf_counter(), 0
        while self.step < c.train.steps:
            self.profiler.before(self.step + 1)
            m = self.train_step()
            prof = self.profiler.after(self.step)
            if prof is not None:
                self.logger.log(prof, step=self.step)
                if self.par.is_main:
                    append_metrics(self.metrics_path, prof, self.step)
                self.print(
                    f"profile of steps {c.logging.profile_at}-{self.step}: "
                    f"{format_summary(prof, self.device.type == 'cuda')} -> {self.profiler.folder}"
                )
            tokens_since += self.tokens_per_step
            bar.update(1)
            if self.step == c.train.short_steps:
                self.print(
                    f"short-context phase over at step {self.step}: windows of "
                    f"{c.train.seq_len} tokens from here"
                )
            if self.unread is not None and self.bad_in_row + 1 >= c.train.max_bad_steps:
                # this step could start a rollback: read it now, so the rollback comes at this step
                self.settle()
            if self.bad_in_row >= c.train.max_bad_steps:
                # The step that triggers the rollback is logged: the rows after it restart at the
                # checkpoint.
                m["bad_steps"] = self.bad_total
                if self.par.is_main:
                    append_metrics(self.metrics_path, {**to_python(m), "rollback": True}, self.step)
                self.rollback()
                bar.n = self.step
                bar.refresh()
                continue
            if self.step % c.logging.log_every == 0 or self.step == c.train.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                    m["mem/peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
                self.settle()
                m["bad_steps"] = self.bad_total
                dt = time.perf_counter() - t0
                m["tokens_per_s"] = tokens_since / dt
                for method in self.sparsity:
                    m.update(method.metrics())
                if self.peak_flops:
                    # at the last step's window length (an interval crossing the end of the
                    # short-context phase is counted at seq_len)
                    model_flops, dense_attn = self.flops_at[m["train/seq_len"]]
                    m.update(
                        mfu_metrics(
                            m["tokens_per_s"],
                            model_flops,
                            dense_attn,
                            m.get("attn/density"),
                            self.peak_flops * self.par.world_size,
                        )
                    )
                m = to_python(m)  # one host copy for every scalar of this log step
                self.logger.log({k: v for k, v in m.items() if k != "skipped"}, step=self.step)
                if self.par.is_main:
                    append_metrics(self.metrics_path, m, self.step)
                bar.set_postfix(loss=f"{float(m['loss/total']):.3f}", lr=f"{m['lr']:.2e}")
                if self.log_lines:
                    self.print(
                        f"step {self.step}/{c.train.steps}: loss {float(m['loss/total']):.4f} "
                        f"lr {m['lr']:.2e} {m['tokens_per_s']:,.0f} tokens/s"
                    )
                t0, tokens_since = time.perf_counter(), 0
            if self.step % c.train.eval_every == 0 or self.step == c.train.steps:
                # Before evaluate(): the layers' stats are still those of the last training step.
                load = next(
                    (s.expert_load() for s in self.sparsity if isinstance(s, ExpertBalancing)), None
                )
                if load is not None:
                    # A fixed scale, 0 .. twice the uniform share, so the pictures of different
                    # steps compare.
                    self.logger.log_heatmap(
                        "moe/expert_load",
                        load.numpy(),
                        self.step,
                        "expert",
                        "layer",
                        2.0 / load.shape[1],
                    )
                self.best_val = min(self.best_val, self.validate())
                self.write_plots(load)
            if (
                c.checkpoint.every and self.step % c.checkpoint.every == 0
            ) or self.step == c.train.steps:
                self.save()
            if self.step < c.train.steps and self._stop_requested():  # a finished run just finishes
                path = (
                    self.save()
                    if self.saved_step != self.step
                    else os.path.join(c.checkpoint_dir, f"step_{self.step:08d}")
                )
                raise Interrupted(
                    f"interrupted at step {self.step}; checkpoint saved in {path} "
                    f"(continue with --resume)"
                )


def run(cfg: Config) -> dict:
    """Train ``cfg`` end to end (alone or under torchrun). Returns a summary dict (rank-local)."""
    try:
        return Trainer(cfg).fit()
    finally:  # also when setup fails (a ConfigError) after the process group was created
        if dist.is_initialized():
            dist.destroy_process_group()
