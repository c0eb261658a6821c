"""Reproduce the Mamba paper's synthetic results with this library (issue 30): train, evaluate,
draw, in one command.

    python scripts/reproduce.py induction_heads --seeds 0,1,2
    python scripts/reproduce.py induction_heads --mixers Mamba2,Mamba3 --seeds 0
    python scripts/reproduce.py selective_copying --seeds 0
    python scripts/reproduce.py induction_heads --tiny --out /tmp/ih   # seconds: the CI version
    python scripts/reproduce.py parity --mixers Mamba3,Mamba3-noRoPE,Mamba2 --seeds 0,1,2

For every mixer and seed, configs/paper/TASK.yaml is trained through the task's stages (STAGES
below: sequence length, batch, steps; each stage continues the run before it with resume=, so
optimiser state and step count carry on), in OUT/TASK_MIXER_sSEED/. Then it is evaluated on the
task's test split: induction heads at every power of two from 2^6 to 2^20 (1024 sequences per
length up to 2^14, 64 above), selective copying at its training length (1024 sequences), the
Mamba-3 paper's state tracking (parity, modular_arithmetic; issue 48) at 256 and 1024 (1024
sequences each), reported as the paper's scaled accuracy, 100·(acc − chance)/(1 − chance). A
finished run is not trained again (remove its folder to).

Splits (ssm.training.data.SPLITS, each its own seed stream): the stages train on "train" and
validate on "val"; nothing here reads the test split but the final evaluation, and nothing is
chosen from it. The test split is data.TEST_SPLIT, a stream no run or script read before the
recipes below were frozen (issue 46). The split called "test" before issue 46 chose stages (the
comments on STAGES quote its misses), so it is a validation split now, data.SELECTION_SPLIT:
--split selection evaluates on it, to read the old numbers again.

Writes OUT/results.json (every number, with the commit), OUT/results.md (the table) and, for
induction heads, OUT/extrapolation.png (--figure PATH to put it elsewhere, e.g.
docs/induction-heads-extrapolation.png). Training runs on torch's threads as set by
OMP_NUM_THREADS; evaluation on --eval-threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Stage:
    seq_len: int  # training length of this stage
    batch_size: int
    steps: int  # optimiser steps in this stage
    val_samples: int = 256  # validation sequences at this stage's length
    lr: float | None = None  # this stage's learning rate (default: the config's optim.lr)
    overrides: tuple[str, ...] = ()  # more config overrides for this stage only ("key=value")


# The length curriculum. The model learns the task at a short length, where it does so in a few
# hundred steps (at 256 from scratch it can sit at chance for thousands); the later stages, up to
# 2^18, are what make it hold its key over a million tokens: it must keep exp(Δ·A) within about
# 1e-6 of 1 on every token but the key, which no loss at 256 asks for. The case the long stages
# almost never show (the key right before the final trigger, 1 sequence in L - 2) is kept in view
# by the config's data.short_gap_prob, and weighted up once more by a last stage at 1024 (100
# steps; 300 steps at L = 16 had undone the long stages, this one cost seed 2 3 of 64 keys at 2^20).
# The long stages (batch 1-2) run with Adam's beta2 at 0.95 instead of the paper's 0.999: at
# 0.999, after a quiet stretch of near-zero gradients the second-moment estimate has shrunk, and
# one sequence the model misses then moves every parameter by several times the rate for ten
# steps (seed 2 of the recipe before: loss at 2^18 from 0.001 to 6); at 0.95 that first step is
# at most about 0.45 times the rate. docs/paper-results.md has the runs.
# Selective copying learns at 64 from the start, where at 256 it sat on its plateau for over
# 1,000 steps; the longer stages then teach it to ignore up to 4096 noise tokens, settling at the
# paper's 1e-4 from 1024 on, and the last stage anneals the rate to 0.
# docs/paper-results.md gives the runs that showed each of these. The misses quoted below were
# seen on the split then called "test": data.SELECTION_SPLIT, a validation split since issue 46.
SHORT_MEMORY_ADAM = ("optim.betas=[0.9, 0.95]",)
ADJACENT_KEYS = ("data.short_gap_prob=0.5", "data.short_gap_window=2")
STAGES = {
    "induction_heads": [
        Stage(64, 16, 1000),
        Stage(256, 8, 1000),
        Stage(2048, 8, 200, 128),
        Stage(16384, 2, 60, 32, overrides=SHORT_MEMORY_ADAM),
        Stage(65536, 1, 30, 8, overrides=SHORT_MEMORY_ADAM),
        Stage(262144, 1, 60, 4, overrides=SHORT_MEMORY_ADAM),
        # the adjacent case (key right before the final trigger) weighted up for 100 steps at 1024:
        # every miss of the six stages above was that case (seed 1 read "T 14 T" as 2 at every length)
        Stage(1024, 8, 100, 128, overrides=SHORT_MEMORY_ADAM + ADJACENT_KEYS),
        # Then 42 steps at 2^19, as two stages (how seed 2's run was continued): with the seven
        # above, seed 2 missed 3 of 64 keys at 2^20, its three longest gaps (615k-1.03M tokens),
        # with the key's probability fading with the gap. 30 more steps at 2^18 did not mend it
        # (95.3% at 2^20); 12 at 2^19 gave 62/64 and 30 more 64/64, and 100% at every length.
        Stage(524288, 1, 12, 2, overrides=SHORT_MEMORY_ADAM),
        Stage(524288, 1, 30, 2, overrides=SHORT_MEMORY_ADAM),
        # Last, 30 steps at 16384 with the rate annealed from 1e-4 to 0: after the 2^19 stages
        # seed 0 read key 3 as 12 in 3 of 2048 sequences at 2^11 and 2^14 (p 0.35-0.40, gaps
        # 1.2k-15k); this stage made both lengths 1024/1024.
        Stage(16384, 2, 30, 32, lr=1e-4, overrides=SHORT_MEMORY_ADAM + ("optim.decay_steps=30",)),
    ],
    "selective_copying": [
        # Three seeds of the recipe before parted in stage 1 and kept their order to the end, the
        # final accuracy following stage 4's: so the cheap stages are longer (L 64: 6000 steps,
        # was 4000; 1024: 1200 + 1000, was 800 + 600). A higher rate at L 64 did not learn faster
        # (seed 1, 1000 steps: 1e-3 and 1.5e-3 both 0.41; 3e-3 never left the plateau).
        # With 6000 steps here and a 1500-step anneal, seed 1 ended at 99.70% (the goal is 99.8):
        # its val/acc at L 64 was still rising at step 6000 (0.84 at 5000, 0.93 at 6000), so
        # 9000 (+4 min); and the anneal 2500 steps (+6 min; 23 min alone before, about 33 now).
        Stage(64, 64, 9000),
        Stage(256, 32, 1500),
        Stage(1024, 8, 1200, 128),
        Stage(1024, 8, 1000, 128, lr=1e-4),  # the paper's rate, to settle where a step is cheap
        # Then the rate annealed from 1e-4 to 0 over 1500 steps at 4096, batch 8. At a constant
        # 1e-4 and batch 4, val/acc swung between 0.976 and 0.985 from one validation to the next
        # (test 98.05%); a 400-step anneal at batch 4 took the test to 99.44%. A constant stage at
        # batch 4 before the anneal (the recipe before) lowered one seed from 0.998 to 0.947.
        Stage(4096, 8, 2500, 128, lr=1e-4, overrides=("optim.decay_steps=2500",)),
    ],
}
# The Mamba-3 paper's state tracking (section 4.2): one stage, lengths drawn per step from
# the config's data.min_seq_len up to the stage's length, validated at its data.val_seq_len (256)
# on the validation split; the recipe (rate, schedule) is the config's.
STAGES["parity"] = [Stage(160, 64, 8000, 256)]
STAGES["modular_arithmetic"] = [Stage(64, 64, 4000, 512)]
STATE_TRACKING = ("parity", "modular_arithmetic")

# Mamba-3's induction heads: a gentler rate from 8192 on. With the stages above, 2 of 3 seeds
# broke at the jump from 2048 to 16384 (validation 0.125 and 0.156; the first losses at 16384
# 6.8 and 4.5, where Mamba-1 and Mamba-2 read 0.00); Mamba-3 carries what it learned at 2048 to
# longer lengths worse (seed 1: 0.91 at 2048, 0.59 at 16384), and at 1e-3 its updates on long
# sequences undo it. Not the rotation: with θ forced to 0 the same model read 0.47 at 16384.
# A stage at 8192 at 1e-3 left seed 1 worse (0.84 at 2048); at 2.5e-4 it read 1.000 at 2048
# and 0.906 at 16384, and then 60 steps at 16384 at 2.5e-4 held 0.953 there.
# docs/paper-results.md has the runs.
MAMBA3_LONG_LR = 2.5e-4


def _gentler_from(stages: list[Stage], length: int, lr: float, inserted: Stage) -> list[Stage]:
    """``stages`` with ``inserted`` before the first stage at ``length`` or longer, and every
    stage from there on at a rate of at most ``lr``."""
    first = next(k for k, s in enumerate(stages) if s.seq_len >= length)
    later = [replace(s, lr=min(s.lr or lr, lr)) for s in stages[first:]]
    return stages[:first] + [inserted] + later


MIXER_STAGES = {
    ("induction_heads", "Mamba3"): _gentler_from(
        STAGES["induction_heads"], 16384, MAMBA3_LONG_LR, Stage(8192, 4, 200, 32, lr=MAMBA3_LONG_LR)
    ),
}


def stages_for(task: str, mixer: str, tiny: bool = False) -> list[Stage]:
    """The stages that ``mixer`` trains ``task`` through: the task's, or the mixer's own."""
    if tiny:
        return TINY_STAGES[task]
    return MIXER_STAGES.get((task, mixer), STAGES[task])


# --tiny: the same path in seconds (a 1-layer d_model-16 model, a few steps per stage).
TINY_STAGES = {
    "induction_heads": [Stage(16, 4, 2, 8), Stage(32, 2, 2, 8)],
    "selective_copying": [Stage(24, 4, 2, 8), Stage(40, 2, 2, 8)],
    "parity": [Stage(16, 4, 2, 8)],
    "modular_arithmetic": [Stage(16, 4, 2, 8)],
}
TINY_OVERRIDES = [
    "model.d_model=16",
    "model.n_layer=1",
    "trainer.val_check_interval=2",
    "checkpoint_every=2",
    "progress_bar=false",
    "log_every=1",
    "trainer.log_every_n_steps=1",
]
# The mixers at about the same parameter count (d_model 64, 2 layers), as scripts/compare_mixers.py.
MIXERS = {
    "Mamba1": {"layer": "Mamba1", "d_state": 16},
    "Mamba2": {"layer": "Mamba2", "d_state": 48, "headdim": 16, "chunk_size": 32},
    "Mamba3": {"layer": "Mamba3", "d_state": 40, "headdim": 16, "chunk_size": 32},
}
TINY_MIXERS = {
    "Mamba1": {"layer": "Mamba1", "d_state": 4},
    "Mamba2": {"layer": "Mamba2", "d_state": 4, "headdim": 8, "chunk_size": 8},
    "Mamba3": {"layer": "Mamba3", "d_state": 4, "headdim": 8, "chunk_size": 8},
    "Mamba3-noRoPE": {"layer": "Mamba3", "d_state": 4, "headdim": 8, "chunk_size": 8, "rope_fraction": 0.0},
}
# State tracking: the Mamba-3 paper's models (state 64; the configs set d_model and layers), and
# its ablation, Mamba-3 without the rotary state. Their A as configs/paper/parity.yaml chose its
# recipe with: A_activation heavy_tail, not mamba-ssm's softplus (see that config).
STATE_TRACKING_MIXERS = {
    "Mamba3": {"layer": "Mamba3", "d_state": 64, "headdim": 16, "chunk_size": 32, "A_activation": "heavy_tail"},
    "Mamba3-noRoPE": {
        "layer": "Mamba3",
        "d_state": 64,
        "headdim": 16,
        "chunk_size": 32,
        "rope_fraction": 0.0,
        "A_activation": "heavy_tail",
    },
    "Mamba2": {"layer": "Mamba2", "d_state": 64, "headdim": 16, "chunk_size": 32},
}


def mixers_for(task: str, tiny: bool = False) -> dict:
    """The mixers ``task`` is reproduced with: name → model.ssm_cfg."""
    if tiny:
        return TINY_MIXERS
    return STATE_TRACKING_MIXERS if task in STATE_TRACKING else MIXERS


# The paper's rows (Gu & Dao 2023, Tables 1 and 2; appendix E.1).
PAPER = {
    "induction_heads": "Mamba (paper): 100% at every length 2^6 .. 2^20, trained at 256",
    "selective_copying": "S6 in the Mamba block (paper): 99.8%",
    "parity": "Mamba-3 paper, Table 5b (scaled accuracy at 256): Mamba-3 100.0, without RoPE 2.27, Mamba-2 0.90",
    "modular_arithmetic": "Mamba-3 paper, Table 5b (scaled accuracy at 256), without / with brackets: "
    "Mamba-3 98.51 / 87.75, without RoPE 1.49 / 0.72, Mamba-2 47.81 / 0.88",
}
# The paper's rows of Table 5b, scaled accuracy at 256 (for modular arithmetic: without brackets,
# with brackets).
PAPER_STATE_TRACKING = {
    "parity": {"Mamba3": 100.0, "Mamba3-noRoPE": 2.27, "Mamba2": 0.90},
    "modular_arithmetic": {"Mamba3": (98.51, 87.75), "Mamba3-noRoPE": (1.49, 0.72), "Mamba2": (47.81, 0.88)},
}
CHANCE = {"parity": 1 / 2, "modular_arithmetic": 1 / 5}


def scaled(task: str, accuracy: float) -> float:
    """The Mamba-3 paper's scaled accuracy: 0 at chance, 100 when perfect."""
    return 100 * (accuracy - CHANCE[task]) / (1 - CHANCE[task])


