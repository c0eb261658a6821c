"""--op gpu-peers: ssm beside mamba-ssm, in one process, pair by pair (issue 44). mamba-ssm comes
from its source in third_party/ (scripts/peers/fetch_mamba_ssm.sh; see mamba_ssm_peer.py):

    selective     ssm.scan.selective_scan(backend="triton") / selective_scan_fn (its CUDA build)
    ssd           ssm.scan.ssd(backend="triton") / mamba_chunk_scan_combined
    mamba3        ssm.scan.trapezoidal_scan(backend="auto", i.e. "triton-ssd") / mamba3_siso_combined
    mamba2_layer  ssm.Mamba2 / mamba_ssm.modules.mamba2.Mamba2, the same weights
    train_step    ssm.MambaLM / MambaLMHeadModel at mamba-130m's shapes, Mamba-1 and Mamba-2

Each pair is timed forward and forward+backward (median of --repeats after --warmup, the two
sides taking turns; ms, or tokens/s for a training step), with the peak memory each adds
(torch.cuda.max_memory_allocated above what was allocated before), and checked: the peer's
outputs and gradients against ssm's within the dtype's tolerance ("agree"), so that a fast wrong
answer cannot count. ``--cases`` picks cases, ``--budget`` seconds skips the pairs that would
start after it, ``--pair-seconds`` stops a pair that runs longer (its row says in which phase:
building, each side's first call, checking, timing), and each finished pair is written to --json at once (a run killed
at its time limit keeps its rows). Each phase is printed as it starts. On the CPU the Triton
kernels need TRITON_INTERPRET=1 and the shapes are tiny, float32 (``--tiny``, automatic there):
a check of the argument mappings, not a timing. ``--compile-only`` stops each pair after its
sides' first calls: gpu_check.py runs the cases so, side by side in several processes, to fill
Triton's on-disk cache on many cores before the pairs are timed one at a time."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import signal
import time
import traceback

import torch

from . import gpu_peer_cases as cases
from . import mamba_ssm_peer, report
from .common import DTYPES, TOLERANCE, MiB, comma_list, commit, config_of, synchronize, write_json

CASES = ("selective", "ssd", "mamba3", "mamba2_layer", "train_step")
BUILDERS = {
    "selective": cases.selective,
    "ssd": cases.ssd,
    "mamba3": cases.mamba3,
    "mamba2_layer": cases.mamba2_layer,
    "train_step": cases.train_step,
}
SSD_130M = dict(heads=24, P=64, N=128, chunk=256)
MAMBA3_130M = dict(heads=24, P=64, N=128, chunk=64)
LAYER_130M = dict(d_model=768, N=128, P=64, chunk=256)
LM_130M = dict(d_model=768, layers=24, vocab=50280)
# The dry run's shapes: as small as the kernels take, lengths across chunk borders.
TINY = {
    "selective": [dict(batch=1, dim=8, N=4, L=64)],
    "ssd": [dict(batch=1, L=40, heads=2, P=16, N=16, chunk=16)],
    "mamba3": [dict(batch=1, L=40, heads=2, P=16, N=16, chunk=16)],
    "mamba2_layer": [dict(batch=1, L=40, d_model=32, N=16, P=16, chunk=16)],
    "train_step": [dict(batch=1, L=24, d_model=32, layers=1, vocab=64, mixer=m, N=16, P=16, chunk=16)
                   for m in ("Mamba1", "Mamba2")],
}  # fmt: skip
INTERPRETER_ONLY_FORWARD = (
    "the peer's Mamba-3 forward runs in Triton's interpreter (its PTX approximations swapped for "
    "Triton's functions) but wrongly: its bfloat16 arithmetic (tensor-descriptor round trips, dots) "
    "comes out wrong there; its backward asserts CUDA tensors"
)


def plan(tiny: bool) -> list[tuple[str, dict, str]]:
    """(case, shape, dtype) of every pair, in the order they run: the first pair of each case
    before the second of any, so that a step that runs out of time has lost the least."""
    if tiny:
        return [(case, shape, "float32") for case in CASES for shape in TINY[case]]
    selective = dict(batch=8, dim=1536, N=16, L=2048)
    return [
        ("selective", selective, "bfloat16"),
        ("ssd", dict(batch=8, L=2048, **SSD_130M), "bfloat16"),
        ("mamba3", dict(batch=8, L=2048, **MAMBA3_130M), "bfloat16"),
        ("mamba2_layer", dict(batch=8, L=2048, **LAYER_130M), "bfloat16"),
        ("train_step", dict(batch=8, L=2048, mixer="Mamba2", **LM_130M), "bfloat16"),
        ("train_step", dict(batch=8, L=2048, mixer="Mamba1", **LM_130M), "bfloat16"),
        ("selective", selective, "float32"),
        ("mamba3", dict(batch=1, L=65536, **MAMBA3_130M), "bfloat16"),  # issue 48's second shape
        ("ssd", dict(batch=8, L=2048, **SSD_130M | {"heads": 32}), "bfloat16"),
        *[("ssd", dict(batch=1, L=L, **SSD_130M), "bfloat16") for L in (8192, 65536)],
    ]


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op gpu-peers (also --repeats, --warmup, --device)")
    group.add_argument("--cases", type=comma_list, default=list(CASES), help="comma-separated, of " + ", ".join(CASES))
    group.add_argument("--tiny", action="store_true", help="the dry run's shapes, float32 (automatic on the CPU)")
    group.add_argument("--budget", type=float, default=None, help="seconds: no pair starts after them")
    group.add_argument("--pair-seconds", type=float, default=None, help="seconds: a pair running longer is stopped")
    group.add_argument(
        "--autotune-shard",
        type=shard_of,
        default=None,
        metavar="I/K",
        help="with --compile-only: the peer's autotuned kernels keep their configurations I, I+K, I+2K, ... "
        "(K processes compile all of them between them into Triton's cache)",
    )
    group.add_argument(
        "--compile-only",
        action="store_true",
        help="only each side's first call (which compiles its kernels, and fills Triton's cache on disk for a "
        "later process): no check, no timing; the rows give each side's seconds",
    )


def shard_of(text: str) -> tuple[int, int]:
    """ "I/K" -> (I, K), 0 <= I < K."""
    try:
        i, k = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--autotune-shard wants I/K, two integers, got {text!r}") from None
    if not 0 <= i < k:
        raise argparse.ArgumentTypeError(f"--autotune-shard I/K wants 0 <= I < K, got {text!r}")
    return i, k


def check(args, parser) -> None:
    unknown = set(args.cases) - set(CASES)
    if unknown or not args.cases:
        parser.error(f"unknown cases {sorted(unknown)}: choose from {', '.join(CASES)}")
    if args.autotune_shard is not None and not args.compile_only:
        parser.error("--autotune-shard cuts the peer's autotuning: only with --compile-only, never for a timing")
    if args.device == "cpu":
        from ssm.scan.triton._interpreter import interpreting

        if not interpreting():
            parser.error("--op gpu-peers on the CPU runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        args.tiny = True


def shape_label(shape: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in shape.items())


def peer_skip(case: str, shape: dict, peer, device: torch.device) -> str | None:
    """Why the peer of this pair cannot run here (None when it can)."""
    needs_build = case == "selective" or (case == "train_step" and shape["mixer"] == "Mamba1")
    if needs_build and not peer.built["selective_scan_cuda"]:
        why = "no CUDA here" if device.type == "cpu" else "see build-selective_scan_cuda.log"
        error = peer.errors.get("selective_scan_cuda")
        return f"selective_scan_cuda is not built ({error or why})"
    module = {"selective": "selective", "ssd": "ssd", "mamba3": "mamba3", "mamba2_layer": "mamba2"}.get(case, "models")
    if getattr(peer, module) is None:
        return f"mamba-ssm's {module} module did not import: {peer.errors[module]}"
    return None


def timed(fn, train: bool, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn(train)
    synchronize(device)
    return time.perf_counter() - start


def peak_mib(fn, train: bool, device: torch.device) -> float | None:
    """MiB that one call allocates at its peak above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn(train)
    synchronize(device)
    return round((torch.cuda.max_memory_allocated(device) - base) / MiB, 1)


