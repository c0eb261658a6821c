"""--op context-parallel: what context parallelism (ssm.distributed, ``cp_group=``) buys and
costs on this machine. For each world size W of --worlds and each length L of --lengths, W
processes (gloo, one torch thread each) run one training step of a MambaLM (--mixer; --d-model,
--layers, --batch) over a sequence of L tokens, each rank over its slice of L / W; W = 1 is one
process without a group. Per rank: the peak resident memory of the step above what the process
held before its first step, with the model built and a step over 8 tokens run (Linux VmHWM,
reset then: the activations, the gradients, the scan's buffers and what the buffer pool keeps
of them), the median wall time of the step (--repeats after --warmup), and what it sent per
layer. The memory is real whatever the load; the times of W processes on fewer cores than W
are not a speed-up measurement, only what the step costs here (printed with the core count).

Sent per layer and rank, by the design in ssm.distributed (``sent_per_layer`` has the sizes):
every rank all-gathers its slice's summary (the final state from zero and the log-decay), and
takes the conv's d_conv − 1 positions from its left neighbour (Mamba-3: one position's key and
input). Its backward sends as much back. The numbers count the forward, from the model's shapes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from . import report
from .common import ROOT, MiB, comma_ints, config_of, decode_mixer_config

CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ssm import MambaConfig, MambaLM

settings = json.loads(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

group = None
if world > 1:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
torch.manual_seed(settings["seed"])
config = MambaConfig(
    d_model=settings["d_model"], n_layer=settings["layers"], vocab_size=256, ssm_cfg=settings["ssm_cfg"]
)
model = MambaLM(config)
L, batch = settings["length"], settings["batch"]
ids = torch.randint(0, 256, (batch, L + 1), generator=torch.Generator().manual_seed(1))
piece = L // world
inputs = ids[:, rank * piece : (rank + 1) * piece]
labels = ids[:, rank * piece + 1 : (rank + 1) * piece + 1]

def step(x=inputs, y=labels):
    logits = model(x, cp_group=group) if group is not None else model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    model.zero_grad(set_to_none=True)

step(inputs[:, :8], labels[:, :8])  # 8 tokens a rank: what loads once (the C library, torch._dynamo)
before = status("VmRSS")  # torch, ssm, the model, its inputs and what the first call loaded
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
times = []
for k in range(settings["warmup"] + settings["repeats"]):
    if group is not None:
        dist.barrier(group)
    start = time.perf_counter()
    step()
    if group is not None:
        dist.barrier(group)
    if k >= settings["warmup"]:
        times.append(time.perf_counter() - start)
print(json.dumps({"rank": rank, "before": before, "step_peak": status("VmHWM") - before,
                  "ms": 1000 * statistics.median(times)}))
if group is not None:
    # the ranks tear down together: once in CI a rank aborted in gloo's teardown after printing
    # its result ("terminate called without an active exception", exit -6)
    dist.barrier(group)
    dist.destroy_process_group()
"""


def add_arguments(parser) -> None:
    group = parser.add_argument_group(
        "--op context-parallel (also --mixer, --lengths, --d-model, --layers, --batch, --repeats, --warmup)"
    )
    group.add_argument("--worlds", type=comma_ints, default=[1, 2, 4], help="processes sharing each sequence")


