"""The training loop: ``run(cfg)`` = seed, mesh, data, model, optimizer, DST, resume, steps, eval, logging.

Each step is a pure function of (checkpointed state, step index): batches come from
``data.sample_batch(seed, step, dp_rank, epoch)``, so ``--resume`` continues bit-exactly. A step whose
loss or gradient norm is not finite is skipped and counted; ``train.max_bad_steps`` of them in a row
roll the run back to the last checkpoint and move the data stream to a new epoch.
"""
from __future__ import annotations

import os
import random
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from configs import Config
from layers import DynamicSparsity, ExpertBalancing, NeuronSchedule, attention_density
from zoo import build_model

from .checkpoint import check_resumable, latest_checkpoint, load_checkpoint, save_checkpoint
from .data import prepare_data, sample_batch
from .logger import append_metrics, make_logger, to_python
from .metrics import device_peak_flops
from .optim import build_optimizer, build_scheduler
from .parallel import all_reduce_mean, clip_grad_norm_, model_init_device, parallelize, setup_parallel


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row with nothing to roll back to (train.py: one line, exit 1)."""


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.par = setup_parallel(cfg)
        self.device = self.par.device
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        from .plan import check_fits
        # The plan's meta-device model also gives the FLOPs per token for MFU (no second build).
        self.flops_per_token = check_fits(cfg, self.par.world_size, self.device).flops_per_token
        self.resume_path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
        if self.resume_path:
            check_resumable(self.resume_path, cfg, self.par.world_size)
        # Same seed on every rank: identical initial weights before sharding.
        seed_everything(cfg.train.seed)
        self.data = prepare_data(cfg, self.par.is_main, self.barrier)
        if self.resume_path:
            check_resumable(self.resume_path, cfg, self.par.world_size, self.data.tokenizer.digest)
        model = build_model(cfg.model, model_init_device(cfg, self.par))   # "meta" when too big to build whole
        self.model = parallelize(model, cfg, self.par)   # in place (FSDP2 / EP): still the Transformer
        if cfg.train.compile:
            # Per block and in place, as torchtitan does: parameter names, FSDP2 units and checkpoints unchanged.
            # Static shapes (a run's batch and length are fixed): automatic dynamic shapes would turn the
            # per-layer ints (layer id, pattern sizes) into symbols once a second block recompiles, which
            # compiles slower and runs slower. Two graphs per distinct block (training; evaluation, whose
            # no_grad and eval mode are guards), so the cache must hold them all: past the limit a block runs
            # eagerly, and validation at step 0 fills the cache before the first training step.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                        2 * len(model.layers) + 8)
            for block in model.layers:
                block.compile(dynamic=False)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type,
                                         compact=cfg.dst.enabled and cfg.dst.compact_state)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.sparsity = self._sparsity_methods()
        self.autocast = self._autocast()
        self.step, self.epoch, self.bad_total, self.bad_in_row = 0, 0, 0, 0
        self.best_val, self.wandb_id = float("inf"), None
        self.val_history: list[tuple[int, float]] = []
        # Different per-rank stream for anything stochastic in the model (router noise on different tokens).
        seed_everything(cfg.train.seed + 1000 * self.par.rank)
        if cfg.checkpoint.resume and self.resume_path is None:
            self.print(f"no checkpoint in {cfg.checkpoint_dir}; starting from step 0")
        elif self.resume_path:
            self._restore(self.resume_path)
            self.print(f"resumed from {self.resume_path} at step {self.step}")
        self.logger = make_logger(cfg, cfg.out_dir, self.par.rank, self.wandb_id)
        self.wandb_id = getattr(self.logger.run, "id", None)
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum * self.par.dp_size
        self.peak_flops = device_peak_flops(self.device)
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        if self.par.is_main:
            os.makedirs(cfg.out_dir, exist_ok=True)

    # ---- setup helpers -------------------------------------------------------------------------
    def _autocast(self):
        dt = self.cfg.train.dtype
        if dt == "bfloat16" or (dt == "auto" and self.device.type == "cuda"):
            return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext

    def _sparsity_methods(self) -> list:
        """What acts between steps (layers.sparsity_method): MoE bias balancing and load stats, the neuron
        FFN schedule, DST. The trainer calls each the same way and knows none of them."""
        c, out = self.cfg, []
        ffn_types = c.model.layer_ffn_types()
        if "moe" in ffn_types:
            # Aux-loss-free balancing: every rank applies the same bias update from the global load.
            out.append(ExpertBalancing(self.model, dist.group.WORLD if self.par.distributed else None))
        if "neuron" in ffn_types:
            out.append(NeuronSchedule(self.model, c.train.steps, self.optimizer))
        if c.dst.enabled:
            out.append(DynamicSparsity.from_config(self.model, c.dst, self.optimizer, total_steps=c.train.steps))
        return out

    def print(self, msg: str) -> None:
        if self.par.is_main:
            tqdm.write(msg)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # ---- state -----------------------------------------------------------------------------------
    def train_state(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "bad_total": self.bad_total, "best_val": self.best_val,
                "val_history": self.val_history, "scheduler": self.scheduler.state_dict(),
                "wandb_id": self.wandb_id, "world_size": self.par.world_size,
                "tokenizer": self.data.tokenizer.digest}

    def _restore(self, path: str) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.bad_total = state["step"], state["epoch"], state["bad_total"]
        self.best_val, self.val_history = state["best_val"], state["val_history"]
        self.wandb_id = state.get("wandb_id")
        self.bad_in_row = 0

    def save(self) -> str:
        return save_checkpoint(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, self.train_state(),
                               self.cfg, self.cfg.checkpoint.keep_last)

    # ---- steps -----------------------------------------------------------------------------------
    def batch(self, step: int, micro: int, split: str = "train"):
        c = self.cfg.train
        tokens = self.data.train if split == "train" else self.data.val
        # The step's global batch (batch_size x grad_accum x dp_size windows) is split into (micro, rank)
        # slices, so how it is split between accumulation and ranks does not change the data.
        accum = c.grad_accum if split == "train" else 1
        x, y = sample_batch(tokens, c.batch_size, c.seq_len, c.seed, step, micro * self.par.dp_size + self.par.dp_rank,
                            accum * self.par.dp_size, self.epoch if split == "train" else -1)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        with self.autocast():
            return self.model(x, y)

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches; returns detached metrics."""
        c = self.cfg
        self.model.train()
        for method in self.sparsity:
            method.before_step(self.step)
        parts_sum: dict[str, torch.Tensor] = {}
        for micro in range(c.train.grad_accum):
            x, y = self.batch(self.step, micro)
            loss, parts = self.compute_loss(x, y)
            (loss / c.train.grad_accum).backward()
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v / c.train.grad_accum
        # A plain tensor, the same on every rank: the norm spans the dense and expert meshes' shards.
        grad_norm = clip_grad_norm_(self.model.parameters(), c.optim.grad_clip, self.par)
        # One all-reduce for every loss part; the total is their sum.
        parts_mean = all_reduce_mean(torch.stack([v.detach().float() for v in parts_sum.values()]), self.par)
        loss_val = parts_mean.sum()
        finite = bool(torch.isfinite(loss_val) & torch.isfinite(grad_norm))   # one host sync
        metrics = {f"loss/{k}": v for k, v in zip(parts_sum, parts_mean)}
        metrics.update({"loss/total": loss_val, "grad_norm": grad_norm.detach(),
                        "lr": self.optimizer.param_groups[0]["lr"]})
        if finite:
            self.optimizer.step()
            for method in self.sparsity:
                method.after_optimizer_step(self.step)
            self.bad_in_row = 0
        else:
            for method in self.sparsity:
                method.skipped_step()
            self.bad_total += 1
            self.bad_in_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        metrics["bad_steps"] = self.bad_total
        metrics["skipped"] = not finite
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for i in range(self.cfg.train.eval_batches):
            x, y = self.batch(i, 0, "val")
            losses.append(self.compute_loss(x, y)[1]["ce"].float())   # compute_loss enters autocast
        self.model.train()
        return float(all_reduce_mean(torch.stack(losses).mean(), self.par))

    def rollback(self) -> None:
        path = latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            raise TrainingDiverged(f"{self.bad_in_row} non-finite steps in a row at step {self.step} and no "
                                   f"checkpoint in {self.cfg.checkpoint_dir} to roll back to; lower optim.lr or "
                                   f"set checkpoint.every")
        epoch, bad_total = self.epoch, self.bad_total
        self._restore(path)
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
        return v

    # ---- main loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        c = self.cfg
        if self.step == 0 or not self.val_history:
            if any(layer.attention.pattern is not None for layer in self.model.layers):
                dens = attention_density(self.model, c.train.seq_len)
                self.logger.log({f"attn_density/{k}": v for k, v in dens.items() if "/head" not in k}, step=0)
                self.print(f"attention density at seq_len {c.train.seq_len}: {dens['mean']:.3f}")
            self.validate()
        bar = tqdm(total=c.train.steps, initial=self.step, disable=not (self.par.is_main and c.logging.progress),
                   dynamic_ncols=True, desc=c.name, unit="step")
        t0, tokens_since = time.perf_counter(), 0
        while self.step < c.train.steps:
            m = self.train_step()
            tokens_since += self.tokens_per_step
            bar.update(1)
            if self.bad_in_row >= c.train.max_bad_steps:
                self.rollback()
                bar.n = self.step
                bar.refresh()
                continue
            if self.step % c.logging.log_every == 0 or self.step == c.train.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                    m["mem/peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
                dt = time.perf_counter() - t0
                m["tokens_per_s"] = tokens_since / dt
                if self.peak_flops:
                    m["mfu"] = m["tokens_per_s"] * self.flops_per_token / (self.peak_flops * self.par.world_size)
                for method in self.sparsity:
                    m.update(method.metrics())
                m = to_python(m)   # one host copy for every scalar of this log step
                self.logger.log({k: v for k, v in m.items() if k != "skipped"}, step=self.step)
                if self.par.is_main:
                    append_metrics(self.metrics_path, m, self.step)
                bar.set_postfix(loss=f"{float(m['loss/total']):.3f}", lr=f"{m['lr']:.2e}")
                t0, tokens_since = time.perf_counter(), 0
            if self.step % c.train.eval_every == 0 or self.step == c.train.steps:
                # Before evaluate(): the layers' stats are still those of the last training step.
                load = next((s.expert_load() for s in self.sparsity if isinstance(s, ExpertBalancing)), None)
                if load is not None:
                    self.logger.log_heatmap("moe/expert_load", load.numpy(), self.step, "experts", "layers")
                self.best_val = min(self.best_val, self.validate())
            if (c.checkpoint.every and self.step % c.checkpoint.every == 0) or self.step == c.train.steps:
                self.save()
        bar.close()
        self.logger.finish()
        return {"step": self.step, "val_history": self.val_history, "bad_steps": self.bad_total}


def run(cfg: Config) -> dict:
    """Train ``cfg`` end to end (alone or under torchrun). Returns a summary dict (rank-local)."""
    try:
        return Trainer(cfg).fit()
    finally:   # also when setup fails (a ConfigError) after the process group was created
        if dist.is_initialized():
            dist.destroy_process_group()
