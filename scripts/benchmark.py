"""Time the scan backends against each other and against a peer implementation.

For one op and one shape, every backend that runs on the device (``ssm.scan.backends``) is
measured, and so is the peer: mambapy's parallel scan (``mambapy.pscan``) when it is installed,
and on CUDA also mamba-ssm's ``selective_scan_fn`` when that is installed. Per implementation:

- forward time (under ``torch.no_grad``) and forward+backward time (gradients of every input
  for a fixed random upstream gradient): the median of ``--repeats`` runs after ``--warmup``;
- extra peak memory of one forward and of one forward+backward, measured in separate untimed
  runs: the most memory held at once beyond what was allocated before the run (the inputs);
- the largest difference of its forward output and gradients from those of ``ref`` (when it is
  run) and of each peer, so that a fast wrong answer cannot go unnoticed: a difference beyond
  the dtype's tolerance is reported and makes the exit status 1;
- achieved bandwidth: the bytes an implementation cannot avoid moving, divided by its time,
  and that as a fraction of the device's copy bandwidth measured in the same run (a
  ``copy_`` of a large buffer: bytes read + written over time). The bytes counted
  (``required_bytes``): forward, every input read once and the output written once;
  forward+backward, that plus the backward's own minimum: the inputs and the upstream
  gradient read, every input's gradient written. Recomputation, saved activations and
  intermediate states are not counted: they are what a fused kernel avoids.

Inputs (channels first, as in ``ssm.scan``; random with ``--seed``):

    selective  u, z, delta: (batch, dim, L); A: (dim, N) = -(1..N), the S4D-real init;
               B, C: (batch, N, L); D, delta_bias: (dim,). A, D and delta_bias are float32,
               the rest ``--dtype``. As in a Mamba layer, D and the silu(z) gate are on and
               Δ = softplus(delta + delta_bias) lies around 0.001-0.1: delta_bias is the
               inverse softplus of a log-uniform step in [0.001, 0.1], delta is small noise.
    linear     gates in [0.5, 1) and inputs: (batch, dim, L, N), scanned along L (dim=2),
               the shape of the selective scan's discretised recurrence.

The peer runs on the same values, converted to its (batch, L, dim, ...) layout before timing.
For the selective scan it computes what mambapy's MambaBlock does, softplus(delta + bias),
D·u and the silu(z) gate included, so that the same work is compared.

Examples:

    python scripts/benchmark.py                              # a mamba-130m layer, every backend
    python scripts/benchmark.py --op linear --repeats 3
    python scripts/benchmark.py --length 4096 --skip ref --json bench.json
    python scripts/benchmark.py --op generate                # recurrent decoding of a small LM

``--op generate`` measures decoding instead: a small ``MambaLM`` (``--d-model``, ``--layers``,
byte vocabulary) prefills ``--positions`` tokens into its cache and times one ``step`` there
(median of ``--repeats``), to show that a token costs the same at position 2000 as at 10; then it
generates ``--new-tokens`` tokens greedily with the cache and, for comparison, by running the full
forward over the growing sequence for every token, and checks that both produce the same tokens.

``--op train-step`` times one whole training step of a language model: forward, cross-entropy
over every position, backward (no optimizer update), on random byte tokens (batch ``--batch``,
default 8; ``--length``, default 512; ``--d-model`` 256, ``--layers`` 4, vocabulary 256, N 16,
expand 2, conv width 4). Implementations, all on the same weights: ``ssm``'s ``MambaLM`` (eager,
its ``auto`` backend), transformers' ``MambaForCausalLM`` under ``torch.compile`` (it takes its
associative-scan path there) and mambapy's ``LM`` (parallel scan), each when importable; the
first step (compiling, for transformers) is timed separately and the losses of that step are
compared. ``--mmap-threshold BYTES`` also times ``ssm``'s step in a child process run with
``MALLOC_MMAP_THRESHOLD_=BYTES``, where glibc returns every larger freed block to the system,
so that a path which allocates large temporaries per call pays page faults for them again.

``--op packed`` measures packed variable-length sequences on real documents: the files of the
text task's training split (the Python standard library's sources), drawn at random and cut
at ``--max-doc-len`` bytes, ``--docs`` per batch. First, training throughput of a ``MambaLM``
(``--d-model``, ``--layers``, ``--layer``; AdamW steps, forward + backward + update) on the
same batches of documents, padded to the longest document of each batch against packed end to
end with ``cu_seqlens``, in real (non-padding) bytes per second, after checking that both give
the same loss on the first batch. Second, the scan alone on one batch's documents at the
model's layer shape (D = 2·d_model, N = 16): one packed ``selective_scan`` call against a
Python loop calling it once per document, forward + backward, for each backend in
``--backends`` (default: all but ref).

``--op layer`` times whole mixer layers instead: Mamba (Mamba-1), Mamba2 and Mamba3 (SISO, and
MIMO of rank ``--mimo-rank``) at one shape, input (``--batch``, ``--length``, ``--d-model``),
expand 2, N = ``--state``, head dim ``--headdim`` (Mamba-3 and Mamba-2 alike, and one group of
B and C), each on its default backend for the device. Forward and forward + backward (gradients
of the input and every parameter for a fixed upstream gradient), the median of ``--repeats``
after ``--warmup``, the layers taking turns in each round so that a change of machine load falls
on all of them alike; each row's time is also given as a ratio to Mamba-2's, measured in the
same run.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ssm.memory import extra_peak_bytes
from ssm.scan import backends, linear_scan, selective_scan

OPS = {"selective": "selective_scan", "linear": "linear_scan"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest accepted max|difference| / max|reference| between two implementations.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
MiB = 2**20


@dataclass
class Case:
    """One implementation to measure: ``fn(*inputs)`` returns the op's output."""

    name: str
    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]  # leaves that require grad, in the layout fn expects
    grad_out: torch.Tensor  # the upstream gradient, in the layout of fn's output
    is_peer: bool = False
    # Inputs and output in the peers' layout: dims 1 and 2 (dim and L) swapped w.r.t. ours.
    swapped: bool = False


@dataclass
class Result:
    name: str
    is_peer: bool
    forward_ms: float
    fwd_bwd_ms: float
    forward_peak_bytes: int
    fwd_bwd_peak_bytes: int
    # Keyed by the name of the row compared with ("ref" and the peers; never the row itself).
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # of the forward output
    max_grad_rel_diff: dict[str, float] = field(default_factory=dict)  # worst input's gradient
    speedup: dict[str, float] = field(default_factory=dict)  # peer fwd+bwd ms / this row's
    forward_gbps: float = 0.0  # required bytes / time, 1e9 bytes per second
    fwd_bwd_gbps: float = 0.0
    forward_copy_fraction: float = 0.0  # of the measured copy bandwidth
    fwd_bwd_copy_fraction: float = 0.0