# --split: what the final evaluation reads (ssm.training.data.SPLITS)
# test48, test49 and test50: parity's (data.PARITY_TEST_SPLIT, PARITY_B128_TEST_SPLIT, PARITY_DENSE_TEST_SPLIT)
EVAL_SPLITS = {"test": "test46", "selection": "test", "test48": "test48", "test49": "test49", "test50": "test50"}


def comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def test_lengths(task: str, tiny: bool, trained: int) -> list[int]:
    if task == "selective_copying":
        return [trained]
    if task in STATE_TRACKING:
        return [32] if tiny else [256, 1024]
    return [2**k for k in range(4, 8)] if tiny else [2**k for k in range(6, 21)]


def test_samples(length: int, tiny: bool, sizes: str = "full") -> int:
    """Test sequences per length. "full": the issue's sizes, 1024 per length up to 2^14 and 64
    above; "quick": 1024 up to 2^12, 256 to 2^14, 64 to 2^16, 16 to 2^18, 8 above (a fifth of
    the tokens, for a busy machine)."""
    if tiny:
        return 8
    if sizes == "quick":
        for limit, n in ((2**12, 1024), (2**14, 256), (2**16, 64), (2**18, 16)):
            if length <= limit:
                return n
        return 8
    return 1024 if length <= 2**14 else 64


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "ssm", "scripts", "configs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip()[:12] + ("+changes" if dirty.stdout.strip() else "")


