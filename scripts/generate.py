"""Sample text from a trained byte-level `text` run.

python scripts/generate.py RUN_DIR --prompt "def main(" --max-new-tokens 200 --temperature 0.8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompt", default="import ")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from ssm.training.evaluate import load_run

    config, model = load_run(args.run_dir, device=args.device)
    if config.data.task != "text":
        parser.error(f"{args.run_dir} trained the {config.data.task!r} task; generate.py samples from 'text' runs")
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        parser.error("--prompt must not be empty")
    ids = torch.tensor([list(prompt)], device=args.device)
    out = model.generate(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=torch.Generator(args.device).manual_seed(args.seed),
    )
    print(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
