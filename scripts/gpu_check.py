"""Prove and time every GPU path of ssm, beside mamba-ssm, in one command that fits one device call.

    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR            # on a machine with CUDA
    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR --dry-run  # the same plan, tiny, on the CPU
    PYTHONPATH=. python3 scripts/gpu_check.py --apply DIR [FILE]  # a GPU run's peer rows into docs/

No install step: run from the repository root with the machine's own python3 (torch, Triton,
pytest; pytorch-lightning and pyyaml for the training step). mamba-ssm, the peer, comes from its
source in third_party/ (scripts/peers/fetch_mamba_ssm.sh, carried to the machine). The plan,
each step with a time budget of its own (seconds on a GPU; all of it within --total-minutes, 8),
each failure recorded and the next step run anyway:

0. environment: device, SM count, memory, driver, torch / Triton / CUDA versions, commit;
1. side by side from the start, in the background:
   - build (300): mamba-ssm's ``selective_scan_cuda`` (with --build-conv causal-conv1d's too),
     ``setup.py build_ext --inplace`` for the device's architecture only, niced;
   - warm-up (200): the first calls of each pair of ssd, mamba3, mamba2_layer and train_step
     (benchmark.py --op gpu-peers --compile-only), which compile the two sides' Triton kernels
     into Triton's cache on disk and say how long each side took; a process per case, and for
     the peer's autotuned kernels several (Mamba-3 6, SSD 3), each compiling its share of their
     configurations (--autotune-shard);
   - tests (200): the suite's GPU-relevant files (every Triton kernel against the reference on
     CUDA tensors in float32, bfloat16 and float16, packed sequences, initial states, gradients,
     torch.compile of the layers), with the failures listed per test;
2. peers, the pairs without the build (160), alone on the GPU: scripts/benchmark.py --op
   gpu-peers (scripts/bench/gpu_peers.py) for ssd, mamba3 and mamba2_layer: ssm and mamba-ssm in
   one process, forward and forward+backward, peak memory, every pair's outputs and gradients
   checked against each other (Mamba-3 at batch 8, L 2048 and at batch 1, L 65536 before the
   other SSD shapes);
3. peers, the pairs that want the build (70), once it is done: selective (selective_scan_fn)
   and train_step (MambaLMHeadModel at mamba-130m's shapes, Mamba-1 and Mamba-2), each said to
   be skipped, with the reason, where its build is missing;
4. speed (40): scripts/benchmark.py for ssm's own backends at mamba-ssm's benchmark shapes,
   as many cases as fit;
5. training (0: measured in earlier windows; --train-minutes gives it time): scripts/train.py in
   bf16-mixed, and the CPU's first steps beside it.

Everything lands in DIR, in at most eight files (a device call returns no more): report.json
(every figure), summary.md (the tables), pytest.log, bench.log, peers.log (the warm-up's too),
build-selective_scan_cuda.log, gpu-peers.json (the measured pairs' rows) and train.log. On a GPU
the run also merges its rows into docs/bench/gpu-peers.json and that section of BENCHMARKS.md in
its own tree; ``--apply DIR`` does it here from what came back (a device's tree does not), and
takes several runs, oldest first, and the --json files of benchmark.py --op gpu-peers too: a row
measured again replaces the old one, the others keep their date and commit. ``--dry-run``
(automatic without CUDA) runs the same plan at tiny sizes on the CPU, the Triton kernels in
Triton's interpreter, with generous budgets, and writes nothing outside DIR; the test suite runs
it so that this script cannot rot between GPU windows.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/bench, the benchmark's package

from bench import gpu_peers, mamba_ssm_peer  # noqa: E402
from bench import report as bench_report  # noqa: E402

# Seconds per step: on a GPU, to fit one device call of about 8 minutes (TOTAL). The build, the
# warm-up and the tests start together and run side by side; the peers are timed after them,
# alone. In a dry run, generous (the CPU and Triton's interpreter are slow, the plan is checked,
# not timed). --*-minutes override them; every step is cut to what TOTAL leaves.
GPU_SECONDS = {"build": 300, "warm": 200, "tests": 200, "peers": 160, "peers_built": 70, "bench": 40, "train": 0,
               "total": 480}  # fmt: skip
DRY_SECONDS = {"build": 0, "warm": 900, "tests": 480, "peers": 300, "peers_built": 300, "bench": 300, "train": 240,
               "total": 3600}  # fmt: skip
# A pair's limit on a GPU, its kernels compiled in the warm-up: the SSD pair's first calls took
# 143 s and more, cold, beside the build, and its whole check 14 s with a warm Triton cache
# (2026-11-28); a warm pair still autotunes the peer's kernels (Mamba-3's: 234 configurations).
PAIR_SECONDS = 90
PEER_CASES = {"peers": "ssd,mamba3,mamba2_layer", "peers_built": "selective,train_step"}
# The warm-up: these cases' first calls (--compile-only), side by side, each in as many processes
# as it has shards (--autotune-shard: each compiles its share of the peer's autotuned configs).
# The peer's Triton kernels are autotuned, Mamba-3's forward+backward over 234 configurations and
# SSD's over about 100, and one process compiles them one after another: cold, the SSD pair's
# first calls did not end in 143 s and the Mamba-3 pair's in 90 s (2026-11-28), in a window of
# 480 s. Side by side they compile on the machine's 16 cores into Triton's cache on disk, which
# the timed pairs then read.
# With the tests' 4 workers that is 15 processes on the 16 cores (the build, niced, takes what is left).
WARM_SHARDS = {"mamba3": 6, "ssd": 3, "mamba2_layer": 1, "train_step": 1}
WARM_CASES = tuple(WARM_SHARDS)
# The peer's extensions to build. causal-conv1d's build ran out of its 300 s in both windows that
# tried it (2026-11-27 and 28) and slowed the rest: --build-conv asks for it.
BUILDS = ("selective_scan_cuda",)

# What step 2 runs: on a GPU the whole of each file; in a dry run a few of their cases.
GPU_TESTS = [
    "tests/scan/test_triton.py",
    "tests/scan/test_triton_trapezoidal.py",
    "tests/scan/test_triton_trapezoidal_ssd.py",
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
    # Mamba-3's own heads (P 64, N 128) in bfloat16, and batch 1 at long L: "triton" (a program per
    # row and head) against "triton-ssd" (chunk-parallel) and "chunked", which auto chooses between
    ("trapezoidal bfloat16 L 2048, Mamba-3's heads", ["--op", "trapezoidal", "--batch", "8", "--length", "2048",
                                                      "--headdim", "64", "--state", "128", "--dtype", "bfloat16",
                                                      "--skip", "ref"]),
    ("trapezoidal float32 batch 1 L 65536", ["--op", "trapezoidal", "--batch", "1", "--length", "65536",
                                             "--skip", "ref"]),
    # what each mixer layer keeps for its backward on the GPU's own path (the CPU's --gpu-path
    # reading, checked): no timing, the forward kernels' compiles only
    ("saved bytes a token, bfloat16, mamba-130m's widths", ["--op", "saved", "--dtype", "bfloat16", "--d-model",
                                                            "768", "--state", "128", "--headdim", "64",
                                                            "--length", "2048"]),
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


def start(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Start ``cmd`` from the repository root in the background (its own session), appending its
    output to ``log``; ``finish`` waits for it."""
    f = open(log, "a")
    f.write(f"\n$ {' '.join(cmd)}\n")
    f.flush()
    process = subprocess.Popen(
        cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )  # fmt: skip
    return {"cmd": " ".join(cmd), "process": process, "file": f, "start": time.perf_counter()}