class StageRecord:
    """What the stopped attempts at a stage spent (stage_partial.json: the stage, its wall
    seconds so far, the commits it trained with), so that the stage's wall and commits count
    every attempt: written when an attempt is interrupted or fails and at each checkpoint (a
    SIGKILL then loses only the time since the last one, as the run loses those steps), and
    folded into stage_walls.json / stage_commits.json when the stage finishes."""

    def __init__(self, run_dir: Path, stage: int, stage_commit: str):
        self.path, self.stage = run_dir / "stage_partial.json", stage
        record = json.loads(self.path.read_text()) if self.path.is_file() else {}
        same = record.get("stage") == stage
        self.wall_before = float(record.get("wall_s", 0.0)) if same else 0.0
        self.commits = list(dict.fromkeys((record.get("commits", []) if same else []) + [stage_commit]))
        self.started = time.perf_counter()

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def save(self) -> None:
        record = {"stage": self.stage, "wall_s": round(self.wall(), 1), "commits": self.commits}
        self.path.write_text(json.dumps(record) + "\n")

    def callback(self):
        import pytorch_lightning as pl

        record = self

        class SaveAtCheckpoints(pl.Callback):
            def on_save_checkpoint(self, trainer, pl_module, checkpoint):
                if trainer.is_global_zero:
                    record.save()

        return SaveAtCheckpoints()