# ----------------------------------------------------------------------------- inputs


def selective_inputs(batch: int, dim: int, N: int, length: int) -> tuple[torch.Tensor, ...]:
    """u, delta, A, B, C, D, z, delta_bias for ``selective_scan``, float32 on the CPU."""
    dt = torch.empty(dim).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    delta_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(delta_bias) = dt
    delta = 0.1 * torch.randn(batch, dim, length)
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(dim, 1)
    u, z = torch.randn(batch, dim, length), torch.randn(batch, dim, length)
    B, C = torch.randn(batch, N, length), torch.randn(batch, N, length)
    D = torch.randn(dim)
    return u, delta, A, B, C, D, z, delta_bias


def linear_inputs(batch: int, dim: int, N: int, length: int) -> tuple[torch.Tensor, ...]:
    """gates, inputs for ``linear_scan(..., dim=2)``, float32 on the CPU."""
    gates = 0.5 + 0.5 * torch.rand(batch, dim, length, N)
    return gates, torch.randn(batch, dim, length, N)


def to_peer_layout(x: torch.Tensor) -> torch.Tensor:
    """Ours (batch, dim, L, ...) or (batch, N, L) -> the peers' (batch, L, dim, ...) or
    (batch, L, N); tensors of fewer than 3 dimensions (A, D, delta_bias) are the same."""
    return x.transpose(1, 2).contiguous() if x.ndim >= 3 else x


