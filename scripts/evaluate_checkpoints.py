"""Length extrapolation of induction heads (or selective copying) against training steps: the
checkpoints a run kept (keep_checkpoint_every) evaluated on a test draw at many lengths, in the
Mamba paper's layout (Table 2: one row per model, one column per length 2^6 .. 2^20), and the
accuracy at a few lengths drawn against the steps (issue 46).

    python scripts/evaluate_checkpoints.py runs/ih-paper --out runs/ih-paper/eval
    python scripts/evaluate_checkpoints.py runs/ih-paper --lengths 2^10,2^14 --out runs/ih-paper/eval
    python scripts/evaluate_checkpoints.py runs/ih-paper/checkpoints/step-0204800.ckpt --out ...

Each argument is a checkpoint file or a run directory (its checkpoints/step-*.ckpt, in step
order). Every (checkpoint, length) measured is kept in OUT/evaluations.json, and a later call
with the same OUT adds to it and skips what is there (the same checkpoint, length, split and
sample count): so the cheap lengths can be measured at every checkpoint and 2^20 at a few, by
separate calls, and a call interrupted loses only the length in progress. Each call then
writes from all of it:

    OUT/results.md    the table in the paper's layout, a row per checkpoint ("-": not measured)
    OUT/steps.csv     run, seed, step, length, accuracy, the curve's points
    OUT/steps.png     accuracy against training steps at --curve-lengths (matplotlib)

--merge FILE adds the records of another evaluations.json (another OUT, or the published
records under docs/bench/) to OUT's, so that one table and one figure hold several runs; with no
checkpoint given, the call only merges and redraws:

    python scripts/evaluate_checkpoints.py --out runs/all --merge docs/bench/induction-heads-paper-protocol.json \
        --merge runs/ih-paper-s2/eval/evaluations.json

The test draw is the test split (ssm.training.data.TEST_SPLIT), a seed stream no run trained,
validated or chose on; --split val or selection reads another stream (to choose anything).
Sequences per length, --samples: "512@2^12,128@2^16,32" (the default) is 512 sequences at each
length up to 2^12, 128 up to 2^16, 32 above. Forward only, each sequence read in pieces of
--chunk tokens with the state carried, on torch's threads (--threads, or OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's ssm, whichever one is installed

SPLITS = {"test": "test46", "selection": "test", "val": "val"}  # --split: ssm.training.data's names
DEFAULT_SAMPLES = "512@2^12,128@2^16,32"
KEPT = re.compile(r"step-(\d+)\.ckpt$")


def parse_samples(text: str) -> list[tuple[int | None, int]]:
    """ "512@2^12,128@2^16,32" -> [(4096, 512), (65536, 128), (None, 32)]: (longest length, count)
    pairs in increasing length, the last one without a length (every longer one). ValueError
    naming --samples otherwise."""
    from ssm.training.evaluate import parse_lengths

    rules: list[tuple[int | None, int]] = []
    parts = [p.strip() for p in text.split(",")]
    for k, part in enumerate(parts):
        count, at, limit = part.partition("@")
        try:
            n = int(count)
            longest = parse_lengths(limit)[0] if at else None
        except (ValueError, IndexError):
            raise ValueError(f"--samples: {part!r} is not COUNT@LENGTH or COUNT (in {text!r})") from None
        if n < 1:
            raise ValueError(f"--samples: counts must be >= 1, got {n} in {text!r}")
        if (longest is None) != (k == len(parts) - 1):
            raise ValueError(f"--samples: every part but the last needs @LENGTH, the last none, got {text!r}")
        if longest is not None and rules and longest <= rules[-1][0]:
            raise ValueError(f"--samples: the lengths must increase, got {text!r}")
        rules.append((longest, n))
    return rules


def samples_at(rules: list[tuple[int | None, int]], length: int) -> int:
    return next(n for longest, n in rules if longest is None or length <= longest)


def checkpoints_of(paths: list[Path]) -> list[Path]:
    """Each path as checkpoint files: a file as it is, a run directory as its kept checkpoints
    (checkpoints/step-*.ckpt) in step order. ValueError naming a path that is neither."""
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            kept = sorted((path / "checkpoints").glob("step-*.ckpt"), key=lambda p: int(KEPT.search(p.name)[1]))
            if not kept:
                raise ValueError(
                    f"{path}: no kept checkpoints (checkpoints/step-*.ckpt; train with keep_checkpoint_every)"
                )
            found += kept
        else:
            raise ValueError(f"{path}: no such checkpoint or run directory")
    return found


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip()[:12]


def run_name(checkpoint: Path) -> str:
    """The run a checkpoint belongs to: its run directory's name (RUN/checkpoints/FILE)."""
    return checkpoint.parent.parent.name if checkpoint.parent.name == "checkpoints" else checkpoint.parent.name