def train_stages(task: str, mixer: str, seed: int, run_dir: Path, tiny: bool, overrides: list[str]) -> dict:
    """Train one run through its stages; returns steps, wall seconds and the final validation."""
    from ssm.training import load_checkpoint, load_config, train

    stages = stages_for(task, mixer, tiny)
    ssm_cfg = json.dumps(mixers_for(task, tiny)[mixer])
    # A run stopped between stages continues with the first stage it has not finished.
    walls_path = run_dir / "stage_walls.json"
    walls = json.loads(walls_path.read_text()) if walls_path.is_file() else []
    # The commit each stage trained with (results.json's commit is the one that evaluated); a
    # stage trained in several attempts (stopped, then continued) with several lists them all.
    commits_path = run_dir / "stage_commits.json"
    commits = json.loads(commits_path.read_text()) if commits_path.is_file() else []
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    done_steps = int(load_checkpoint(ckpt, mmap=True)["global_step"]) if ckpt.is_file() else 0
    steps, metrics = 0, {}
    for k, stage in enumerate(stages):
        steps += stage.steps
        if steps <= done_steps and k < len(walls):
            continue
        stage_overrides = [
            f"model.ssm_cfg={ssm_cfg}",
            f"seed={seed}",
            f"run_dir={run_dir}",
            f"data.seq_len={stage.seq_len}",
            f"data.batch_size={stage.batch_size}",
            f"data.val_samples={stage.val_samples}",
            f"trainer.max_steps={steps}",
            *([f"optim.lr={stage.lr}"] if stage.lr is not None else []),
            *stage.overrides,
            *([f"resume={run_dir}"] if done_steps else []),
            *(TINY_OVERRIDES if tiny else []),
            *overrides,
        ]
        print(
            f"== {task} {mixer} seed {seed}: stage {k + 1}/{len(stages)}, L = {stage.seq_len}, "
            f"batch {stage.batch_size}, to step {steps}",
            flush=True,
        )
        record = StageRecord(run_dir, k, commit())
        config = load_config(ROOT / "configs" / "paper" / f"{task}.yaml", stage_overrides)
        try:
            result = train(config, callbacks=(record.callback(),))
        except BaseException:  # a crash: this attempt's time counts when the stage is run again
            record.save()
            raise
        if result.interrupted:
            record.save()
            raise SystemExit(f"stage {k + 1} of {run_dir} was interrupted; run the command again to continue")
        # indexed by stage: a stage run again replaces its own entry, whatever the lists held
        commits = commits[:k] + [", ".join(record.commits)]
        commits_path.write_text(json.dumps(commits) + "\n")
        walls = walls[:k] + [round(record.wall_before + result.metrics["wall_s"], 1)]
        walls_path.write_text(json.dumps(walls) + "\n")  # last: a stage is done when its wall is written
        record.path.unlink(missing_ok=True)
        metrics, done_steps = result.metrics, steps
    if not metrics and (run_dir / "metrics.json").is_file():  # every stage was done before
        metrics = json.loads((run_dir / "metrics.json").read_text())
    info = {
        "steps": steps,
        "train_wall_s": round(sum(walls), 1),
        "stage_wall_s": walls,
        "stage_commits": commits,
        "stages": [vars(s) for s in stages],
        "final_val_acc": metrics.get("val/acc"),
    }
    (run_dir / "reproduce.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def evaluate_run(
    task: str, run_dir: Path, tiny: bool, batch_size: int, chunk: int, sizes: str, split: str = "test"
) -> list[dict]:
    """The run's accuracy at the task's test lengths, on ``split``: "test" (data.TEST_SPLIT) or
    "selection" (data.SELECTION_SPLIT, the split the stages were designed on)."""
    from ssm.training.data import TaskDataModule
    from ssm.training.evaluate import evaluate_length, load_run

    config, model = load_run(run_dir)
    data = TaskDataModule(config.data, seed=config.seed)
    rows = []
    for length in test_lengths(task, tiny, config.data.seq_len):
        m = evaluate_length(
            model, data, length, test_samples(length, tiny, sizes), batch_size, chunk, EVAL_SPLITS[split]
        )
        rows.append({"length": length, **m})
        peak = m["peak_rss_bytes"] / 2**20 if m["peak_rss_bytes"] else float("nan")
        print(
            f"   L {length:8d}  acc {m['val/acc']:.4f} ({m['correct']}/{m['scored']}), last {m['last/acc']:.4f}  "
            f"{m['seconds']:6.1f} s  peak {peak:5.0f} MiB",
            flush=True,
        )
    return rows


