"""What limits a Mamba-3 induction-heads model at lengths it never trained on: its accuracy on the
validation split (never the test split) with one layer's mechanism switched off at a time.

    python scripts/dev/mamba3_interventions.py CKPT --layer 1 --lengths 256,1024,4096 --samples 64

Each intervention changes one Mamba-3 layer (``--layer``, counted from 0) and nothing else:
- ``none``: the model as trained (the baseline row; it equals scripts/evaluate.py's accuracy);
- ``decay0``: that layer's A set to 0, so its state never decays;
- ``theta0``: its rotary angles θ set to 0, so its keys and queries never turn;
- ``mute``: the values x of ordinary tokens set to 0 in that layer, so that only the triggers and
  the 4 tokens after the first trigger (the key, and the positions a causal reading of it can
  reach) write to its state;
- ``mute+decay0``: both.
If one of them lifts the accuracy at the long lengths, that mechanism is what fails there; if the
accuracy stays where it was, the cause lies elsewhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

INTERVENTIONS = ("none", "decay0", "theta0", "mute", "mute+decay0")
KEY_SPAN = 4  # tokens after the first trigger that may write under "mute"


def written_by(inputs, trigger: int):
    """(B, L) float mask of the positions that still write under ``mute``: every trigger, and the
    KEY_SPAN tokens after the first trigger of each row."""
    import torch

    keep = inputs == trigger
    first = keep.int().argmax(1)
    rows = torch.arange(len(inputs))
    for after in range(1, KEY_SPAN + 1):
        keep[rows, (first + after).clamp(max=inputs.shape[1] - 1)] = True
    return keep.float()


def accuracy(model, dataset, samples: int, batch: int = 16, before=None) -> float:
    """Accuracy over the scored positions of ``samples`` examples; ``before(inputs)`` runs before
    each batch's forward (to set what an intervention reads)."""
    import torch

    from ssm.training.data import IGNORE

    correct = total = 0
    for lo in range(0, samples, batch):
        inputs, targets = (torch.stack(t) for t in zip(*[dataset[i] for i in range(lo, min(lo + batch, samples))]))
        if before is not None:
            before(inputs)
        with torch.no_grad():
            logits = model(inputs)
        logits = logits[0] if isinstance(logits, tuple) else logits
        scored = targets != IGNORE
        correct += int(((logits.argmax(-1) == targets) & scored).sum())
        total += int(scored.sum())
    return correct / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--layer", type=int, default=1, help="the Mamba-3 layer changed (from 0)")
    parser.add_argument("--lengths", default="256,1024,4096", help="validation lengths (comma-separated)")
    parser.add_argument("--samples", type=int, default=64, help="validation sequences per length")
    parser.add_argument("--do", default=",".join(INTERVENTIONS), help=f"of {', '.join(INTERVENTIONS)}")
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    chosen = args.do.split(",")
    unknown = [d for d in chosen if d not in INTERVENTIONS]
    if unknown:
        parser.error(f"--do takes {', '.join(INTERVENTIONS)}; got {', '.join(unknown)}")
    if args.samples < 1 or min(lengths) < 3:
        parser.error("--samples must be >= 1 and --lengths >= 3")

    import torch

    from ssm.layers import Mamba3
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import load_checkpoint_model

    config, model, step = load_checkpoint_model(args.checkpoint)
    if config.data.task != "induction_heads":
        parser.error(f"{args.checkpoint}: a run of {config.data.task}, not induction_heads")
    layers = [m for m in model.modules() if isinstance(m, Mamba3)]
    if not 0 <= args.layer < len(layers):
        parser.error(f"--layer must be in 0..{len(layers) - 1}: the run has {len(layers)} Mamba-3 layers")
    target, data = layers[args.layer], TaskDataModule(config.data, seed=config.seed)
    original, state = Mamba3._inputs, {}

    def changed(self, u):
        z, x, B, C, dt, A, trap, theta = original(self, u)
        if self is target:
            if "mute" in state["do"]:
                x = x * state["keep"][..., None, None]
            if "decay0" in state["do"]:
                A = torch.zeros_like(A)
            if "theta0" in state["do"]:
                theta = torch.zeros_like(theta)
        return z, x, B, C, dt, A, trap, theta

    print(f"{args.checkpoint} (step {step}), Mamba-3 layer {args.layer}, accuracy on '{VALIDATION_SPLIT}':")
    Mamba3._inputs = changed
    try:
        for do in chosen:
            row = []
            for length in lengths:
                dataset = data.dataset(VALIDATION_SPLIT, args.samples, length)
                state["do"] = do

                def before(inputs, trigger=dataset.trigger):
                    state["keep"] = written_by(inputs, trigger)

                row.append(f"{length}: {accuracy(model, dataset, args.samples, before=before):.3f}")
            print(f"  {do:12s} " + "  ".join(row), flush=True)
    finally:
        Mamba3._inputs = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
