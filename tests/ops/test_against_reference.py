"""Every backend of ssm.ops against ssm.ops.reference (plain float64 loops that share nothing
with the backends): values and every gradient under a random upstream gradient, at odd sizes,
packed sequences with an empty one included; and the fused decoding step of a stack of blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssm import ops
from ssm.native import library
from ssm.ops import LMHeadWeights, MambaBlockWeights

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def needs_library():
    if library() is None:
        pytest.fail("the C library did not build: the 'cpu' backends are untested")


def grads(out, inputs, upstream):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], upstream, allow_unused=True)


CONV_CASES = {
    "plain": dict(batch=2, L=13, D=5, K=4, cu=None, bias=True),
    "no bias, K 3": dict(batch=3, L=7, D=6, K=3, cu=None, bias=False),
    "packed": dict(batch=1, L=17, D=5, K=4, cu=[0, 2, 2, 9, 17], bias=True),
}


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_causal_conv1d_silu(backend, case, dtype, transposed):
    if backend == "cpu":
        needs_library()
    c = CONV_CASES[case]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(c["batch"], c["L"], c["D"], generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(c["D"], 1, c["K"], generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(c["D"], generator=g, dtype=dtype, requires_grad=True) if c["bias"] else None
    cu = None if c["cu"] is None else torch.tensor(c["cu"])
    out, state = ops.causal_conv1d_silu(x, w, b, None, cu, transposed, backend=backend)
    assert state is None
    ref, _ = ops.causal_conv1d_ref(x.transpose(1, 2), w, b, None, cu)
    ref = F.silu(ref)  # (B, D, L)
    y = out[0] if transposed else out
    torch.testing.assert_close(y.double(), ref.transpose(1, 2), **TOL[dtype])
    if transposed:
        torch.testing.assert_close(out[1].double(), ref, **TOL[dtype])
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)  # (B, D, L)
    got = grads(y if not transposed else out[1], (x, w, b), (up.transpose(1, 2) if not transposed else up).to(dtype))
    want = grads(ref, (x, w, b), up)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), **TOL[dtype])


@pytest.mark.parametrize("case", ["plain", "no bias, K 3"])
def test_causal_conv1d_silu_under_autocast_keeps_only_its_input(case):
    """The tensor path (a GPU's) in bfloat16 under autocast, float32 taps, x a view of a wider
    tensor as in_proj leaves it: values and gradients against the float64 reference on the
    same bfloat16 values and taps, and autograd keeping for the backward no more than x's
    storage and the taps (through the conv and F.silu it kept x padded and the conv's output
    besides)."""
    c = CONV_CASES[case]
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(c["batch"], c["L"], c["D"] + 6, generator=g).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(c["D"], 1, c["K"], generator=g)).requires_grad_()
    b = torch.randn(c["D"], generator=g).requires_grad_() if c["bias"] else None

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ops.causal_conv1d_silu(wide[..., 1 : 1 + c["D"]], w, b, backend="torch")[0]

    from ssm.memory import saved_storages

    kept, y = saved_storages(run)  # {storage: bytes} of every tensor autograd keeps
    taps = w.nbytes + (b.nbytes if c["bias"] else 0)
    others = [n for ptr, n in kept.items() if ptr != wide.untyped_storage().data_ptr() and n > taps]
    assert y.dtype == torch.bfloat16 and not others, others  # x's own storage, the taps (and their casts)
    w16, b16 = w.detach().bfloat16().double(), None if b is None else b.detach().bfloat16().double()
    x64, w64 = wide.detach().double()[..., 1 : 1 + c["D"]].requires_grad_(), w16.requires_grad_()
    b64 = None if b16 is None else b16.requires_grad_()
    ref = F.silu(ops.causal_conv1d_ref(x64.transpose(1, 2), w64, b64, None, None)[0]).transpose(1, 2)
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)
    up = torch.randn(ref.shape, generator=g).bfloat16()
    got = grads(y, (wide, w, b), up)
    want = grads(ref, (x64, w64, b64), up.double())
    torch.testing.assert_close(got[0][..., 1 : 1 + c["D"]].double(), want[0], rtol=2e-2, atol=2e-2)
    assert got[0][..., :1].abs().max() == 0 and got[0][..., 1 + c["D"] :].abs().max() == 0
    for a, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.double(), e, rtol=3e-2, atol=3e-2 * e.abs().max().item())


def test_causal_conv1d_with_a_state_and_packed_states():
    """The tensor path continuing from a history: values, the new state, every gradient."""
    g = torch.Generator().manual_seed(2)
    for cu in (None, torch.tensor([0, 3, 3, 8])):
        batch = 2 if cu is None else 1
        rows = batch if cu is None else 3
        x = torch.randn(batch, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
        state = torch.randn(rows, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
        y, new_state = ops.causal_conv1d(x, w, None, state, cu)
        y_ref, state_ref = ops.causal_conv1d_ref(x, w, None, state, cu)
        torch.testing.assert_close(y, y_ref, **TOL[torch.float64])
        torch.testing.assert_close(new_state, state_ref, **TOL[torch.float64])
        up = torch.randn(y.shape, generator=g, dtype=torch.float64)
        for a, e in zip(grads(y, (x, w, state), up), grads(y_ref, (x, w, state), up)):
            torch.testing.assert_close(a, e, **TOL[torch.float64])


NORM_CASES = {
    "plain": dict(shape=(3, 7, 12), group=None, gate=None),
    "one row": dict(shape=(1, 33), group=None, gate=None),
    "groups of 4, gate after": dict(shape=(5, 12), group=4, gate="after"),
    "gate before, one group": dict(shape=(2, 3, 10), group=None, gate="before"),
    "groups of 5, gate before": dict(shape=(4, 10), group=5, gate="before"),  # Mamba-3's per-head norm
    "groups of 3, no gate": dict(shape=(2, 4, 9), group=3, gate=None),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", NORM_CASES)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_rms_norm(backend, case, dtype):
    if backend == "cpu":
        needs_library()
    c = NORM_CASES[case]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*c["shape"], generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(c["shape"][-1], generator=g, dtype=dtype, requires_grad=True)
    z = torch.randn(*c["shape"], generator=g, dtype=dtype, requires_grad=True) if c["gate"] else None
    before = c["gate"] == "before"
    y = ops.rms_norm(x, w, 1e-3, z, c["group"], before, backend=backend)
    ref = ops.rms_norm_ref(x, w, 1e-3, z, c["group"], before)
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, e in zip(grads(y, (x, w, z), up.to(dtype)), grads(ref, (x, w, z), up)):
        torch.testing.assert_close(a.double(), e.double(), **TOL[dtype])


@pytest.mark.parametrize("case", [c for c in NORM_CASES if NORM_CASES[c]["gate"] or NORM_CASES[c]["group"]])
def test_rms_norm_in_bfloat16_keeps_only_its_inputs(case):
    """The tensor path with bfloat16 x and z (z a view of a wider tensor, as in_proj leaves it)
    and a float32 weight, as under autocast on a GPU: values and gradients against the float64
    reference on the same bfloat16 values, and what autograd keeps for the backward no more than
    the inputs themselves and one float32 1/rms per group (the formulas through autograd kept
    five float32 copies of x's size)."""
    c = NORM_CASES[case]
    g = torch.Generator().manual_seed(4)
    shape, M = c["shape"], c["shape"][-1]
    group = c["group"] or M
    x = torch.randn(*shape, generator=g).bfloat16().requires_grad_()
    wide = torch.randn(*shape[:-1], M + 7, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.5 * torch.randn(M, generator=g)).requires_grad_()
    before = c["gate"] == "before"

    def run():
        z = wide[..., 2 : 2 + M] if c["gate"] else None
        return ops.rms_norm(x, w, 1e-3, z, c["group"], before, backend="torch")

    from ssm.memory import saved_bytes

    kept, y = saved_bytes(run)
    rows = x.numel() // M
    allowed = x.untyped_storage().nbytes() + w.untyped_storage().nbytes() + rows * (M // group) * 4
    allowed += wide.untyped_storage().nbytes() if c["gate"] else 0
    assert y.dtype == torch.bfloat16 and kept <= allowed, (kept, allowed)

    x64, wide64, w64 = (t.detach().double().requires_grad_() for t in (x, wide, w))
    z64 = wide64[..., 2 : 2 + M] if c["gate"] else None
    ref = ops.rms_norm_ref(x64, w64, 1e-3, z64, c["group"], before)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    up = torch.randn(ref.shape, generator=g).bfloat16()
    inputs, inputs64 = (x, w, wide) if c["gate"] else (x, w), (x64, w64, wide64) if c["gate"] else (x64, w64)
    for t, a, e in zip(inputs, grads(y, inputs, up), grads(ref, inputs64, up.double())):
        assert a.dtype == t.dtype
        torch.testing.assert_close(a.double(), e, rtol=2e-2, atol=2e-2)


def test_a_named_backend_that_cannot_take_the_inputs_is_an_error():
    x, w = torch.randn(1, 6, 3), torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="backend 'cpu' of causal_conv1d_silu does not take these inputs"):
        # a state to continue from with packed sequences: the C kernel takes one only unpacked
        ops.causal_conv1d_silu(x, w, None, torch.zeros(2, 3, 4), torch.tensor([0, 2, 6]), backend="cpu")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        ops.rms_norm(x, torch.ones(3), backend="fast")
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(4))
    with pytest.raises(ValueError, match="group_size must divide"):
        ops.rms_norm(x, torch.ones(3), group_size=2)
    with pytest.raises(ValueError, match="unknown op"):
        ops.backends("conv")
    assert ops.backends("rms_norm", "cpu") == ["cpu", "torch"]
    assert ops.backends("causal_conv1d_silu", "meta") == ["torch"]


def random_blocks(n, batch, M, D, N, R, K, g, dtype):
    def r(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    blocks = []
    for i in range(n):
        blocks.append(
            MambaBlockWeights(
                norm_weight=1 + r(M),
                norm_eps=1e-5,
                in_proj_weight=r(2 * D, M),
                in_proj_bias=r(2 * D) if i % 2 else None,
                conv_weight=r(D, 1, K),
                conv_bias=r(D),
                conv_state=r(batch, D, K),
                x_proj_weight=r(R + 2 * N, D),
                dt_proj_weight=r(D, R),
                dt_proj_bias=r(D) - 2,
                A=-torch.arange(1, N + 1, dtype=dtype).repeat(D, 1),
                D=r(D),
                ssm_state=r(batch, D, N),
                out_proj_weight=r(M, D),
                out_proj_bias=r(M) if i % 2 == 0 else None,
            )
        )
    return blocks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_head", [False, True])
def test_the_fused_blocks_step_against_the_reference(with_head, dtype):
    """Three blocks (the outputs alternate between two buffers), batch 2, a bias absent in some:
    the step's output and both states of every block, updated in place."""
    needs_library()
    g = torch.Generator().manual_seed(4)
    batch, M, D, N, R, K, V = 2, 8, 12, 4, 3, 4, 11
    blocks = random_blocks(3, batch, M, D, N, R, K, g, dtype)
    head = LMHeadWeights(norm_weight=torch.rand(M, generator=g).to(dtype) + 0.5, norm_eps=1e-5, weight=None)
    head = LMHeadWeights(head.norm_weight, 1e-5, torch.randn(V, M, generator=g).to(dtype)) if with_head else None
    hidden = torch.randn(batch, M, generator=g).to(dtype)
    want, conv_states, ssm_states = ops.mamba_blocks_step_ref(hidden, blocks, head)
    got = ops.mamba_blocks_step(hidden, blocks, head)
    assert got is not None, "the C step declined inputs it takes"
    if with_head:
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
    else:
        for a, e in zip(got, want):
            torch.testing.assert_close(a.double(), e.double(), **TOL[dtype])
    for blk, conv, ssm in zip(blocks, conv_states, ssm_states):
        torch.testing.assert_close(blk.conv_state.double(), conv, **TOL[dtype])
        torch.testing.assert_close(blk.ssm_state.double(), ssm, **TOL[dtype])


def test_the_fused_blocks_step_declines_what_it_does_not_run():
    g = torch.Generator().manual_seed(5)
    blocks = random_blocks(1, 1, 8, 12, 4, 3, 4, g, torch.float32)
    hidden = torch.randn(1, 8)
    assert ops.mamba_blocks_step(hidden.double(), blocks) is None  # dtypes differ
    assert ops.mamba_blocks_step(hidden, []) is None
    grad = [MambaBlockWeights(**{**blocks[0].__dict__, "A": blocks[0].A.requires_grad_()})]
    assert ops.mamba_blocks_step(hidden, grad) is None  # a gradient to keep
