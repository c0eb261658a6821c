"""--op layer: whole mixer layers, Mamba (Mamba-1), Mamba2 and Mamba3 (SISO, and MIMO of rank
``--mimo-rank``) at one shape: input (``--batch``, ``--length``, ``--d-model``), expand 2, N =
``--state``, head dim ``--headdim`` (one group of B and C), each on its default backend for the
device (Triton's on CUDA), beside transformers' Mamba2Mixer on Mamba2's weights when importable
(checked equal first: exit status 1 if not). Forward and forward + backward (gradients of the
input and every parameter for a fixed upstream gradient), the median of ``--repeats`` after
``--warmup``, the layers taking turns in each round so that a change of machine load falls on
all of them alike; each time also as a ratio to Mamba-2's in the same run."""

from __future__ import annotations

import statistics
import time

import torch

from . import peers, report
from .common import DTYPES, TOLERANCE, alternate, config_of, describe_device, relative_difference, synchronize


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op layer (also --batch, --length, --state, --d-model, --headdim, --dtype)")
    group.add_argument("--mimo-rank", type=int, default=4, help="R of the Mamba3 MIMO row (0: no such row)")


def check(args, parser) -> None:
    args.d_model = args.d_model or 128
    if min(args.batch, args.length, args.state, args.d_model, args.headdim, args.repeats) < 1:
        parser.error("--batch, --length, --state, --d-model, --headdim and --repeats must be positive")
    if args.mimo_rank < 0:
        parser.error(f"--mimo-rank must be >= 0 (0: no MIMO row), got {args.mimo_rank}")
    if (2 * args.d_model) % args.headdim:
        parser.error(f"--headdim {args.headdim} must divide 2·d_model = {2 * args.d_model}")


def run(args) -> tuple[int, dict | None]:
    """Forward and forward + backward of whole mixer layers, as ratios to Mamba-2's."""
    from ssm import Mamba, Mamba2, Mamba3

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    d, N, P = args.d_model, args.state, args.headdim
    kw = dict(device=device, dtype=dtype)
    torch.manual_seed(args.seed)
    layers = {"Mamba2": Mamba2(d, d_state=N, headdim=P, **kw), "Mamba3": Mamba3(d, d_state=N, headdim=P, **kw)}
    if args.mimo_rank:
        mimo = Mamba3(d, d_state=N, headdim=P, is_mimo=True, mimo_rank=args.mimo_rank, **kw)
        layers[f"Mamba3 MIMO R={args.mimo_rank}"] = mimo
    layers["Mamba"] = Mamba(d, d_state=N, **kw)
    x = torch.randn(args.batch, args.length, d, **kw)
    grad = torch.randn(args.batch, args.length, d, **kw)
    peer = None if args.no_peer else peers.transformers_mamba2_mixer(layers["Mamba2"], d, N, P)
    if peer is not None:  # the same weights: it must compute the same function before it is timed
        layers[peers.PEER_MAMBA2] = peer
        with torch.no_grad():
            difference = relative_difference(peer(x), layers["Mamba2"](x))
        print(f"{peers.PEER_MAMBA2} against ssm's Mamba2, same weights and input: relative difference {difference:.1e}")
        if difference > TOLERANCE[dtype]:
            print(f"error: {peers.PEER_MAMBA2} and ssm's Mamba2 differ beyond {TOLERANCE[dtype]:.0e}")
            return 1, None

    def forward(layer):
        with torch.no_grad():
            return layer(x)

    def fwd_bwd(layer):
        xi = x.detach().requires_grad_()
        return torch.autograd.grad(layer(xi), [xi, *layer.parameters()], grad)

    def timed(fn, layer):
        def run() -> float:
            synchronize(device)
            start = time.perf_counter()
            fn(layer)
            synchronize(device)
            return time.perf_counter() - start

        return run

    runners = {
        (name, way): timed(fn, layer)
        for name, layer in layers.items()
        for way, fn in (("fwd", forward), ("fwd+bwd", fwd_bwd))
    }
    samples = alternate(runners, args.warmup, args.repeats)
    ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}
    params = {name: sum(p.numel() for p in layer.parameters()) for name, layer in layers.items()}
    print(
        f"mixer layers, input ({args.batch}, {args.length}, {d}) {args.dtype}, expand 2, N = {N}, P = {P}, "
        f"default backends; {describe_device(device)}; median of {args.repeats} after {args.warmup} warm-up"
    )
    print(
        f"{'layer':18s} {'params':>8s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} "
        f"{'fwd / Mamba2':>13s} {'fwd+bwd / Mamba2':>17s}"
    )
    for name in layers:
        f, fb = ms[name, "fwd"], ms[name, "fwd+bwd"]
        print(
            f"{name:18s} {params[name]:8d} {f:9.2f} {fb:11.2f} {f / ms['Mamba2', 'fwd']:12.2f}x "
            f"{fb / ms['Mamba2', 'fwd+bwd']:16.2f}x"
        )
    result = {
        "config": config_of(args),
        "parameters": params,
        "ms": {f"{name}/{way}": v for (name, way), v in ms.items()},
        "device": describe_device(device),
    }
    return 0, result


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, ms, params = result["config"], result["ms"], result["parameters"]
    rows = []
    for name in params:
        f, fb = ms[f"{name}/fwd"], ms[f"{name}/fwd+bwd"]
        rows.append(
            [
                name,
                str(params[name]),
                f"{f:.2f}",
                f"{fb:.2f}",
                f"{f / ms['Mamba2/fwd']:.2f}",
                f"{fb / ms['Mamba2/fwd+bwd']:.2f}",
            ]
        )
    headers = ["layer", "parameters", "fwd ms", "fwd+bwd ms", "fwd / Mamba2", "fwd+bwd / Mamba2"]
    body = report.table(headers, rows)
    body += (
        f"\n\nMedian of {c['repeats']} after {c['warmup']} warm-up, the layers taking turns; each on its default "
        "backend; fwd+bwd: gradients of the input and every parameter. The transformers row holds ssm Mamba2's "
        "weights and is checked to compute the same function first."
    )
    title = (
        f"mixer layers: input ({c['batch']}, {c['length']}, {c['d_model']}) {c['dtype']}, N {c['state']}, "
        f"P {c['headdim']}, {c['device']}"
    )
    return "layer", title, body