def wait_or_kill(process: subprocess.Popen, deadline: float) -> bool:
    """Wait for ``process`` (started in a session of its own) until ``deadline`` (perf_counter),
    then kill it and everything it started (setup.py, ninja and its nvcc jobs; pytest's workers);
    whether it ran out of time."""
    try:
        process.wait(timeout=max(0.0, deadline - time.perf_counter()))
        return False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return True


def finish(started: dict, deadline: float) -> dict:
    """Wait for a ``start``ed command until ``deadline`` (perf_counter), then kill it and all it
    started; its exit status, seconds, and whether it ran out of time."""
    process = started["process"]
    timed_out = wait_or_kill(process, deadline)
    if timed_out:
        started["file"].write(f"\n[gpu_check] killed after {time.perf_counter() - started['start']:.0f} s\n")
    started["file"].close()
    return {"cmd": started["cmd"], "returncode": None if timed_out else process.returncode,
            "seconds": round(time.perf_counter() - started["start"], 1), "timed_out": timed_out}  # fmt: skip


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root, appending its output to ``log``; its exit status,
    seconds, and whether it ran out of time (then killed)."""
    return finish(start(cmd, log, env), time.perf_counter() + timeout)


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
    """The summary line of the last pytest run in ``log``, its counts and the ids of its failed
    tests. A run killed before its summary (-v) still gives what it got to: its counts so far,
    its failures so far and the tests it was in when killed ("unfinished")."""
    text = log.read_text(errors="replace")
    text = text[text.rfind("\n$ ") + 1 :]  # the last run
    # "15 passed in 54.6s" under -q, "==== 1 failed, 3 passed in 2.00s ====" otherwise
    outcomes = r"\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)"
    summary = re.findall(
        rf"^(?:=+ )?((?:{outcomes}(?:, )?)+ in [\d.]+s(?: \([\d:]+\))?|no tests ran.*?)(?: =+)?$", text, re.M
    )
    # -v: "tests/a.py::t[x] PASSED  [ 1%]", and with xdist "[gw0] [  1%] FAILED tests/a.py::t[x]"
    serial = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text, re.M)
    spread = [(i, o) for o, i in re.findall(r"^\[gw\d+\] \[\s*\d+%\] ([A-Z]+) (\S+::\S+)", text, re.M)]
    verbose = serial + spread
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M))
    failed |= {test for test, outcome in verbose if outcome in ("FAILED", "ERROR")}
    if summary:
        counts = {k: int(n) for n, k in re.findall(r"(\d+) ([a-z]+)", summary[-1])}
    else:
        counts = {}
        for _, outcome in verbose:
            key = outcome.lower().replace("error", "errors")
            counts[key] = counts.get(key, 0) + 1
    result = {"summary": summary[-1] if summary else None, "counts": counts, "failed": sorted(failed)}
    if not summary:  # killed: the test it was in (serial -v prints the id before the outcome)
        result["unfinished"] = re.findall(r"^(\S+::\S+) *$", text, re.M)[-1:]
    return result


def start_tests(args, out: Path, env: dict) -> dict:
    tests = DRY_TESTS if args.dry_run else GPU_TESTS
    # -v: a run killed at its budget still says what passed, what failed and where it was;
    # --durations: a run that ends says where its time went
    cmd = [sys.executable, "-m", "pytest", *tests, "-v", "-rfE", "--durations=25", "-p", "no:cacheprovider"]
    if not args.dry_run and args.test_workers > 1 and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(args.test_workers)]  # Triton's and Inductor's compiles are CPU-bound: spread them
    return start(cmd, out / "pytest.log", env)


def finish_tests(started: dict, out: Path, deadline: float) -> dict:
    return finish(started, deadline) | pytest_outcome(out / "pytest.log")


def start_warm(args, out: Path, env: dict, device: str) -> list[dict]:
    """The warm-up: --compile-only processes, side by side, WARM_SHARDS of each case on a GPU,
    one in a dry run (where the interpreter keeps one configuration of each kernel)."""
    started = []
    for case, shards in WARM_SHARDS.items():
        shards = 1 if args.dry_run else shards
        for i in range(shards):
            name = f"{case}-{i}"
            log, path = out / f"warm-{name}.log", out / f"warm-{name}.json"
            path.unlink(missing_ok=True)
            cmd = [sys.executable, "scripts/benchmark.py", "--op", "gpu-peers", "--cases", case, "--compile-only",
                   "--device", device, "--json", str(path)]  # fmt: skip
            cmd += ["--autotune-shard", f"{i}/{shards}"] if shards > 1 else []
            started.append(start(cmd, log, env) | {"case": case, "shard": f"{i}/{shards}", "log": log, "json": path})
    return started


def finish_warm(started: list[dict], out: Path, deadline: float) -> dict:
    """Wait for the warm-up's processes until ``deadline``; each one's outcome and its rows (each
    side's first-call seconds, or where it stopped), its log appended to peers.log (the files
    that come back from a device are few)."""
    runs, rows = [], []
    for warm in started:
        runs.append({"case": warm["case"], "shard": warm["shard"]} | finish(warm, deadline))
        if warm["json"].exists():
            rows += [row | {"shard": warm["shard"]} for row in json.loads(warm["json"].read_text())["rows"]]
            warm["json"].unlink()
        with open(out / "peers.log", "a") as f:
            f.write(f"\n[warm-up, {warm['case']}, shard {warm['shard']}]" + warm["log"].read_text(errors="replace"))
        warm["log"].unlink()
    return {"runs": runs, "rows": rows}


def with_dry_shape(argv: list[str]) -> list[str]:
    argv = list(argv)
    shape = DRY_SHAPE | ({"--headdim": "4"} if argv[1] in ("ssd", "trapezoidal") else {})
    for flag, value in shape.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv + ["--repeats", "1", "--warmup", "0", "--no-peer"]


def step_bench(args, out: Path, env: dict, device: str, budget: float) -> list[dict]:
    log, rows = out / "bench.log", []
    deadline = time.perf_counter() + budget
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


def step_train(args, out: Path, env: dict, device: str, budget: float) -> list[dict]:
    log, rows = out / "train.log", []
    runs_root = tempfile.TemporaryDirectory(prefix="ssm-gpu-check-")  # the runs' files stay out of DIR
    runs = Path(runs_root.name)
    plan = list(TRAIN_RUNS)
    if args.dry_run:
        plan = [(label, [a for a in argv if not a.startswith(("trainer.max_steps", "trainer.precision"))])
                for label, argv in plan[:1]]  # fmt: skip
    cpu_run = ("default, CPU, first steps", [f"trainer.max_steps={CPU_STEPS}", "trainer.accelerator=cpu"])
    deadline = time.perf_counter() + budget
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


def start_build(args, out: Path, env: dict) -> dict:
    """Start the peer's CUDA builds in the background (see mamba_ssm_peer.start_builds)."""
    problem = mamba_ssm_peer.source_problem()
    if problem:
        return {"skipped": problem}
    if args.dry_run:
        return {"skipped": "no CUDA (dry run): nothing to build for"}
    import torch

    extensions = BUILDS + (("causal_conv1d_cuda",) if args.build_conv else ())
    started = mamba_ssm_peer.start_builds(out, env, torch.cuda.get_device_capability(0), extensions)
    return {"extensions": started, "start": time.perf_counter()}


