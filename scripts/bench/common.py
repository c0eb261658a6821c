"""What every op of scripts/benchmark.py shares: the arguments common to several ops, timing
(median of repeats after warm-up, CUDA synchronised), the comparison of two results, the
machine / date / commit / command header of a run, and the JSON written by ``--json``."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
SCRIPT = ROOT / "scripts" / "benchmark.py"  # the one command (child processes run it again)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The weight precisions the CPU decoding ops compare: name -> (--dtype, --quantize).
PRECISIONS = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "float16": ("float16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
}
# Largest accepted max|difference| / max|reference| between two implementations.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
MiB = 2**20
OUTPUT_ARGS = ("json", "markdown", "plot")  # where results go: not part of a run's config


# ----------------------------------------------------------------------------- arguments


def comma_list(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def comma_ints(text: str) -> list[int]:
    try:
        return [int(item) for item in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that several ops read (each op's own are added by its module)."""
    parser.add_argument("--batch", type=int, default=None, help="default 1 (8 for train-step and hybrid)")
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--state", type=int, default=16, help="N, the state size per channel")
    parser.add_argument("--length", type=int, default=None, help="default 1024 (512 for train-step)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", type=comma_list, help="comma-separated; default: all")
    parser.add_argument("--skip", type=comma_list, default=[], help="backends not to run")
    parser.add_argument("--no-peer", action="store_true", help="do not run the peers")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs (the median is reported); ref is slow at big shapes, so a long run "
        "wants --repeats 1 --warmup 0 or --skip ref",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before those")
    parser.add_argument("--seed", type=int, default=0)
    output = parser.add_argument_group("output (every op)")
    output.add_argument("--json", metavar="PATH", help="also write the results there")
    output.add_argument(
        "--markdown",
        metavar="PATH",
        help="write this op's table, with the machine, date, commit and command, into PATH's "
        "section for the op (replaced if there, else appended), e.g. BENCHMARKS.md",
    )
    output.add_argument(
        "--plot", metavar="PATH", help="draw the op's picture there (ops that have one; needs matplotlib)"
    )
    model = parser.add_argument_group("model ops (generate, decode, packed, layer, train-step, ssd)")
    model.add_argument("--d-model", type=int, default=None, help="default 256 (generate), 128 (packed)")
    model.add_argument(
        "--layers",
        type=int,
        default=None,
        help="default 4 (24 for decode, decode-table, text, memory; 2 for context-parallel)",
    )
    model.add_argument("--new-tokens", type=int, default=256)
    model.add_argument("--prompt-length", type=int, default=16)
    model.add_argument("--headdim", type=int, default=32, help="P of Mamba2 and Mamba3 (layer), of ssd's heads")


def fill_defaults(args: argparse.Namespace) -> None:
    """The defaults that depend on the op."""
    if args.layers is None:
        deep = args.op in ("decode", "decode-table", "text", "memory")
        args.layers = 24 if deep else 2 if args.op == "context-parallel" else 4
    if args.batch is None:
        args.batch = 8 if args.op in ("train-step", "hybrid") else 1
    if args.length is None:
        args.length = 512 if args.op in ("train-step", "hybrid") else 1024


def decode_mixer_config(mixer: str, d_model: int) -> dict:
    """The ssm_cfg of --mixer mamba1 | mamba2 | mamba3 at the published checkpoints' shapes: Mamba-1
    N 16 (mamba-130m); Mamba-2 and Mamba-3 N 128, head dim 64 (mamba2-130m)."""
    if mixer == "mamba1":
        return {"d_state": 16}
    return {"layer": "Mamba2" if mixer == "mamba2" else "Mamba3", "d_state": 128, "headdim": math.gcd(2 * d_model, 64)}


def config_of(args: argparse.Namespace) -> dict:
    """The run's settings as the JSON reports hold them."""
    return {k: v for k, v in vars(args).items() if k not in OUTPUT_ARGS}


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


# ----------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Milliseconds of ``step()``: the median of ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def alternate(runners: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Each runner's seconds over ``repeats`` rounds after ``warmup``, the runners taking turns
    within every round, so that a change in the machine's load falls on all of them alike."""
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            times[name].append(fn())
    return times


def relative_difference(x: torch.Tensor, reference: torch.Tensor) -> float:
    """max|x - reference| / max|reference|; NaN if either holds a NaN."""
    return ((x - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


# ----------------------------------------------------------------------------- the run


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}"


def cpu_name() -> str:
    """The processor's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> str:
    """One line naming the hardware and torch a run used."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def git(*command: str) -> str:
    out = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def commit(outputs: tuple[str | None, ...] = ()) -> str:
    """The repository's commit, with ``-dirty`` when the work tree has uncommitted changes to
    tracked files other than ``outputs`` (the markdown file and picture a run writes, so that
    the second op written into BENCHMARKS.md still names a clean commit); ``unknown`` outside
    a git checkout."""
    excluded = []
    for path in filter(None, outputs):
        relative = os.path.relpath(Path(path).resolve(), ROOT)
        if not relative.startswith(".."):
            excluded.append(f":(exclude){relative}")
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def command_line(argv: list[str] | None) -> str:
    """The command as a user would type it again, output options left out."""
    argv = sys.argv[1:] if argv is None else argv
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in ("--json", "--markdown", "--plot"):
            skip = "=" not in item
            continue
        kept.append(item)
    return shlex.join(["python", "scripts/benchmark.py", *kept])


def peer_versions() -> str:
    """The installed peers' versions, e.g. "mambapy 1.2.0, transformers 5.24.0"."""
    found = []
    for package in ("mambapy", "mamba_ssm", "transformers"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found) or "none installed"


def load() -> str:
    """The machine's 1-minute load average as the run ends, when the system reports one: the
    other work that shared the machine with the run (above the core count, every timing slows)."""
    try:
        return f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores as the run ended"
    except (AttributeError, OSError):
        return ""


def run_header(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str]:
    """Machine, date (UTC), commit and command of this run, for the markdown sections."""
    return {
        "machine": f"{machine(torch.device(args.device))} (peers: {peer_versions()}){load()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit((args.markdown, args.plot)),
        "command": command_line(argv),
    }