def from_peer_layout(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if x.ndim >= 3 else x


# ----------------------------------------------------------------------------- peers


def mambapy_selective_scan(pscan, x, delta, A, B, C, D, z, delta_bias) -> torch.Tensor:
    """The selective scan as mambapy's MambaBlock computes it (``ssm``, ``selective_scan`` and
    the output gate of ``forward``), in its layout: x, delta, z (batch, L, dim); B, C (batch,
    L, N); A (dim, N); D, delta_bias (dim,)."""
    delta = F.softplus(delta + delta_bias)
    deltaA = torch.exp(delta.unsqueeze(-1) * A)  # (batch, L, dim, N)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)  # (batch, L, dim, N)
    # PScan.forward copies its arguments (clone, or F.pad when it pads L to a power of two)
    # before scanning in place, so the caller's tensors are never modified.
    hs = pscan(deltaA, BX)
    # With 16-bit inputs, Δ and so the states are float32 (as delta_bias is); C follows.
    y = (hs @ C.unsqueeze(-1).to(hs.dtype)).squeeze(3) + D * x  # (batch, L, dim)
    return y * F.silu(z)


def peer_cases(op: str, device: torch.device, inputs, grad_out) -> list[Case]:
    """The peers that are installed and run on ``device``."""
    cases = []
    try:
        from mambapy.pscan import pscan
    except ImportError:
        pass
    else:
        fn = pscan if op == "linear_scan" else partial(mambapy_selective_scan, pscan)
        peer_inputs = tuple(to_peer_layout(x.detach()).requires_grad_() for x in inputs)
        peer_grad_out = to_peer_layout(grad_out)
        cases.append(Case("mambapy.pscan (peer)", fn, peer_inputs, peer_grad_out, is_peer=True, swapped=True))

    # mamba-ssm's CUDA kernel has our signature and layout, so it runs on our very inputs.
    if op == "selective_scan" and device.type == "cuda":
        try:
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        except ImportError:
            pass
        else:
            fn = partial(selective_scan_fn, delta_softplus=True)
            name = "mamba_ssm.selective_scan_fn (peer)"
            cases.append(Case(name, fn, inputs, grad_out, is_peer=True))
    return cases


def peer_versions() -> dict[str, str]:
    versions = {}
    for package in ("mambapy", "mamba_ssm"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


# ----------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
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


def measure(case: Case, device: torch.device, warmup: int, repeats: int, copy_gbps: float):
    """Time and measure one case; also return its output and gradients (float32, our layout)."""

    def forward():
        with torch.no_grad():
            return case.fn(*case.inputs)

    def forward_backward():
        out = case.fn(*case.inputs)
        return out, torch.autograd.grad(out, case.inputs, case.grad_out.to(out.dtype))

    forward_peak, out = extra_peak_bytes(forward, device)
    fwd_bwd_peak, (_, grads) = extra_peak_bytes(forward_backward, device)
    result = Result(
        name=case.name,
        is_peer=case.is_peer,
        forward_ms=median_ms(forward, device, warmup, repeats),
        fwd_bwd_ms=median_ms(forward_backward, device, warmup, repeats),
        forward_peak_bytes=forward_peak,
        fwd_bwd_peak_bytes=fwd_bwd_peak,
    )
    set_bandwidth(result, case.inputs, out, copy_gbps)
    ours = from_peer_layout if case.swapped else (lambda x: x)
    return result, ours(out).float(), [ours(g).float() for g in grads]


def required_bytes(inputs, output: torch.Tensor) -> tuple[int, int]:
    """(forward, forward+backward) bytes that any implementation must move: forward reads every
    input and writes the output; the backward reads every input and the output's gradient and
    writes every input's gradient."""
    inputs_bytes = sum(x.numel() * x.element_size() for x in inputs)
    output_bytes = output.numel() * output.element_size()
    forward = inputs_bytes + output_bytes
    return forward, forward + 2 * inputs_bytes + output_bytes


def copy_bandwidth_gbps(device: torch.device, nbytes: int, warmup: int = 2, repeats: int = 5) -> float:
    """The device's copy bandwidth in 1e9 bytes/s: a ``copy_`` between two buffers of
    ``nbytes`` each moves 2·nbytes (read and write); the median of ``repeats`` runs."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def set_bandwidth(result: Result, inputs, output: torch.Tensor, copy_gbps: float) -> None:
    """Fill in ``result``'s achieved bandwidths from its times."""
    forward, fwd_bwd = required_bytes(inputs, output)
    result.forward_gbps = forward / (result.forward_ms * 1e-3) / 1e9
    result.fwd_bwd_gbps = fwd_bwd / (result.fwd_bwd_ms * 1e-3) / 1e9
    result.forward_copy_fraction = result.forward_gbps / copy_gbps
    result.fwd_bwd_copy_fraction = result.fwd_bwd_gbps / copy_gbps


def relative_difference(x: torch.Tensor, reference: torch.Tensor) -> float:
    """max|x - reference| / max|reference|; NaN if either holds a NaN."""
    return ((x - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def compare(results, outputs, grads, reference: str, tolerance: float) -> list[str]:
    """Fill in every row's differences from row ``reference``; return those beyond tolerance."""
    failures = []
    out_ref, grads_ref = outputs[reference], grads[reference]
    for r in results:
        if r.name == reference:
            continue
        out_diff = relative_difference(outputs[r.name], out_ref)
        grad_diffs = [relative_difference(g, g_ref) for g, g_ref in zip(grads[r.name], grads_ref)]
        r.max_abs_diff[reference] = (outputs[r.name] - out_ref).abs().max().item()
        r.max_grad_rel_diff[reference] = torch.tensor(grad_diffs).max().item()  # NaN if any is
        if not (out_diff <= tolerance and r.max_grad_rel_diff[reference] <= tolerance):
            failures.append(
                f"{r.name} vs {reference}: relative difference of the output {out_diff:.1e}, "
                f"of the gradients {r.max_grad_rel_diff[reference]:.1e} (tolerance {tolerance:.0e})"
            )
    return failures


# ----------------------------------------------------------------------------- reporting


def describe(args, device: torch.device, copy_gbps: float) -> str:
    if device.type == "cuda":
        where = f"cuda: {torch.cuda.get_device_name(device)}"
    else:
        where = f"cpu: {torch.get_num_threads()} threads, {os.cpu_count()} cores"
    versions = "".join(f", {p} {v}" for p, v in peer_versions().items())
    return (
        f"{OPS[args.op]}: batch={args.batch} dim={args.dim} state={args.state} "
        f"length={args.length} {args.dtype} | {where} | torch {torch.__version__}{versions}\n"
        f"median of {args.repeats} after {args.warmup} warm-up; "
        "peak = most memory held at once beyond the inputs (MiB); "
        "x vs P = P's fwd+bwd ms / the row's\n"
        f"GB/s = required input+output bytes / time; % copy = of the measured copy bandwidth, "
        f"{copy_gbps:.1f} GB/s"
    )


def format_table(results: list[Result]) -> str:
    peers = [r.name for r in results if r.is_peer]
    headers = [
        "",
        "fwd ms",
        "fwd+bwd ms",
        "fwd GB/s",
        "fwd % copy",
        "fwd+bwd GB/s",
        "fwd+bwd % copy",
        "fwd peak",
        "fwd+bwd peak",
    ]
    headers += [f"x vs {p.removesuffix(' (peer)')}" for p in peers] or ["x vs peer"]
    rows = [headers]
    for r in results:
        row = [
            r.name,
            f"{r.forward_ms:.2f}",
            f"{r.fwd_bwd_ms:.2f}",
            f"{r.forward_gbps:.3g}",
            f"{100 * r.forward_copy_fraction:.0f}%",
            f"{r.fwd_bwd_gbps:.3g}",
            f"{100 * r.fwd_bwd_copy_fraction:.0f}%",
            f"{r.forward_peak_bytes / MiB:.1f}",
            f"{r.fwd_bwd_peak_bytes / MiB:.1f}",
        ]
        row += [f"{r.speedup[p]:.2f}" for p in peers] or [""]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]) for row in rows
    )


def format_differences(results: list[Result], reference: str) -> str:
    others = [r for r in results if reference in r.max_abs_diff]
    return f"vs {reference}:  " + "   ".join(
        f"{r.name} {r.max_abs_diff[reference]:.1e} (grads {r.max_grad_rel_diff[reference]:.1e})" for r in others
    )


# ----------------------------------------------------------------------------- main


def comma_list(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def comma_ints(text: str) -> list[int]:
    try:
        return [int(item) for item in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--op",
        choices=[*OPS, "ssd", "generate", "decode", "packed", "layer", "train-step", "cold-start"],
        default="selective",
    )
    parser.add_argument("--batch", type=int, default=None, help="default 1 (8 for train-step)")
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
    parser.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="buffer size of the copy-bandwidth measurement (default 1024 on cuda, 64 on cpu)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results there")
    generation = parser.add_argument_group("--op generate and --op packed")
    generation.add_argument("--d-model", type=int, default=None, help="default 256 (generate), 128 (packed)")
    generation.add_argument("--layers", type=int, default=None, help="default 4 (24 for decode)")
    generation.add_argument(
        "--positions", type=comma_ints, default=[10, 2000], help="positions at which one step is timed"
    )
    generation.add_argument("--new-tokens", type=int, default=256)
    generation.add_argument("--prompt-length", type=int, default=16)
    packed = parser.add_argument_group("--op packed")
    packed.add_argument("--layer", choices=["Mamba1", "Mamba2"], default="Mamba1")
    packed.add_argument("--docs", type=int, default=16, help="documents per batch")
    packed.add_argument("--max-doc-len", type=int, default=1024, help="documents are cut at this many bytes")
    packed.add_argument("--batches", type=int, default=3, help="timed training steps per way (after --warmup)")
    train = parser.add_argument_group("--op train-step")
    train.add_argument(
        "--peers",
        type=comma_list,
        default=["transformers", "mambapy"],
        help="peers to run when importable (transformers, mambapy)",
    )
    train.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="also time ssm's step in a child process under MALLOC_MMAP_THRESHOLD_=BYTES",
    )
    train.add_argument("--only-ssm", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    decode = parser.add_argument_group("--op decode (also --d-model, --layers, --new-tokens, --prompt-length)")
    decode.add_argument("--vocab", type=int, default=50280, help="vocabulary size (mamba-130m's by default)")
    decode.add_argument("--decode-batches", type=comma_ints, default=[1, 8], help="batch sizes to decode")
    layer = parser.add_argument_group("--op layer (also --batch, --length, --state, --d-model, --dtype)")
    layer.add_argument("--headdim", type=int, default=32, help="P of Mamba2 and Mamba3")
    layer.add_argument("--mimo-rank", type=int, default=4, help="R of the Mamba3 MIMO row")
    args = parser.parse_args(argv)
    train_step = args.op == "train-step"
    if args.layers is None:
        args.layers = 24 if args.op == "decode" else 4
    if args.batch is None:
        args.batch = 8 if train_step else 1
    if args.length is None:
        args.length = 512 if train_step else 1024
    if train_step:
        args.d_model = args.d_model or 256
        if min(args.batch, args.length, args.d_model, args.layers, args.repeats) < 1 or args.warmup < 0:
            parser.error("--batch, --length, --d-model, --layers and --repeats must be positive")
        unknown = set(args.peers) - {"transformers", "mambapy"}
        if unknown:
            parser.error(f"unknown peers {sorted(unknown)}: choose from transformers, mambapy")
        if args.no_peer:
            args.peers = []
        return args
    if args.op == "cold-start":
        return args
    if args.op == "ssd":
        if (
            min(args.batch, args.dim, args.state, args.length, args.headdim, args.repeats) < 1
            or args.dim % args.headdim
        ):
            parser.error(
                "--batch, --dim, --state, --length, --headdim, --repeats must be positive, --headdim divide --dim"
            )
        return args
    if args.op == "decode":
        args.d_model = args.d_model or 768
        if min(args.d_model, args.layers, args.vocab, args.new_tokens, args.prompt_length, *args.decode_batches) < 1:
            parser.error(
                "--d-model, --layers, --vocab, --new-tokens, --prompt-length and --decode-batches must be positive"
            )
        return args
    if args.op == "layer":
        args.d_model = args.d_model or 128
        if min(args.batch, args.length, args.state, args.d_model, args.headdim, args.mimo_rank, args.repeats) < 1:
            parser.error("--batch, --length, --state, --d-model, --headdim, --mimo-rank and --repeats must be positive")
        if (2 * args.d_model) % args.headdim:
            parser.error(f"--headdim {args.headdim} must divide 2·d_model = {2 * args.d_model}")
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda, but CUDA is not available")
        return args
    if args.d_model is None:
        args.d_model = 128 if args.op == "packed" else 256
    if args.op == "packed":
        if min(args.d_model, args.layers, args.docs, args.max_doc_len, args.batches, args.repeats) < 1:
            parser.error("--d-model, --layers, --docs, --max-doc-len, --batches and --repeats must be positive")
        op = "selective_scan" if args.layer == "Mamba1" else "ssd"
        available = backends(op, args.device)
        requested = args.backends or [b for b in available if b != "ref"]
        args.backends = [b for b in requested if b not in args.skip]
        unknown = set(args.backends) - set(available)
        if unknown:
            parser.error(f"unknown backends {sorted(unknown)} for {op}; on {args.device}: {available}")
        return args
    if args.op == "generate":
        if min(args.d_model, args.layers, args.new_tokens, args.prompt_length, args.repeats, *args.positions) < 1:
            parser.error(
                "--d-model, --layers, --new-tokens, --prompt-length, --positions and --repeats must be positive"
            )
        return args

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if min(args.batch, args.dim, args.state, args.length, args.repeats) < 1 or args.warmup < 0:
        parser.error("sizes and --repeats must be positive, --warmup non-negative")
    available = backends(OPS[args.op], args.device)
    unknown = set(args.backends or []).union(args.skip) - set(available)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; on {args.device}: {available}")
    args.backends = [b for b in args.backends or available if b not in args.skip]
    return args


def benchmark_generation(args) -> int:
    """Per-token step time against position, and cached generation against full recomputation."""
    from ssm import MambaConfig, MambaLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=256)
    model = MambaLM(config).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"MambaLM d_model={args.d_model} n_layer={args.layers} vocab=256 ({params / 1e6:.2f} M parameters), "
        f"{describe_device(device)}"
    )

    # Prefill one cache per position, then time single steps at the positions in turn (so that
    # warm-up and machine noise fall on all of them alike); report the median per position.
    samples: dict[int, list[float]] = {p: [] for p in args.positions}
    with torch.no_grad():
        caches = {}
        for position in args.positions:
            caches[position] = model.allocate_inference_cache(1, device=device)
            model(torch.randint(0, 256, (1, position), device=device), cache=caches[position])
        token = torch.tensor([1], device=device)
        for i in range(args.warmup + max(args.repeats, 10)):
            for position, cache in caches.items():
                synchronize(device)
                start = time.perf_counter()
                model.step(token, cache)
                synchronize(device)
                if i >= args.warmup:
                    samples[position].append((time.perf_counter() - start) * 1e3)
    step_ms = {p: statistics.median(v) for p, v in samples.items()}
    first = args.positions[0]
    print("\nposition   step ms   / step ms at position", first)
    for position, ms in step_ms.items():
        print(f"{position:8d}  {ms:8.3f}   {ms / step_ms[first]:.2f}")

    prompt = torch.randint(0, 256, (1, args.prompt_length), device=device)

    def cached():
        return model.generate(prompt, args.new_tokens, temperature=0)

    def recompute():
        seq = prompt
        with torch.no_grad():
            for _ in range(args.new_tokens):
                seq = torch.cat([seq, model(seq, num_last_tokens=1)[:, -1, :256].argmax(-1, keepdim=True)], 1)
        return seq

    timings, outputs = {}, {}
    for name, fn in (("cached (prefill + step)", cached), ("full forward per token", recompute)):
        synchronize(device)
        start = time.perf_counter()
        outputs[name] = fn()
        synchronize(device)
        timings[name] = time.perf_counter() - start
    print(f"\ngenerating {args.new_tokens} tokens after a {args.prompt_length}-token prompt (greedy):")
    for name, seconds in timings.items():
        print(f"  {name:26s} {seconds:8.2f} s   {args.new_tokens / seconds:8.1f} tokens/s")
    same = torch.equal(*outputs.values())
    print(
        f"  speed-up of the cache: {timings['full forward per token'] / timings['cached (prefill + step)']:.1f}x; "
        f"same tokens: {same}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "parameters": params,
                    "step_ms": step_ms,
                    "generate_s": timings,
                    "same_tokens": same,
                },
                f,
                indent=2,
            )
    return 0 if same else 1


