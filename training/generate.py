"""Sample text from a trained run: ``python -m moezoo.training.generate --run runs/tiny_dense
--prompt "def "``.

Loads the run's latest checkpoint and its tokenizer (training.trained) and samples through the KV
cache (zoo.sampling) with temperature / top-k / top-p. Prints each sample, prompt included.
"""

from __future__ import annotations

import argparse
import sys

from moezoo.configs import ConfigError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m moezoo.training.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--run",
        required=True,
        help="runs/<name> (its latest run), a run folder (runs/<name>/<N>), its checkpoints/ or "
        "one step_* checkpoint",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: start from nothing)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        if (
            a.max_new_tokens < 1
            or a.num_samples < 1
            or a.temperature < 0
            or not 0 < a.top_p <= 1
            or a.top_k < 0
        ):
            raise ConfigError(
                "generate",
                "need --max-new-tokens >= 1, --num-samples >= 1, --temperature >= 0, "
                "0 < --top-p <= 1, --top-k >= 0",
            )
        from moezoo.zoo.sampling import generate

        from .trained import load_run

        model, tok, _, _ = load_run(a.run, a.device)
        # Start from EOS when there is no prompt: documents follow an EOS in the training stream.
        prompt = tok.encode(a.prompt) if a.prompt else [tok.eos_id]
        ids = generate(
            model,
            [prompt] * a.num_samples,
            a.max_new_tokens,
            a.temperature,
            a.top_k or None,
            a.top_p,
            tok.eos_id,
            a.seed,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, row in enumerate(ids.tolist()):
        new = row[len(prompt) :]
        if tok.eos_id in new:
            new = new[: new.index(tok.eos_id)]
        print((f"--- sample {i}\n" if a.num_samples > 1 else "") + a.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