def table(task: str, runs: list[dict]) -> str:
    """The results in the paper's layout: the paper's row, then ours, one per mixer and seed."""
    if task in STATE_TRACKING:
        return state_tracking_table(task, runs)
    if task == "induction_heads":
        lengths = [r["length"] for r in runs[0]["test"]] if runs else []
        head = (
            "| model | seed | params | steps | train wall | "
            + " | ".join(f"2^{n.bit_length() - 1}" for n in lengths)
            + " |"
        )
        lines = [head, "|" + "---|" * (5 + len(lengths))]
        if not any(r.get("tiny") for r in runs):
            lines.append("| Mamba (paper) | | 74K | 204,800 | | " + " | ".join("100" for _ in lengths) + " |")
        for r in runs:
            accs = " | ".join(f"{100 * t['val/acc']:.1f}" if t["val/acc"] < 1 else "100" for t in r["test"])
            lines.append(
                f"| {r['mixer']} (ours) | {r['seed']} | {r['params']:,} | {r['steps']:,} | "
                f"{r['train_wall_s'] / 60:.1f} min | {accs} |"
            )
        return "\n".join(lines) + "\n"
    lines = ["| model | seed | params | steps | train wall | L | test accuracy |", "|---|---|---|---|---|---|---|"]
    if not any(r.get("tiny") for r in runs):
        lines.append("| S6 in the Mamba block (paper) | | | 400,000 | | 4096 | 99.8 |")
    for r in runs:
        t = r["test"][-1]
        lines.append(
            f"| {r['mixer']} (ours) | {r['seed']} | {r['params']:,} | {r['steps']:,} | "
            f"{r['train_wall_s'] / 60:.1f} min | {t['length']} | {100 * t['val/acc']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def state_tracking_table(task: str, runs: list[dict]) -> str:
    """Table 5b's layout: scaled accuracy (0 chance, 100 perfect) per model, the paper's rows
    first (at 256). Ours at each test length over every scored position, and at each sequence's
    last position (parity scores every position; modular arithmetic only its answer, so both
    read the same there)."""
    lengths = sorted({t["length"] for r in runs for t in r["test"]})
    head = [str(n) for n in lengths] + [f"{n}, last position" for n in lengths]
    lines = [
        "| model | seed | params | steps | train wall | " + " | ".join(head) + " |",
        "|---|---|---|---|---|" + "---|" * len(head),
    ]
    if not any(r.get("tiny") for r in runs):
        for mixer, value in PAPER_STATE_TRACKING[task].items():
            both = isinstance(value, tuple)
            shown = " / ".join(f"{v:.2f}" for v in value) if both else f"{value:.2f}"
            cells = [shown if n == 256 else "" for n in lengths] + [""] * len(lengths)
            label = f"{mixer} (paper{', without / with brackets' if both else ''})"
            lines.append(f"| {label} | | | 10,000 | | " + " | ".join(cells) + " |")
    for r in runs:
        by_length = {t["length"]: t for t in r["test"]}
        cells = [
            f"{scaled(task, by_length[n][key]):.2f}" if n in by_length else "-"
            for key in ("val/acc", "last/acc")
            for n in lengths
        ]
        variant = f", {r['variant']}" if r.get("variant") else ""
        lines.append(
            f"| {r['mixer']} (ours{variant}) | {r['seed']} | {r['params']:,} | {r['steps']:,} | "
            f"{r['train_wall_s'] / 60:.1f} min | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Accuracy against test length (log2 axis), one line per mixer and seed, the training
    lengths marked."""
    from ssm.training._optional import require

    figure = require("matplotlib.figure", "scripts/reproduce.py (the figure)")
    fig = figure.Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    styles = {"Mamba1": "-", "Mamba2": "--", "Mamba3": ":"}
    trained = sorted({s["seq_len"] for s in runs[0]["stages"]}) if runs else []  # the band's lengths
    for r in runs:
        xs = [t["length"] for t in r["test"]]
        trained_to = max(s["seq_len"] for s in r["stages"])  # a run trained through fewer stages says so
        note = f" (trained to {trained_to})" if trained_to != trained[-1] else ""
        ax.plot(
            xs,
            [100 * t["val/acc"] for t in r["test"]],
            styles.get(r["mixer"], "-"),
            marker="o",
            markersize=3,
            label=f"{r['mixer']} seed {r['seed']}{note}",
        )
    if runs:
        ax.axvspan(
            min(trained),
            max(trained),
            color="grey",
            alpha=0.12,
            label=f"training lengths {min(trained)}..{max(trained)}",
        )
        if 256 in trained:
            ax.axvline(256, color="grey", linestyle="--", linewidth=1, label="the paper's training length 256")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 102)
    ax.set_xlabel("test sequence length")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("induction heads: length extrapolation (paper's Mamba: 100% to 2^20)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(STAGES))
    parser.add_argument(
        "--mixers",
        type=comma_list,
        default=None,
        help=f"from {', '.join(MIXERS)} (state tracking: {', '.join(STATE_TRACKING_MIXERS)}); "
        "default Mamba1 (state tracking: Mamba3)",
    )
    parser.add_argument("--seeds", type=comma_list, default=["0", "1", "2"])
    parser.add_argument("--out", type=Path, default=None, help="default runs/paper_TASK")
    parser.add_argument("--figure", type=Path, default=None, help="default OUT/extrapolation.png")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps: checks the path in seconds")
    parser.add_argument("--eval-threads", type=int, default=None, help="torch threads for evaluation")
    parser.add_argument("--batch-size", type=int, default=16, help="evaluation sequences per forward pass")
    parser.add_argument("--chunk", type=int, default=256, help="evaluation piece length (state carried)")
    parser.add_argument("--test-sizes", choices=("full", "quick"), default="full", help="see test_samples")
    parser.add_argument("--train-only", action="store_true", help="train (or finish training) and stop")
    parser.add_argument(
        "--split",
        choices=sorted(EVAL_SPLITS),
        default="test",
        help="the split evaluated: test (fresh, chose nothing), test48, test49 and test50 (parity's second, third "
        "and fourth fresh draws, for its recipes of 2026-11-28 and 29) or selection (the old 'test' split, which "
        "chose stages)",
    )
    parser.add_argument(
        "--with",
        dest="others",
        type=Path,
        action="append",
        default=[],
        metavar="RESULTS_JSON",
        help="also draw and tabulate the runs of another results.json of the task (e.g. other mixers' runs)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every stage")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    args.mixers = args.mixers or (["Mamba3"] if args.task in STATE_TRACKING else ["Mamba1"])
    known = mixers_for(args.task)
    unknown = [m for m in args.mixers if m not in known]
    if unknown:
        parser.error(f"--mixers: unknown {unknown}; choose from {list(known)}")
    try:
        seeds = [int(s) for s in args.seeds]
    except ValueError:
        parser.error(f"--seeds must be comma-separated ints, got {args.seeds}")
    extra_runs = []
    for path in args.others:  # read first: a bad one fails before any training
        try:
            other = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--with {path}: {err}")
        if other.get("task") != args.task:
            parser.error(f"--with {path}: its runs are of {other.get('task')!r}, not {args.task}")
        extra_runs += other["runs"]
    out = args.out or ROOT / "runs" / f"paper_{args.task}"
    out.mkdir(parents=True, exist_ok=True)

    import torch

    runs = []
    for mixer in args.mixers:
        for seed in seeds:
            run_dir = out / f"{args.task}_{mixer}_s{seed}"
            done = run_dir / "reproduce.json"
            total = sum(s.steps for s in stages_for(args.task, mixer, args.tiny))
            info = json.loads(done.read_text()) if done.is_file() else None
            if info is not None and info["steps"] == total:
                print(f"== {run_dir}: trained already ({info['steps']} steps, {info['train_wall_s']:.0f} s)")
            else:  # not trained, or trained through fewer stages than STAGES now lists: continue
                info = train_stages(args.task, mixer, seed, run_dir, args.tiny, args.overrides)
            if args.train_only:
                continue
            sizes = "tiny" if args.tiny else args.test_sizes
            cached = run_dir / f"eval_{EVAL_SPLITS[args.split]}_{sizes}_step{info['steps']}.json"
            if cached.is_file():  # evaluated already (remove the file to evaluate again)
                test, eval_wall = json.loads(cached.read_text()), None
                print(f"== {run_dir}: evaluated already ({cached.name})")
            else:
                threads = torch.get_num_threads()
                if args.eval_threads:
                    torch.set_num_threads(args.eval_threads)
                started = time.perf_counter()
                print(
                    f"== evaluating {run_dir} on the {args.split} split ({EVAL_SPLITS[args.split]}, "
                    f"{torch.get_num_threads()} threads)",
                    flush=True,
                )
                test = evaluate_run(
                    args.task, run_dir, args.tiny, args.batch_size, args.chunk, args.test_sizes, args.split
                )
                torch.set_num_threads(threads)
                eval_wall = round(time.perf_counter() - started, 1)
                cached.write_text(json.dumps(test, indent=2) + "\n")
            from ssm.training.evaluate import load_run

            run_config, run_model = load_run(run_dir)
            params = sum(p.numel() for p in run_model.parameters())
            variant = None
            if args.task == "modular_arithmetic":
                variant = "with brackets" if run_config.data.brackets else "without brackets"
            runs.append(
                {
                    "mixer": mixer,
                    "variant": variant,
                    "seed": seed,
                    "params": params,
                    "run_dir": str(run_dir),
                    **info,
                    "tiny": args.tiny,
                    "test_sizes": args.test_sizes,
                    "split": EVAL_SPLITS[args.split],
                    "eval_wall_s": eval_wall,
                    "test": test,
                }
            )
    if args.train_only:
        return 0
    results = {
        "task": args.task,
        "commit": commit(),
        "paper": PAPER[args.task],
        "split": EVAL_SPLITS[args.split],
        "runs": runs,
    }
    runs = runs + extra_runs  # drawn and tabulated, not written into this results.json
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(f"Evaluated on the split {EVAL_SPLITS[args.split]!r}.\n\n" + table(args.task, runs))
    print(table(args.task, runs))
    if args.task == "induction_heads":
        figure = args.figure or out / "extrapolation.png"
        plot(runs, figure)
        print(f"figure: {figure}")
    print(f"results: {out / 'results.json'}, {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
