"""Run logging: wandb (``logging.wandb: online | offline | disabled``) or a null logger.

Offline is the default: runs land in ``<out_dir>/wandb/offline-run-*`` and upload later with
``wandb sync``; nothing asks for a login. ``disabled`` returns a logger that writes nothing.
Only rank 0 logs. wandb is imported only when used.
"""

from __future__ import annotations

import json
import os

import torch

from moezoo.configs import Config, to_dict


class NullLogger:
    """Same interface as WandbLogger; does nothing (disabled mode and ranks > 0)."""

    run = None

    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_heatmap(
        self,
        name: str,
        matrix,
        step: int,
        xlabel: str = "",
        ylabel: str = "",
        vmax: float | None = None,
    ) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    def __init__(self, cfg: Config, out_dir: str, resume_id: str | None = None):
        import wandb

        self.wandb = wandb
        os.makedirs(out_dir, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logging.project,
            entity=cfg.logging.entity,
            name=cfg.logging.run_name or cfg.name,
            mode=cfg.logging.wandb,
            dir=out_dir,
            config=to_dict(cfg),
            id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(to_python(metrics), step=step)

    def log_heatmap(
        self,
        name: str,
        matrix,
        step: int,
        xlabel: str = "",
        ylabel: str = "",
        vmax: float | None = None,
    ) -> None:
        """A [rows, cols] array (e.g. expert load: layers x experts) as a picture with axes and a
        colour bar; ``vmax`` fixes the scale at 0 .. vmax so the pictures of different steps
        compare."""
        from .plot import figure_array, heatmap_figure

        fig = heatmap_figure(matrix, xlabel, ylabel, f"{name}, step {step}", vmax)
        self.run.log({name: self.wandb.Image(figure_array(fig))}, step=step)

    def finish(self) -> None:
        self.run.finish()


def to_python(metrics: dict) -> dict:
    """Scalar tensors -> Python numbers (bool tensors -> bools) with one device-to-host copy (one
    sync), others unchanged."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    out = dict(metrics)
    if keys:
        values = torch.stack(
            [metrics[k].detach().reshape(()).float().to(metrics[keys[0]].device) for k in keys]
        )
        out.update(
            (k, bool(v) if metrics[k].dtype == torch.bool else v)
            for k, v in zip(keys, values.cpu().tolist())
        )
    return out


def append_metrics(path: str, metrics: dict, step: int) -> None:
    """One JSON line of scalar metrics per logging step (``<out_dir>/metrics.jsonl``, rank 0), for
    scripts."""
    row = {
        "step": step,
        **{k: v for k, v in to_python(metrics).items() if isinstance(v, (int, float, bool))},
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def make_logger(cfg: Config, out_dir: str, rank: int = 0, resume_id: str | None = None):
    if rank != 0 or cfg.logging.wandb == "disabled":
        return NullLogger()
    return WandbLogger(cfg, out_dir, resume_id)
