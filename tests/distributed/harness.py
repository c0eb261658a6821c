"""Running a test body on W gloo processes on the CPU, and the checks every context-parallel
test makes: each rank's slice of the output equals the single-process output's slice, each
rank's input gradient the slice of the single-process input gradient, and every parameter's
gradient summed over the ranks the single-process gradient.

``run_ranks(body, world, tmp_path, *args)`` spawns ``world`` processes (torch.multiprocessing,
spawn: a fork would inherit the parent's OpenMP pool) joined by a file:// rendezvous in
``tmp_path``; each calls ``body(rank, world, *args)``, a module-level function. An assertion in
any rank fails the test with that rank's traceback."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(body, world: int, tmp_path, *args) -> None:
    init = tmp_path / f"rendezvous-{os.getpid()}-{world}"
    mp.spawn(_entry, args=(world, str(init), body, args), nprocs=world, join=True)


def _entry(rank, world, init, body, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()


def assert_gradients_match(module: torch.nn.Module, reference: dict[str, torch.Tensor], group=None, **tol) -> None:
    """Every parameter's gradient, summed over ``group``'s ranks, equals ``reference[name]``
    (the single-process gradient); a parameter without a gradient counts as zeros."""
    assert set(reference) == {n for n, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, reference[name], msg=lambda m, name=name: f"gradient of {name}: {m}", **tol)


def reference_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients the last backward left (zeros where none), then cleared."""
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads
