"""State passing: a linear recurrence over a sequence split across the ranks of a group.

Rank r holds positions [r·L/W, (r+1)·L/W) of every sequence. The recurrence
h_t = a_t ⊙ h_{t-1} + b_t maps the state entering a slice to the state leaving it by an affine
map h ↦ Π_t a_t ⊙ h + S, where S is the slice's final state from a zero state. Each rank
summarises its slice as that pair (the log of the product, the decay, and S), the ranks gather
the pairs, and each composes those of the ranks before it (an exclusive scan) into the state
that truly enters its slice. It then adds that state's part to its outputs, or runs its
slice again from it (below).

Why an all_gather of the summaries, not a chain of point-to-point sends: the summaries are
small, O(W·batch·H·P·N) numbers received per rank (W states: batch·H·P·N each for Mamba-2,
plus batch·H for its decay per head; batch·D·N each for Mamba-1, plus batch·D for its Σ_t Δ_t,
which each rank multiplies by A), independent of L; one collective has the latency of one step where a chain
has W - 1 dependent steps; and every rank composes its entering state locally from the
gathered pairs. The backward is one all_reduce of the gradients of the gathered pairs
(``collectives.all_gather_stacked``), through which each rank's gradient reaches the states
and decays of the ranks before it.

Rescan or add: after the exchange a rank either scans its slice again from the entering state
(two scans on every rank but the first, each the scan the layer runs anyway, with its gating
and skip term) or adds the entering state's contribution C_t·(Π_{s<=t} a_s ⊙ h) to the first
scan's output, where that output is linear in the state and the contribution cheap to form:
``scan_with_passed_state(..., contribution=)``. Mamba-2 adds (its decay is one scalar per
head: the contribution is one (L, N) × (N, P) product per head; measured on the CPU, float32,
H 8, P 64, N 64, forward and backward of that second step alone: 3.6 ms against 36 ms for the
rescan at L 512, 21 against 153 ms at L 2048); Mamba-1 (a decay per channel and state: the
contribution would hold batch·D·L·N numbers, what its scan avoids), Mamba-3 (the queries
rotate) and a Mamba-2 that gates inside its scan (no gated norm) rescan. Mamba-1's first scan,
on a rank that rescans, is its summary alone (``summary=``: no gate, no skip term), and its
log-decay recomputes softplus in the backward (``summed_softplus``): measured with
``scripts/benchmark.py --op context-parallel`` at L 32768, W 2, d_model 256, the step's peak per
rank fell from 0.68 of one process's to 0.54 (1/W is 0.5). The other rescanning layers' first
scan keeps nothing for the backward: it is recomputed there (``_recomputed``), after the
rescan's backward has freed the rescan's tensors, so a rank holds one scan's activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from .collectives import all_gather_stacked, attach, from_previous_rank, group_rank_and_size
from .packing import SlicePacking


def shard_sequence(x: torch.Tensor, group, dim: int = 1, argument: str = "input_ids") -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim``: positions [r·L/W, (r+1)·L/W).
    A ValueError naming ``argument`` when W does not divide L."""
    rank, size = group_rank_and_size(group)
    length = x.shape[dim]
    if length % size:
        raise ValueError(
            f"{argument}: its length L = {length} (dim {dim}) is not divisible by the context-parallel "
            f"group's size W = {size}; every rank must hold L / W positions"
        )
    return x.narrow(dim, rank * (length // size), length // size)


def check_slices(x: torch.Tensor, group, argument: str = "input_ids") -> None:
    """Every rank of ``group`` holds a slice of the same shape (batch, L / W, ...): one
    all_gather of the shape, so that a rank that passed another length or batch gets a
    ValueError naming ``argument`` (on every rank alike), not a hang or a wrong position."""
    _, size = group_rank_and_size(group)
    shape = torch.tensor(x.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    for k, other in enumerate(shapes):
        if not torch.equal(other, shapes[0]):
            raise ValueError(
                f"{argument}: the ranks of cp_group hold slices of different shapes (rank 0 "
                f"{tuple(shapes[0].tolist())}, rank {k} {tuple(other.tolist())}); every rank must "
                "pass its L / W positions of the same batch"
            )


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's slice ``x`` (batch, L / W, ...) joined in rank order along dim 1: the whole
    (batch, L, ...). For attention's keys and values (the simplest correct scheme: each rank
    receives all of them, W·|x| per rank; a ring would hold one slice at a time). The gradient
    of each slice goes back to its rank."""
    gathered = all_gather_stacked(x, group)  # (W, batch, L / W, ...)
    return gathered.transpose(0, 1).flatten(1, 2)


def conv_state_from_previous_rank(
    x: torch.Tensor,
    kernel: int,
    group,
    packing: SlicePacking | None = None,
    initial: torch.Tensor | None = None,
    argument: str = "hidden_states",
):
    """The causal convolution's state (batch, D, K) holding the previous rank's last K - 1
    inputs of ``x`` (batch, L, D) (zeros on rank 0: no history), for ``causal_conv1d_silu``;
    None for K = 1 (no taps reach back). The halo's gradient goes back to the previous rank.
    A ValueError naming ``argument`` when the slice is shorter than K - 1 positions (the halo
    would need more than one neighbour).

    With ``packing``: (S, D, K), one row per local sequence, zero but for the sequence that
    continues from the previous rank, whose row holds the halo's positions of that sequence
    (those of an earlier one are zeros: the convolution never reads across a boundary).

    ``initial`` (batch, D, K): the state before the whole sequence (a cache's), rank 0's in
    place of zeros."""
    if kernel <= 1:
        return None
    if x.shape[1] < kernel - 1:
        raise ValueError(
            f"{argument}: this rank's slice has {x.shape[1]} positions, fewer than the causal "
            f"convolution's d_conv - 1 = {kernel - 1} that the next rank reads from it"
        )
    halo = from_previous_rank(x[:, x.shape[1] - (kernel - 1) :], group)  # (batch, K - 1, D)
    state = F.pad(halo.transpose(1, 2), (1, 0))  # (batch, D, K); the oldest slot is never read
    if initial is not None and group_rank_and_size(group)[0] == 0:
        return attach(initial.to(state.dtype), state)
    if packing is None:
        return state
    start = packing.whole.bounds[packing.first]  # global positions offset - K .. offset - 1 below
    keep = [packing.continues and p >= start for p in range(packing.offset - kernel, packing.offset)]
    state = state * torch.tensor(keep, dtype=state.dtype, device=state.device)
    rows = state.new_zeros(packing.local.num_sequences, *state.shape[1:])
    return rows.index_copy(0, torch.tensor([packing.first], device=state.device), state)


def entering_state(
    log_decay: torch.Tensor,
    final_state: torch.Tensor,
    group,
    carries: bool = True,
    initial=None,
    decay_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(The state entering this rank's slice, the state after the whole sequence), from every
    rank's summary of its own: ``log_decay`` (broadcastable to ``final_state``: the log of the
    slice's total decay) and ``final_state`` (the slice's last state from a zero state). One
    all_gather of both, flattened together; rank r then composes ranks 0 .. r - 1 (and all W
    for the second): h ← exp(log_decay_k)·h + S_k, from h = ``initial`` (the state before the
    whole sequence) or zero. ``carries`` False (a packed sequence that starts on this rank): the
    state entering rank k does not reach its end, h ← S_k. Rank 0's entering state is still
    attached to the gathered tensor, so that rank 0's backward joins the collective.

    ``decay_scale`` (the same on every rank, e.g. Mamba-1's A (D, N)): each gathered
    ``log_decay`` is multiplied by it after the exchange, so that a rank sends the smaller
    factor (Mamba-1: Σ_t Δ_t, D numbers a row, not D·N). Its gradient stays on each rank, which
    the ranks' gradients, summed, count once per use as one process does."""
    rank, size = group_rank_and_size(group)
    log_decay = log_decay.to(final_state.dtype)
    n, m = final_state.numel(), log_decay.numel()
    flag = final_state.new_full((1,), float(carries))
    gathered = all_gather_stacked(torch.cat([final_state.reshape(-1), log_decay.reshape(-1), flag]), group)
    state = final_state.new_zeros(final_state.shape) if initial is None else initial.to(final_state.dtype)
    for k in range(size):
        if k == rank:
            entering = attach(state, gathered) if rank == 0 else state
        S_k = gathered[k, :n].view(final_state.shape)
        log_k = gathered[k, n : n + m].view(log_decay.shape)
        log_k = log_k if decay_scale is None else log_k * decay_scale
        decay_k = log_k.exp() * gathered[k, n + m].detach()
        state = decay_k * state + S_k
    return entering, state


class _SummedSoftplus(torch.autograd.Function):
    """Σ_t softplus(x_t + bias) over the last dim, its backward recomputing sigmoid(x + bias)
    from ``x`` rather than keeping softplus's (…, L) input: ``x`` is the scan's Δ, which the scan
    keeps anyway, so the slice's log-decay costs no activation memory of its own."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return F.softplus(x + bias[:, None]).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x = grad[..., None] * torch.sigmoid(x + bias[:, None])
        grad_bias = grad_x.sum(dim=(0, 2)) if ctx.needs_input_grad[1] else None
        return (grad_x if ctx.needs_input_grad[0] else None), grad_bias


def summed_softplus(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Σ_t softplus(x[..., t] + bias) for ``x`` (batch, D, L) and ``bias`` (D,): (batch, D), the
    log of a Mamba-1 slice's decay divided by A, with gradients, at no activation memory beyond
    ``x`` (kept by the scan)."""
    return _SummedSoftplus.apply(x, bias)


def _recomputed(scan: Callable, initial):
    """``scan(initial)`` for a summary only (its last state; the rescan gives the output), its
    saved tensors recomputed in the backward instead of kept (torch.utils.checkpoint): a rank
    then holds one scan's activations, not two. Its backward runs after the rescan's has freed
    the rescan's, when the exchange brings the summary's gradient."""
    return torch.utils.checkpoint.checkpoint(scan, initial, use_reentrant=False)


def scan_with_passed_state(
    scan: Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    log_decay: Callable[[int], torch.Tensor],
    group,
    packing: SlicePacking | None = None,
    contribution: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    initial_state: torch.Tensor | None = None,
    summary: Callable[[], torch.Tensor] | None = None,
    decay_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(The output of this rank's slice of a recurrence split across ``group``, the state after
    the whole sequence, the same on every rank).

    ``scan(initial_state)`` runs the slice (from zero for None) and returns (out, last_state);
    ``log_decay(start)``, broadcastable to last_state, is the log of the product of the
    slice's decays from position ``start`` on (with gradients: they reach the parameters and
    inputs that made them). Rank 0 scans once; every other rank scans from zero for its
    summary, then again from the state the exchange gives it.

    With ``packing`` (batch 1; the scan runs ``packing.local``, its states one per local
    sequence): the summary is the last local sequence's, from where it starts; the entering
    state goes to the first local sequence, and only if it continues from the previous rank
    (else the first scan's output is the answer).

    ``contribution(state, n)``, where the output is linear in the entering state: what the
    entering ``state`` (as it enters the first local sequence) adds to the first ``n`` outputs
    (batch, n, ...), added to the first scan's output in place of a second scan.

    ``initial_state`` (not with ``packing``): the state before the whole sequence (a cache's),
    the same on every rank; rank 0 enters with it. The state after the whole sequence is then
    its composition with every rank's summary (with ``packing``, the last sequence's).

    ``summary()``: the slice's last states from zero alone (what ``scan(None)[1]`` returns),
    for a rank that scans again, where a cheaper scan gives them (Mamba-1's without its gate and
    skip term: no gradient of z, nor of an output that the rescan replaces, is kept or formed).
    ``decay_scale``: ``log_decay(start)`` times it is the log-decay (``entering_state``)."""
    rank, _ = group_rank_and_size(group)
    continues = (rank > 0 or initial_state is not None) if packing is None else packing.continues
    if continues and contribution is None:  # the rescan below gives the output
        out, last_state = None, (summary() if summary is not None else _recomputed(scan, None)[1])
    else:
        out, last_state = scan(None)
    if packing is None:
        state, whole = entering_state(log_decay(0), last_state, group, True, initial_state, decay_scale)
    else:
        final = last_state[packing.last : packing.last + 1]
        state, whole = entering_state(
            log_decay(packing.last_start), final, group, packing.carries, decay_scale=decay_scale
        )
    if not continues:  # its entering state is zero: the first scan's output is the answer
        return attach(out, state), whole
    if contribution is not None:  # the positions the entering state reaches: the first sequence's
        n = out.shape[1] if packing is None else packing.local.bounds[packing.first + 1]
        return torch.cat([out[:, :n] + contribution(state, n).to(out.dtype), out[:, n:]], dim=1), whole
    if packing is not None:
        rows = state.new_zeros(last_state.shape)
        state = rows.index_copy(0, torch.tensor([packing.first], device=state.device), state)
    out, _ = scan(state)
    return out, whole


def scan_with_passed_rotating_state(
    scan: Callable[[tuple], tuple[torch.Tensor, tuple]],
    last_step: Callable[[torch.Tensor], tuple],
    phase_steps: torch.Tensor,
    log_decay: Callable[[int], torch.Tensor],
    group,
    packing: SlicePacking | None = None,
    initial_state: tuple | None = None,
) -> tuple[torch.Tensor, tuple | None]:
    """(The output of this rank's slice of Mamba-3's trapezoidal scan split across ``group``,
    and with ``initial_state`` the state after the whole sequence, the same on every rank).

    Its state is (phase, ssm, key, value) (``ssm.scan.TrapezoidalState``): the ssm state in
    absolute (rotated) coordinates decays by a real scalar per head and step, the keys it adds
    are rotated by the phase, and the first step also adds the previous step's rotated key and
    input (the trapezoidal rule). So, in three exchanges:
    1. the phase: an all_gather of each slice's increment Σ_t Δ_t·θ_t (``phase_steps`` (batch,
       L, H, M), one per step); rank r enters at the sum of those before it;
    2. the previous position (a halo of one): the previous rank scans its own last position
       alone, from the phase before that position (``last_step(phase)`` → the state after
       it), and sends the rotated key and the input it leaves; rank 0 gets zeros;
    3. the ssm state, as ``scan_with_passed_state``: ``scan(initial_state)`` from (the
       entering phase, zero, the halo's key and value) gives the slice's state from zero,
       ``log_decay(start)`` (broadcastable to it: Σ_t Δ_t·A_t from ``start`` on) its decay;
       every rank but the first then scans again from the composed state.
    ``scan(state)`` and ``last_step(phase)`` return (out, last state) and the last state.

    With ``packing`` (batch 1, the scan over ``packing.local``, one state per local sequence):
    the phase and the ssm state are summarised for the last local sequence from where it
    starts, and restart where a sequence starts; the entering phase, halo and state go to the
    first local sequence's row, and only if it continues from the previous rank.

    ``initial_state`` (not with ``packing``): the state before the whole sequence (a cache's),
    the same on every rank: its phase starts the sum, rank 0 takes its key and value as its
    halo, its ssm state starts the composition. The state after the whole sequence is then
    returned too: the phases summed, the composed ssm state, the last rank's key and value (one
    more all_gather, only then)."""
    rank, size = group_rank_and_size(group)
    start = 0 if packing is None else packing.last_start
    carries = 1.0 if packing is None or packing.carries else 0.0
    if packing is None:
        continues = rank > 0 or initial_state is not None
    else:
        continues = packing.continues
    increment = phase_steps[:, start:].sum(1)  # (batch, H, M): the last sequence's turn here
    n = increment.numel()
    gathered = all_gather_stacked(torch.cat([increment.reshape(-1), increment.new_full((1,), carries)]), group)
    phase = gathered[:0, :n].sum(0).view_as(increment)  # zeros, still part of the graph
    if initial_state is not None:
        phase = phase + initial_state.phase.to(phase.dtype)
    for k in range(rank):
        phase = phase * gathered[k, n].detach() + gathered[k, :n].view_as(increment)
    tail = last_step(phase * carries + increment - phase_steps[:, -1])  # before the last position
    key, value = tail.key, tail.value
    halo = from_previous_rank(torch.cat([key.flatten(1), value.flatten(1)], dim=1), group)
    if initial_state is not None and rank == 0:
        given = torch.cat([initial_state.key.flatten(1), initial_state.value.flatten(1)], dim=1)
        halo = attach(given.to(halo.dtype), halo)
    halo = halo * float(continues)  # (kept in the graph: the neighbours' backward waits for it)
    key, value = halo[:, : key[0].numel()].view_as(key), halo[:, key[0].numel() :].view_as(value)
    phase = phase * float(continues)

    def entering(ssm):
        state = type(tail)(phase, ssm, key, value)
        if packing is None:
            return state
        index = torch.tensor([packing.first], device=phase.device)
        rows = packing.local.num_sequences
        return type(tail)(*(t.new_zeros(rows, *t.shape[1:]).index_copy(0, index, t) for t in state))

    first = entering(tail.ssm.new_zeros(tail.ssm.shape))
    out, last_state = _recomputed(scan, first) if continues else scan(first)  # the rescan's pass below
    final = last_state.ssm if packing is None else last_state.ssm[packing.last : packing.last + 1]
    initial_ssm = None if initial_state is None else initial_state.ssm
    ssm, whole_ssm = entering_state(log_decay(start), final, group, bool(carries), initial_ssm)
    whole = None
    if initial_state is not None:  # after the whole sequence: the last rank's key and value
        ends = all_gather_stacked(torch.cat([tail.key.flatten(1), tail.value.flatten(1)], dim=1), group)[-1]
        whole = type(tail)(
            initial_state.phase.to(phase.dtype) + gathered[:, :n].sum(0).view_as(increment),
            whole_ssm,
            ends[:, : key[0].numel()].view_as(key),
            ends[:, key[0].numel() :].view_as(value),
        )
    if not continues:
        return attach(out, ssm), whole
    out, _ = scan(entering(ssm))
    return out, whole
