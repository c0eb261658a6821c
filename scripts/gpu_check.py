"""Prove and time every GPU path of ssm in one command, within a short device window.

    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR            # on a machine with CUDA
    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR --dry-run  # the same plan, tiny, on the CPU

No install step: run from the repository root with the machine's own python3 (torch, Triton,
pytest; pytorch-lightning and pyyaml for the training step). The plan, each step with a time
budget of its own, each failure recorded and the next step run anyway:

1. environment: device, SM count, memory, driver, torch / Triton / CUDA versions, commit;
2. tests: the suite's GPU-relevant files (every Triton kernel against the reference on CUDA
   tensors in float32, bfloat16 and float16, odd lengths, packed sequences, initial states,
   every gradient, torch.compile of the layers), with the failures listed per test;
3. speed: scripts/benchmark.py on the device for the selective scan at mamba-ssm's benchmark
   shapes (batch 8, D 1536, N 16, L 2048 and 8192; bf16 and fp32; forward and forward +
   backward), the linear scan, ssd (also at Mamba-2-130m's heads: 24 of P 64, N 128) and Mamba-3's
   trapezoidal scan, every backend that runs there (the Triton kernels, the pure-PyTorch pscan /
   chunked paths), with peak memory, and at L 2048 fp32 a loop of ``torch.compile``'d reference
   steps beside them;
4. training: scripts/train.py, the default config and a Mamba-2 byte-level text model, in
   bf16-mixed for a few hundred steps (tokens/s, final loss), and the first steps of the default
   config on the CPU beside it, so that the losses can be compared;
5. the mamba-ssm CUDA peer, when its source lies in third_party/mamba-ssm (unpacked from
   ``pip download --no-binary :all: --no-deps mamba-ssm``; git ignores third_party/): built for
   sm_90 within a budget and then timed by step 3's selective-scan cases.

Everything lands in DIR as at most 8 files: report.json (every figure), summary.md, pytest.log,
bench.log, train.log, build.log. ``--dry-run`` (automatic without CUDA) runs the same plan at
tiny sizes on the CPU, the Triton kernels in Triton's interpreter, in about a minute; the test
suite runs it so that this script cannot rot between GPU windows.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What step 2 runs: on a GPU the whole of each file; in a dry run a few of their cases.
GPU_TESTS = [
    "tests/scan/test_triton.py",
    "tests/scan/test_triton_trapezoidal.py",
    "tests/scan/test_triton_ssd.py",
    "tests/scan/test_compile.py",
    "tests/layers/test_mixers.py",
    "tests/layers/test_layer_numerics.py",
]
DRY_TESTS = [
    "tests/scan/test_triton.py::test_selective_lengths",
    "tests/scan/test_triton.py::test_selective_packed_equals_each_sequence_alone",
    "tests/scan/test_triton.py::test_linear_block_boundaries",
    "tests/scan/test_triton_ssd.py::test_packed_sequences_equal_each_sequence_alone",
]

# Step 3: (label, benchmark.py arguments); the dry run shrinks the shapes.
SCAN_CASES = [
    (f"selective {dtype} L {length}", ["--op", "selective", "--batch", "8", "--dim", "1536", "--state", "16",
                                       "--length", str(length), "--dtype", dtype, "--skip", "ref"])
    for dtype in ("bfloat16", "float32")
    for length in (2048, 8192)
] + [
    ("linear float32 L 2048", ["--op", "linear", "--batch", "8", "--dim", "1536", "--state", "16", "--length", "2048",
                               "--skip", "ref"]),
    ("ssd float32 L 2048", ["--op", "ssd", "--batch", "8", "--length", "2048"]),
    ("ssd float32 L 2048, Mamba-2-130m's heads", ["--op", "ssd", "--batch", "8", "--length", "2048", "--headdim", "64",
                                                  "--state", "128"]),
    ("trapezoidal float32 L 2048", ["--op", "trapezoidal", "--batch", "8", "--length", "2048", "--skip", "ref"]),
]  # fmt: skip
SCAN_CASES[2][1].append("--compiled-step")  # fp32 L 2048: beside a loop of torch.compile'd reference steps
DRY_SHAPE = {"--batch": "1", "--dim": "8", "--length": "64", "--state": "4"}

# Step 4: (label, train.py overrides).
TRAIN_RUNS = [
    ("default, bf16-mixed", ["trainer.max_steps=300", "trainer.precision=bf16-mixed"]),
    ("Mamba-2 text, bf16-mixed", ["--config", "configs/text.yaml", "model.ssm_cfg.layer=Mamba2",
                                  "trainer.max_steps=300", "trainer.precision=bf16-mixed"]),
]  # fmt: skip
DRY_TRAIN = ["trainer.max_steps=4", "trainer.val_check_interval=4", "data.val_samples=8", "model.n_layer=1"]
CPU_STEPS = 20  # the first steps of the default config on the CPU, to compare losses with the GPU's


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root, appending its output to ``log``; its exit status,
    seconds, and whether it ran out of time (then killed)."""
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            code = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env
            ).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
            f.write(f"\n[gpu_check] killed after {timeout:.0f} s\n")
    return {"cmd": " ".join(cmd), "returncode": code, "seconds": round(time.perf_counter() - start, 1),
            "timed_out": timed_out}  # fmt: skip