def benchmark_decoding(args) -> int:
    """Greedy decoding throughput of a language model at a real size (mamba-130m's by default:
    d_model 768, 24 layers, vocabulary 50280, float32), ssm against transformers'
    MambaForCausalLM holding the same weights, at each of ``--decode-batches``. The tokens must
    be the same, or part only at a tie: where the float64 model finds the two tokens' logits
    closer than TIE (``tie_gap``)."""
    device = torch.device(args.device)
    hf_model = None if args.no_peer else transformers_mamba(args, device, vocab_size=args.vocab)
    if hf_model is not None:
        hf_model.eval()
        hf_model.generation_config.eos_token_id = None  # every row decodes --new-tokens tokens
        hf_model.generation_config.pad_token_id = 0
    model = ssm_lm(args, hf_model, device, vocab_size=args.vocab).eval()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"greedy decoding, MambaLM d_model={args.d_model} n_layer={args.layers} vocab={args.vocab} "
        f"({params / 1e6:.1f} M parameters, {4 * params / 1e6:.0f} MB in float32), {describe_device(device)}; "
        f"{args.new_tokens} new tokens after a {args.prompt_length}-token prompt"
    )
    read_s, read_bytes = weight_read_seconds(model, device)
    ceiling = 1 / read_s
    print(
        f"reading the weights' bytes once (torch's sum over them as one tensor, median of 9): "
        f"{read_s * 1e3:.1f} ms, {read_bytes / read_s / 1e9:.1f} GB/s: {ceiling:.1f} tokens/s at batch 1 if a "
        "token cost only its weight reads at that rate (caches can hold part of them between tokens)"
    )
    print(f"{'batch':>5s} {'ssm tok/s':>10s} {'transformers tok/s':>19s} {'ratio':>6s}  same tokens")
    exact = None  # the model in float64, built when the two disagree
    g = torch.Generator().manual_seed(args.seed)
    results, ok = [], True
    for batch in args.decode_batches:
        prompt = torch.randint(0, args.vocab, (batch, args.prompt_length), generator=g).to(device)
        runs = {"ssm": lambda: model.generate(prompt, args.new_tokens, temperature=0)}
        if hf_model is not None:
            runs["transformers"] = lambda: hf_model.generate(
                prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )
        seconds, tokens = {}, {}
        with torch.no_grad():
            for name, run in runs.items():
                run()  # warm-up (first-call allocations, lazy kernel builds)
                synchronize(device)
                start = time.perf_counter()
                tokens[name] = run()
                synchronize(device)
                seconds[name] = time.perf_counter() - start
        rate = {name: batch * args.new_tokens / s for name, s in seconds.items()}
        same = torch.equal(*tokens.values()) if len(tokens) == 2 else None
        gap = None
        if same is False:
            exact = exact or copy.deepcopy(model).double()
            gap = tie_gap(exact, *tokens.values())
        ok = ok and (same is not False or gap < TIE)
        peer = rate.get("transformers")
        verdict = "-" if same is None else "True" if same else f"False, at a tie (float64 gap {gap:.1e})"
        if gap is not None and gap >= TIE:
            verdict = f"False: float64 gap {gap:.1e} at the first difference, not a tie"
        print(
            f"{batch:5d} {rate['ssm']:10.1f} {peer or float('nan'):19.1f} "
            f"{rate['ssm'] / peer if peer else float('nan'):5.2f}x  {verdict}"
        )
        results.append({"batch": batch, "tokens_per_s": rate, "same_tokens": same, "tie_gap": gap})
    if 1 in args.decode_batches:
        at_one = results[args.decode_batches.index(1)]["tokens_per_s"]["ssm"]
        print(f"batch 1: ssm decodes at {at_one / ceiling:.0%} of that rate")
    if args.json:
        with open(args.json, "w") as f:
            config = {k: v for k, v in vars(args).items() if k != "json"}
            report = {"config": config, "parameters": params, "weight_read_s": read_s, "results": results}
            json.dump(report, f, indent=2)
    return 0 if ok else 1


