"""Context parallelism of each mixer (``forward(x, cp_group=group)``) on 2 and 4 gloo
processes, float64, against the same mixer run on the whole sequence in one process: each
rank's output slice, its input gradient, and every parameter's gradient summed over ranks.
With W = 4 the entering state of ranks 2 and 3 composes the decay of the ranks between, and
the slice (L / W = 8 positions) is longer than the conv halo (d_conv - 1 = 3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ssm.distributed import shard_sequence
from ssm.layers import Mamba, Mamba2

from .harness import assert_gradients_match, reference_gradients, run_ranks

D_MODEL, BATCH, LENGTH = 16, 2, 32


def make_mixer(name: str) -> torch.nn.Module:
    if name == "mamba1":
        return Mamba(D_MODEL, d_state=8, d_conv=4, expand=2, dtype=torch.float64)
    if name == "mamba2":
        return Mamba2(
            D_MODEL, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=2, chunk_size=8,
            dt_min=0.05, dt_max=0.3, A_init_range=(0.2, 2.0), dtype=torch.float64,
        )  # fmt: skip
    raise ValueError(name)


def mixer_body(rank: int, world: int, name: str) -> None:
    torch.manual_seed(0)  # the same mixer, input and output weights on every rank
    mixer = make_mixer(name)
    x = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64)

    whole = mixer(x)  # the single-process computation
    (whole * weights).sum().backward()
    grads, x_grad = reference_gradients(mixer), x.grad

    group = dist.group.WORLD
    mine = shard_sequence(x.detach(), group, argument="x").clone().requires_grad_()
    out = mixer(mine, cp_group=group)
    torch.testing.assert_close(out, shard_sequence(whole.detach(), group, argument="whole"))
    (out * shard_sequence(weights, group, argument="weights")).sum().backward()
    torch.testing.assert_close(mine.grad, shard_sequence(x_grad, group, argument="x.grad"))
    assert_gradients_match(mixer, grads, group)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["mamba2", "mamba1"])
def test_mixer_slices_and_gradients_equal_one_process(tmp_path, name, world):
    run_ranks(mixer_body, world, tmp_path, name)