def lengths_label(length: int) -> str:
    return f"2^{length.bit_length() - 1}" if length & (length - 1) == 0 else str(length)


def save_record(store: Path, records: list[dict], record: dict) -> list[dict]:
    """``records`` with ``record`` added, merged with what ``store`` holds now (another call
    writing to the same OUT, e.g. a final evaluation beside a loop over the checkpoints, keeps
    its records: each call reads the file again before it writes), written atomically (a call
    stopped mid-write leaves the previous file). Returns the merged list."""
    key = lambda r: (r["checkpoint"], r["length"], r["samples"], r["split"])  # noqa: E731
    merged = {key(r): r for r in (json.loads(store.read_text())["records"] if store.is_file() else [])}
    merged.update((key(r), r) for r in [*records, record])
    out = list(merged.values())
    partial = store.with_name(store.name + ".partial")
    partial.write_text(json.dumps({"records": out}, indent=1) + "\n")
    partial.replace(store)
    return out


def table(records: list[dict]) -> str:
    """The paper's layout: a row per (run, step), a column per length, accuracy in percent."""
    lengths = sorted({r["length"] for r in records})
    rows = sorted({(r["run"], r["seed"], r["step"]) for r in records})
    acc = {(r["run"], r["step"], r["length"]): r for r in records}
    lines = [
        "| run | seed | steps | " + " | ".join(lengths_label(n) for n in lengths) + " |",
        "|---|---|---|" + "---|" * len(lengths),
    ]
    for run, seed, step in rows:
        cells = []
        for n in lengths:
            r = acc.get((run, step, n))
            cells.append("-" if r is None else "100" if r["correct"] == r["scored"] else f"{100 * r['acc']:.1f}")
        lines.append(f"| {run} | {seed} | {step:,} | " + " | ".join(cells) + " |")
    samples = sorted({(r["length"], r["samples"]) for r in records})
    counts = ", ".join(f"{lengths_label(n)}: {k}" for n, k in samples)
    return (
        "\n".join(lines) + f"\n\nAccuracy (%) on the split {records[0]['split']!r}; sequences per length: {counts}.\n"
    )