def environment(device: str) -> dict:
    import torch

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {"device": props.name, "sm_count": props.multi_processor_count}
        env |= {"memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}"}
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["device"] = "cpu (dry run: Triton in its interpreter)"
    return env


def pytest_outcome(log: Path) -> dict:
    """The summary line of the last pytest run in ``log`` and the ids of its failed tests."""
    text = log.read_text(errors="replace")
    # "15 passed in 54.6s" under -q, "==== 1 failed, 3 passed in 2.00s ====" otherwise
    outcomes = r"\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)"
    summary = re.findall(
        rf"^(?:=+ )?((?:{outcomes}(?:, )?)+ in [\d.]+s(?: \([\d:]+\))?|no tests ran.*?)(?: =+)?$", text, re.M
    )
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) ([a-z]+)", summary[-1])} if summary else {}
    return {"summary": summary[-1] if summary else None, "counts": counts, "failed": failed}


def step_tests(args, out: Path, env: dict) -> dict:
    log = out / "pytest.log"
    tests = DRY_TESTS if args.dry_run else GPU_TESTS
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-rfE", "-p", "no:cacheprovider"]
    if not args.dry_run and args.test_workers > 1 and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(args.test_workers)]  # Triton's and Inductor's compiles are CPU-bound: spread them
    result = run(cmd, log, args.test_minutes * 60, env)
    return result | pytest_outcome(log)


def with_dry_shape(argv: list[str]) -> list[str]:
    argv = list(argv)
    shape = DRY_SHAPE | ({"--headdim": "4"} if argv[1] in ("ssd", "trapezoidal") else {})
    for flag, value in shape.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv + ["--repeats", "1", "--warmup", "0", "--no-peer"]


def step_bench(args, out: Path, env: dict, device: str) -> list[dict]:
    log, rows = out / "bench.log", []
    deadline = time.perf_counter() + args.bench_minutes * 60
    for label, argv in SCAN_CASES:
        left = deadline - time.perf_counter()
        if left < 5:
            rows.append({"case": label, "skipped": "out of the step's time"})
            continue
        argv = with_dry_shape(argv) if args.dry_run else argv
        path = out / "bench-case.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "scripts/benchmark.py", *argv, "--device", device, "--json", str(path)]
        result = run(cmd, log, left, env)
        if path.exists():
            result["report"] = json.loads(path.read_text())
            path.unlink()
        rows.append({"case": label} | result)
    return rows


def last_metrics(run_dir: Path) -> dict:
    """The final validation metrics (metrics.json) and the last logged training loss and
    tokens/s of a run (metrics.csv), as far as they are there."""
    found = {}
    if (run_dir / "metrics.json").exists():
        found["final"] = json.loads((run_dir / "metrics.json").read_text())
    path = run_dir / "metrics.csv"  # rows of (step, metric, value)
    if path.exists():
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        for key in ("train/loss", "train/tokens_per_s"):
            values = [(int(r["step"]), float(r["value"])) for r in rows if r["metric"] == key]
            if values:
                found[key] = {"first": values[0], "last": values[-1]}
    return found


def step_train(args, out: Path, env: dict, device: str) -> list[dict]:
    log, rows = out / "train.log", []
    runs_root = tempfile.TemporaryDirectory(prefix="ssm-gpu-check-")  # the runs' files stay out of DIR
    runs = Path(runs_root.name)
    plan = list(TRAIN_RUNS)
    if args.dry_run:
        plan = [(label, [a for a in argv if not a.startswith(("trainer.max_steps", "trainer.precision"))])
                for label, argv in plan[:1]]  # fmt: skip
    cpu_run = ("default, CPU, first steps", [f"trainer.max_steps={CPU_STEPS}", "trainer.accelerator=cpu"])
    deadline = time.perf_counter() + args.train_minutes * 60
    for label, overrides in [*plan, cpu_run]:
        left = deadline - time.perf_counter()
        if left < 5:
            rows.append({"run": label, "skipped": "out of the step's time"})
            continue
        run_dir = runs / re.sub(r"\W+", "-", label)
        config = overrides[:2] if overrides[:1] == ["--config"] else []
        overrides = overrides[len(config) :] + (DRY_TRAIN if args.dry_run else [])
        if args.dry_run and label == cpu_run[0]:
            overrides = [o for o in overrides if not o.startswith("trainer.max_steps")] + ["trainer.max_steps=4"]
        cmd = [sys.executable, "scripts/train.py", *config, *overrides, f"run_dir={run_dir}"]
        result = run(cmd, log, left, env)
        rows.append({"run": label} | result | last_metrics(run_dir))
    runs_root.cleanup()
    return rows


