"""Accuracy of a trained run at several sequence lengths (length extrapolation), or, for a text
run, bits per byte with the recurrent state carried across segments against without it.

    python scripts/evaluate.py RUN_DIR --lengths 64,128,256,512,1024
    python scripts/evaluate.py RUN_DIR --carried-state --segments 32

Lengths: prints a table and plots it to RUN_DIR/extrapolation.png. The examples are the task's
validation examples (seeded as in training) at each length; the trained length is marked.
Carried state: the validation text read as data.batch_size long streams of --segments
consecutive segments of data.seq_len bytes, each scored once with every layer's state carried
from the segment before (as data.stateful trains) and once from a zero state; prints both and
writes RUN_DIR/carried_state.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--lengths", default=None, help="comma-separated sequence lengths (default: 1x, 2x, 4x, 8x the trained one)"
    )
    parser.add_argument(
        "--val-samples", type=int, default=None, help="examples per length (default: the run's data.val_samples)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--carried-state",
        action="store_true",
        help="text runs: bits per byte with the state carried across segments against without",
    )
    parser.add_argument("--segments", type=int, default=16, help="consecutive segments per stream (--carried-state)")
    args = parser.parse_args(argv)

    from ssm.training.data import TaskDataModule
    from ssm.training.evaluate import evaluate, evaluate_carried_state, load_run

    config, model = load_run(args.run_dir, device=args.device)
    if args.carried_state:
        if config.data.task != "text":
            parser.error(f"--carried-state needs a text run; {args.run_dir} trained {config.data.task}")
        if args.segments < 1:
            parser.error("--segments must be positive")
        m = evaluate_carried_state(model, TaskDataModule(config.data, seed=config.seed), args.segments)
        L = config.data.seq_len
        print(
            f"text run {args.run_dir} (trained with data.stateful={config.data.stateful}): "
            f"{config.data.batch_size} streams of {args.segments} x {L} bytes, {m['bytes']} scored"
        )
        print(f"  bits per byte, state carried across segments: {m['bpb_carried']:.4f}")
        print(f"  bits per byte, each segment from a zero state: {m['bpb_fresh']:.4f}")
        (args.run_dir / "carried_state.json").write_text(
            json.dumps({**m, "segments": args.segments, "seq_len": L}, indent=2) + "\n"
        )
        return 0
    trained = config.data.seq_len
    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [trained * f for f in (1, 2, 4, 8)]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints, got {args.lengths!r}")
    if min(lengths) < 1:
        parser.error("--lengths must be positive")
    if args.val_samples:
        config.data.val_samples = args.val_samples
    data = TaskDataModule(config.data, seed=config.seed)

    rows = []
    print(f"{config.data.task} run {args.run_dir} (trained at L = {trained})")
    print(f"{'L':>8}  {'val/acc':>8}  {'val/loss':>9}")
    for length in lengths:
        m = evaluate(model, data, length)
        rows.append({"length": length, **m})
        mark = "  (trained)" if length == trained else ""
        print(f"{length:8d}  {m['val/acc']:8.4f}  {m['val/loss']:9.4f}{mark}", flush=True)
    (args.run_dir / "extrapolation.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, trained, config.data.task, args.run_dir / "extrapolation.png")
    print(f"plot: {args.run_dir / 'extrapolation.png'}")
    return 0


def plot(rows, trained, task, path):
    from ssm.training._optional import require

    figure = require("matplotlib.figure", "scripts/evaluate.py (extrapolation.png)")
    fig = figure.Figure(figsize=(6, 4))  # a Figure of its own: no pyplot state
    ax = fig.subplots()
    ax.plot([r["length"] for r in rows], [r["val/acc"] for r in rows], marker="o")
    ax.axvline(trained, color="grey", linestyle="--", label=f"trained L = {trained}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{task}: length extrapolation")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