def write_curve(records: list[dict], lengths: list[int], out: Path) -> str:
    """steps.csv, and steps.png when matplotlib is there; returns what was written."""
    points = sorted((r["run"], r["seed"], r["step"], r["length"], r["acc"]) for r in records if r["length"] in lengths)
    with open(out / "steps.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "seed", "step", "length", "accuracy"])
        writer.writerows(points)
    try:
        import matplotlib.figure
    except ImportError:
        return f"{out / 'steps.csv'} (matplotlib is not installed: no steps.png)"
    fig = matplotlib.figure.Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    styles = ["-", "--", ":", "-."]  # a line style per length, a colour per run
    for k, length in enumerate(lengths):
        for i, run in enumerate(sorted({p[0] for p in points})):
            xs = [(p[2], 100 * p[4]) for p in points if p[0] == run and p[3] == length]
            if xs:
                label = f"L {lengths_label(length)}  {run}"
                ax.plot(*zip(*xs), styles[k % 4], color=f"C{i % 10}", marker="o", markersize=3, label=label)
    ax.set_ylim(0, 102)
    ax.set_xlabel("training steps (trained at the run's length)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("induction heads: extrapolation against training steps")
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / "steps.png", dpi=110)
    return f"{out / 'steps.csv'}, {out / 'steps.png'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="CHECKPOINT_OR_RUN")
    parser.add_argument("--out", type=Path, required=True, help="folder of evaluations.json and the results")
    parser.add_argument("--lengths", default="2^6..2^20", help="lengths measured (default 2^6..2^20)")
    parser.add_argument("--samples", default=DEFAULT_SAMPLES, help=f"sequences per length (default {DEFAULT_SAMPLES})")
    parser.add_argument("--curve-lengths", default="2^10,2^14,2^20", help="lengths drawn against steps")
    parser.add_argument("--split", choices=sorted(SPLITS), default="test", help="test (default), selection or val")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    parser.add_argument("--chunk", type=int, default=256, help="piece length, the state carried (default 256)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--merge", type=Path, action="append", default=[], help="evaluations.json whose records join OUT's (repeatable)"
    )
    args = parser.parse_args(argv)

    from ssm.training.evaluate import parse_lengths

    try:
        lengths = parse_lengths(args.lengths)
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints or 2^a..2^b, got {args.lengths!r}")
    try:
        curve_lengths = parse_lengths(args.curve_lengths)
    except ValueError:
        parser.error(f"--curve-lengths must be comma-separated ints or 2^a..2^b, got {args.curve_lengths!r}")
    if min(lengths) < 3:
        parser.error(f"--lengths must be >= 3, got {args.lengths!r}")
    try:
        rules = parse_samples(args.samples)
        checkpoints = checkpoints_of(args.paths)
    except ValueError as err:
        parser.error(str(err))
    if args.batch_size < 1 or args.chunk < 1 or args.threads is not None and args.threads < 1:
        parser.error("--batch-size, --chunk and --threads must be >= 1")

    import torch

    from ssm.training import CheckpointError
    from ssm.training.data import TaskDataModule
    from ssm.training.evaluate import evaluate_length, load_checkpoint_model

    if args.threads:
        torch.set_num_threads(args.threads)
    split = SPLITS[args.split]
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "evaluations.json"
    records = json.loads(store.read_text())["records"] if store.is_file() else []
    if records and records[0]["split"] != split:
        parser.error(f"--out {args.out} holds evaluations on the split {records[0]['split']!r}, not {split!r}")
    for other in args.merge:
        try:
            added = json.loads(other.read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.error(f"--merge {other}: not an evaluations.json ({err})")
        if any(r.get("split") != split for r in added):
            parser.error(f"--merge {other}: holds evaluations on another split than {split!r}")
        if added:
            records = save_record(store, [*records, *added[:-1]], added[-1])
    have = {(r["checkpoint"], r["length"], r["samples"]) for r in records}
    for path in checkpoints:
        try:
            config, model, step = load_checkpoint_model(path)
        except CheckpointError as err:
            parser.error(str(err))
        data = TaskDataModule(config.data, seed=config.seed)
        run = run_name(path)
        for length in lengths:
            n = samples_at(rules, length)
            if (str(path.resolve()), length, n) in have:
                continue
            m = evaluate_length(model, data, length, n, args.batch_size, args.chunk, split)
            record = {
                "run": run,
                "seed": config.seed,
                "step": step,
                "trained_at": config.data.seq_len,
                "length": length,
                "samples": n,
                "split": split,
                "acc": m["val/acc"],
                "correct": m["correct"],
                "scored": m["scored"],
                "loss": m["val/loss"],
                "seconds": round(m["seconds"], 2),
                "threads": torch.get_num_threads(),
                "checkpoint": str(path.resolve()),
                "commit": commit(),
                "machine": platform.node(),
                "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
            records = save_record(store, records, record)  # after each length
            have.add((record["checkpoint"], length, n))
            print(
                f"{run} step {step:>7}  L {lengths_label(length):>5}  acc {m['val/acc']:.4f} "
                f"({m['correct']}/{m['scored']})  {m['seconds']:7.1f} s",
                flush=True,
            )
    if not records:
        parser.error("nothing was evaluated: give a checkpoint or run directory, or --merge an evaluations.json")
    (args.out / "results.md").write_text(table(records))
    print(table(records))
    print("curve:", write_curve(records, curve_lengths, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
