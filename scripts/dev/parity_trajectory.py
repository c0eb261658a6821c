"""How a Mamba-3 parity run's solution moves from checkpoint to checkpoint (issue 48;
docs/paper-results.md, "What the collapse is"): a run kept with ``keep_checkpoint_every``, read
at each of its kept checkpoints in a step range.

    python scripts/dev/parity_trajectory.py runs/diag-s2 --from 3900 --to 4000
    python scripts/dev/parity_trajectory.py runs/diag-s2 --from 3900 --to 4000 --half-lives 50,200

Per checkpoint: its step and learning rate; the accuracy (every position) on the validation split
(never the test split) at each of --lengths; and the parity pair, the head and rotary pair of
the first Mamba-3 layer whose turns Δ·θ come closest to 0 for bit 0 and to π for bit 1 (mod
2π), with bit 1's Δ there and the pair's error in radians, the larger of the two distances.
An error ε on each 1-bit adds up over a sequence's ones, so a length L needs ε below about
π/2 / (L/2).

``--half-lives`` (in steps) adds the accuracy of exponential averages of the weights over the
checkpoints read so far (from the first in the range on), each checkpoint weighted as one
update of 2^(−gap / half-life), gap the steps since the one before.
"""

from __future__ import annotations

import argparse
import math
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parity_pair(rows: list[dict]) -> tuple[int, int, float]:
    """(head, pair, error in rad) of the rotary pair closest to parity's turns: 0 for bit 0 and
    π for bit 1, modulo 2π. ``rows``: parity_probe.per_bit's, per bit."""

    def off(turns_over_pi, target):  # distance to target (a multiple of π) modulo 2π, in rad
        return abs((turns_over_pi - target + 1) % 2 - 1) * math.pi

    best = None
    for h, (zero, one) in enumerate(zip(rows[0]["turn_over_pi"], rows[1]["turn_over_pi"], strict=True)):
        for m, (t0, t1) in enumerate(zip(zero, one, strict=True)):
            error = max(off(t0, 0.0), off(t1, 1.0))
            if best is None or error < best[2]:
                best = (h, m, error)
    return best


def averaged(average: dict | None, state: dict, weight: float) -> dict:
    """An exponential average of the weights: ``state`` itself first, then
    weight·average + (1 − weight)·state."""
    if average is None:
        return {k: v.clone() for k, v in state.items()}
    return {k: weight * average[k] + (1 - weight) * v for k, v in state.items()}


def kept_checkpoints(run: Path, first: int, last: int) -> list[tuple[int, Path]]:
    """(step, path) of the run's checkpoints/step-NNNNNNN.ckpt with first <= step <= last."""
    found = []
    for path in sorted((run / "checkpoints").glob("step-*.ckpt")):
        step = int(path.stem.split("-")[1])
        if first <= step <= last:
            found.append((step, path))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory with kept checkpoints (keep_checkpoint_every)")
    parser.add_argument("--from", dest="first", type=int, default=0, help="first step read")
    parser.add_argument("--to", dest="last", type=int, default=10**9, help="last step read")
    parser.add_argument("--lengths", default="40,160,256", help="validation lengths (comma-separated)")
    parser.add_argument("--samples", type=int, default=256, help="validation sequences per length")
    parser.add_argument("--half-lives", default="", help="steps (comma-separated): averaged weights too")
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        half_lives = [float(h) for h in args.half_lives.split(",") if h]
    except ValueError:
        parser.error("--lengths and --half-lives are comma-separated numbers")
    if args.samples < 1 or min(lengths) < 1 or any(h <= 0 for h in half_lives):
        parser.error("--samples, --lengths and --half-lives must be positive")
    found = kept_checkpoints(args.run, args.first, args.last)
    if not found:
        parser.error(f"{args.run}: no checkpoints/step-*.ckpt between steps {args.first} and {args.last}")

    from ssm.layers import Mamba3
    from ssm.training.checkpoint import load_checkpoint
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import evaluate_length, load_checkpoint_model

    per_bit = runpy.run_path(str(Path(__file__).with_name("parity_probe.py")))["per_bit"]
    config, model, _ = load_checkpoint_model(found[0][1])
    if config.data.task != "parity" or not any(isinstance(m, Mamba3) for m in model.modules()):
        parser.error(f"{args.run}: a {config.data.task} run without Mamba-3 layers; this reads parity's")
    data = TaskDataModule(config.data, seed=config.seed)

    def accuracies(state: dict) -> str:
        model.load_state_dict(state)
        return " / ".join(
            f"{evaluate_length(model, data, n, args.samples, 64, None, split=VALIDATION_SPLIT)['val/acc']:.3f}"
            for n in lengths
        )

    averages, previous = dict.fromkeys(half_lives), None
    print(f"accuracy on the validation split at {' / '.join(map(str, lengths))}; the parity pair (head, pair)")
    for step, path in found:
        checkpoint = load_checkpoint(path)
        state = {k.removeprefix("model."): v.float() for k, v in checkpoint["state_dict"].items()}
        rate = checkpoint["lr_schedulers"][0]["_last_lr"][0]
        line = f"step {step:7d}  rate {rate:.2e}  {accuracies(state)}"
        rows = per_bit(model)
        head, pair, error = parity_pair(rows)
        line += f"  h{head} m{pair}: bit-1 Δ {rows[1]['delta'][head]:.4f}, error {error:.4f} rad"
        for h in half_lives:
            weight = 0.5 ** ((step - previous) / h) if previous is not None else 0.0
            averages[h] = averaged(averages[h], state, weight)
            line += f"  | average (half-life {h:g}) {accuracies(averages[h])}"
        previous = step
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
