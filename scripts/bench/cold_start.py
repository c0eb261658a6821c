"""--op cold-start: seconds from starting ``python scripts/train.py`` (the default config, two
steps) to its first training step's log line, with an empty kernel cache (SSM_CACHE_DIR in a new
temporary directory, so the cpu backend's C kernels are built in that time; on CUDA also an
empty TRITON_CACHE_DIR, and the run on the GPU) and again with the cache that run filled; and the
whole process's time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

from . import report
from .common import ROOT, config_of, describe_device


def command(run_dir: str, device: str) -> list[str]:
    """scripts/train.py for two steps, logging each, into ``run_dir``; on the CPU, or the GPU with --device cuda."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "trainer.max_steps=2"]
    command += ["log_every=1", "progress_bar=false", f"run_dir={run_dir}"]
    # explicit either way: the default ("auto") would take a GPU when there is one
    command.append("trainer.accelerator=" + ("gpu" if device == "cuda" else "cpu"))
    return command


def run(args) -> tuple[int, dict | None]:
    print(f"cold start of scripts/train.py (default config, 2 steps), {describe_device(torch.device(args.device))}")
    print(f"{'kernel cache':>12s} {'to first step s':>16s} {'whole run s':>12s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cache in ("empty", "filled"):
            env = {**os.environ, "SSM_CACHE_DIR": os.path.join(tmp, "kernels")}
            if args.device == "cuda":
                env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
            start = time.perf_counter()
            process = subprocess.Popen(
                command(f"{tmp}/run-{cache}", args.device),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            first, lines = None, []
            for line in process.stdout:
                lines.append(line)
                if first is None and line.startswith("step 1/"):
                    first = time.perf_counter() - start
            whole = time.perf_counter() - start
            if process.wait() != 0 or first is None:
                print("".join(lines[-20:]))
                print(f"error: scripts/train.py failed (exit {process.returncode}) or logged no first step")
                return 1, None
            results[cache] = {"first_step_s": first, "whole_s": whole}
            print(f"{cache:>12s} {first:16.1f} {whole:12.1f}")
    return 0, {"config": config_of(args), "results": results}


def markdown(result: dict, args) -> tuple[str, str, str]:
    rows = [[cache, f"{r['first_step_s']:.1f}", f"{r['whole_s']:.1f}"] for cache, r in result["results"].items()]
    body = report.table(["kernel cache", "to first training step s", "whole run s"], rows)
    body += (
        "\n\n`python scripts/train.py trainer.max_steps=2` (the default config): start to its first step's log line."
    )
    return "cold-start", f"cold start of scripts/train.py, {result['config']['device']}", body
