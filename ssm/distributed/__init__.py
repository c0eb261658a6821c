"""Context parallelism: a sequence split across the ranks of a torch.distributed group, each
rank running every layer over its own contiguous slice only.

The layers call this package when given ``cp_group=`` (the forwards of Mamba, Mamba2, Mamba3,
MHA, and MambaLM.forward, which passes it to every layer); the scan core never sees a process
group: the layers hand the public scans an initial state that this package computed. Two
exchanges per Mamba-1 or Mamba-2 layer:
- the causal convolution's halo, the previous rank's last d_conv - 1 inputs, point to point
  (``conv_state_from_previous_rank``);
- the state summaries, one all_gather per layer (``scan_with_passed_state``; state_passing.py
  says why all_gather and what it moves).
Mamba-3 (``Mamba3.forward``) has no conv; its state carries a phase, and its first step reads the
previous position: an all_gather of the phases, a halo of one position, the state summaries
(``scan_with_passed_rotating_state``). Attention (``MHA.forward``) gathers every rank's keys and
values (``gather_sequence``) and masks with positions counted from the sequence's start; its
conv, if any, takes the same halo.
Packed sequences (``cu_seqlens`` of the whole row, the same on every rank) may cross rank
boundaries: ``slice_packing`` gives a rank its view of them (packing.py).
A cache handed to a layer (the same on every rank) is the state before the whole sequence, and
is left holding the state after it on every rank (``from_last_rank`` for what only the last rank
has). All are autograd functions whose backward sends each gradient back to the rank it came
from. ssm/training uses this through ``MambaLM.forward(cp_group=)`` (trainer.context_parallel).
"""

from .collectives import all_gather_stacked, attach, from_last_rank, from_previous_rank, group_rank_and_size
from .packing import SlicePacking, slice_packing
from .state_passing import (
    check_slices,
    conv_state_from_previous_rank,
    entering_state,
    gather_sequence,
    scan_with_passed_rotating_state,
    scan_with_passed_state,
    shard_sequence,
    summed_softplus,
)

__all__ = [
    "SlicePacking",
    "slice_packing",
    "all_gather_stacked",
    "check_slices",
    "attach",
    "conv_state_from_previous_rank",
    "entering_state",
    "from_last_rank",
    "from_previous_rank",
    "gather_sequence",
    "group_rank_and_size",
    "scan_with_passed_rotating_state",
    "scan_with_passed_state",
    "shard_sequence",
    "summed_softplus",
]