def weight_read_seconds(model: torch.nn.Module, device: torch.device, repeats: int = 9) -> tuple[float, int]:
    """(seconds, bytes) for torch's ``sum`` to read as many bytes as ``model``'s weights hold (a
    tied one once), laid out as one contiguous tensor: the memory traffic a batch-1 decoding
    step cannot avoid, at the rate torch streams memory: 1 / seconds is the tokens/s such a
    step would reach if nothing else cost (more when caches hold part of the weights between
    tokens). Median of ``repeats`` after one warm-up."""
    weights = {p.data_ptr(): p.detach() for p in model.parameters()}.values()
    flat = torch.cat([w.flatten() for w in weights])

    def read() -> float:
        synchronize(device)
        start = time.perf_counter()
        flat.sum()
        synchronize(device)
        return time.perf_counter() - start

    read()
    return statistics.median(read() for _ in range(repeats)), flat.numel() * flat.element_size()


# Greedy tokens of two float32 runs may part where the two best logits are closer than float32's
# rounding leaves them apart (random weights over 50280 tokens: such ties come every few hundred
# tokens). Logits of our float32 step differ from float64's by up to 0.013 over 256 steps
# (measured at mamba-130m size), so a float64 gap below 0.05 is a tie, not an error.
TIE = 0.05


def tie_gap(exact, a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest float64 logit gap, over the rows where token sequences a and b (batch, L)
    differ, between the two tokens chosen at the row's first difference, computed by ``exact``
    (the model in float64) on the tokens both runs share before it."""
    gaps = []
    with torch.no_grad():
        for r in (a != b).any(1).nonzero()[:, 0].tolist():
            j = int((a[r] != b[r]).nonzero()[0])
            logits = exact(a[r : r + 1, :j].to(exact.lm_head.weight.device))[0, -1]
            gaps.append(abs(float(logits[a[r, j]] - logits[b[r, j]])))
    return max(gaps)


def benchmark_ssd(args) -> int:
    """ssd's fast backends on one shape, fwd+bwd: x (batch, L, dim / headdim heads, headdim),
    one group of B, C (N = --state), D, z, dt_bias and softplus; outputs and gradients checked
    against each other."""
    from ssm.scan import ssd

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
    names = [n for n in backends("ssd", device) if n != "ref"]
    ms, grads = {}, {}
    for name in names:

        def step(name=name):
            x, dt, A, B, C, D, z, bias = inputs
            out = ssd(x, dt, A, B, C, D, z, dt_bias=bias, dt_softplus=True, chunk_size=256, backend=name)
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
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "ms": ms}, f, indent=2)
    return 0


def benchmark_cold_start(args) -> int:
    """Seconds from starting ``python scripts/train.py`` (the default config, two steps) to its
    first training step's log line, with an empty kernel cache (SSM_CACHE_DIR in a new
    temporary directory, so the cpu backend's C kernels are built in that time) and again with
    the cache that run filled; and the whole process's time."""
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"cold start of scripts/train.py (default config, 2 steps), {describe_device(torch.device('cpu'))}")
    print(f"{'kernel cache':>12s} {'to first step s':>16s} {'whole run s':>12s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cache in ("empty", "filled"):
            command = [sys.executable, os.path.join(root, "scripts", "train.py"), "trainer.max_steps=2"]
            command += ["log_every=1", "progress_bar=false", f"run_dir={tmp}/run-{cache}"]
            env = {**os.environ, "SSM_CACHE_DIR": os.path.join(tmp, "kernels")}
            start = time.perf_counter()
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            first, lines = None, []
            for line in process.stdout:
                lines.append(line)
                if first is None and line.startswith("step 1/"):
                    first = time.perf_counter() - start
            whole = time.perf_counter() - start
            if process.wait() != 0 or first is None:
                print("".join(lines[-20:]))
                print(f"error: scripts/train.py failed (exit {process.returncode}) or logged no first step")
                return 1
            results[cache] = {"first_step_s": first, "whole_s": whole}
            print(f"{cache:>12s} {first:16.1f} {whole:12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, f, indent=2)
    return 0


def text_documents(count: int, max_len: int, seed: int) -> list[bytes]:
    """``count`` documents drawn at random (with replacement) from the text task's training
    files, each cut at ``max_len`` bytes; empty files are skipped."""
    from ssm.training.data import default_text_files, split_files

    files, _ = split_files(default_text_files(), 0.1)
    g = torch.Generator().manual_seed(seed)
    docs = []
    while len(docs) < count:
        text = open(files[int(torch.randint(len(files), (), generator=g))], "rb").read()[:max_len]
        if text:
            docs.append(text)
    return docs


def padded_batch(docs: list[bytes], device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, longest) padded with 0 on the right, targets the next byte, -100 past each end."""
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    targets = torch.full((len(docs), longest), -100, dtype=torch.long)
    for i, d in enumerate(docs):
        x = torch.tensor(list(d))
        ids[i, : len(d)] = x
        targets[i, : len(d) - 1] = x[1:]
    return ids.to(device), targets.to(device)


def packed_batch(docs: list[bytes], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (1, total), targets the next byte of the same document (-100 at each document's
    last byte) and cu_seqlens."""
    ids = torch.tensor([b for d in docs for b in d])
    targets = torch.roll(ids, -1).clone()
    lengths = torch.tensor([len(d) for d in docs])
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
    targets[cu[1:] - 1] = -100
    return ids[None].to(device), targets[None].to(device), cu.to(device)


def benchmark_packed(args) -> int:
    """Training throughput, packed against padded, and the packed scan against a loop."""
    from ssm import MambaConfig, MambaLM

    device = torch.device(args.device)
    steps = args.warmup + args.batches
    docs = text_documents(args.docs * steps, args.max_doc_len, args.seed)
    batches = [docs[i * args.docs : (i + 1) * args.docs] for i in range(steps)]
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.float64)
    real = sum(len(d) for b in batches for d in b)
    padded_total = sum(len(b) * max(len(d) for d in b) for b in batches)
    ssm_cfg = (
        {"layer": args.layer, "d_state": 16}
        if args.layer == "Mamba1"
        else {"layer": "Mamba2", "d_state": 64, "headdim": 32}
    )
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=256, ssm_cfg=ssm_cfg)
    print(
        f"{len(docs)} documents of the text task (stdlib sources cut at {args.max_doc_len} bytes), "
        f"{args.docs} per batch: length mean {lengths.mean():.0f}, median {lengths.median():.0f}, "
        f"min {lengths.min():.0f}, max {lengths.max():.0f}; "
        f"padded to each batch's longest, {1 - real / padded_total:.0%} of the positions are padding"
    )
    print(f"MambaLM {args.layer} d_model={args.d_model} n_layer={args.layers}, {describe_device(device)}")

    def step_fn(model, optimizer, batch, packed):
        if packed:
            ids, targets, cu = packed_batch(batch, device)
            logits = model(ids, cu_seqlens=cu)
        else:
            ids, targets = padded_batch(batch, device)
            logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    training, first_losses, ok = {}, {}, True
    for backend in args.backends:
        for way in ("padded", "packed"):
            torch.manual_seed(args.seed)
            model = MambaLM(config, backend=backend).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            times = []
            for i, batch in enumerate(batches):
                synchronize(device)
                start = time.perf_counter()
                loss = step_fn(model, optimizer, batch, way == "packed")
                synchronize(device)
                if i == 0:
                    first_losses[backend, way] = loss
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            timed = sum(len(d) for b in batches[args.warmup :] for d in b)
            training[backend, way] = timed / sum(times)
            print(f"  trained {backend} {way}: {training[backend, way]:,.0f} bytes/s", file=sys.stderr, flush=True)
        same = math.isclose(first_losses[backend, "padded"], first_losses[backend, "packed"], rel_tol=1e-4)
        ok &= same
    print("\ntraining step (forward + backward + AdamW), real bytes per second:")
    print(f"{'backend':10s} {'padded':>12s} {'packed':>12s} {'packed/padded':>14s}  first-batch loss padded / packed")
    for backend in args.backends:
        pad, pack = training[backend, "padded"], training[backend, "packed"]
        print(
            f"{backend:10s} {pad:12,.0f} {pack:12,.0f} {pack / pad:13.2f}x  "
            f"{first_losses[backend, 'padded']:.5f} / {first_losses[backend, 'packed']:.5f}"
        )

    # The scan alone, at the model's layer shape, on the first timed batch's documents.
    scan_ms = {}
    if args.layer == "Mamba1":
        batch = batches[args.warmup]
        seq = [len(d) for d in batch]
        total, dim = sum(seq), 2 * args.d_model
        torch.manual_seed(args.seed)
        inputs = [x.to(device).requires_grad_() for x in selective_inputs(1, dim, 16, total)]
        u, delta, A, B, C, D, z, delta_bias = inputs
        grad = torch.randn(1, dim, total, device=device)
        cu = F.pad(torch.cumsum(torch.tensor(seq), 0), (1, 0)).to(device)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        for backend in args.backends:

            def packed_call():
                out = selective_scan(u, delta, A, B, C, D, z, delta_bias, True, cu_seqlens=cu, backend=backend)
                return torch.autograd.grad(out, inputs, grad)

            def loop_call():
                out = torch.cat(
                    [
                        selective_scan(
                            u[..., a:b],
                            delta[..., a:b],
                            A,
                            B[..., a:b],
                            C[..., a:b],
                            D,
                            z[..., a:b],
                            delta_bias,
                            True,
                            backend=backend,
                        )
                        for a, b in bounds
                    ],
                    -1,
                )
                return torch.autograd.grad(out, inputs, grad)

            got, want = packed_call(), loop_call()
            diff = max(relative_difference(g.float(), w.float()) for g, w in zip(got, want))
            ok &= diff < TOLERANCE[torch.float32]
            scan_ms[backend] = (
                median_ms(packed_call, device, args.warmup, args.repeats),
                median_ms(loop_call, device, args.warmup, args.repeats),
                diff,
            )
            print(f"  scan {backend}: done", file=sys.stderr, flush=True)
        print(f"\nselective_scan forward + backward on those {len(seq)} documents ({total} steps), D = {dim}, N = 16:")
        print(
            f"{'backend':10s} {'packed ms':>10s} {'loop ms':>10s} {'loop/packed':>12s}"
            "  max relative gradient difference"
        )
        for backend, (pack, loop, diff) in scan_ms.items():
            print(f"{backend:10s} {pack:10.1f} {loop:10.1f} {loop / pack:11.2f}x  {diff:.1e}")
    if not ok:
        print("MISMATCH: packed and padded (or looped) results differ", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "documents": {
                        "count": len(docs),
                        "mean": float(lengths.mean()),
                        "median": float(lengths.median()),
                        "max": float(lengths.max()),
                        "padding_fraction": 1 - real / padded_total,
                    },
                    "training_bytes_per_s": {f"{b}/{w}": v for (b, w), v in training.items()},
                    "first_batch_loss": {f"{b}/{w}": v for (b, w), v in first_losses.items()},
                    "scan_ms": {
                        b: {"packed": p, "loop": q, "max_grad_rel_diff": d} for b, (p, q, d) in scan_ms.items()
                    },
                    "device": describe_device(device),
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


def transformers_mamba(args, device, vocab_size: int = 256):
    """transformers' MambaForCausalLM with fresh weights at the benchmark's sizes, or None."""
    try:
        from transformers import MambaConfig as HFMambaConfig
        from transformers import MambaForCausalLM
    except ImportError:
        return None
    config = HFMambaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        state_size=16,
        num_hidden_layers=args.layers,
        expand=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(args.seed)
    return MambaForCausalLM(config).to(device).float().train()


def mambapy_lm(args, hf_state: dict, device):
    """mambapy's Mamba stack (mambapy.mamba: blocks, parallel scan) between an embedding and a
    final RMSNorm with a tied LM head, with transformers' weights (the same names as
    mamba-ssm's, the prefixes aside); None when mambapy is not importable. (mambapy.lm.LM
    imports mamba-ssm's Triton kernels for its Mamba-2 path, so it is not used.)"""
    try:
        from mambapy.mamba import Mamba, RMSNorm
        from mambapy.mamba import MambaConfig as MambapyConfig
    except ImportError:
        return None

    class MambapyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = MambapyConfig(
                d_model=args.d_model, n_layers=args.layers, d_state=16, expand_factor=2, d_conv=4, rms_norm_eps=1e-5
            )
            self.embedding = torch.nn.Embedding(256, args.d_model)
            self.mamba = Mamba(config)
            self.norm_f = RMSNorm(args.d_model, 1e-5)

        def forward(self, tokens):
            return F.linear(self.norm_f(self.mamba(self.embedding(tokens))), self.embedding.weight)

    model = MambapyLM()
    state = {}
    for key, value in hf_state.items():
        if key in ("backbone.embeddings.weight", "backbone.norm_f.weight"):
            state[key.split(".")[1].replace("embeddings", "embedding") + ".weight"] = value
        elif key.startswith("backbone."):
            state["mamba." + key[len("backbone.") :]] = value
    model.load_state_dict(state)
    return model.to(device).train()


def ssm_lm(args, hf_model, device, vocab_size: int = 256):
    """ssm's MambaLM with transformers' weights, read the way users load them (from_pretrained)."""
    import tempfile

    from ssm import MambaLM

    if hf_model is None:
        from ssm import MambaConfig

        torch.manual_seed(args.seed)
        config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=vocab_size, ssm_cfg={"d_state": 16})
        return MambaLM(config).to(device).train()
    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        return MambaLM.from_pretrained(directory, device=device).train()


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


