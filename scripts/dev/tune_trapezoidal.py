"""Time the Triton trapezoidal scan's (Mamba-3 SISO) launch configurations on a GPU (a developer's
tool, as tune_selective.py beside it): forward and forward+backward ms of each (CHUNK, BLOCK_P,
forward warps, backward warps), by replacing trapezoidal_scan.config, with each configuration's
output and gradients checked against the PyTorch chunked backend's.

    python scripts/dev/tune_trapezoidal.py 120        # time each config until 120 s have passed
    python scripts/dev/tune_trapezoidal.py 70 3/8     # only every 8th config from the 3rd: run 8
                                                      # at once to compile in parallel, then time
                                                      # them all in one process

SHAPES="B,H,P,N,L;..." (default: batch 8, 24 heads of 64 channels, N 16 and N 128, L 2048: the
benchmark's shape and Mamba-3's d_state). Writes $OUT/sweep_trapezoidal.json (default /tmp);
REPS timed calls per figure (median; default 10). Without CUDA it runs in Triton's interpreter
(tiny SHAPES only; checks the script). Imports this checkout's ssm, whichever one is installed;
tests/scan/test_tune_scripts.py runs main().
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # this checkout's ssm
sys.path.insert(0, str(HERE))  # tune_selective beside it, also under runpy
if not torch.cuda.is_available():  # before the kernels are defined (see tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tune_selective import DEVICE, record  # noqa: E402

import ssm.scan.triton.trapezoidal_scan as T  # noqa: E402
from ssm.scan import trapezoidal_scan  # noqa: E402
from ssm.scan.triton._jit import next_power_of_2  # noqa: E402

WARPS = ((2, 4), (4, 4), (4, 8), (8, 8))  # (forward, backward)
MAX_TILE = 16384  # elements of one (BLOCK_P, BLOCK_N, CHUNK) tile


def grid(N: int) -> list[tuple[int, int, int, int]]:
    """(CHUNK, BLOCK_P, warps forward, warps backward), the default's first."""
    d = T.config(64, N, 1)
    rows = [(d.chunk, d.block_p, d.num_warps, d.num_warps_bwd)]
    for chunk, block_p, (wf, wb) in itertools.product((8, 16, 32), (2, 4, 8, 16, 32, 64), WARPS):
        if block_p * next_power_of_2(N) * chunk <= MAX_TILE and (chunk, block_p, wf, wb) not in rows:
            rows.append((chunk, block_p, wf, wb))
    return rows


def inputs(shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    """trapezoidal_scan's arguments at benchmark.py --op trapezoidal's value ranges."""
    batch, H, P, N, L = shape
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*size):
        return torch.rand(*size, device=DEVICE, generator=g)

    def randn(*size):
        return torch.randn(*size, device=DEVICE, generator=g)

    x = dict(x=randn(batch, L, H, P), z=randn(batch, L, H, P), B=randn(batch, L, 1, N), C=randn(batch, L, 1, N))
    x = {k: v.to(dtype) for k, v in x.items()}
    x |= dict(dt=1e-3 + 0.099 * rand(batch, L, H), A=-0.5 - rand(batch, L, H), trap=rand(batch, L, H))
    x |= dict(angles=0.1 * rand(batch, L, H, N // 2), D=randn(H))
    return {k: v.requires_grad_() for k, v in x.items()}


def with_config(chunk: int, block_p: int, warps: int, warps_bwd: int):
    def config(P, N, R):
        block_r, block_n = next_power_of_2(R), next_power_of_2(N)
        return T.Config(block_r, min(block_p, next_power_of_2(P)), block_n, chunk, warps, warps_bwd)

    return config


def outputs_and_grads(x: dict, backend: str) -> list[torch.Tensor]:
    for v in x.values():
        v.grad = None
    out = trapezoidal_scan(**x, backend=backend)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    out.float().backward(torch.randn(out.shape, device=DEVICE, generator=g))
    return [t.detach().float().clone() for t in (out, *(v.grad for v in x.values()))]  # .float() may alias


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest of each tensor's max |got - want| / max |want|."""
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, want))


def main(argv: list[str]) -> None:
    deadline = time.time() + float(argv[0])
    part = tuple(map(int, argv[1].split("/"))) if len(argv) > 1 else (0, 1)
    shapes = os.environ.get("SHAPES", "8,24,64,16,2048;8,24,64,128,2048")
    shapes = [tuple(int(v) for v in s.split(",")) for s in shapes.split(";")]
    reps = int(os.environ.get("REPS", "10"))
    path = os.path.join(os.environ.get("OUT", "/tmp"), "sweep_trapezoidal.json")
    default, results = T.config, []
    for shape, dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
        x = inputs(shape, dtype)
        want = outputs_and_grads(x, "chunked")
        for cfg in grid(shape[3])[part[0] :: part[1]]:
            if time.time() > deadline:
                break
            T.config = with_config(*cfg)

            def forward():
                with torch.no_grad():
                    trapezoidal_scan(**x, backend="triton")

            def forward_backward():
                trapezoidal_scan(**x, backend="triton").sum().backward()

            def check():
                return dict(max_rel_err=float(f"{max_error(outputs_and_grads(x, 'triton'), want):.2e}"))

            row = dict(shape=shape, dtype=str(dtype).removeprefix("torch."), chunk=cfg[0], block_p=cfg[1])
            try:
                row |= dict(warps_f=cfg[2], warps_b=cfg[3])
                record(row, forward, forward_backward, reps, results, path, check)
            finally:
                T.config = default


if __name__ == "__main__":
    main(sys.argv[1:])
