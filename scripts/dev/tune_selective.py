"""Time the Triton selective scan's launch configurations on a GPU (a developer's tool, as
compile_kernels.py beside it): forward and forward+backward ms of each (CHUNK, TILE, warps),
by replacing selective_scan.config, at mamba-ssm's benchmark shape (SHAPE="B,D,N,L").

    python scripts/dev/tune_selective.py 120         # time each config until 120 s have passed
    python scripts/dev/tune_selective.py 70 3/8      # only every 8th config from the 3rd: run 8
                                                     # of these at once to compile in parallel,
                                                     # then time them all in one process

Writes $OUT/sweep.json (default /tmp); REPS timed calls per figure (median; default 10). Without
CUDA it runs on the CPU in Triton's interpreter (tiny SHAPE only; checks the script). The H200
run behind selective_scan.config's warps is in BENCHMARKS.md ("CUDA"). Imports this checkout's
ssm, whichever one is installed; tests/scan/test_tune_scripts.py runs main().
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ssm
if not torch.cuda.is_available():  # before the kernels are defined (see tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ssm.scan.triton.selective_scan as S  # noqa: E402
from ssm.scan import selective_scan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRID = [(32, 2048, 4, 8)] + [  # (CHUNK, TILE, warps forward, warps backward); the first: the old default
    (chunk, tile, warps, warps_bwd)
    for chunk, tile in itertools.product((16, 32, 64), (512, 1024, 2048, 4096))
    for warps, warps_bwd in ((4, 4), (4, 8), (8, 16))
    if not (tile >= 4096 and warps_bwd == 4)
]


def inputs(shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    batch, dim, N, L = shape
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, device=DEVICE, generator=g)

    x = dict(u=randn(batch, dim, L), delta=0.5 * randn(batch, dim, L), B=randn(batch, 1, N, L))
    x |= dict(C=randn(batch, 1, N, L), z=randn(batch, dim, L))
    x = {k: v.to(dtype) for k, v in x.items()}
    x |= dict(A=-torch.rand(dim, N, device=DEVICE) - 0.5, D=randn(dim), delta_bias=randn(dim))
    return {k: v.requires_grad_() for k, v in x.items()}


def median_ms(fn, reps: int) -> float:
    def sync():
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def with_config(chunk: int, tile: int, warps: int, warps_bwd: int):
    """selective_scan.config at another CHUNK and TILE (the module constants it reads), with
    these warps."""
    default = S.config

    def config(u, B, C):
        saved = S.CHUNK, S.TILE
        S.CHUNK, S.TILE = chunk, tile
        try:
            return dataclasses.replace(default(u, B, C), num_warps=warps, num_warps_bwd=warps_bwd)
        finally:
            S.CHUNK, S.TILE = saved

    return config


def main(argv: list[str]) -> None:
    deadline = time.time() + float(argv[0])
    grid = GRID
    if len(argv) > 1:
        i, n = map(int, argv[1].split("/"))
        grid = grid[i::n]
    shape = tuple(int(v) for v in os.environ.get("SHAPE", "8,1536,16,2048").split(","))
    reps = int(os.environ.get("REPS", "10"))
    path = os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json")
    default, results = S.config, []
    for dtype in (torch.float32, torch.bfloat16):
        x = inputs(shape, dtype)
        for cfg in grid:
            if time.time() > deadline:
                break
            S.config = with_config(*cfg)

            def forward():
                with torch.no_grad():
                    selective_scan(**x, delta_softplus=True, backend="triton")

            def forward_backward():
                selective_scan(**x, delta_softplus=True, backend="triton").sum().backward()

            row = dict(dtype=str(dtype).removeprefix("torch."), chunk=cfg[0], tile=cfg[1])
            try:
                record(row | dict(warps_f=cfg[2], warps_b=cfg[3]), forward, forward_backward, reps, results, path)
            finally:
                S.config = default


def record(row: dict, forward, forward_backward, reps: int, results: list, path: str, check=None) -> None:
    """``row`` with the median ms of ``forward`` and ``forward_backward`` (and what ``check()``
    returns, a dict), or the error a configuration met, printed and added to ``results``, which
    are written to ``path`` at once (a sweep stopped at its deadline keeps every row)."""
    try:
        row |= dict(fwd_ms=round(median_ms(forward, reps), 3))
        row |= dict(fwd_bwd_ms=round(median_ms(forward_backward, reps), 3))
        if check is not None:
            row |= check()
    except Exception as e:  # a config the compiler refuses is a row, not the end of the sweep
        row |= dict(error=repr(e)[:300])
    print(row, flush=True)
    results.append(row)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
