"""The harness of the scan ops (selective, linear, trapezoidal): every backend of ``ssm.scan.backends`` that
runs on the device and every installed peer, on the same inputs, each timed forward and
forward+backward, its extra peak memory measured, its output and gradients checked against
``ref``'s and each peer's, and its achieved bandwidth computed; ``--lengths`` repeats the whole
run at several lengths (the time-against-length picture). An op module supplies the inputs and
the function of each backend; the rest is here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ssm.memory import extra_peak_bytes
from ssm.scan import backends

from . import peers, report
from .common import DTYPES, TOLERANCE, MiB, comma_ints, config_of, median_ms, relative_difference


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


# ----------------------------------------------------------------------------- arguments


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op selective, linear and trapezoidal")
    group.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="buffer size of the copy-bandwidth measurement (default 1024 on cuda, 64 on cpu)",
    )
    group.add_argument(
        "--compiled-step",
        action="store_true",
        help="--op selective: also time a Python loop over L of torch.compile(selective_scan_step)",
    )
    group.add_argument(
        "--lengths",
        type=comma_ints,
        default=None,
        help="a sweep: the whole run at each of these lengths (instead of --length), e.g. 256,1024,4096",
    )


def check(args, parser, op: str) -> None:
    if args.d_model is None:
        args.d_model = 256  # unused; recorded in the JSON config as it always was
    lengths = args.lengths or [args.length]
    if min(args.batch, args.dim, args.state, *lengths, args.repeats) < 1 or args.warmup < 0:
        parser.error("sizes and --repeats must be positive, --warmup non-negative")
    available = backends(op, args.device)
    unknown = set(args.backends or []).union(args.skip) - set(available)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; on {args.device}: {available}")
    args.backends = [b for b in args.backends or available if b not in args.skip]


# ----------------------------------------------------------------------------- measuring


def to_peer_layout(x: torch.Tensor) -> torch.Tensor:
    """Ours (batch, dim, L, ...) or (batch, N, L) -> the peers' (batch, L, dim, ...) or
    (batch, L, N); tensors of fewer than 3 dimensions (A, D, delta_bias) are the same."""
    return x.transpose(1, 2).contiguous() if x.ndim >= 3 else x


def from_peer_layout(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if x.ndim >= 3 else x


def peer_cases(op: str, device: torch.device, inputs, grad_out) -> list[Case]:
    """The peers that are installed and run on ``device``, on ``inputs`` in their layout."""
    cases = []
    for name, fn, swapped in peers.scan_peers(op, device):
        if swapped:
            peer_inputs = tuple(to_peer_layout(x.detach()).requires_grad_() for x in inputs)
            cases.append(Case(name, fn, peer_inputs, to_peer_layout(grad_out), is_peer=True, swapped=True))
        else:
            cases.append(Case(name, fn, inputs, grad_out, is_peer=True))
    return cases


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


# ----------------------------------------------------------------------------- running


def run(args, op: str, make_inputs, make_functions) -> tuple[int, dict]:
    """The op at ``--length``, or at each of ``--lengths`` (then the report holds one run per
    length under ``runs``); exit status 1 when any row disagrees with a reference."""
    if not args.lengths:
        return run_one(args, op, make_inputs, make_functions)
    status, runs = 0, []
    for length in args.lengths:
        args.length = length
        code, one = run_one(args, op, make_inputs, make_functions)
        status, runs = max(status, code), [*runs, one]
        print()
    return status, {"config": config_of(args), "lengths": args.lengths, "runs": runs}


def run_one(args, op: str, make_inputs, make_functions) -> tuple[int, dict]:
    """``make_inputs(batch, dim, N, length)``: the op's inputs, float32 on the CPU (those of
    fewer than 3 dimensions are parameters and stay float32); ``make_functions(backends)``:
    {backend: fn(*inputs)}."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    cpu_inputs = make_inputs(args.batch, args.dim, args.state, args.length)
    inputs = tuple(x.to(device, dtype if x.ndim >= 3 else torch.float32).requires_grad_() for x in cpu_inputs)
    grad_out = torch.randn(cpu_inputs[0].shape).to(device, dtype)  # shaped like the first input

    cases = [Case(name, fn, inputs, grad_out) for name, fn in make_functions(args.backends).items()]
    if not args.no_peer:
        cases += peer_cases(op, device, inputs, grad_out)

    copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
    copy_gbps = copy_bandwidth_gbps(device, copy_mib * MiB, repeats=max(args.repeats, 3))
    results, outputs, grads = [], {}, {}
    for case in cases:
        print(f"measuring {case.name} ...", file=sys.stderr, flush=True)
        result, outputs[case.name], grads[case.name] = measure(case, device, args.warmup, args.repeats, copy_gbps)
        results.append(result)

    peer_rows = [r for r in results if r.is_peer]
    for r in results:
        r.speedup = {p.name: p.fwd_bwd_ms / r.fwd_bwd_ms for p in peer_rows}
    references = (["ref"] if "ref" in outputs else []) + [p.name for p in peer_rows]
    failures = []
    for reference in references:
        failures += compare(results, outputs, grads, reference, TOLERANCE[dtype])

    print(describe(args, op, device, copy_gbps))
    print()
    print(format_table(results))
    print()
    print("max |forward output difference| (max relative gradient difference):")
    for reference in references:
        print("  " + format_differences(results, reference))
    for failure in failures:
        print(f"MISMATCH: {failure}", file=sys.stderr)

    environment = {
        "torch": torch.__version__,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "peers": peers.versions(),
        "copy_gbps": copy_gbps,
    }
    result = {
        "config": config_of(args),
        "environment": environment,
        "results": [asdict(r) for r in results],
        "mismatches": failures,
    }
    return (1 if failures else 0), result


