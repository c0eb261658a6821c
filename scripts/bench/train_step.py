"""--op train-step: one whole training step of a language model: forward, cross-entropy over
every position, backward (no optimizer update), on random byte tokens (batch ``--batch``, default
8; ``--length``, default 512; ``--d-model`` 256, ``--layers`` 4, vocabulary 256, N 16, expand 2,
conv width 4). Implementations, all on the same weights: ssm's ``MambaLM`` (eager, its ``auto``
backend: Triton's on CUDA), transformers' ``MambaForCausalLM`` under ``torch.compile`` (it takes
its associative-scan path there) and mambapy's Mamba stack (parallel scan), each when importable;
the first step (compiling, for transformers) is timed separately and the losses of that step are
compared (exit status 1 if they differ). ``--mixers Mamba1,Mamba2,Mamba3`` adds ssm's model with
the other mixers (N 16, head dim ``--headdim``; fresh weights, so their losses are not compared):
the picture of step time per mixer. ``--mmap-threshold BYTES`` also times ssm's step in a child
process run with ``MALLOC_MMAP_THRESHOLD_=BYTES``, where glibc returns every larger freed block
to the system, so that a path which allocates large temporaries per call pays page faults for
them again."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import peers, report
from .common import SCRIPT, comma_list, config_of, describe_device

SSM_ROW = "ssm MambaLM (eager)"  # Mamba-1, on the peers' weights
MIXERS = ("Mamba1", "Mamba2", "Mamba3")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op train-step (also --batch, --length, --d-model, --layers)")
    group.add_argument(
        "--peers",
        type=comma_list,
        default=["transformers", "mambapy"],
        help="peers to run when importable (transformers, mambapy)",
    )
    group.add_argument(
        "--mixers",
        type=comma_list,
        default=["Mamba1"],
        help="ssm's model with each of these mixers (Mamba1, Mamba2, Mamba3); Mamba1 is the peers' model",
    )
    group.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="also time ssm's step in a child process under MALLOC_MMAP_THRESHOLD_=BYTES",
    )
    group.add_argument("--only-ssm", action="store_true", help=argparse.SUPPRESS)  # the child's mode


def check(args, parser) -> None:
    args.d_model = args.d_model or 256
    if min(args.batch, args.length, args.d_model, args.layers, args.repeats) < 1 or args.warmup < 0:
        parser.error("--batch, --length, --d-model, --layers and --repeats must be positive")
    unknown = set(args.peers) - {"transformers", "mambapy"}
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}: choose from transformers, mambapy")
    unknown = set(args.mixers) - set(MIXERS)
    if unknown or not args.mixers:
        parser.error(f"unknown mixers {sorted(unknown)}: choose from {', '.join(MIXERS)}")
    if args.no_peer:
        args.peers = []


def time_train_steps(step: Callable[[], float], warmup: int, repeats: int) -> tuple[float, float, list[float]]:
    """(first step's loss, first step's seconds, the later steps' seconds)."""
    start = time.perf_counter()
    loss = step()
    first = time.perf_counter() - start
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return loss, first, times


def child_command(args) -> list[str]:
    """scripts/benchmark.py timing ssm's step alone, at this run's sizes."""
    command = [sys.executable, str(SCRIPT), "--op", "train-step", "--only-ssm", "--device", args.device]
    for flag in ("batch", "length", "d_model", "layers", "warmup", "repeats", "seed"):
        command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return command


def run(args) -> tuple[int, dict | None]:
    """A whole language model's training step: ssm against transformers compiled and mambapy."""
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (args.batch, args.length + 1), generator=g).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def make_step(model, logits_of):
        def step() -> float:
            model.zero_grad(set_to_none=True)
            logits = logits_of(model, inputs)
            loss = F.cross_entropy(logits[..., :256].reshape(-1, 256).float(), targets.reshape(-1))
            loss.backward()
            return loss.item()

        return step

    # transformers' fresh weights are everyone's weights (when it is importable)
    hf = peers.transformers_mamba(args, device) if args.peers and not args.only_ssm else None
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()} if hf is not None else None
    model = peers.ssm_lm(args, hf, device)
    params = sum(p.numel() for p in model.parameters())
    rows: dict[str, tuple[float, float, list[float]]] = {}
    compared = {SSM_ROW}  # rows on the same weights, whose first-step losses must agree
    missing = []
    print("measuring ssm ...", file=sys.stderr, flush=True)
    rows[SSM_ROW] = time_train_steps(make_step(model, lambda m, x: m(x)), args.warmup, args.repeats)
    if args.only_ssm:
        print(json.dumps({"times": rows[SSM_ROW][2]}))
        return 0, None
    for mixer in args.mixers:
        if mixer == "Mamba1":
            continue
        print(f"measuring ssm with {mixer} mixers ...", file=sys.stderr, flush=True)
        other = peers.ssm_lm(args, None, device, ssm_cfg={"layer": mixer, "d_state": 16, "headdim": args.headdim})
        step = make_step(other, lambda m, x: m(x))
        rows[f"ssm MambaLM {mixer} (eager)"] = time_train_steps(step, args.warmup, args.repeats)
    if args.mmap_threshold is not None:
        print(f"measuring ssm under MALLOC_MMAP_THRESHOLD_={args.mmap_threshold} ...", file=sys.stderr, flush=True)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
        result = subprocess.run(child_command(args), env=env, capture_output=True, text=True, check=True)
        times = json.loads(result.stdout.strip().splitlines()[-1])["times"]
        rows[f"ssm MambaLM, MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"] = (math.nan, math.nan, times)
    if "transformers" in args.peers:
        if hf is None:
            missing.append("transformers (not importable)")
        else:
            print("measuring transformers (compiling first) ...", file=sys.stderr, flush=True)
            name = "transformers MambaForCausalLM, torch.compile"
            compiled = torch.compile(hf)
            rows[name] = time_train_steps(make_step(compiled, lambda m, x: m(x).logits), args.warmup, args.repeats)
            compared.add(name)
    if "mambapy" in args.peers:
        peer = peers.mambapy_lm(args, hf_state, device) if hf_state is not None else None
        if peer is None:
            missing.append("mambapy (not importable, or needs transformers' weights)")
        else:
            print("measuring mambapy ...", file=sys.stderr, flush=True)
            rows["mambapy LM (pscan)"] = time_train_steps(make_step(peer, lambda m, x: m(x)), args.warmup, args.repeats)
            compared.add("mambapy LM (pscan)")

    print(
        f"training step (forward, cross-entropy, backward) of a Mamba LM: d_model {args.d_model}, "
        f"{args.layers} layers, vocab 256, N 16, batch {args.batch}, L {args.length} "
        f"({params / 1e6:.2f} M parameters), {describe_device(device)}; median of {args.repeats} steps "
        f"after the first and {args.warmup} more"
    )
    ours = statistics.median(rows[SSM_ROW][2])
    print(f"\n{'':58s} {'first step s':>12s} {'step s':>8s} {'min':>7s} {'max':>7s} {'x ssm':>7s} {'loss':>10s}")
    for name, (loss, first, times) in rows.items():
        median = statistics.median(times)
        print(
            f"{name:58s} {first:12.2f} {median:8.3f} {min(times):7.3f} {max(times):7.3f} "
            f"{median / ours:7.2f} {loss:10.6f}"
        )
    for name in missing:
        print(f"not measured: {name}")
    ok = True
    losses = [loss for name, (loss, _, _) in rows.items() if name in compared and not math.isnan(loss)]
    if len(losses) > 1 and max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"MISMATCH: first-step losses differ: {losses}", file=sys.stderr)
        ok = False
    result = {
        "config": config_of(args),
        "rows": {n: {"loss": loss, "first_s": fs, "step_s": t} for n, (loss, fs, t) in rows.items()},
        "not_measured": missing,
    }
    return (0 if ok else 1), result


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, rows = result["config"], result["rows"]
    ours = statistics.median(rows[SSM_ROW]["step_s"])
    table = []
    for name, row in rows.items():
        median = statistics.median(row["step_s"])
        first = "-" if math.isnan(row["first_s"]) else f"{row['first_s']:.2f}"
        loss = "-" if math.isnan(row["loss"]) else f"{row['loss']:.6f}"
        table.append([name, first, f"{median:.3f}", f"{median / ours:.2f}", loss])
    body = report.table(["implementation", "first step s", "step s", "x ssm's time", "first-step loss"], table)
    body += (
        f"\n\nForward, cross-entropy over every position and backward (no optimizer), on random bytes; median "
        f"of {c['repeats']} steps after the first and {c['warmup']} more. ssm's Mamba-1 model and the peers hold "
        "the same weights (their first-step losses are checked to agree)."
    )
    if result["not_measured"]:
        body += " Not measured: " + "; ".join(result["not_measured"]) + "."
    title = (
        f"training step: Mamba LM d_model {c['d_model']}, {c['layers']} layers, batch {c['batch']}, "
        f"L {c['length']}, {c['device']}"
    )
    return "train-step", title, body


def plot(result: dict, path: str) -> None:
    report.save(figure(result), path)


def figure(result: dict):
    """Median step time of each row, as horizontal bars (ssm's mixers first, then the peers)."""
    plt = report.pyplot()
    names = list(result["rows"])
    seconds = [statistics.median(result["rows"][n]["step_s"]) for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    colors = ["tab:blue" if n.startswith("ssm") else "tab:gray" for n in names]
    ax.barh(names[::-1], seconds[::-1], color=colors[::-1])
    for y, s in enumerate(seconds[::-1]):
        ax.text(s, y, f" {s:.3f} s", va="center")
    ax.set_xlim(0, 1.25 * max(seconds))
    ax.set_xlabel("seconds per training step (median)")
    c = result["config"]
    ax.set_title(f"training step, d_model {c['d_model']}, {c['layers']} layers, batch {c['batch']}, L {c['length']}")
    return fig
