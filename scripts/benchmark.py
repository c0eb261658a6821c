"""Time ssm against itself and its peers: one command, one ``--op`` at a time.

    selective   the selective scan, every backend and mambapy (the default op; --lengths sweeps)
    linear      the linear scan, every backend and mambapy
    trapezoidal Mamba-3's scan, every backend
    ssd         Mamba-2's scan, every fast backend
    layer       whole mixer layers (Mamba-1, -2, -3 SISO and MIMO) and transformers' Mamba2 mixer
    train-step  a language model's training step against transformers (compiled) and mambapy
    hybrid      a hybrid model (attention in one block of four) against all-Mamba: training, decoding
    decode      greedy decoding at mamba-130m's size against transformers
    generate    a decoding step against position, and the cache against recomputation
    packed      packed documents against padded ones, and the packed scan against a loop
    cold-start  scripts/train.py's start-up with an empty and a filled kernel cache
    memory      the resident memory of decoding at each precision (float32 .. int4)
    gpu-peers   ssm beside mamba-ssm (from third_party/) pair by pair, checked to agree (gpu_check runs it)
    context-parallel  memory per rank of a training step split over W gloo processes, against L

Each op lives in scripts/bench/<op>.py (``python scripts/benchmark.py --op OP --help`` prints its
description); every op takes ``--device cpu|cuda`` (on CUDA the Triton backend is timed beside
the others), ``--json PATH`` (the results), ``--markdown PATH`` (its table, with machine, date,
commit and command, into that file's section for the op) and, where the op has a picture,
``--plot PATH``. A mismatch between implementations prints MISMATCH (or error) and makes the
exit status 1. ``make bench`` regenerates BENCHMARKS.md and its pictures.

Examples:

    python scripts/benchmark.py                              # a mamba-130m layer, every backend
    python scripts/benchmark.py --op linear --repeats 3
    python scripts/benchmark.py --length 4096 --skip ref --json bench.json
    python scripts/benchmark.py --lengths 256,1024,4096 --skip ref --plot docs/bench/selective.png
    python scripts/benchmark.py --op generate                # recurrent decoding of a small LM
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ssm, whichever is installed
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/bench, also under runpy

from bench import OPS, common, report  # noqa: E402


def op_module(op: str):
    return importlib.import_module(f"bench.{OPS[op]}")


def build_parser(op: str | None = None) -> argparse.ArgumentParser:
    """Every op's options (one namespace, as the JSON configs record it); ``op``'s own
    description below the usage when it is known."""
    epilog = op_module(op).__doc__ if op in OPS else None
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--op", choices=list(OPS), default="selective")
    common.add_arguments(parser)
    adders = dict.fromkeys(getattr(op_module(name), "add_arguments", None) for name in OPS)
    for add in filter(None, adders):
        add(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--op", choices=list(OPS), default="selective")
    known, _ = first.parse_known_args(argv)
    parser = build_parser(known.op)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        parser.error(f"--device cuda, but CUDA is not available: {why} (torch {torch.__version__})")
    common.fill_defaults(args)
    module = op_module(args.op)
    if hasattr(module, "check"):
        module.check(args, parser)
    if args.plot and not hasattr(module, "plot"):
        parser.error(f"--op {args.op} draws no picture; --plot is for {', '.join(ops_with('plot'))}")
    return args


def ops_with(attribute: str) -> list[str]:
    return [op for op in OPS if hasattr(op_module(op), attribute)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    module = op_module(args.op)
    status, result = module.run(args)
    if result is None:  # stopped before any result (an error it printed), or a child's run
        return status
    if args.json:
        common.write_json(args.json, result)
    if args.plot:
        module.plot(result, args.plot)
    if args.markdown:
        key, title, body = module.markdown(result, args)
        key = f"{key}-{args.device}"  # a GPU run and a CPU run of an op each keep their section
        picture = report.relative_picture(args.plot, args.markdown)
        report.write_section(
            args.markdown, key, report.section(key, title, body, common.run_header(args, argv), picture)
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