def wait_build(build: dict, deadline: float) -> dict:
    """Wait for the builds until ``deadline`` (perf_counter), then stop what still runs; each
    extension's exit status, seconds, whether it is built, and its log's tail if it failed."""
    if "extensions" not in build:
        return build
    outcome = {}
    for extension, started in build["extensions"].items():
        if "process" not in started:
            outcome[extension] = started | {"built": mamba_ssm_peer.built(extension)}
            continue
        process = started["process"]
        timed_out = wait_or_kill(process, deadline)
        result = {"returncode": None if timed_out else process.returncode, "timed_out": timed_out,
                  "seconds": round(time.perf_counter() - build["start"], 1), "log": started["log"].name,
                  "built": mamba_ssm_peer.built(extension)}  # fmt: skip
        if not result["built"]:
            result["log_tail"] = started["log"].read_text(errors="replace").splitlines()[-15:]
        outcome[extension] = result
    return {"extensions": outcome}


def step_peers(args, out: Path, env: dict, device: str, phase: str, budget: float) -> dict:
    """One process of scripts/benchmark.py --op gpu-peers for the cases of ``phase``; its rows
    (those written before a kill at the budget included)."""
    path = out / f"peers-{phase}.json"
    path.unlink(missing_ok=True)
    repeats = ["--repeats", "1", "--warmup", "0"] if args.dry_run else ["--repeats", "7", "--warmup", "2"]
    cmd = [sys.executable, "scripts/benchmark.py", "--op", "gpu-peers", "--cases", PEER_CASES[phase],
           "--device", device, "--budget", f"{0.75 * budget:.0f}", *repeats, "--json", str(path)]  # fmt: skip
    if not args.dry_run:
        cmd += ["--pair-seconds", str(PAIR_SECONDS)]  # one pair that hangs leaves the others their time
    result = run(cmd, out / "peers.log", budget, env)
    if path.exists():
        measured = json.loads(path.read_text())
        result |= {"rows": measured["rows"], "peer": measured.get("peer")}
        path.unlink()
    return result


