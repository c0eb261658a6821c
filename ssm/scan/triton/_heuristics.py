"""Launch heuristics of the Triton kernels, kept apart from the kernel bodies.

Every choice here is a pure function of shapes and dtypes, so that the launchers, the fake
(meta) implementations of the custom ops and the tests agree on it (the number of saved
chunk states depends on the chunk length).

These defaults follow the register budget of the designs they come from (mamba-ssm's fused
scan keeps a chunk of states per thread; accelerated-scan scans one chunk per program and
carries across chunks). They have NOT been tuned on a GPU: no GPU was available when they were
written. Tuning belongs here, not in the kernels.

Memory that the block sizes set (float32, for the selective scan of (batch, dim, L) inputs):
- saved for the backward: one state per chunk, batch·dim·N·L / CHUNK elements;
- during the backward only: for time-varying B (and C), one partial sum of dB (dC) per channel
  block, batch·(dim / BLOCK_D)·N·L elements, summed in a fixed order afterwards (what keeps
  the gradients deterministic without atomics). At N = 16, CHUNK = 32, BLOCK_D = 4 that is
  4·batch·dim·L elements, written and read once: the first thing to measure on a GPU, and to
  trade against CHUNK (a larger BLOCK_D·CHUNK tile needs more registers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Time steps a selective-scan program scans at once (a power of two). The forward saves one
# state per chunk for the backward, so activation memory is batch·dim·N·L / CHUNK elements.
SELECTIVE_CHUNK = 32
# Elements of one (channels, N, chunk) tile, a few of which are live at once in registers.
SELECTIVE_TILE = 2048
# Elements of one (chunk, lanes) tile of the linear scan.
LINEAR_TILE = 2048


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class SelectiveScanConfig:
    segment: int  # channels per program group; a block never straddles a group of B or C
    block_d: int  # channels per program (power of two)
    block_n: int  # N rounded up to a power of two
    chunk: int  # time steps per iteration (power of two)
    num_warps: int  # forward
    num_warps_bwd: int  # backward: about twice the live tiles of the forward

    def n_chunks(self, length: int) -> int:
        # (works on torch.compile's symbolic lengths too: the fake op computes it)
        return (length + self.chunk - 1) // self.chunk

    def grid(self, batch: int, dim: int) -> tuple[int, int, int]:
        return batch, dim // self.segment, -(-self.segment // self.block_d)


def channels_per_group(M_ndim: int, M_groups: int, dim: int) -> int:
    """Channels sharing one group of B or C: all of them when it is fixed (dim, N)."""
    return dim if M_ndim == 2 else dim // M_groups


def selective_scan_config(
    dim: int, N: int, b_per_group: int, c_per_group: int
) -> SelectiveScanConfig:
    """Block sizes for the selective scan of (batch, dim, L) inputs with state size N (the
    same for every L).

    ``b_per_group`` / ``c_per_group``: channels per group of B and C (``dim`` when fixed).
    Programs cover channels within one segment of ``gcd`` of the two, so every program reads
    one group of B and one of C and its partial gradients of B and C belong to one group: they
    are summed in a fixed order afterwards, with no atomics (deterministic gradients).
    """
    segment = math.gcd(b_per_group, c_per_group)
    block_n = next_power_of_2(N)
    # The same chunk for every length: the shape of the saved states must be computable from
    # a symbolic length when torch.compile traces with dynamic shapes.
    chunk = SELECTIVE_CHUNK
    block_d = max(1, min(next_power_of_2(segment), SELECTIVE_TILE // (block_n * chunk)))
    tile = block_d * block_n * chunk
    # Compiled for sm_90 at a (4, 16, 32) tile: forward 128 registers a thread with 4 warps,
    # backward 252 with 4 warps and 177 with 8, none spilled (ptxas; no GPU run).
    num_warps = 4 if tile <= 2048 else 8
    num_warps_bwd = 8 if tile <= 2048 else 16
    return SelectiveScanConfig(segment, block_d, block_n, chunk, num_warps, num_warps_bwd)


@dataclass(frozen=True)
class LinearScanConfig:
    block_t: int  # time steps per iteration (power of two)
    block_q: int  # lanes of the trailing dimension per program (power of two)
    num_warps: int


def linear_scan_config(T: int, Q: int) -> LinearScanConfig:
    """Block sizes for the linear scan of (P, T, Q) tensors along T."""
    block_q = min(next_power_of_2(Q), 64)
    block_t = max(1, min(next_power_of_2(T), LINEAR_TILE // block_q))
    # Compiled for sm_90 at 2048 x 1 (forward, backward): no spills with 8 warps (the backward
    # needed 244 registers a thread at 4096 x 1).
    num_warps = 4 if block_t * block_q <= 1024 else 8
    return LinearScanConfig(block_t, block_q, num_warps)