def benchmark_train_step(args) -> int:
    """A whole language model's training step: ssm against transformers compiled and mambapy."""
    import subprocess

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
    hf = transformers_mamba(args, device) if args.peers and not args.only_ssm else None
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()} if hf is not None else None
    model = ssm_lm(args, hf, device)
    params = sum(p.numel() for p in model.parameters())
    rows: dict[str, tuple[float, float, list[float]]] = {}
    missing = []
    print("measuring ssm ...", file=sys.stderr, flush=True)
    rows["ssm MambaLM (eager)"] = time_train_steps(make_step(model, lambda m, x: m(x)), args.warmup, args.repeats)
    if args.only_ssm:
        print(json.dumps({"times": rows["ssm MambaLM (eager)"][2]}))
        return 0
    if args.mmap_threshold is not None:
        print(f"measuring ssm under MALLOC_MMAP_THRESHOLD_={args.mmap_threshold} ...", file=sys.stderr, flush=True)
        child = [
            sys.executable,
            os.path.abspath(__file__),
            "--op",
            "train-step",
            "--only-ssm",
            "--device",
            args.device,
            "--batch",
            str(args.batch),
            "--length",
            str(args.length),
            "--d-model",
            str(args.d_model),
            "--layers",
            str(args.layers),
            "--warmup",
            str(args.warmup),
            "--repeats",
            str(args.repeats),
            "--seed",
            str(args.seed),
        ]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
        result = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        times = json.loads(result.stdout.strip().splitlines()[-1])["times"]
        rows[f"ssm MambaLM, MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"] = (math.nan, math.nan, times)
    if "transformers" in args.peers:
        if hf is None:
            missing.append("transformers (not importable)")
        else:
            print("measuring transformers (compiling first) ...", file=sys.stderr, flush=True)
            compiled = torch.compile(hf)
            rows["transformers MambaForCausalLM, torch.compile"] = time_train_steps(
                make_step(compiled, lambda m, x: m(x).logits), args.warmup, args.repeats
            )
    if "mambapy" in args.peers:
        peer = mambapy_lm(args, hf_state, device) if hf_state is not None else None
        if peer is None:
            missing.append("mambapy (not importable, or needs transformers' weights)")
        else:
            print("measuring mambapy ...", file=sys.stderr, flush=True)
            rows["mambapy LM (pscan)"] = time_train_steps(make_step(peer, lambda m, x: m(x)), args.warmup, args.repeats)

    print(
        f"training step (forward, cross-entropy, backward) of a Mamba LM: d_model {args.d_model}, "
        f"{args.layers} layers, vocab 256, N 16, batch {args.batch}, L {args.length} "
        f"({params / 1e6:.2f} M parameters), {describe_device(device)}; median of {args.repeats} steps "
        f"after the first and {args.warmup} more"
    )
    ours = statistics.median(rows["ssm MambaLM (eager)"][2])
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
    losses = [loss for loss, _, _ in rows.values() if not math.isnan(loss)]
    if len(losses) > 1 and max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"MISMATCH: first-step losses differ: {losses}", file=sys.stderr)
        ok = False
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "rows": {n: {"loss": loss, "first_s": fs, "step_s": t} for n, (loss, fs, t) in rows.items()},
                    "not_measured": missing,
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