def peer_rows(result: dict) -> list[dict]:
    return [row for phase in ("peers", "peers_built") for row in result.get(phase, {}).get("rows", [])]


def row_key(row: dict) -> tuple:
    return row["op"], row.get("shape"), row.get("dtype"), row.get("pass")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each pair and pass that ``new`` measured again replaced by the new row, in
    old's order, and new's other rows after them: a window that measures a few pairs keeps the
    rows of the windows before it, each with its own date and commit."""
    fresh = {row_key(row): row for row in new}
    merged = [fresh.pop(row_key(row), row) for row in old]
    return merged + [row for row in new if row_key(row) in fresh]


def peers_section(rows: list[dict], key: str = "gpu-peers-cuda") -> str:
    """The pairs' BENCHMARKS.md section: every row with the date and commit it was measured at,
    naming the devices."""
    devices = ", ".join(sorted({row["device"] for row in rows}))
    cells = [
        cells + [f"{row['date'][:10]}, `{row['commit']}`" if "date" in row else "-"]
        for row, cells in zip(rows, gpu_peers.table_rows(rows))
    ]
    versions = ", ".join(sorted({row.get("peer_version") or "?" for row in rows if "ssm" in row}))
    return "\n".join([
        f"<!-- bench:{key} -->",
        f"### ssm beside mamba-ssm on {devices}",
        "",
        bench_report.table(gpu_peers.HEADERS + ["measured"], cells),
        "",
        f"mamba-ssm {versions} from its source (scripts/peers/fetch_mamba_ssm.sh; its builds as each row's note "
        "says). Forward and forward+backward, median of 7 after 2 warm-ups, the two sides taking turns, each "
        "side's kernels compiled before (the warm-up); \"ssm ahead by\": the peer's time over ssm's (tokens/s: "
        "ssm's over the peer's); peak: MiB allocated above the inputs; agree: the peer's outputs and gradients "
        "against ssm's within the dtype's tolerance (float32 1e-4, bfloat16 5e-2; kernels: max|difference| / "
        "max|value|, layers and models: the norms' ratio; the largest named). A window that measures a pair again "
        "replaces its rows; the others keep their date and commit. By",
        "",
        "```",
        "bash scripts/peers/fetch_mamba_ssm.sh                        # here; carry third_party to the GPU",
        "PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT/gpu-check  # on the GPU machine",
        "PYTHONPATH=. python3 scripts/gpu_check.py --apply DIR           # here, DIR: what came back",
        "```",
        f"<!-- /bench:{key} -->",
    ])  # fmt: skip


def run_peer(result: dict) -> dict:
    """What a gpu_check report says of the peer it loaded (version, builds), or {}."""
    return next((result[p]["peer"] for p in ("peers_built", "peers") if (result.get(p) or {}).get("peer")), {})


def write_peers(result: dict, out: Path) -> None:
    """The measured pairs' rows into DIR/gpu-peers.json (their table is in summary.md); on a GPU
    run also merged into docs/bench/gpu-peers.json and BENCHMARKS.md, as --apply does."""
    measured = [row for row in peer_rows(result) if "ssm" in row and "peer" in row]
    peer = run_peer(result)
    measured = [row | {"peer_version": peer.get("version")} for row in measured]
    (out / "gpu-peers.json").write_text(json.dumps(measured, indent=2) + "\n")
    if not result["dry_run"] and measured:
        apply_peers([out])


def measured_rows(path: Path) -> list[dict]:
    """The rows that measured both sides, from a gpu_check DIR (its gpu-peers.json) or from
    the --json file of ``scripts/benchmark.py --op gpu-peers``."""
    if path.is_dir():
        rows, report = json.loads((path / "gpu-peers.json").read_text()), path / "report.json"
        result = json.loads(report.read_text()) if report.exists() else {}
        peer = run_peer(result)
        return [{"peer_version": peer.get("version")} | row for row in rows]
    result = json.loads(path.read_text())
    version = (result.get("peer") or {}).get("version")
    return [row | {"peer_version": version} for row in result.get("rows", []) if "ssm" in row and "peer" in row]


def apply_peers(paths: list[Path]) -> int:
    """Merge GPU runs' rows (each a gpu_check DIR or a benchmark --json file, in the order
    measured) into docs/bench/gpu-peers.json and write BENCHMARKS.md's section from all of them;
    a dry run's (the CPU's, interpreted) are refused."""
    docs = ROOT / "docs" / "bench" / "gpu-peers.json"
    rows = json.loads(docs.read_text()) if docs.exists() else []
    for path in paths:
        new = measured_rows(path)
        if not new or any(row["device"].startswith("cpu") for row in new):
            print(f"{path}: no GPU run's rows (a dry run's stay out of docs/)")
            return 1
        rows = merge_rows(rows, new)
    docs.write_text(json.dumps(rows, indent=2) + "\n")
    bench_report.write_section(ROOT / "BENCHMARKS.md", "gpu-peers-cuda", peers_section(rows))
    print(f"wrote docs/bench/gpu-peers.json ({len(rows)} rows) and BENCHMARKS.md's gpu-peers-cuda section")
    return 0


def summary_markdown(report: dict) -> str:
    """The report as a reader sees it: a section per step that ran."""
    env, lines = report["environment"], ["# gpu_check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- seconds: {report.get('seconds')} (budgets: {report.get('budgets_s')})"]
    if "tests" in report:
        tests = report["tests"]
        lines += ["", "## Tests", ""]
        lines.append(f"{tests.get('summary')} ({tests.get('seconds')} s, timed out: {tests.get('timed_out')})")
        lines += [f"- FAILED {t}" for t in tests.get("failed", [])]
        lines += [f"- counts so far (killed): {tests['counts']}"] if tests.get("timed_out") else []
        lines += [f"- running when killed: {t}" for t in tests.get("unfinished", [])]
        lines += [f"- skipped: {tests['skipped']}"] if "skipped" in tests else []
    if "bench" in report:
        lines += ["", "## Speed (ms; forward / forward+backward; extra peak MiB fwd+bwd)", ""]
        lines += ["| case | implementation | fwd ms | fwd+bwd ms | peak MiB |", "|---|---|---|---|---|"]
        lines += bench_lines(report["bench"])
    if "train" in report:
        lines += ["", "## Training", ""]
        lines += ["| run | exit | s | first loss | last loss | tokens/s | val |", "|---|---|---|---|---|---|---|"]
        for row in report["train"]:
            loss, tps = row.get("train/loss", {}), row.get("train/tokens_per_s", {})
            lines.append(
                f"| {row['run']} | {row.get('returncode', row.get('skipped'))} | {row.get('seconds')} | "
                f"{loss.get('first')} | {loss.get('last')} | {tps.get('last')} | {row.get('final')} |"
            )
    if any(step in report for step in ("build", "peers", "peers_built")):
        lines += ["", "## ssm beside mamba-ssm", ""] + peer_lines(report)
    return "\n".join(lines + [""])


def bench_lines(bench: list[dict]) -> list[str]:
    lines = []
    for row in bench:
        measured = row.get("report", {})
        results = measured.get("results", [])
        results += [{"name": name, "fwd_bwd_ms": ms} for name, ms in measured.get("ms", {}).items()]  # ssd's form
        for name, kept in measured.get("bytes_per_token", {}).items():  # --op saved: no times
            lines.append(f"| {row['case']} | {name}: {kept:,.0f} bytes a token kept for the backward | - | - | - |")
        if not results and "bytes_per_token" not in measured:
            status = row.get("skipped") or f"exit {row.get('returncode')}, timed out {row.get('timed_out')}"
            lines.append(f"| {row['case']} | ({status}) | | | |")
        for r in results:
            peak = r.get("fwd_bwd_peak_bytes")
            peak = f"{peak / 2**20:.1f}" if isinstance(peak, (int, float)) else "?"
            fwd = f"{r['forward_ms']:.3f}" if "forward_ms" in r else "-"
            times = f"{fwd} | {r.get('fwd_bwd_ms', 0):.3f}"
            lines.append(f"| {row['case']} | {r.get('name')} | {times} | {peak} |")
    return lines


def peer_lines(report: dict) -> list[str]:
    """The builds, the two peer steps, every pair skipped (with why) and the pairs' table."""
    lines, build = [], report.get("build") or {}
    if "skipped" in build:
        lines.append(f"- build: skipped: {build['skipped']}")
    for name, outcome in build.get("extensions", {}).items():
        state = "built" if outcome.get("built") else outcome.get("skipped") or f"exit {outcome.get('returncode')}"
        lines.append(
            f"- build of {name}: {state}, {outcome.get('seconds', '-')} s, timed out: {outcome.get('timed_out')}"
        )
    for run in report.get("warm", {}).get("runs", []):
        status = f"exit {run['returncode']}, {run['seconds']} s, timed out: {run['timed_out']}"
        lines.append(f"- warm-up, {run['case']} (shard {run['shard']}): {status}")
    for row in report.get("warm", {}).get("rows", []):
        what = row["op"] + (f" ({row['shape']}, {row['dtype']})" if row.get("shape") else "")
        first = ", ".join(f"{side} {s} s" for side, s in row.get("first_call_s", {}).items())
        why = row.get("skipped") or row.get("error")
        shard = f" (shard {row['shard']})" if row.get("shard", "0/1") != "0/1" else ""
        lines.append(f"- warm-up, {what}{shard}: first calls {first or '-'}" + (f"; {why}" if why else ""))
    for phase in ("peers", "peers_built"):
        step = report.get(phase)
        if step is not None:
            status = step.get("skipped") or f"exit {step.get('returncode')}, timed out: {step.get('timed_out')}"
            lines.append(f"- {phase} ({PEER_CASES[phase]}): {status}, {step.get('seconds')} s")
    for row in peer_rows(report):
        if "ssm" not in row:
            what = row["op"] + (f" ({row['shape']})" if row.get("shape") else "")
            lines.append(f"- not measured: {what}: {row.get('skipped') or row.get('error')}")
        elif row.get("agree") is not True:  # False, or "unchecked"
            why = row.get("why", row.get("diff"))
            lines.append(f"- {row['op']} ({row['shape']}, {row['pass']}): agree {row['agree']}: {why}")
    if peer_rows(report):
        lines += ["", bench_report.table(gpu_peers.HEADERS, gpu_peers.table_rows(peer_rows(report)))]
    return lines