# ----------------------------------------------------------------------------- reporting


def describe(args, op: str, device: torch.device, copy_gbps: float) -> str:
    if device.type == "cuda":
        where = f"cuda: {torch.cuda.get_device_name(device)}"
    else:
        where = f"cpu: {torch.get_num_threads()} threads, {os.cpu_count()} cores"
    versions = "".join(f", {p} {v}" for p, v in peers.versions().items())
    return (
        f"{op}: batch={args.batch} dim={args.dim} state={args.state} "
        f"length={args.length} {args.dtype} | {where} | torch {torch.__version__}{versions}\n"
        f"median of {args.repeats} after {args.warmup} warm-up; "
        "peak = most memory held at once beyond the inputs (MiB); "
        "x vs P = P's fwd+bwd ms / the row's\n"
        f"GB/s = required input+output bytes / time; % copy = of the measured copy bandwidth, "
        f"{copy_gbps:.1f} GB/s"
    )


def format_table(results: list[Result]) -> str:
    peer_names = [r.name for r in results if r.is_peer]
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
    headers += [f"x vs {p.removesuffix(' (peer)')}" for p in peer_names] or ["x vs peer"]
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
        row += [f"{r.speedup[p]:.2f}" for p in peer_names] or [""]
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


def runs_of(result: dict) -> list[dict]:
    """The single runs of a report, one per length."""
    return result["runs"] if "runs" in result else [result]


def markdown(result: dict, args, op: str) -> tuple[str, str, str]:
    """(section key, title, body): a row per implementation (and length, for a sweep) with its
    times, peak memory and speed-up over each peer; the mismatches, if any, below."""
    runs = runs_of(result)
    sweep = "runs" in result
    c = runs[0]["config"]
    peer_names = [r["name"] for r in runs[0]["results"] if r["is_peer"]]
    headers = (["L"] if sweep else []) + ["implementation", "fwd ms", "fwd+bwd ms", "fwd+bwd peak MiB"]
    headers += [f"x {p.removesuffix(' (peer)')}" for p in peer_names]
    rows = []
    for one in runs:
        for r in one["results"]:
            row = [str(one["config"]["length"])] if sweep else []
            row += [
                r["name"],
                f"{r['forward_ms']:.2f}",
                f"{r['fwd_bwd_ms']:.2f}",
                f"{r['fwd_bwd_peak_bytes'] / MiB:.1f}",
            ]
            row += [f"{r['speedup'][p]:.2f}" for p in peer_names]
            rows.append(row)
    lengths = ", ".join(str(one["config"]["length"]) for one in runs)
    title = f"{op}: batch {c['batch']}, dim {c['dim']}, N {c['state']}, L {lengths}, {c['dtype']}, {c['device']}"
    notes = [
        f"Median of {c['repeats']} after {c['warmup']} warm-up; fwd is under `torch.no_grad()`, fwd+bwd the "
        "gradients of every input; peak = the most memory held at once beyond the inputs; x P = P's fwd+bwd "
        "time over the row's (above 1: faster than P). Every row's output and gradients are checked "
        "against `ref`'s and each peer's in the same run."
    ]
    mismatches = [m for one in runs for m in one["mismatches"]]
    notes += [f"MISMATCH: {m}" for m in mismatches]
    key = op + ("-lengths" if sweep else "")
    return key, title, report.table(headers, rows) + "\n\n" + "\n\n".join(notes)


def plot(result: dict, path: str, op: str) -> None:
    report.save(figure(result, op), path)


def figure(result: dict, op: str):
    """Forward and forward+backward time against length, log-log, one line per implementation."""
    plt = report.pyplot()
    runs = runs_of(result)
    lengths = [one["config"]["length"] for one in runs]
    names = [r["name"] for r in runs[0]["results"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (key, label) in zip(axes, (("forward_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))):
        for name in names:
            ms = [next(r[key] for r in one["results"] if r["name"] == name) for one in runs]
            ax.plot(lengths, ms, marker="o", label=name.removesuffix(" (peer)"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(length) for length in lengths], minor=False)
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xlabel("sequence length L")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms (median)")
    axes[1].legend()
    c = runs[0]["config"]
    fig.suptitle(f"{op}, batch {c['batch']}, dim {c['dim']}, N {c['state']}, {c['dtype']}, {c['device']}")
    return fig
