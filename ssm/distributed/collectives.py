"""The collectives of context parallelism, each an autograd function whose backward runs the
matching collective, so that a rank's gradient reaches the ranks whose tensors it read.

    group_rank_and_size(group, argument)   (rank, W) of a process group, or a ValueError naming it
    all_gather_stacked(x, group)           (W, *x.shape): every rank's x, in rank order
    from_last_rank(x, group)               the last rank's x, on every rank
    from_previous_rank(x, group)           the previous rank's x (zeros on rank 0): the halo
    attach(y, *others)                     y, with ``others`` made part of its graph

Every rank of the group must call these in the same order (as every collective). The backward
collectives run in the order autograd reaches them, which the forward's data dependencies fix
the same way on every rank: a layer's state exchange reads the scan that read its halo, so its
backward runs first, and a later layer's backward before an earlier one's. What a rank does not
use must still be reached by its backward (the other ranks wait for it): ``attach``.

torch.distributed is imported here, at the top: the layers import this package only when a
context-parallel group is given (``cp_group=None`` imports nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_and_size(group, argument: str = "cp_group") -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size W), or a ValueError naming
    ``argument`` when torch.distributed is not initialised or ``group`` is not a process group
    this process belongs to."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{argument}: torch.distributed is not initialised (call init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{argument} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{argument}: this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


class _AllGather(torch.autograd.Function):
    """Forward: every rank's x stacked in rank order, (W, *x.shape). Backward: the gradient of
    rank r's x is the sum over all ranks of their gradient's row r; one all_reduce of the
    (W, *x.shape) gradient, then this rank's row. (A reduce_scatter would move W times less, but
    gloo has none; the tensors gathered here are the small per-rank summaries and halos.)"""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank = group, rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None, None, None


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` (the same shape and dtype on every rank), stacked in rank order:
    (W, *x.shape). Gradients flow back to each rank's ``x``."""
    rank, size = group_rank_and_size(group)
    return _AllGather.apply(x, group, rank, size)


def from_last_rank(x: torch.Tensor, group) -> torch.Tensor:
    """The last rank's ``x`` on every rank (what a cache keeps after the whole sequence); one
    all_gather."""
    return all_gather_stacked(x, group)[-1]


class _FromPrevious(torch.autograd.Function):
    """Forward: rank r > 0 receives rank r - 1's x, rank 0 gets zeros. Backward: the reverse,
    each rank's gradient of what it received goes back to the rank it came from (the last
    rank's x got no gradient from anyone: zeros). Point to point: only neighbours talk, O(|x|)
    per rank whatever W. Each rank posts its send and its receive together
    (``batch_isend_irecv``), so no pair waits on the other's order."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        received = torch.zeros_like(x)
        _exchange(group, rank, size, send=x, to=rank + 1, receive=received, source=rank - 1)
        return received

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        back = torch.zeros_like(grad)
        _exchange(ctx.group, ctx.rank, ctx.size, send=grad, to=ctx.rank - 1, receive=back, source=ctx.rank + 1)
        return back, None, None, None


def _exchange(group, rank, size, send, to, receive, source) -> None:
    """Send ``send`` to group rank ``to`` and receive into ``receive`` from ``source``, either
    skipped where that rank does not exist."""
    ops = []
    if 0 <= to < size:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=to))
    if 0 <= source < size:
        ops.append(dist.P2POp(dist.irecv, receive, group=group, group_peer=source))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def from_previous_rank(x: torch.Tensor, group) -> torch.Tensor:
    """The previous rank's ``x`` (the same shape and dtype on every rank); zeros on rank 0.
    The gradient of the result goes back to the previous rank's ``x``."""
    rank, size = group_rank_and_size(group)
    return _FromPrevious.apply(x, group, rank, size)


class _Attach(torch.autograd.Function):
    """y unchanged; ``others`` get zero gradients. Makes a tensor that this rank computed but
    does not use part of the graph its loss reaches, so that its backward still runs the
    collective behind that tensor, which the other ranks wait for."""

    @staticmethod
    def forward(ctx, y, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def attach(y: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``y``, with ``others`` (which y does not depend on) in its autograd graph."""
    if not torch.is_grad_enabled() or not any(o.requires_grad for o in others):
        return y
    return _Attach.apply(y, *others)
