"""--op ssd: ``ssm.scan.ssd`` (Mamba-2's recurrence) on each backend of the device but ``ref``,
forward+backward at one shape: x (batch, L, dim / headdim heads, headdim), one group of B and C
(N = --state), D, z, dt_bias and softplus; every backend's gradients checked against the first's
(a difference beyond float32's tolerance: exit status 1). "chunked" runs once per block length
of --chunk-sizes (its row "chunked/T"), and "auto" is what the public default picks."""

from __future__ import annotations

import torch

from ssm.scan import backends, ssd

from . import report
from .common import TOLERANCE, comma_ints, config_of, describe_device, median_ms, relative_difference


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op ssd (also --batch, --length, --dim, --state, --headdim)")
    group.add_argument(
        "--chunk-sizes",
        type=comma_ints,
        default=[64, 256],
        help="block lengths of the chunked rows, comma-separated (default 64,256)",
    )


def check(args, parser) -> None:
    if min(args.batch, args.dim, args.state, args.length, args.headdim, args.repeats) < 1 or args.dim % args.headdim:
        parser.error("--batch, --dim, --state, --length, --headdim, --repeats must be positive, --headdim divide --dim")
    if not args.chunk_sizes or min(args.chunk_sizes) < 1:
        parser.error(f"--chunk-sizes must be positive integers separated by commas, got {args.chunk_sizes!r}")


def run(args) -> tuple[int, dict | None]:
    device = torch.device(args.device)
    heads = args.dim // args.headdim
    g = torch.Generator().manual_seed(args.seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device).requires_grad_()

    b, L = args.batch, args.length
    inputs = (
        rand(b, L, heads, args.headdim),
        rand(b, L, heads, scale=0.5),
        (-torch.rand(heads, generator=g) - 0.5).to(device).requires_grad_(),
        rand(b, L, 1, args.state),
        rand(b, L, 1, args.state),
        rand(heads),
        rand(b, L, heads, args.headdim),
        rand(heads),
    )
    runs = {"auto": ("auto", max(args.chunk_sizes))}  # auto is given the largest chunk asked for
    for backend in backends("ssd", device):
        if backend == "chunked":
            runs.update({f"chunked/{c}": ("chunked", c) for c in args.chunk_sizes})
        elif backend != "ref":
            runs[backend] = (backend, max(args.chunk_sizes))
    names = list(runs)
    ms, grads = {}, {}
    for name in names:

        def step(name=name):
            x, dt, A, B, C, D, z, bias = inputs
            backend, chunk = runs[name]
            out = ssd(x, dt, A, B, C, D, z, dt_bias=bias, dt_softplus=True, chunk_size=chunk, backend=backend)
            return torch.autograd.grad(out.sum(), inputs)

        grads[name] = step()
        ms[name] = median_ms(step, device, args.warmup, args.repeats)
    print(f"ssd fwd+bwd: batch {b}, L {L}, H {heads}, P {args.headdim}, N {args.state}; {describe_device(device)}")
    for name in names:
        diff = max(relative_difference(a, r) for a, r in zip(grads[name], grads[names[0]]))
        print(
            f"  {name:10s} {ms[name]:9.1f} ms   {ms[name] / ms[names[0]]:5.2f}x {names[0]}   "
            f"grads vs {names[0]}: {diff:.1e}"
        )
        if diff > TOLERANCE[torch.float32]:
            print(f"error: {name}'s gradients differ from {names[0]}'s beyond {TOLERANCE[torch.float32]:.0e}")
            return 1, None
    return 0, {"config": config_of(args), "ms": ms}


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, ms = result["config"], result["ms"]
    first = next(iter(ms))
    rows = [[name, f"{t:.1f}", f"{t / ms[first]:.2f}"] for name, t in ms.items()]
    title = (
        f"ssd: batch {c['batch']}, L {c['length']}, {c['dim'] // c['headdim']} heads of P {c['headdim']}, "
        f"N {c['state']}, float32, {c['device']}"
    )
    body = report.table(["backend", "fwd+bwd ms", f"x {first}'s time"], rows)
    body += f"\n\nMedian of {c['repeats']} after {c['warmup']} warm-up; gradients checked against {first}'s."
    return "ssd", title, body
