"""Packed sequences (``cu_seqlens``) under context parallelism: the boundaries of the whole row,
the same on every rank, seen from one rank's slice.

A document may start on one rank and end on another. Each rank then scans its slice as packed
sequences of its own (the whole row's bounds clamped to the slice: the documents not on it are
empty), and the state passing concerns only the document that crosses its left edge (``first``,
when it ``continues`` from the previous rank) and the one open at its right edge (``last``). A
document that starts on a rank takes no state from the left: its summary does not carry the
state that entered the rank (``carries`` False), so the composition of the summaries restarts
there.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..scan import PackedSequences, packed_sequences
from .collectives import group_rank_and_size


@dataclass(frozen=True)
class SlicePacking:
    """One rank's view of a packed row split across a group. ``whole``: the row's validated
    boundaries (S + 1); ``local``: the same S sequences clamped to this slice [offset, offset +
    length); ``first`` and ``last``: the sequences holding the slice's first and last
    positions; ``continues``: ``first`` started before the slice; ``carries``: the state
    entering the slice reaches its end (``first`` is ``last`` and continues); ``last_start``:
    where ``last`` starts in the slice (0 if before)."""

    whole: PackedSequences
    local: PackedSequences
    offset: int
    first: int
    last: int
    continues: bool
    carries: bool
    last_start: int


def slice_packing(cu_seqlens, length: int, group, device=None) -> SlicePacking:
    """This rank's ``SlicePacking`` of the whole row's ``cu_seqlens`` (S + 1,) (a tensor or a
    validated ``PackedSequences``), for slices of ``length`` positions each: it must rise from 0
    to W·length (validated here once, one host read; a ``SlicePacking`` is returned as given)."""
    if isinstance(cu_seqlens, SlicePacking):
        return cu_seqlens
    rank, size = group_rank_and_size(group)
    whole = packed_sequences(cu_seqlens, size * length, 1, device)
    offset, bounds = rank * length, whole.bounds
    local = [min(max(b - offset, 0), length) for b in bounds]
    first = bisect.bisect_right(bounds, offset) - 1
    last = bisect.bisect_right(bounds, offset + length - 1) - 1
    continues = bounds[first] < offset
    return SlicePacking(
        whole=whole,
        local=PackedSequences(torch.tensor(local, dtype=torch.int64, device=whole.cu_seqlens.device), tuple(local)),
        offset=offset,
        first=first,
        last=last,
        continues=continues,
        carries=continues and first == last,
        last_start=max(bounds[last] - offset, 0),
    )
