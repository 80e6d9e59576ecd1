"""Command line: ``python train.py --config zoo/tiny_dense.yaml [key=value ...] [--resume] [--plan [--gpus N]]``.

Bad input (unknown key, wrong type, missing file, inconsistent sizes, a run that cannot fit) prints one
line naming the key or file and exits with code 2, before any training starts.
"""
from __future__ import annotations

import argparse
import sys

from configs import ConfigError, load_config
from training.loop import TrainingDiverged, run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train.py", description="Train a moezoo model from a YAML config.")
    p.add_argument("--config", required=True, help="preset YAML, e.g. zoo/tiny_dense.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied last, e.g. model.n_layers=2 train.steps=50")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("--plan", action="store_true", help="print params, FLOPs/token, memory and a parallel layout; "
                   "allocate nothing")
    p.add_argument("--eval", choices=["passkey"], default=None,
                   help="evaluate instead of training: passkey retrieval at eval.passkey_lengths (with --resume: the latest checkpoint)")
    p.add_argument("--gpus", type=int, default=None, help="GPU count for --plan (default: the smallest power of two that fits)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        if args.plan:
            if args.gpus is not None and args.gpus < 1:
                raise ConfigError("--gpus", f"must be >= 1, got {args.gpus}")
            from training.plan import format_plan, plan
            print(format_plan(plan(cfg, args.gpus)))
            return 0
        if args.eval == "passkey":
            from training.passkey import run_passkey
            run_passkey(cfg)
            return 0
        summary = run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the last complete checkpoint is intact (use --resume)", file=sys.stderr)
        return 130
    hist = summary["val_history"]
    if hist:
        print(f"done: {summary['step']} steps, val loss {hist[0][1]:.4f} -> {hist[-1][1]:.4f}, "
              f"skipped steps {summary['bad_steps']}")
    return 0
