"""The one-step functions, run token by token, equal the reference scan in float64, for every
option of their public signatures (the step functions use _common.py; the reference shares
nothing with them)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ssm.scan import selective_scan, selective_scan_step, ssd, ssd_step
from tests.helpers import selective_inputs, ssd_inputs

L = 7


def step_forms(M: torch.Tensor) -> list[torch.Tensor]:
    """A time-varying B or C, (B, N, L) or (B, G, N, L), as the step takes it at each t."""
    return [M[..., t] for t in range(M.shape[-1])]


@pytest.mark.parametrize("form", ["varying", "grouped"])
@pytest.mark.parametrize("D,z,bias,softplus", list(itertools.product([False, True], repeat=4)))
def test_selective_scan_step_equals_the_scan(form, D, z, bias, softplus):
    x = {
        k: v.detach()
        for k, v in selective_inputs(
            L, B_form=form, D=D, z=z, bias=bias, wide_delta=bias and softplus, dtype=torch.float64
        ).items()
    }
    if not softplus:  # Δ must stay positive without softplus
        x["delta"] = x["delta"].abs() + 0.01 - (x["delta_bias"][:, None] if bias else 0)
    out, last = selective_scan(**x, delta_softplus=softplus, return_last_state=True, backend="ref")
    h = x["initial_state"]
    for t, (B_t, C_t) in enumerate(zip(step_forms(x["B"]), step_forms(x["C"]))):
        y, h = selective_scan_step(
            h,
            x["u"][..., t],
            x["delta"][..., t],
            x["A"],
            B_t,
            C_t,
            x.get("D"),
            None if not z else x["z"][..., t],
            x.get("delta_bias"),
            delta_softplus=softplus,
        )
        torch.testing.assert_close(y, out[..., t], rtol=1e-12, atol=1e-12, msg=lambda m: f"step {t}: {m}")
    torch.testing.assert_close(h, last, rtol=1e-12, atol=1e-12)


def test_selective_scan_step_keeps_dtypes():
    """Half inputs: the state stays float32, the output comes back in the input dtype."""
    x = {k: v.detach() for k, v in selective_inputs(1, dtype=torch.bfloat16).items()}
    y, h = selective_scan_step(
        x["initial_state"],
        x["u"][..., 0],
        x["delta"][..., 0],
        x["A"],
        x["B"][..., 0],
        x["C"][..., 0],
        x["D"],
        x["z"][..., 0],
        x["delta_bias"],
        True,
    )
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.3)])
@pytest.mark.parametrize("D", ["none", "heads", "channels"])
@pytest.mark.parametrize("z,bias", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_step_equals_the_scan(groups, z, bias, D, dt_limit):
    """dt_limit included: the step clamps Δ as the scan does."""
    x = {k: v.detach() for k, v in ssd_inputs(L, groups=groups, D=D, z=z, bias=bias, dtype=torch.float64).items()}
    out, last = ssd(**x, dt_softplus=True, dt_limit=dt_limit, return_last_state=True, backend="ref")
    h = x["initial_state"]
    for t in range(L):
        y, h = ssd_step(
            h,
            x["x"][:, t],
            x["dt"][:, t],
            x["A"],
            x["B"][:, t],
            x["C"][:, t],
            x.get("D"),
            None if not z else x["z"][:, t],
            dt_bias=x.get("dt_bias"),
            dt_softplus=True,
            dt_limit=dt_limit,
        )
        torch.testing.assert_close(y, out[:, t], rtol=1e-12, atol=1e-12, msg=lambda m: f"step {t}: {m}")
    torch.testing.assert_close(h, last, rtol=1e-12, atol=1e-12)


def test_ssd_dt_limit_binds_in_these_cases():
    """The limited case above can fail: at these inputs the limit changes the result."""
    x = {k: v.detach() for k, v in ssd_inputs(L, dtype=torch.float64).items()}
    free = ssd(**x, dt_softplus=True, backend="ref")
    limited = ssd(**x, dt_softplus=True, dt_limit=(0.05, 0.3), backend="ref")
    assert (free - limited).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_step_in_c_equals_the_tensor_formulas(dtype):
    """On the CPU without gradients the step is one C call; with a gradient to keep it is the
    tensor formulas. Same values, from strided rows (B, C, dt split out of one projection, z
    half of another) as a Mamba layer passes them."""
    from ssm.native import library
    from ssm.scan import step_cpu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C step is untested")
    g = torch.Generator().manual_seed(3)
    batch, dim, N = 3, 40, 16
    state = torch.randn(batch, dim, N, generator=g, dtype=dtype)
    xz = torch.randn(batch, 2 * dim, generator=g, dtype=dtype)
    u, z = xz.chunk(2, dim=-1)
    proj = torch.randn(batch, dim + 2 * N, generator=g, dtype=dtype)
    delta, B, C = proj.split([dim, N, N], dim=-1)
    A = -torch.rand(dim, N, generator=g, dtype=dtype) * 4
    D, bias = torch.randn(dim, generator=g, dtype=dtype), torch.randn(dim, generator=g, dtype=dtype)
    with torch.no_grad():
        y, h = selective_scan_step(state, u, delta, A, B, C, D, z, bias, delta_softplus=True)
    assert step_cpu.selective_step_cpu(state, u, delta, A, B, C, D, z, bias, True) is not None
    y_ref, h_ref = selective_scan_step(state.requires_grad_(), u, delta, A, B, C, D, z, bias, delta_softplus=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y, y_ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(h, h_ref.detach(), rtol=tol, atol=tol)
