"""Command line: ``python train.py --config tiny_dense [key=value ...] [--resume [RUN]
[--trust-checkpoint]] [--plan [--gpus N]] [--print-config]``; overrides may come before, between
or after the flags.

``--config`` takes a YAML path or a shipped preset's name (``tiny_dense``, zoo/*.yaml). A new run
writes to a new folder ``runs/<name>/<N>`` (training.run_folder); ``--resume`` continues the latest
run of the config's name (or RUN: ``runs/<name>/3``, any run folder) from its checkpoint's config,
with the command line's overrides on top (``--config`` may then be left out). Bad input
(unknown key, wrong type, missing file, inconsistent sizes, a run that cannot fit) prints one line
naming the key or file and exits with code 2, before any training starts.

Only training imports torch.distributed, the layers and the kernels (seconds of imports), so
``--help``, ``--print-config`` and config errors answer without torch, and ``--plan`` with torch
alone plus the model's layers on the meta device.
"""

from __future__ import annotations

import argparse
import os
import sys

from moezoo.configs import exit_code, load_config, to_dict
from moezoo.configs.errors import require_extra
from moezoo.configs.presets import resolve_config_path


def parse_args(argv=None) -> argparse.Namespace:
    # allow_abbrev=False: "--resum" must be an error, not quietly taken as --resume.
    p = argparse.ArgumentParser(
        prog="train.py", description="Train a moezoo model from a YAML config.", allow_abbrev=False
    )
    p.add_argument("--config", help="preset YAML path, or a shipped preset's name, e.g. tiny_dense")
    p.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides applied last, e.g. model.n_layers=2 train.steps=50",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN",
        help="continue the latest run of the config's name (or RUN, a run folder such as "
        "runs/tiny_dense/3) from its newest checkpoint, with its saved config and the "
        "overrides given here on top",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load checkpoint files the safe reader refuses (pickled objects): THEY CAN RUN CODE; "
        "only for a checkpoint whose author you trust",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print params, FLOPs/token, memory and a parallel layout; allocate nothing; "
        "exit status 3 when the plan does not fit",
    )
    p.add_argument(
        "--eval",
        choices=["passkey"],
        default=None,
        help="evaluate instead of training: passkey retrieval at eval.passkey_lengths "
        "(with --resume: the latest checkpoint)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPU count for --plan (default: the smallest that fits, 1-8 GPUs or whole 8-GPU "
        "nodes); when no layout fits on all N, the plan uses the largest count below that does",
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="h100|h200|b200|GB",
        help="GPU for --plan: h100 (80 GB), h200 (141 GB), b200 (180 GB) or its memory in GB "
        "(default: this machine's GPU, else h100)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (every key, defaults included) as YAML and exit",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    # Intermixed: "name=x --resume train.steps=60" parses like "--resume name=x train.steps=60".
    args = p.parse_intermixed_args(argv)
    if isinstance(args.resume, str) and "=" in args.resume and not os.path.isdir(args.resume):
        # an override right after --resume, not a run folder; overrides keep their order
        args.overrides = sorted([*args.overrides, args.resume], key=argv.index)
        args.resume = True
    if args.config is None and not isinstance(args.resume, str):
        p.error("the following arguments are required: --config (or --resume RUN)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return exit_code(_main, args)
    # Interrupted says which checkpoint it saved; a second Ctrl-C says nothing
    except KeyboardInterrupt as e:
        print(
            str(e) or "\ninterrupted; the last complete checkpoint is intact (use --resume)",
            file=sys.stderr,
        )
        return 130


def _main(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + (["checkpoint.trust=true"] if args.trust_checkpoint else [])
    cfg = load_config(resolve_config_path(args.config), overrides) if args.config else None
    if args.resume:
        from moezoo.training.run_folder import resume_config

        run = args.resume if isinstance(args.resume, str) else None
        trust = args.trust_checkpoint or bool(cfg and cfg.checkpoint.trust)
        cfg = resume_config(cfg, overrides, run, trust)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.plan:
        from moezoo.training.plan import plan_command

        return plan_command(cfg, args.gpus, args.gpu)
    if args.eval == "passkey":
        from moezoo.training.evaluate import run_passkey

        run_passkey(cfg)
        return 0
    # the data's paths first: a missing data.source is one line before torch's seconds of import
    from moezoo.training.corpus import check_source

    check_source(cfg.data)
    if cfg.model.init_from:
        require_extra("transformers", "hf", "model.init_from")
    # torch.distributed, layers, kernels: only to train
    from moezoo.training.loop import TrainingDiverged, run

    try:
        summary = run(cfg)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    hist = summary["val_history"]
    if hist and summary.get("rank", 0) == 0:  # every rank returns a summary; one line is enough
        print(
            f"done: {summary['step']} steps, val loss {hist[0][1]:.4f} -> {hist[-1][1]:.4f}, "
            f"skipped steps {summary['bad_steps']}"
        )
    return 0