def benchmark_layers(args) -> int:
    """Forward and forward + backward of whole mixer layers, as ratios to Mamba-2's."""
    from ssm import Mamba, Mamba2, Mamba3

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    d, N, P = args.d_model, args.state, args.headdim
    kw = dict(device=device, dtype=dtype)
    torch.manual_seed(args.seed)
    layers = {
        "Mamba2": Mamba2(d, d_state=N, headdim=P, **kw),
        "Mamba3": Mamba3(d, d_state=N, headdim=P, **kw),
        f"Mamba3 MIMO R={args.mimo_rank}": Mamba3(
            d, d_state=N, headdim=P, is_mimo=True, mimo_rank=args.mimo_rank, **kw
        ),
        "Mamba": Mamba(d, d_state=N, **kw),
    }
    x = torch.randn(args.batch, args.length, d, **kw)
    grad = torch.randn(args.batch, args.length, d, **kw)
    peer = None if args.no_peer else transformers_mamba2_mixer(layers["Mamba2"], d, N, P)
    if peer is not None:  # the same weights: it must compute the same function before it is timed
        layers[PEER_MAMBA2] = peer
        with torch.no_grad():
            difference = relative_difference(peer(x), layers["Mamba2"](x))
        print(f"{PEER_MAMBA2} against ssm's Mamba2, same weights and input: relative difference {difference:.1e}")
        if difference > TOLERANCE[dtype]:
            print(f"error: {PEER_MAMBA2} and ssm's Mamba2 differ beyond {TOLERANCE[dtype]:.0e}")
            return 1

    def forward(layer):
        with torch.no_grad():
            return layer(x)

    def fwd_bwd(layer):
        xi = x.detach().requires_grad_()
        return torch.autograd.grad(layer(xi), [xi, *layer.parameters()], grad)

    samples = {(name, way): [] for name in layers for way in ("fwd", "fwd+bwd")}
    for i in range(args.warmup + args.repeats):
        for name, layer in layers.items():
            for way, fn in (("fwd", forward), ("fwd+bwd", fwd_bwd)):
                synchronize(device)
                start = time.perf_counter()
                fn(layer)
                synchronize(device)
                if i >= args.warmup:
                    samples[name, way].append(1e3 * (time.perf_counter() - start))
    ms = {key: statistics.median(v) for key, v in samples.items()}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "parameters": params,
                    "ms": {f"{name}/{way}": v for (name, way), v in ms.items()},
                    "device": describe_device(device),
                },
                f,
                indent=2,
            )
    return 0


PEER_MAMBA2 = "transformers Mamba2"


def transformers_mamba2_mixer(ours, d_model: int, N: int, P: int):
    """transformers' Mamba2Mixer (its pure-PyTorch chunked path on CPU) holding the weights of
    ``ours`` (the same parameter names), or None when transformers is not importable."""
    try:
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    except ImportError:
        return None
    config = Mamba2Config(
        hidden_size=d_model,
        state_size=N,
        head_dim=P,
        num_heads=2 * d_model // P,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=ours.chunk_size,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        num_hidden_layers=1,
    )
    peer = Mamba2Mixer(config, layer_idx=0).to(device=ours.in_proj.weight.device, dtype=ours.in_proj.weight.dtype)
    peer.load_state_dict(ours.state_dict())
    return peer


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.op == "generate":
        return benchmark_generation(args)
    if args.op == "decode":
        return benchmark_decoding(args)
    if args.op == "cold-start":
        return benchmark_cold_start(args)
    if args.op == "ssd":
        return benchmark_ssd(args)
    if args.op == "packed":
        return benchmark_packed(args)
    if args.op == "train-step":
        return benchmark_train_step(args)
    if args.op == "layer":
        return benchmark_layers(args)
    op, device, dtype = OPS[args.op], torch.device(args.device), DTYPES[args.dtype]

    torch.manual_seed(args.seed)
    make = selective_inputs if op == "selective_scan" else linear_inputs
    cpu_inputs = make(args.batch, args.dim, args.state, args.length)
    # A, D and delta_bias are parameters and stay float32, as in a Mamba layer.
    inputs = tuple(x.to(device, dtype if x.ndim >= 3 else torch.float32).requires_grad_() for x in cpu_inputs)
    grad_out = torch.randn(cpu_inputs[0].shape).to(device, dtype)  # shaped like u or gates

    if op == "selective_scan":
        fns = {b: partial(selective_scan, delta_softplus=True, backend=b) for b in args.backends}
    else:
        fns = {b: partial(linear_scan, dim=2, backend=b) for b in args.backends}
    cases = [Case(name, fn, inputs, grad_out) for name, fn in fns.items()]
    if not args.no_peer:
        cases += peer_cases(op, device, inputs, grad_out)

    copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
    copy_gbps = copy_bandwidth_gbps(device, copy_mib * MiB, repeats=max(args.repeats, 3))
    results, outputs, grads = [], {}, {}
    for case in cases:
        print(f"measuring {case.name} ...", file=sys.stderr, flush=True)
        result, outputs[case.name], grads[case.name] = measure(case, device, args.warmup, args.repeats, copy_gbps)
        results.append(result)

    peers = [r for r in results if r.is_peer]
    for r in results:
        r.speedup = {p.name: p.fwd_bwd_ms / r.fwd_bwd_ms for p in peers}
    references = (["ref"] if "ref" in outputs else []) + [p.name for p in peers]
    failures = []
    for reference in references:
        failures += compare(results, outputs, grads, reference, TOLERANCE[dtype])

    print(describe(args, device, copy_gbps))
    print()
    print(format_table(results))
    print()
    print("max |forward output difference| (max relative gradient difference):")
    for reference in references:
        print("  " + format_differences(results, reference))
    for failure in failures:
        print(f"MISMATCH: {failure}", file=sys.stderr)

    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        environment = {
            "torch": torch.__version__,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "peers": peer_versions(),
            "copy_gbps": copy_gbps,
        }
        report = {
            "config": config,
            "environment": environment,
            "results": [asdict(r) for r in results],
            "mismatches": failures,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
