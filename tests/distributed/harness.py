"""Running a test body on W gloo processes on the CPU, and the checks every context-parallel
test makes: each rank's slice of the output equals the single-process output's slice, each
rank's input gradient the slice of the single-process input gradient, and every parameter's
gradient summed over the ranks the single-process gradient.

``run_ranks(body, world, tmp_path, *args)`` starts ``world`` processes joined by a file://
rendezvous in ``tmp_path``; each calls ``body(rank, world, *args)``, a module-level function. An
assertion in any rank fails the test with that rank's traceback (the others are terminated).
The processes are forked from a fork server (torch.multiprocessing, "forkserver") that has
imported torch, torch._dynamo (which the first custom-op call imports) and ssm once per test
session: a plain spawn pays those imports, some 10 s on a busy 2-core machine, in every process
of every test; a plain fork would inherit pytest's OpenMP pool.

``groups(world)``: the context-parallel groups one spawn checks, to pay the start of the
processes (seconds each: they import torch) once: the whole world (W = 4), then pairs
[0, 1], [2, 3] (W = 2, the second with group ranks that are not the global ones)."""

from __future__ import annotations

import multiprocessing
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "ssm", "ssm.distributed", __name__]


def run_ranks(body, world: int, tmp_path, *args) -> None:
    init = tmp_path / f"rendezvous-{os.getpid()}-{world}"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD + [body.__module__])  # read when the server starts
    mp.start_processes(_entry, args=(world, str(init), body, args), nprocs=world, start_method="forkserver")


def _entry(rank, world, init, body, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()


def groups(rank: int, world: int) -> list:
    """[the whole world, this rank's pair] (every rank creates every group, as new_group asks)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    return [dist.group.WORLD, pairs[rank // 2]]


def shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of a whole (batch, L, ...) tensor (the test's own cut, not the library's)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[1] // size
    return x[:, rank * n : (rank + 1) * n]


def reference_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients the last backward left (zeros where none), then cleared."""
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def assert_gradients_match(module: torch.nn.Module, reference: dict[str, torch.Tensor], group, what: str) -> None:
    """Every parameter's gradient, summed over ``group``'s ranks, equals ``reference[name]``
    (the single-process gradient); a parameter without a gradient counts as zeros. Clears them."""
    assert set(reference) == {n for n, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, reference[name], msg=lambda m, name=name: f"{what}: gradient of {name}: {m}")
    module.zero_grad(set_to_none=True)
