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
from ssm.scan.triton import linear_scan, selective_scan, trapezoidal_scan  # noqa: E402

IO = {"u_ptr", "delta_ptr", "z_ptr", "out_ptr", "B_ptr", "C_ptr", "dout_ptr", "du_ptr", "ddelta_ptr", "dz_ptr", "x_ptr"}
INT64 = {"bounds_ptr", "chunk_first_ptr"}


def signature(fn, constexprs: dict, io_type: str) -> dict:
    """Pointers ending in _ptr (16-bit for the (B, D, L)-sized ones, int32 for the sequence of
    each packed step), int32 for the rest."""
    return {
        name: "constexpr"
        if name in constexprs
        else "*i32"
        if name == "seq_ptr"
        else (f"*{io_type}" if name in IO else "*i64" if name in INT64 else "*fp32")
        if name.endswith("_ptr")
        else "i32"
        for name in fn.arg_names
    }


def variants():
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
        for fn, constexprs, num_warps in variants():
            source = ASTSource(fn, signature(fn, constexprs, io_type), constexprs)
            kernel = triton.compile(source, target=target, options={"num_warps": num_warps})
            flags = ",".join(k for k, v in constexprs.items() if v is True)
            print(f"{fn.__name__} {io_type} {flags} warps={num_warps}: {resource_usage(kernel.asm['cubin'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