def check(args, parser) -> None:
    args.d_model = args.d_model or 256
    args.lengths = args.lengths or [2**12, 2**14, 2**16]
    if sys.platform != "linux":
        parser.error("--op context-parallel reads /proc/self/status: Linux only")
    if args.device != "cpu":
        parser.error("--op context-parallel runs gloo processes on the CPU; run it with --device cpu")
    if min(args.worlds) < 1 or any(L % w for L in args.lengths for w in args.worlds):
        parser.error(f"--worlds must be positive and divide every length of --lengths {args.lengths}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sent_per_layer(args, ssm_cfg: dict, world: int) -> dict:
    """Bytes one rank sends per layer in the forward (float32), from ssm.distributed's
    exchanges: its summary all-gathered to the W − 1 others (a ring all-gather sends W − 1
    pieces of that size), and its halo to its right. The summary is the slice's final state from
    zero and its log-decay per row, and one flag (``entering_state``): Mamba-1 D·N + D floats a
    row (its log-decay is Σ_t Δ_t per channel, times A after the exchange), Mamba-2 H·P·N + H;
    Mamba-3 adds the phase's increment, H·M a row, and its flag. The halo: the conv's
    d_conv − 1 = 3 positions of its channels (Mamba-1 x, Mamba-2 x, B and C); Mamba-3's one
    position, its rotated key and input (H·N + H·P)."""
    if world == 1:
        return {"summary": 0, "halo": 0}
    d_inner, N, b = 2 * args.d_model, ssm_cfg.get("d_state", 16), args.batch
    layer = ssm_cfg.get("layer", "Mamba1")
    if layer == "Mamba1":
        summary, halo = b * (d_inner * N + d_inner) + 1, b * 3 * d_inner
    else:
        P = ssm_cfg["headdim"]
        H = d_inner // P
        summary = b * (H * P * N + H) + 1
        if layer == "Mamba2":
            halo = b * 3 * (d_inner + 2 * N)
        else:
            summary += b * H * (N // 4) + 1  # the phase of M = N/4 rotary pairs (rope_fraction 0.5)
            halo = b * (H * N + H * P)
    return {"summary": 4 * summary * (world - 1), "halo": 4 * halo}


def run(args) -> tuple[int, dict | None]:
    ssm_cfg = decode_mixer_config(args.mixer, args.d_model)
    print(
        f"context parallelism: one training step of MambaLM ({args.mixer}) d_model {args.d_model}, "
        f"{args.layers} layers, batch {args.batch}, each of W gloo processes (1 thread) over L / W tokens; "
        f"{os.cpu_count()} cores here"
    )
    print(f"{'L':>8} {'W':>3} {'step peak MiB/rank':>19} {'before MiB':>11} {'ms/step':>9} {'sent KiB/layer':>15}")
    rows = []
    for L in args.lengths:
        for world in args.worlds:
            settings = dict(
                d_model=args.d_model, layers=args.layers, ssm_cfg=ssm_cfg, length=L, batch=args.batch,
                seed=args.seed, warmup=args.warmup, repeats=args.repeats,
            )  # fmt: skip
            env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            env.update(OMP_NUM_THREADS="1")
            children = [
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(ROOT), json.dumps(settings)],
                    env=dict(env, RANK=str(rank)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(world)
            ]
            results = []
            for child in children:
                out, err = child.communicate()
                if child.returncode != 0:
                    print(out[-2000:] + err[-3000:])
                    print(f"error: a rank of W = {world}, L = {L} failed (exit {child.returncode})")
                    for other in children:
                        other.kill()
                    return 1, None
                results.append(json.loads(out.strip().splitlines()[-1]))
            sent = sent_per_layer(args, ssm_cfg, world)
            row = {
                "length": L,
                "world": world,
                "step_peak_bytes": max(r["step_peak"] for r in results),
                "before_bytes": max(r["before"] for r in results),
                "ms": max(r["ms"] for r in results),
                "sent_bytes_per_layer": sent,
            }
            rows.append(row)
            print(
                f"{L:8d} {world:3d} {row['step_peak_bytes'] / MiB:19.0f} {row['before_bytes'] / MiB:11.0f} "
                f"{row['ms']:9.0f} {sum(sent.values()) / 1024:15.1f}",
                flush=True,
            )
    return 0, {"config": config_of(args), "cores": os.cpu_count(), "rows": rows}


def markdown(result: dict, args) -> tuple[str, str, str]:
    c = result["config"]
    base = {r["length"]: r for r in result["rows"] if r["world"] == 1}
    rows = []
    for r in result["rows"]:
        one = base.get(r["length"])
        share = f"{r['step_peak_bytes'] / one['step_peak_bytes']:.2f}" if one else "-"
        rows.append(
            [
                str(r["length"]),
                str(r["world"]),
                f"{r['step_peak_bytes'] / MiB:.0f}",
                share,
                f"{r['before_bytes'] / MiB:.0f}",
                f"{r['ms']:.0f}",
                f"{r['sent_bytes_per_layer']['summary'] / 1024:.1f} + {r['sent_bytes_per_layer']['halo'] / 1024:.1f}",
            ]
        )
    body = report.table(
        ["L", "W", "step peak MiB per rank", "of W = 1", "held before MiB", "ms per step", "sent KiB per layer"],
        rows,
    )
    body += (
        f"\n\nMambaLM ({c['mixer']}) d_model {c['d_model']}, {c['layers']} layers, batch {c['batch']}: one training "
        "step (forward, cross-entropy, backward) per rank over its L / W tokens, W gloo processes of one thread "
        f"on {result['cores']} cores. Step peak: the largest rank's VmHWM over its steps above its VmRSS "
        "before the first (model built, one 8-token step run). Sent: summary all-gather (to W − 1 ranks) "
        "+ halo, float32, forward only (the backward sends as much). Times with W above the core count "
        "share cores: not a speed-up."
    )
    return "context-parallel", f"context parallelism: memory per rank against L ({c['mixer']})", body


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for world in sorted({r["world"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["world"] == world]
        peaks = [r["step_peak_bytes"] / MiB for r in rows]
        ax.plot([r["length"] for r in rows], peaks, marker="o", label=f"W = {world}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length L (whole sequence)")
    ax.set_ylabel("training-step peak per rank (MiB)")
    ax.set_title(f"context parallelism: memory per rank ({result['config']['mixer']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