MINUTES = {  # step -> the option that overrides its budget
    "build": "build_minutes",
    "warm": "warm_minutes",
    "peers": "peer_minutes",
    "tests": "test_minutes",
    "peers_built": "peer_built_minutes",
    "bench": "bench_minutes",
    "train": "train_minutes",
    "total": "total_minutes",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the report files (created)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    parser.add_argument("--steps", default="build,peers,tests,bench,train", help="comma-separated subset of the steps")
    for step, flag in MINUTES.items():
        default = f"{GPU_SECONDS[step]} s on a GPU, {DRY_SECONDS[step]} s in a dry run"
        parser.add_argument("--" + flag.replace("_", "-"), type=float, default=None, help=f"default {default}")
    parser.add_argument(
        "--test-workers",
        type=int,
        default=4,
        help="pytest-xdist workers for the tests on a GPU, where xdist is installed (default 4: the 228 tests "
        "took 55 s serially with a warm cache on 2026-11-27, and reached 81 in 75 s cold on 2026-11-28)",
    )
    parser.add_argument(
        "--build-conv",
        action="store_true",
        help="also build causal-conv1d's extension (the peer's fused conv path), which needs more than 300 s",
    )
    parser.add_argument(
        "--apply",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="merge GPU runs' peer rows (gpu_check DIRs or benchmark --json files, oldest first) into docs/",
    )
    args = parser.parse_args(argv)
    if args.apply:
        return apply_peers(args.apply)
    if args.out is None:
        parser.error("--out is required (or --apply DIR)")

    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    args.dry_run = args.dry_run or device == "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    steps = set(args.steps.split(","))
    seconds = dict(DRY_SECONDS if args.dry_run else GPU_SECONDS)
    seconds |= {step: 60 * getattr(args, flag) for step, flag in MINUTES.items() if getattr(args, flag) is not None}
    start = time.perf_counter()
    deadline = start + seconds["total"] - 10  # 10 s to write the report

    def budget(step: str) -> float:
        return max(0.0, min(seconds[step], deadline - time.perf_counter()))

    report = {"environment": environment(device), "dry_run": args.dry_run, "budgets_s": seconds}
    report["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out_of_time = {"skipped": "out of the window's time", "rows": []}
    # side by side, in the background: the build, the warm-up (the pairs' first calls) and the tests
    build = start_build(args, args.out, env) if "build" in steps else None
    warm = start_warm(args, args.out, env, device) if "peers" in steps else None
    warm_deadline = time.perf_counter() + budget("warm")
    tests = start_tests(args, args.out, env) if "tests" in steps else None
    tests_deadline = time.perf_counter() + budget("tests")
    if warm is not None:
        report["warm"] = finish_warm(warm, args.out, warm_deadline)
    if tests is not None:
        report["tests"] = finish_tests(tests, args.out, tests_deadline)
    if "peers" in steps:  # alone on the GPU from here
        report["peers"] = (
            step_peers(args, args.out, env, device, "peers", budget("peers")) if budget("peers") > 5 else out_of_time
        )
    if build is not None:
        report["build"] = wait_build(build, min(start + seconds["build"], deadline))
    if "peers" in steps:
        ok = budget("peers_built") > 5
        report["peers_built"] = (
            step_peers(args, args.out, env, device, "peers_built", budget("peers_built")) if ok else out_of_time
        )
    if "bench" in steps:
        report["bench"] = step_bench(args, args.out, env, device, budget("bench"))
    if "train" in steps:
        report["train"] = step_train(args, args.out, env, device, budget("train"))
    report["seconds"] = round(time.perf_counter() - start, 1)
    if "peers" in steps:
        write_peers(report, args.out)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "summary.md").write_text(summary_markdown(report))
    print((args.out / "summary.md").read_text())
    failed = report.get("tests", {}).get("failed") or any(
        row.get("returncode") not in (0, None)
        for row in report.get("bench", [])
        + report.get("train", [])
        + [report.get("peers", {}), report.get("peers_built", {})]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