def step_peer_build(args, out: Path, env: dict) -> dict:
    source = ROOT / "third_party" / "mamba-ssm"
    if not source.exists():
        return {"skipped": f"no source at {source.relative_to(ROOT)}"}
    if args.dry_run:
        return {"skipped": "dry run"}
    build_env = env | {"MAMBA_FORCE_BUILD": "TRUE", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": str(os.cpu_count())}
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", str(source)]
    return run(cmd, out / "build.log", args.build_minutes * 60, build_env)


def summary_markdown(report: dict) -> str:
    env, lines = report["environment"], ["# gpu_check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()] + ["", "## Tests", ""]
    tests = report.get("tests", {})
    lines.append(f"{tests.get('summary')} ({tests.get('seconds')} s, timed out: {tests.get('timed_out')})")
    lines += [f"- FAILED {t}" for t in tests.get("failed", [])]
    lines += ["", "## Speed (ms; forward / forward+backward; extra peak MiB fwd+bwd)", ""]
    lines += ["| case | implementation | fwd ms | fwd+bwd ms | peak MiB |", "|---|---|---|---|---|"]
    for row in report.get("bench", []):
        measured = row.get("report", {})
        results = measured.get("results", [])
        results += [{"name": name, "fwd_bwd_ms": ms} for name, ms in measured.get("ms", {}).items()]  # ssd's form
        if not results:
            status = row.get("skipped") or f"exit {row.get('returncode')}, timed out {row.get('timed_out')}"
            lines.append(f"| {row['case']} | ({status}) | | | |")
        for r in results:
            peak = r.get("fwd_bwd_peak_bytes")
            peak = f"{peak / 2**20:.1f}" if isinstance(peak, (int, float)) else "?"
            fwd = f"{r['forward_ms']:.3f}" if "forward_ms" in r else "-"
            times = f"{fwd} | {r.get('fwd_bwd_ms', 0):.3f}"
            lines.append(f"| {row['case']} | {r.get('name')} | {times} | {peak} |")
    lines += [
        "",
        "## Training",
        "",
        "| run | exit | s | first loss | last loss | tokens/s | val |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report.get("train", []):
        loss, tps = row.get("train/loss", {}), row.get("train/tokens_per_s", {})
        lines.append(
            f"| {row['run']} | {row.get('returncode', row.get('skipped'))} | {row.get('seconds')} | "
            f"{loss.get('first')} | {loss.get('last')} | {tps.get('last')} | {row.get('final')} |"
        )
    lines += ["", "## mamba-ssm build", "", f"{report.get('peer_build')}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for the report files (created)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    parser.add_argument("--steps", default="tests,bench,train,build", help="comma-separated subset of the steps")
    parser.add_argument("--test-minutes", type=float, default=8)
    parser.add_argument("--bench-minutes", type=float, default=5)
    parser.add_argument("--train-minutes", type=float, default=4)
    parser.add_argument("--build-minutes", type=float, default=8)
    parser.add_argument(
        "--test-workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="pytest-xdist workers for the tests on a GPU, where xdist is installed",
    )
    args = parser.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    args.dry_run = args.dry_run or device == "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    steps = set(args.steps.split(","))
    report = {"environment": environment(device), "dry_run": args.dry_run}
    start = time.perf_counter()
    if "build" in steps:  # first: a built peer is then timed by the speed step
        report["peer_build"] = step_peer_build(args, args.out, env)
    if "tests" in steps:
        report["tests"] = step_tests(args, args.out, env)
    if "bench" in steps:
        report["bench"] = step_bench(args, args.out, env, device)
    if "train" in steps:
        report["train"] = step_train(args, args.out, env, device)
    report["seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "summary.md").write_text(summary_markdown(report))
    print((args.out / "summary.md").read_text())
    failed = report.get("tests", {}).get("failed") or any(
        row.get("returncode") not in (0, None) for row in report.get("bench", []) + report.get("train", [])
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
