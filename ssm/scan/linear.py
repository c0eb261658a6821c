"""The public first-order linear scan (the "PScan" primitive)."""

from __future__ import annotations

import torch

from .._backends import BackendTable
from . import triton
from ._checks import check_cu_seqlens, check_same_device, check_shape, check_tensor, empty_output
from .cpu import linear_scan_cpu
from .pscan import linear_scan_pscan
from .reference import linear_scan_ref

# Backends take (gates, inputs, dim, initial_state, reverse, cu_seqlens) with dim non-negative
# and cu_seqlens None or validated int64 (S + 1,) on the inputs' device, and return the states.
BACKENDS = BackendTable(
    "linear_scan",
    auto={"cpu": ("cpu", "pscan"), "cuda": ("triton", "pscan"), "*": ("pscan",)},
)
BACKENDS.add("ref", linear_scan_ref)
BACKENDS.add("pscan", linear_scan_pscan)
BACKENDS.add("cpu", linear_scan_cpu, devices=("cpu",))
BACKENDS.add("triton", triton.linear_scan_triton, devices=triton.devices, hint=triton.hint)


def linear_scan(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    *,
    dim: int = -1,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """All states of the recurrence h_t = gates_t·h_{t-1} + inputs_t along ``dim``.

    Shapes: ``gates`` and ``inputs`` are (..., L, ...) with L at ``dim``, any number of other
    dimensions; ``initial_state`` is their shape without ``dim`` and is h_{-1} (default 0).
    With ``reverse=True`` the scan runs from the end: h_t = gates_t·h_{t+1} + inputs_t, and
    ``initial_state`` is h_L.

    Returns the states, shaped like ``inputs``, in the promoted dtype of gates and inputs; they
    are computed in float32 (float64 for float64 inputs). Gradients flow to gates, inputs and
    initial_state.

    Packed sequences: ``cu_seqlens`` (S + 1,) int32 or int64 lays S sequences end to end along
    ``dim`` (0 = cu_seqlens[0] <= ... <= cu_seqlens[S] = L; sequence s is positions
    cu_seqlens[s] .. cu_seqlens[s+1] - 1), with every dimension before ``dim`` of size 1
    (E = 1). Each sequence is scanned on its own: the state restarts at its first step in scan
    order (its last position when ``reverse``) from ``initial_state[s]`` or 0, where
    ``initial_state`` is (S, *the dimensions after dim). The states of all positions are
    returned as without packing (so there is no separate last state: it is the state at
    position cu_seqlens[s+1] - 1, or cu_seqlens[s] when ``reverse``). Zero-length sequences
    are allowed (they have no positions).

    ``backend``: ``"auto"`` or a name from ``ssm.scan.backends("linear_scan")``.
    """
    check_tensor("gates", gates)
    check_tensor("inputs", inputs)
    if inputs.ndim == 0:
        raise ValueError("inputs must have at least one dimension (the scanned one), got a 0-D tensor")
    check_shape("gates", gates, inputs.shape, "inputs.shape")
    if not isinstance(dim, int) or not -inputs.ndim <= dim < inputs.ndim:
        raise ValueError(
            f"dim must be an int in [{-inputs.ndim}, {inputs.ndim - 1}] for {inputs.ndim}-D inputs, got {dim!r}"
        )
    dim = dim % inputs.ndim
    state_shape, what = inputs.shape[:dim] + inputs.shape[dim + 1 :], f"inputs.shape without dim {dim}"
    if cu_seqlens is not None:
        if any(size != 1 for size in inputs.shape[:dim]):
            raise ValueError(
                f"with cu_seqlens the sequences are packed along dim {dim}, and every dimension before it "
                f"must have size 1; got inputs of shape {tuple(inputs.shape)}"
            )
        cu_seqlens = check_cu_seqlens(cu_seqlens, inputs.shape[dim], 1, inputs.device)
        state_shape = (cu_seqlens.numel() - 1, *inputs.shape[dim + 1 :])
        what = f"(num_seqs, *inputs.shape after dim {dim})"
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, state_shape, what)
    check_same_device("inputs", inputs, gates=gates, initial_state=initial_state)
    impl = BACKENDS.resolve(backend, inputs.device)

    if inputs.numel() == 0:  # nothing to scan (L or another dimension is 0): no backend runs
        return empty_output(inputs.shape, torch.promote_types(gates.dtype, inputs.dtype), inputs, gates, initial_state)
    return impl.fn(gates, inputs, dim, initial_state, bool(reverse), cu_seqlens).contiguous()
