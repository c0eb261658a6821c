"""--op saved: what each mixer layer keeps for its backward, in bytes per token: Mamba2, Mamba3
and Mamba3 MIMO of rank ``--mimo-rank`` (0: no such row) at one shape (``--d-model``, expand 2,
N = ``--state``, head dim ``--headdim``) and Mamba (Mamba-1, its own N 16), a forward of
(``--batch``, L) with float32 weights under autocast to ``--dtype``, as mixed-precision training
runs it. Counted by autograd's saved-tensor hooks, each
storage once, at L = ``--length`` and 2·L: the difference over batch·L is what grows with the
tokens (the weights and their casts do not). Memory a GPU's peak adds on top (workspaces, the
gradients in flight) is not in it: `--op gpu-peers` measures the peak.

On a CPU the layers run their CPU paths (the C kernels). ``--gpu-path`` runs there what a GPU
runs: the tensor paths of the causal conv and the norm, and the Triton kernels (selective scan,
SSD, Mamba-3's ``triton-ssd``; MIMO's "chunked", which a GPU takes while batch × heads is
under its multiprocessor count) in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set
before the command starts. Slow: keep the shape small, and ``--skip Mamba`` (its selective scan
is the slowest to interpret) at mamba-130m's widths."""

from __future__ import annotations

import os

import torch

from . import report
from .common import DTYPES, config_of, describe_device

# the backend each mixer takes on a GPU (what backend="auto" picks there), for --gpu-path
GPU_BACKENDS = {"Mamba": "triton", "Mamba2": "triton", "Mamba3": "triton-ssd"}
MIMO_GPU_BACKEND = "chunked"  # at the small batches measured here (ssm.scan.trapezoidal.auto_on_cuda)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op saved (also --batch, --length, --state, --d-model, --headdim, --dtype)")
    group.add_argument(
        "--gpu-path", action="store_true", help="on a CPU, a GPU's code: tensor conv and norm, Triton interpreted"
    )


def check(args, parser) -> None:
    args.d_model = args.d_model or 768
    if args.gpu_path and args.device != "cpu":
        parser.error("--gpu-path is for a CPU (a GPU runs its own path)")
    if args.gpu_path and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "--gpu-path runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 before the command"
        )
    unknown = set(args.skip) - set(GPU_BACKENDS)
    if unknown:
        parser.error(f"--skip takes layers here, of {', '.join(GPU_BACKENDS)}; got {', '.join(sorted(unknown))}")
    if min(args.batch, args.length, args.state, args.d_model, args.headdim) < 1 or (2 * args.d_model) % args.headdim:
        parser.error(
            "--batch, --length, --state, --d-model and --headdim must be positive, --headdim dividing 2·d_model"
        )


def kept_bytes(layer, x, dtype) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of layer(x) under autocast."""
    from ssm.memory import saved_bytes

    def forward():
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            return layer(x)

    return saved_bytes(forward)[0]


def run(args) -> tuple[int, dict | None]:
    from ssm import Mamba, Mamba2, Mamba3
    from ssm.ops import conv, norm

    tables = (conv.BACKENDS, norm.BACKENDS)
    orders = [table.auto for table in tables]
    if args.gpu_path:  # the tensor paths a GPU takes, in place of the C kernels (for this call only)
        for table in tables:
            table.auto = {"*": ("torch",)}
    try:
        return measure(args, Mamba, Mamba2, Mamba3)
    finally:
        for table, order in zip(tables, orders):
            table.auto = order


def measure(args, Mamba, Mamba2, Mamba3) -> tuple[int, dict]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    d, N, P = args.d_model, args.state, args.headdim
    backend = (lambda name: GPU_BACKENDS[name]) if args.gpu_path else (lambda name: "auto")
    torch.manual_seed(args.seed)
    build = {
        "Mamba": lambda: Mamba(d, d_state=16, backend=backend("Mamba"), device=device),
        "Mamba2": lambda: Mamba2(d, d_state=N, headdim=P, backend=backend("Mamba2"), device=device),
        "Mamba3": lambda: Mamba3(d, d_state=N, headdim=P, backend=backend("Mamba3"), device=device),
    }
    layers = {name: make() for name, make in build.items() if name not in args.skip}
    if args.mimo_rank and "Mamba3" not in args.skip:
        mimo_backend = MIMO_GPU_BACKEND if args.gpu_path else "auto"
        layers[f"Mamba3 MIMO R={args.mimo_rank}"] = Mamba3(
            d, d_state=N, headdim=P, is_mimo=True, mimo_rank=args.mimo_rank, backend=mimo_backend, device=device
        )
    per_token = {}
    for name, layer in layers.items():
        kept = [
            kept_bytes(layer, torch.randn(args.batch, L, d, device=device, requires_grad=True), dtype)
            for L in (args.length, 2 * args.length)
        ]
        per_token[name] = (kept[1] - kept[0]) / (args.batch * args.length)
        print(f"{name:8s} {per_token[name]:10.0f} bytes a token  (kept at L and 2L: {kept[0]:,} and {kept[1]:,})")
    path = "a GPU's (tensor conv and norm, Triton interpreted)" if args.gpu_path else "the device's own"
    return 0, {"config": config_of(args), "bytes_per_token": per_token, "path": path, "device": describe_device(device)}


def markdown(result: dict, args) -> tuple[str, str, str]:
    c = result["config"]
    rows = [[name, f"{v:,.0f}"] for name, v in result["bytes_per_token"].items()]
    body = report.table(["layer", "bytes a token kept for the backward (at 2L less at L, over the tokens)"], rows)
    title = (
        f"saved for the backward: batch {c['batch']}, L {c['length']}, d_model {c['d_model']}, N {c['state']}, "
        f"P {c['headdim']}, float32 weights under autocast to {c['dtype']}, {result['path']} path"
    )
    return "saved", title, body
