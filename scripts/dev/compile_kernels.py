"""Compile every Triton kernel of ssm.scan.triton for a GPU target, without a GPU.

Triton's interpreter (what the tests run the kernels in) executes the kernel bodies as
Python and accepts code that the compiler rejects; this compiles them to a cubin for
sm_90 (Hopper) instead, through ptxas shipped with triton, and prints each kernel's
registers and local (spill) memory. Run without TRITON_INTERPRET (the kernels must be
JIT functions):

    python scripts/dev/compile_kernels.py           # inputs in bf16 and in fp32
    python scripts/dev/compile_kernels.py bf16      # what tests/scan/test_triton.py runs

Imports this checkout's ssm, whichever one is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ssm
from ssm.scan.triton import (  # noqa: E402
    _ssd_bwd_kernels,
    _ssd_kernels,
    linear_scan,
    selective_scan,
    ssd,
    trapezoidal_scan,
)

IO = {"u_ptr", "delta_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr", "dout_ptr", "du_ptr", "ddelta_ptr", "dz_ptr", "x_ptr"}
IO |= {"dt_ptr", "y_pre_ptr", "dy_ptr", "dx_ptr", "ddt_ptr"}  # ssd's (its delta_ptr is float32 Δ)
INT64 = {"bounds_ptr", "chunk_first_ptr", "cu_ptr"}
FLOAT = {"dt_min", "dt_max"}


def signature(fn, constexprs: dict, io_type: str) -> dict:
    """Pointers ending in _ptr (16-bit for the (B, D, L)-sized ones, int32 for the sequence of
    each packed step), int32 for the rest but float scalars."""
    io = IO - {"delta_ptr"} if fn.__name__.startswith("_ssd") else IO
    return {
        name: "constexpr"
        if name in constexprs
        else "*i32"
        if name == "seq_ptr"
        else (f"*{io_type}" if name in io else "*i64" if name in INT64 else "*fp32")
        if name.endswith("_ptr")
        else "fp32"
        if name in FLOAT
        else "i32"
        for name in fn.arg_names
    }


def variants(io_type: str = "bf16"):
    """(JIT function, its compile-time arguments, warps) of every kernel at a mamba-130m layer's
    shape, each with every option on (the flags @triton.heuristics would derive), the selective
    scan's also packed (PACKED: cu_seqlens) and the linear scan's packed."""
    import torch

    u, B = torch.empty(1, 1536, 1), torch.empty(1, 1, 16, 1)
    cfg = selective_scan.config(u, B, B)
    blocks = dict(BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk)
    flags = dict(COMPUTE=tl.float32, HAS_D=True, HAS_Z=True, HAS_DELTA_BIAS=True, SOFTPLUS=True, **blocks)
    bwd = dict(HAS_DLAST=True, LOG2_CHUNK=cfg.chunk.bit_length() - 1, INT=tl.int32)
    for varying, packed in ((True, False), (False, False), (True, True)):
        BC = dict(B_VARYING=varying, C_VARYING=varying, HAS_INITIAL_STATE=True, PACKED=packed)
        fwd = {**flags, **BC, "SAVE_CHUNK_STATES": True}
        yield selective_scan._selective_scan_fwd_kernel.fn, fwd, cfg.num_warps
        yield selective_scan._selective_scan_bwd_kernel.fn, {**flags, **BC, **bwd}, cfg.num_warps_bwd
    # trapezoidal_scan at a Mamba-3 layer of mamba-ssm's defaults (P 64, N 128), SISO and MIMO rank 4
    for ranks in (1, 4):
        cfg = trapezoidal_scan.config(64, 128, ranks)
        blocks = dict(
            BLOCK_R=cfg.block_r,
            BLOCK_P=cfg.block_p,
            BLOCK_N=cfg.block_n,
            CHUNK=cfg.chunk,
            HALVED=ranks > 1,
            COMPUTE=tl.float32,
            HAS_B_BIAS=True,
            HAS_C_BIAS=True,
            HAS_MIMO_X=ranks > 1,
            HAS_Z=True,
            HAS_MIMO_Z=ranks > 1,
            HAS_MIMO_O=ranks > 1,
            HAS_D=True,
        )
        yield (
            trapezoidal_scan._trapezoidal_scan_fwd_kernel.fn,
            {**blocks, "HAS_INITIAL_STATE": True, "SAVE_CHUNK_STATES": True},
            cfg.num_warps,
        )
        yield (
            trapezoidal_scan._trapezoidal_scan_bwd_kernel.fn,
            {**blocks, "HAS_DLAST": True, "INT": tl.int32, "LOG2_CHUNK": cfg.chunk.bit_length() - 1},
            cfg.num_warps_bwd,
        )
    lin = linear_scan.config(65536, 4)
    for backward, packed in ((False, False), (True, False), (False, True), (True, True)):
        constexprs = dict(
            COMPUTE=tl.float32,
            REVERSE=True,
            HAS_INITIAL_STATE=True,
            BACKWARD=backward,
            PACKED=packed,
            BLOCK_T=lin.block_t,
            BLOCK_F=lin.block_f,
        )
        yield linear_scan._linear_scan_kernel.fn, constexprs, lin.num_warps
    yield from ssd_variants(io_type)


def ssd_variants(io_type: str):
    """ssd's kernels at a Mamba-2-130m layer (P 64, N 128, chunks of 256), every option on:
    unpacked (training) for the kernels both paths run, packed for all."""
    half = io_type in ("bf16", "fp16")
    cfg = ssd.config(8, 2048, 24, 64, 1, 128, 256, 2 if half else 4)
    dots = dict(DOT=tl.bfloat16 if io_type == "bf16" else tl.float16 if half else tl.float32)
    dots.update(PRECISION="tf32" if half else "ieee", COMPUTE=tl.float32)
    tiles = dict(CHUNK=cfg.chunk, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n)
    dt = dict(HAS_DT_BIAS=True, SOFTPLUS=True, CLAMP=True, COMPUTE=tl.float32, CHUNK=cfg.chunk, BLOCK_H=cfg.block_h)
    passing = dict(HAS_H0=True, COMPUTE=tl.float32, CHUNK=cfg.chunk, BLOCK=ssd.STATE_BLOCK)
    fwd, bwd = _ssd_kernels, _ssd_bwd_kernels
    w = cfg.num_warps
    yield fwd._ssd_cumsum_kernel, dt, w
    yield fwd._ssd_cb_kernel, {**dots, **tiles}, w
    yield bwd._ssd_gate_bwd_kernel, dict(HAS_Z=True, HAS_D=True, COMPUTE=tl.float32, BLOCK_L=cfg.block_l, BLOCK_P=64), w
    for packed in (False, True):
        head = dict(PACKED=packed, HAS_H0=True, **dots, **tiles)
        yield fwd._ssd_chunk_state_kernel, {**head, "BLOCK_P": cfg.block_p}, w
        yield fwd._ssd_state_passing_kernel, {**passing, "PACKED": packed, "STORE_LAST": not packed}, w
        gate = dict(HAS_D=True, D_PER_CHANNEL=packed, HAS_Z=True, SAVE_Y=True, BLOCK_P=cfg.block_p)
        yield fwd._ssd_chunk_scan_kernel, {**head, **gate}, w
        del head["HAS_H0"]
        yield bwd._ssd_dstate_kernel, {**head, "HAS_DLAST": True, "BLOCK_P": cfg.block_p}, w
        yield bwd._ssd_state_passing_bwd_kernel, {**passing, "PACKED": packed, "HAS_DLAST": True}, w
        full = dict(BLOCK_P=cfg.block_p_full, **head)
        yield bwd._ssd_bwd_dx_kernel, {**full, "HAS_DLAST": True, "HAS_D": True, "D_PER_CHANNEL": packed}, w
        yield bwd._ssd_bwd_dc_kernel, {**full, "HAS_H0": True}, w
        yield bwd._ssd_dt_bwd_kernel, {**dt, "PACKED": packed, "HAS_DS_LAST": packed}, w
    packed_only = dict(HAS_H0=True, **dots, **tiles, BLOCK_P=cfg.block_p)
    yield fwd._ssd_last_state_kernel, packed_only, w
    yield bwd._ssd_sequence_bwd_kernel, {**packed_only, "HAS_DLAST": True}, w


def resource_usage(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(
        word
        for line in out.splitlines()
        if "REG:" in line
        for word in line.split()
        if word.startswith(("REG:", "LOCAL:"))
    )


def main(argv: list[str] | None = None) -> int:
    io_types = (sys.argv[1:] if argv is None else argv) or ["bf16", "fp32"]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", 90, 32)
    for io_type in io_types:
        for fn, constexprs, num_warps in variants(io_type):
            source = ASTSource(fn, signature(fn, constexprs, io_type), constexprs)
            kernel = triton.compile(source, target=target, options={"num_warps": num_warps})
            flags = ",".join(k for k, v in constexprs.items() if v is True)
            print(f"{fn.__name__} {io_type} {flags} warps={num_warps}: {resource_usage(kernel.asm['cubin'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
