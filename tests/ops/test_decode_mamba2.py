"""The fused decoding step of a stack of Mamba-2 blocks (ssm.ops.mamba_blocks_step with
Mamba2BlockWeights, one C call) against ssm.ops.mamba2_blocks_step_ref (plain float64 loops that
share nothing with it): the output or the logits and both states of every block, over several
tokens, batch > 1, ngroups > 1, the gate norm in each of its forms, the mixer's MLP branch and
the block's MLP; and the inputs it declines or rejects."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssm import ops
from ssm.native import library
from ssm.ops import GatedMLPWeights, LMHeadWeights, Mamba2BlockWeights

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=3e-5, atol=3e-5)}


def needs_library():
    if library() is None:
        pytest.fail("the C library did not build: the fused Mamba-2 step is untested")


def random_blocks(n, batch, M, H, P, N, G, K, dtype, g, *, Q=0, F=0, gate="after", D_per_channel=False):
    """n blocks with every bias, odd sizes; ``gate``: "after" (norm(y·silu(z)), Mamba-2's),
    "before" (norm(y)·silu(z)) or None (no norm). Norm groups of two heads where H allows."""

    def r(*shape, scale=0.4):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    S = H * P
    C = S + 2 * G * N
    E = 2 * Q + S + C + H
    blocks = []
    for i in range(n):
        mlp = None
        if F:
            mlp = GatedMLPWeights(norm_weight=1 + r(M), norm_eps=1e-5, fc1_weight=r(2 * F, M), fc2_weight=r(M, F))
        blocks.append(
            Mamba2BlockWeights(
                norm_weight=1 + r(M),
                norm_eps=1e-5,
                in_proj_weight=r(E, M),
                in_proj_bias=r(E) if i % 2 else None,
                conv_weight=r(C, 1, K),
                conv_bias=r(C) if i % 2 == 0 else None,
                conv_state=r(batch, C, K),
                dt_bias=r(H, scale=1.0) - 1,
                A=-torch.linspace(0.5, 3, H, dtype=torch.float64).to(dtype),
                D=r(S) if D_per_channel else r(H),
                ssm_state=r(batch, H, P, N),
                ngroups=G,
                dt_limit=(0.0, float("inf")),
                gate_norm_weight=None if gate is None else 1 + r(S),
                gate_norm_eps=1e-5,
                gate_norm_group=S // 2 if H % 2 == 0 else S,
                norm_before_gate=gate == "before",
                out_proj_weight=r(M, Q + S),
                out_proj_bias=r(M) if i % 2 else None,
                mlp=mlp,
            )
        )
    return blocks


CASES = {
    # name: (batch, M, H, P, N, G, K, extra)
    "ngroups 2, batch 3": (3, 10, 4, 3, 5, 2, 4, {}),
    "ngroups 4 = heads, odd sizes": (2, 9, 4, 5, 3, 4, 3, {}),
    "one group, block MLP": (2, 8, 3, 4, 6, 1, 4, dict(F=7)),
    "mixer MLP branch and block MLP": (2, 8, 4, 2, 4, 2, 4, dict(Q=5, F=6)),
    "norm before gate, D per channel": (2, 8, 4, 3, 4, 2, 4, dict(gate="before", D_per_channel=True)),
    "no gate norm": (2, 8, 2, 4, 4, 1, 4, dict(gate=None)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_head", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_the_fused_mamba2_step_against_the_reference(case, with_head, dtype):
    """Three blocks (the outputs alternate between two buffers), four tokens in a row, each
    token's output and every block's two states after it (updated in place)."""
    needs_library()
    batch, M, H, P, N, G, K, extra = CASES[case]
    g = torch.Generator().manual_seed(7)
    blocks = random_blocks(3, batch, M, H, P, N, G, K, dtype, g, **extra)
    head = None
    if with_head:
        norm, weight = torch.rand(M, generator=g) + 0.5, torch.randn(11, M, generator=g)
        head = LMHeadWeights(norm.to(dtype), 1e-5, weight.to(dtype))
    for _ in range(4):
        hidden = torch.randn(batch, M, generator=g).to(dtype)
        want, conv_states, ssm_states = ops.mamba2_blocks_step_ref(hidden, blocks, head)
        got = ops.mamba_blocks_step(hidden, blocks, head)
        assert got is not None, "the C step declined inputs it takes"
        for a, e in zip([got] if with_head else got, [want] if with_head else want):
            torch.testing.assert_close(a.double(), e, **TOL[dtype])
        for blk, conv, ssm in zip(blocks, conv_states, ssm_states):
            torch.testing.assert_close(blk.conv_state.double(), conv, **TOL[dtype])
            torch.testing.assert_close(blk.ssm_state.double(), ssm, **TOL[dtype])


def test_the_dt_limit_clamps_delta():
    """A Δ limit that binds (dt_bias large: softplus far above dt_max) changes the output, as in
    the reference."""
    needs_library()
    g = torch.Generator().manual_seed(8)
    (block,) = random_blocks(1, 2, 8, 4, 3, 4, 2, 4, torch.float64, g)
    block = dataclasses.replace(block, dt_bias=block.dt_bias + 3, dt_limit=(0.05, 0.5))
    hidden = torch.randn(2, 8, generator=g, dtype=torch.float64)
    want, _, _ = ops.mamba2_blocks_step_ref(hidden, [block])
    got = ops.mamba_blocks_step(hidden, [block])
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float64])


def test_the_fused_mamba2_step_declines_or_rejects():
    """Declined (None, the caller steps its layers): mixed dtypes, a gradient to keep, Mamba-1
    and Mamba-2 blocks mixed, a non-contiguous state. Rejected (ValueError naming the field):
    shapes that do not fit together."""
    g = torch.Generator().manual_seed(9)
    blocks = random_blocks(1, 2, 8, 4, 3, 4, 2, 4, torch.float32, g)
    hidden = torch.randn(2, 8)
    assert ops.mamba_blocks_step(hidden.double(), blocks) is None
    grad = [dataclasses.replace(blocks[0], A=blocks[0].A.clone().requires_grad_())]
    assert ops.mamba_blocks_step(hidden, grad) is None
    strided = blocks[0].conv_state.transpose(1, 2).contiguous().transpose(1, 2)
    assert ops.mamba_blocks_step(hidden, [dataclasses.replace(blocks[0], conv_state=strided)]) is None
    from tests.ops.test_against_reference import random_blocks as mamba1_blocks

    mixed = [mamba1_blocks(1, 2, 8, 12, 4, 3, 4, g, torch.float32)[0], blocks[0]]
    assert ops.mamba_blocks_step(hidden, mixed) is None
    with pytest.raises(ValueError, match="out_proj_weight"):
        ops.mamba_blocks_step(hidden, [dataclasses.replace(blocks[0], out_proj_weight=torch.randn(8, 11))])
    with pytest.raises(ValueError, match="conv_weight"):  # ngroups that the conv's channels do not hold
        ops.mamba_blocks_step(hidden, [dataclasses.replace(blocks[0], ngroups=3)])
    with pytest.raises(ValueError, match="gate_norm_group"):
        ops.mamba_blocks_step(hidden, [dataclasses.replace(blocks[0], gate_norm_group=4)])
