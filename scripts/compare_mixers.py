"""Mamba-1, Mamba-2 and Mamba-3 trained on the same synthetic tasks at an equal parameter count.

    python scripts/compare_mixers.py                         # both tasks, all three mixers, seed 0
    python scripts/compare_mixers.py --seeds 0,1 --jobs 2    # two seeds, two runs at a time
    python scripts/compare_mixers.py --tasks induction_heads --mixers Mamba2,Mamba3 --steps 500
    python scripts/compare_mixers.py --tasks induction_heads data.seq_len=64    # any config override

Each run is ``scripts/train.py`` in its own process on one thread (OMP_NUM_THREADS=1), so runs
side by side do not slow each other's arithmetic and every run sees the same conditions: the
task's config (configs/default.yaml for selective copying, configs/induction_heads.yaml for
induction heads), the same data, seed, optimiser and number of steps. Only the mixer changes,
with its d_state chosen so that the whole model's parameter count matches Mamba-1's within 1%
(printed in the table). The table gives validation accuracy at every validation, so it shows
how fast each mixer learns as well as where it ends. Runs go to --out (default
runs/compare_mixers/); a run already finished there is read back, not trained again.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = {"selective_copying": "configs/default.yaml", "induction_heads": "configs/induction_heads.yaml"}
# The mixers' settings. d_state is what evens out the parameter counts (d_model 64, 2 layers):
# Mamba-1 66,496 parameters, Mamba-2 66,224, Mamba-3 66,432 with the selective-copying vocabulary.
MIXERS = {
    "Mamba1": {"layer": "Mamba1", "d_state": 16},
    "Mamba2": {"layer": "Mamba2", "d_state": 48, "headdim": 16, "chunk_size": 32},
    "Mamba3": {"layer": "Mamba3", "d_state": 40, "headdim": 16, "chunk_size": 32},
}


def comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=comma_list, default=list(TASKS), help=f"from {', '.join(TASKS)}")
    parser.add_argument("--mixers", type=comma_list, default=list(MIXERS), help=f"from {', '.join(MIXERS)}")
    parser.add_argument("--seeds", type=comma_list, default=["0"], help="comma-separated integers")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the task's config)")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for every run (not model.ssm_cfg)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_mixers")
    parser.add_argument("--json", metavar="PATH", help="also write the results there")
    args = parser.parse_args(argv)
    for name, chosen, known in (("--tasks", args.tasks, TASKS), ("--mixers", args.mixers, MIXERS)):
        unknown = [item for item in chosen if item not in known]
        if unknown or not chosen:
            parser.error(f"{name}: expected names from {', '.join(known)}, got {','.join(chosen) or 'nothing'}")
    try:
        args.seeds = [int(seed) for seed in args.seeds]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {','.join(args.seeds)}")
    bad = [o for o in args.overrides if "=" not in o or o.startswith(("model.ssm_cfg", "seed=", "run_dir="))]
    if bad:
        parser.error(f"overrides: expected key=value other than model.ssm_cfg, seed and run_dir, got {' '.join(bad)}")
    if args.jobs < 1:
        parser.error(f"--jobs: expected at least 1, got {args.jobs}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    return args


def overrides(task: str, mixer: str, seed: int, steps: int | None, run_dir: Path, extra=()) -> list[str]:
    items = [
        *extra,
        f"model.ssm_cfg={json.dumps(MIXERS[mixer])}",
        f"seed={seed}",
        f"run_dir={run_dir}",
        "progress_bar=false",
    ]
    if steps is not None:
        items.append(f"trainer.max_steps={steps}")
    return items


def parameter_count(task: str, mixer: str, extra=()) -> int:
    from ssm.training import load_config
    from ssm.training.data import TaskDataModule
    from ssm.training.run import build_model

    config = load_config(ROOT / TASKS[task], overrides(task, mixer, 0, None, Path("unused"), extra))
    model = build_model(config, TaskDataModule(config.data, seed=0).vocab_size)
    return sum(p.numel() for p in model.parameters())


def validation_accuracies(run_dir: Path, final_step: int) -> dict[int, float]:
    """val/acc at each validation, keyed by the number of training steps before it."""
    accuracies = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["metric"] == "val/acc":
                # Lightning logs a validation inside fit at the index of the step it followed (one
                # less than the steps done), the closing one (after fit) at the steps done.
                step = int(row["step"])
                accuracies[step if step == final_step else step + 1] = float(row["value"])
    return dict(sorted(accuracies.items()))


def run_all(args) -> list[dict]:
    jobs = []
    for task in args.tasks:
        for mixer in args.mixers:
            for seed in args.seeds:
                jobs.append((task, mixer, seed, args.out / f"{task}-{mixer}-seed{seed}"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending = [job for job in jobs if not (job[3] / "metrics.json").is_file()]
    for job in jobs:
        if job not in pending:
            print(f"{job[3].name}: finished before, read back", flush=True)
    running: list[tuple[tuple, subprocess.Popen, object]] = []
    failed = []
    while pending or running:
        while pending and len(running) < args.jobs:
            task, mixer, seed, run_dir = job = pending.pop(0)
            if run_dir.exists():
                raise SystemExit(f"{run_dir} holds an unfinished run; remove it or continue it with train.py resume=")
            args.out.mkdir(parents=True, exist_ok=True)
            log = open(args.out / f"{run_dir.name}.log", "w")
            command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / TASKS[task])]
            command += overrides(task, mixer, seed, args.steps, run_dir, args.overrides)
            print(f"{run_dir.name}: training (log in {log.name})", flush=True)
            running.append((job, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(1)
        for entry in list(running):
            job, process, log = entry
            if process.poll() is not None:
                running.remove(entry)
                log.close()
                if process.returncode != 0:
                    failed.append(f"{job[3].name} (exit {process.returncode}, see {log.name})")
    if failed:
        raise SystemExit("failed: " + "; ".join(failed))

    results = []
    counts = {}
    for task, mixer, seed, run_dir in jobs:
        if (task, mixer) not in counts:
            counts[task, mixer] = parameter_count(task, mixer, args.overrides)
        final = json.loads((run_dir / "metrics.json").read_text())
        results.append(
            {
                "task": task,
                "mixer": mixer,
                "seed": seed,
                "params": counts[task, mixer],
                "steps": final["step"],
                "val_acc": final["val/acc"],
                "val_loss": final["val/loss"],
                "wall_s": final["wall_s"],
                "val_acc_by_step": validation_accuracies(run_dir, final["step"]),
            }
        )
    return results


def format_table(results: list[dict]) -> str:
    """One markdown table per task: accuracy at each validation, final loss and wall time."""
    tables = []
    for task in dict.fromkeys(r["task"] for r in results):
        rows = [r for r in results if r["task"] == task]
        steps = sorted({step for r in rows for step in r["val_acc_by_step"]})
        header = ["mixer", "params", "seed", *(f"acc @ {s}" for s in steps), "final loss", "wall s"]
        lines = [f"{task}:", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            accs = [f"{r['val_acc_by_step'][s]:.3f}" if s in r["val_acc_by_step"] else "" for s in steps]
            cells = [
                r["mixer"],
                f"{r['params']:,}",
                str(r["seed"]),
                *accs,
                f"{r['val_loss']:.4f}",
                f"{r['wall_s']:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_all(args)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
