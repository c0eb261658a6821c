"""Context parallelism of each mixer (``forward(x, cp_group=group)``) on gloo processes, float64,
against the same mixer run on the whole sequence in one process: each rank's output slice, its
input gradient, and every parameter's gradient summed over ranks; then packed rows whose
documents cross rank boundaries (``cu_seqlens`` of the whole row), and a cache handed in.
One spawn of 4 processes checks W = 4 (ranks 2 and 3 enter with a state that composes the decay
of the ranks before them) and W = 2 (two pairs). L / W = 8 positions, longer than the conv halo (d_conv - 1 = 3)."""

from __future__ import annotations

import pytest
import torch

from ssm.layers import MHA, Mamba, Mamba2, Mamba3

from .harness import assert_gradients_match, groups, reference_gradients, run_ranks, shard

D_MODEL, BATCH, LENGTH = 16, 2, 32


def make_mixer(name: str) -> torch.nn.Module:
    f64 = dict(dtype=torch.float64)
    if name == "mamba1":
        return Mamba(D_MODEL, d_state=8, d_conv=4, expand=2, dt_min=0.05, dt_max=0.3, **f64)
    if name.startswith("mamba2"):  # the gated norm (adds the entering state), or the gate in the scan (rescans)
        return Mamba2(
            D_MODEL, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=2, chunk_size=8,
            dt_min=0.05, dt_max=0.3, A_init_range=(0.2, 2.0), rmsnorm=name == "mamba2", **f64,
        )  # fmt: skip
    if name.startswith("mamba3"):  # SISO, and MIMO with the per-head gated norm
        mimo = dict(is_mimo=True, mimo_rank=2, is_outproj_norm=True) if name == "mamba3-mimo" else {}
        return Mamba3(D_MODEL, d_state=8, headdim=8, ngroups=2, chunk_size=4, dt_min=0.05, dt_max=0.3, **mimo, **f64)
    if name == "mha":  # GQA, rotary on part of each head, a conv on qkv, a fused MLP
        return MHA(D_MODEL, num_heads=4, num_heads_kv=2, causal=True, d_conv=4, rotary_emb_dim=2, mlp_dim=8, **f64)
    raise ValueError(name)


# Packed rows of 32 positions (slices of 8 at W = 4, 16 at W = 2). "crossing": a document over
# ranks 0-1 (3..13), one of one position (13), one over ranks 1-3 (14..27: rank 2 passes its
# state on, rank 3 masks the conv halo's position 13), an empty one. "at the edges": documents
# that start exactly where a rank's slice starts (8, 16, 24): no state, no halo.
PACKINGS = {"crossing": [0, 3, 3, 13, 14, 27, 32], "at the edges": [0, 8, 11, 16, 24, 32]}


def mixer_body(rank: int, world: int, name: str) -> None:
    cases = [(None, BATCH)] + [(cu, 1) for cu in PACKINGS.values()]
    for cu, batch in cases:
        check_mixer(rank, world, name, batch, None if cu is None else torch.tensor(cu))
    check_mixer_with_cache(rank, world, name)


def check_mixer_with_cache(rank: int, world: int, name: str) -> None:
    """A cache handed in (random states, or for attention a prefix of 5 tokens, the same on every
    rank, with gradients) is the state before the whole sequence: the outputs, every gradient
    (the initial states' too, summed over ranks) and the state left in every rank's cache equal
    one process's prefill."""
    torch.manual_seed(0)
    mixer = make_mixer(name)
    x = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(BATCH, LENGTH, D_MODEL, dtype=torch.float64)
    template = mixer.allocate_inference_cache(BATCH, dtype=torch.float64)
    if name == "mha":  # its keys, values and lengths: those of a prefix
        with torch.no_grad():
            mixer(torch.randn(BATCH, 5, D_MODEL, dtype=torch.float64), cache=template)
        given = [t.clone() for t in template.tensors()]
    else:
        given = [torch.randn_like(t) for t in template.tensors()]

    def fresh():
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in given]
        return template.replace(leaves), leaves

    cache, leaves = fresh()
    whole = mixer(x, cache=cache)
    (whole * weights).sum().backward()
    grads, x_grad = reference_gradients(mixer), x.grad
    state_grads, final = [t.grad for t in leaves], [t.detach() for t in cache.tensors()]
    for group in groups(rank, world):
        what = f"{name} with a cache, W = {torch.distributed.get_world_size(group)}"
        cache, leaves = fresh()
        mine = shard(x.detach(), group).clone().requires_grad_()
        out = mixer(mine, cache=cache, cp_group=group)
        torch.testing.assert_close(out, shard(whole.detach(), group), msg=lambda m: f"{what}: output: {m}")
        for i, (left, expected) in enumerate(zip(cache.tensors(), final)):
            torch.testing.assert_close(left.detach(), expected, msg=lambda m, i=i: f"{what}: cache tensor {i}: {m}")
        (out * shard(weights, group)).sum().backward()
        torch.testing.assert_close(mine.grad, shard(x_grad, group), msg=lambda m: f"{what}: input gradient: {m}")
        for i, (leaf, expected) in enumerate(zip(leaves, state_grads)):
            if not leaf.is_floating_point():
                continue
            grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad.clone()
            torch.distributed.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, expected, msg=lambda m, i=i: f"{what}: initial state {i} gradient: {m}")
        assert_gradients_match(mixer, grads, group, what)


def check_mixer(rank: int, world: int, name: str, batch: int, cu_seqlens) -> None:
    torch.manual_seed(0)  # the same mixer, input and output weights on every rank
    mixer = make_mixer(name)
    x = torch.randn(batch, LENGTH, D_MODEL, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(batch, LENGTH, D_MODEL, dtype=torch.float64)
    whole = mixer(x, cu_seqlens=cu_seqlens)  # the single-process computation
    (whole * weights).sum().backward()
    grads, x_grad = reference_gradients(mixer), x.grad
    for group in groups(rank, world):
        what = f"{name}, W = {torch.distributed.get_world_size(group)}, cu_seqlens {cu_seqlens}"
        mine = shard(x.detach(), group).clone().requires_grad_()
        out = mixer(mine, cu_seqlens=cu_seqlens, cp_group=group)
        torch.testing.assert_close(out, shard(whole.detach(), group), msg=lambda m: f"{what}: output: {m}")
        (out * shard(weights, group)).sum().backward()
        torch.testing.assert_close(mine.grad, shard(x_grad, group), msg=lambda m: f"{what}: input gradient: {m}")
        assert_gradients_match(mixer, grads, group, what)


@pytest.mark.parametrize("name", ["mamba2", "mamba2-gated", "mamba1", "mamba3", "mamba3-mimo", "mha"])
def test_mixer_slices_and_gradients_equal_one_process(tmp_path, name):
    run_ranks(mixer_body, 4, tmp_path, name)