def measure(pair: cases.Pair, train: bool, device, warmup: int, repeats: int) -> dict:
    """Both sides, taking turns: the median seconds of each and each one's peak memory."""
    sides = {"ssm": pair.ssm, "peer": pair.peer}
    for _ in range(warmup):
        for fn in sides.values():
            fn(train)
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(timed(fn, train, device))
    result = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    result |= {f"peak_mib_{name}": peak_mib(fn, train, device) for name, fn in sides.items()}
    return result


class PairOverTime(BaseException):
    """A pair past --pair-seconds (a BaseException: the pair's own ``except Exception`` blocks,
    which turn one phase's failure into its row, must not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise PairOverTime in this (the main) thread after ``seconds``; None: no limit."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise PairOverTime()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Phases:
    """The pair's current phase, printed as it starts, so that a pair stopped or killed in the
    middle says where its time went."""

    def __init__(self):
        self.start, self.name = time.perf_counter(), "starting"

    def __call__(self, name: str) -> None:
        self.name = name
        print(f"  [{time.perf_counter() - self.start:6.1f} s] {name}", flush=True)


def run_pair(case: str, shape: dict, dtype_name: str, peer, args, device, phase=None) -> list[dict]:
    """The rows of one pair: forward and forward+backward, or one row saying why not."""
    base = {"op": case, "shape": shape_label(shape), "dtype": dtype_name, "device": device_name(device)}
    skip = peer_skip(case, shape, peer, device)
    if skip:
        return [base | {"skipped": skip}]
    phase = phase or Phases()
    dtype = DTYPES[dtype_name]
    start = time.perf_counter()
    phase("building both sides")
    try:
        pair = BUILDERS[case](peer, shape, dtype, device, TOLERANCE[dtype])
    except Exception as e:  # noqa: BLE001 - one pair's failure is its row, the others still run
        return [base | {"error": f"building the pair: {type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}]
    interpreted_mamba3 = case == "mamba3" and device.type == "cpu"
    passes = (True,) if args.tiny else pair.passes  # the dry run: one pass, the check is its point
    if interpreted_mamba3:
        passes = (False,)
    # Each side's first call alone, forward+backward where the pair times it: it compiles that
    # side's kernels (cold, the peer's autotuned Triton kernels took minutes in the window of
    # 2026-11-28), so that a pair stopped here says whose compile held it, and the check and the
    # timings after it start warm.
    first_call = {}
    for name, fn in (("ssm", pair.ssm), ("peer", pair.peer)):
        phase(f"first call of {name}'s side ({'fwd+bwd' if max(passes) else 'fwd'}: compiles its kernels)")
        started = time.perf_counter()
        try:
            fn(max(passes))
            synchronize(device)
        except Exception as e:  # noqa: BLE001
            error = f"first call of {name}'s side: {type(e).__name__}: {e}"
            return [base | {"error": error, "trace": traceback.format_exc(limit=4), "first_call_s": first_call}]
        first_call[name] = round(time.perf_counter() - started, 3)  # a warm tiny call can take under 0.05 s
    base["first_call_s"] = first_call
    if getattr(args, "compile_only", False):
        return [base | {"compiled": True, "seconds": round(time.perf_counter() - start, 1)}]
    if interpreted_mamba3:
        agreement = {"agree": "unchecked", "why": INTERPRETER_ONLY_FORWARD}
    else:
        try:
            phase("checking: both sides' outputs and gradients (the first calls compile)")
            agreement = pair.check()
        except Exception as e:  # noqa: BLE001
            agreement = {"agree": False, "why": f"{type(e).__name__}: {e}"}
    rows = []
    for train in passes:
        row = base | {"pass": "fwd+bwd" if train else "fwd"} | agreement
        phase(f"timing {row['pass']}")
        try:
            measured = measure(pair, train, device, args.warmup, args.repeats)
        except Exception as e:  # noqa: BLE001
            rows.append(row | {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)})
            continue
        if pair.tokens:
            row |= {"ssm": round(pair.tokens / measured["ssm"]), "peer": round(pair.tokens / measured["peer"])}
            row["unit"] = "tokens/s"
        else:
            row |= {"ssm": round(1e3 * measured["ssm"], 3), "peer": round(1e3 * measured["peer"], 3), "unit": "ms"}
        row |= {k: v for k, v in measured.items() if k.startswith("peak")}
        rows.append(row | ({"note": "; ".join(pair.notes)} if pair.notes else {}))
    for row in rows:
        row["seconds"] = round(time.perf_counter() - start, 1)  # the pair's whole time, compiles included
    del pair
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)"


def run(args) -> tuple[int, dict | None]:
    device = torch.device(args.device)
    start = time.perf_counter()
    stamp = {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    result = {"config": config_of(args), "rows": []}
    problem = mamba_ssm_peer.source_problem()
    if problem:
        result["rows"] = [{"op": case, "skipped": problem} for case in args.cases]
        print(f"gpu-peers: {problem}")
        return 0, result
    peer = mamba_ssm_peer.load(interpreting=device.type == "cpu", shard=getattr(args, "autotune_shard", None))
    result["peer"] = {"version": peer.version, "built": peer.built, "stubs": peer.stubs, "errors": peer.errors}
    print(f"mamba-ssm {peer.version} from third_party (built: {peer.built}; stubs: {peer.stubs})", flush=True)
    for case, shape, dtype in plan(args.tiny):
        if case not in args.cases:
            continue
        left = None if args.budget is None else args.budget - (time.perf_counter() - start)
        if left is not None and left < 5:
            rows = [{"op": case, "shape": shape_label(shape), "dtype": dtype, "skipped": "out of the step's time"}]
        else:
            print(f"{case}: {shape_label(shape)}, {dtype} ...", flush=True)
            limit = args.pair_seconds if left is None else min(args.pair_seconds or left, left)
            phase = Phases()
            try:
                with time_limit(limit):
                    rows = run_pair(case, shape, dtype, peer, args, device, phase)
            except PairOverTime:
                why = f"stopped after {limit:.3g} s, while {phase.name}"
                rows = [{"op": case, "shape": shape_label(shape), "dtype": dtype, "skipped": why}]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for row in rows:
            result["rows"].append(stamp | row if "ssm" in row else row)
            shown = ("pass", "agree", "worst", "why", "ssm", "peer", "unit", "first_call_s", "skipped", "error",
                     "seconds")  # fmt: skip
            print("  " + ", ".join(f"{k} {row[k]}" for k in shown if k in row), flush=True)
        if args.json:
            write_json(args.json, result)  # after each pair: a run killed at its limit keeps its rows
    failed = [r for r in result["rows"] if "error" in r or r.get("agree") is False]
    return (1 if failed else 0), result


# ----------------------------------------------------------------------------- the table


def cell(value, unit: str | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and unit != "tokens/s":
        return f"{value:,.3f}" if value < 100 else f"{value:,.1f}"
    return f"{value:,}"


def table_rows(rows: list[dict]) -> list[list[str]]:
    """Each measured row: its pair, ssm's and the peer's figures, the ratio (> 1: ssm ahead),
    peak MiB and agreement; each skipped one with its reason."""
    out = []
    for r in rows:
        what = f"{r['op']} ({r.get('shape', '')}, {r.get('dtype', '')})"
        if "ssm" not in r:
            reason = r.get("skipped") or r.get("error") or "?"
            out.append([what, r.get("pass", "-"), "-", "-", "-", "-", "-", f"not measured: {reason}"])
            continue
        ahead = r["ssm"] / r["peer"] if r["unit"] == "tokens/s" else r["peer"] / r["ssm"]
        agree = {True: "yes", False: "**NO**"}.get(r["agree"], r["agree"])
        details = f"{agree} ({r['worst']}: {r['diff'][r['worst']]:.1e})" if "diff" in r else f"{agree}: {r.get('why')}"
        if r.get("referee"):  # each side's distance from the peer in float32, at ssm's farthest tensor
            ref = r["referee"]
            details += f"; from float32: ssm {ref['ssm']:.1e}, peer {ref['peer']:.1e} ({ref['tensor']})"
        peaks = f"{cell(r.get('peak_mib_ssm'))} / {cell(r.get('peak_mib_peer'))}"
        out.append([what, r["pass"], f"{cell(r['ssm'], r['unit'])} {r['unit']}", f"{cell(r['peer'], r['unit'])}",
                    f"{ahead:.2f}x", peaks, details, r.get("note", "")])  # fmt: skip
    return out


HEADERS = ["pair", "pass", "ssm", "mamba-ssm", "ssm ahead by", "peak MiB ssm / peer", "agree", "note"]


def markdown(result: dict, args) -> tuple[str, str, str]:
    body = report.table(HEADERS, table_rows(result["rows"]))
    peer = result.get("peer", {})
    body += (
        f"\n\nmamba-ssm {peer.get('version')} from its source (built: {peer.get('built')}); median of "
        f'{args.repeats} after {args.warmup} warm-up, the two sides taking turns. "ssm ahead by": the peer\'s '
        "time over ssm's (tokens/s: ssm's over the peer's). Peak: MiB allocated above the inputs."
    )
    return "gpu-peers", "ssm beside mamba-ssm, one process", body
