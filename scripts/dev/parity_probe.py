"""What a Mamba-3 parity checkpoint does with each bit, and how its accuracy moves when its
decay is scaled (issue 48; docs/paper-results.md, "State tracking").

    python scripts/dev/parity_probe.py runs/parity/parity_Mamba3_s0/checkpoints/last.ckpt
    python scripts/dev/parity_probe.py CKPT --scales 1,0.3,0.1,0 --lengths 128,256 --samples 256

For the first Mamba-3 layer, per head and for each bit (its token read alone, through the
embedding and the block's norm): Δ, Δ·A (the log of the decay that step applies), λ (the
trapezoid's weight) and the turn Δ·θ of the first rotary pairs, in units of π. Parity needs a turn
of π (mod 2π) on a 1-bit and 0 on a 0-bit, and Δ·A near 0 at both. Then the accuracy on the
validation split (never the test split) at each of --lengths, over every position and at the
last, with every layer's A multiplied by each of --scales (the same weights otherwise).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def per_bit(model) -> list[dict]:
    """Per bit (0, 1): Δ, Δ·A, λ (per head) and Δ·θ / π (per head and rotary pair) of the first
    Mamba3 layer, the bit's token read alone."""
    import torch

    from ssm.layers import Mamba3

    block = next(b for b in model.backbone.layers if isinstance(b.mixer, Mamba3))
    with torch.no_grad():
        u = block.norm(model.backbone.embedding.weight[:2][None])
        u = u[0] if isinstance(u, tuple) else u
        _, _, _, _, dt, A, trap, theta = block.mixer._inputs(u)
    rows = []
    for bit in (0, 1):
        rows.append(
            {
                "delta": dt[0, bit].tolist(),
                "delta_A": (dt[0, bit] * A[0, bit]).tolist(),
                "trapezoid": trap[0, bit].tolist(),
                "turn_over_pi": (dt[0, bit, :, None] * theta[0, bit] / math.pi).tolist(),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--scales", default="1,0.3,0.1,0", help="factors for A (comma-separated)")
    parser.add_argument("--lengths", default="128,256,1024", help="validation lengths (comma-separated)")
    parser.add_argument("--samples", type=int, default=256, help="validation sequences per length")
    parser.add_argument("--pairs", type=int, default=4, help="rotary pairs shown per head")
    args = parser.parse_args(argv)
    try:
        scales = [float(s) for s in args.scales.split(",")]
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error("--scales and --lengths are comma-separated numbers")
    if args.samples < 1 or min(lengths) < 1:
        parser.error("--samples and --lengths must be positive")

    from ssm.layers import Mamba3
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import evaluate_length, load_checkpoint_model

    config, model, step = load_checkpoint_model(args.checkpoint)
    if config.data.task != "parity" or not any(isinstance(m, Mamba3) for m in model.modules()):
        parser.error(f"{args.checkpoint}: a {config.data.task} run without Mamba-3 layers; this probe reads parity's")
    print(f"{args.checkpoint} (step {step}), first Mamba-3 layer, each bit read alone:")
    for bit, row in enumerate(per_bit(model)):
        print(f"  bit {bit}:")
        for h, (d, da, lam, turns) in enumerate(
            zip(row["delta"], row["delta_A"], row["trapezoid"], row["turn_over_pi"], strict=True)
        ):
            shown = " ".join(f"{t:+.3f}" for t in turns[: args.pairs])
            print(f"    head {h}: Δ {d:.3f}  Δ·A {da:+.4f}  λ {lam:.2f}  Δ·θ/π {shown}")
    data = TaskDataModule(config.data, seed=config.seed)
    original = Mamba3._inputs
    try:
        for scale in scales:

            def scaled(self, u, scale=scale):
                z, x, B, C, dt, A, trap, theta = original(self, u)
                return z, x, B, C, dt, A * scale, trap, theta

            Mamba3._inputs = scaled
            for length in lengths:
                m = evaluate_length(model, data, length, args.samples, 64, None, split=VALIDATION_SPLIT)
                print(f"A x {scale:g}: L {length:5d}  every position {m['val/acc']:.4f}  last {m['last/acc']:.4f}")
    finally:
        Mamba3._inputs = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
