"""What the tests share: input cases for each scan op, the comparison of a backend with the
float64 reference, NaN-poisoned allocations, dtype-aware closeness. Test modules import from
here, never from each other.

Shape symbols: B batch, L length, D channels, N state size, G groups, H heads, P head dim.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ssm.scan import TrapezoidalState, linear_scan, selective_scan, ssd, trapezoidal_scan

# ----------------------------------------------------------------------------- poisoning

_UNINITIALISED = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
}


class _PoisonEmpty(TorchDispatchMode):
    """Fills every uninitialised allocation with NaN, so that an element a kernel forgets to
    write shows up as NaN in its output instead of as whatever the memory held."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _UNINITIALISED and out.is_floating_point():
            out.fill_(float("nan"))
        return out


@contextlib.contextmanager
def poisoned():
    with _PoisonEmpty():
        yield


# ----------------------------------------------------------------------------- closeness

# Absolute-and-relative tolerances by dtype, for comparisons between two runs of our own code
# (for a backend against the reference use check_against_reference).
TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=2e-4, atol=2e-4),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Compare in float64, with the tolerance of ``dtype`` scaled by the size of ``expected``."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result (an element left unwritten?)"
    tol = TOLERANCES[dtype]
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{what}: {m}"
    )


# torch.autograd.gradcheck's tolerances here: in float64, each gradient to 1e-6 of itself (its
# defaults, rtol 1e-3 and atol 1e-5, let a gradient 1e-4 off pass: a planted 1.0001 did).
GRADCHECK_TOL = dict(atol=1e-8, rtol=1e-6)

# Relative tolerances against the float64 reference, (forward, gradients), by the dtype of the
# backend's inputs. Half-precision results are rounded to their dtype (a relative error up to
# 2^-8 for bfloat16, 2^-11 for float16 per element) before they are compared.
REFERENCE_TOLERANCES = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-4, 1e-3),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.5e-2, 3e-2),
}


def rounding_noise_floor(numel: int) -> float:
    """The ``floor`` for 16-bit products (operands rounded to the inputs' dtype before each
    product, as tensor-core kernels do): their error is noise of about the dtype's rounding times
    the *terms* of a sum, not times the sum, so an element that cancels to near zero carries as
    much of it as any. The relative RMS check allows noise up to tol·rms; the largest of n such
    errors lies about sqrt(2·ln n) standard deviations out (5.5 at a Mamba-2 layer's 3.1M
    outputs). The element-wise bound near zero, 10·tol·floor·rms, must allow that, or a kernel
    within its RMS tolerance fails on its largest tensors: so floor ≥ sqrt(2·ln n)/10, and never
    below 0.1. (An H200's bfloat16 SSD at 2×1024×24×64 had one output 0.021·rms off, a 5σ
    outlier of its rounding noise, against a near-zero bound of 0.015·rms at floor 0.1.)"""
    return max(0.1, math.sqrt(2.0 * math.log(max(numel, 2))) / 10.0)


def assert_relative(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, floor: float | Callable[[int], float] = 0.01
) -> None:
    """``actual`` equals ``expected`` (float64) to a relative tolerance that small elements
    cannot hide behind large ones:

    - over the whole tensor, ‖actual − expected‖ ≤ tol·‖expected‖ (relative RMS);
    - element by element, |actual − expected| ≤ 10·tol·(|expected| + floor·rms(expected)): every
      element not tiny next to the tensor's typical size (``floor``, 1% unless told; a function of
      the element count, such as ``rounding_noise_floor``, for 16-bit products) is checked
      against its own size.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result (an element left unwritten?)"
    if expected.numel() == 0:
        return
    if callable(floor):
        floor = floor(expected.numel())
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    err = (a - e).abs()
    rms = e.pow(2).mean().sqrt().item()
    if rms == 0.0:
        assert err.max().item() <= tol, f"{what}: expected all zeros, got max |value| {err.max().item():.3g}"
        return
    relative_rms = err.pow(2).mean().sqrt().item() / rms
    assert relative_rms <= tol, f"{what}: relative RMS error {relative_rms:.3g} > {tol:.3g}"
    bound = 10 * tol * (e.abs() + floor * rms)
    worst = (err / bound).flatten().argmax().item()
    assert err.flatten()[worst] <= bound.flatten()[worst], (
        f"{what}: element {worst} (of {e.numel()}) is {a.flatten()[worst].item():.6g}, expected "
        f"{e.flatten()[worst].item():.6g} (|error| {err.flatten()[worst].item():.3g} > bound "
        f"{bound.flatten()[worst].item():.3g}; the tensor's RMS is {rms:.3g})"
    )


def as_float64(inputs: dict) -> dict:
    """Float64 leaf copies of ``inputs`` (the same values, rounded as the originals are)."""
    return {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in inputs.items()}


def run_with_grads(call, inputs: dict, backend: str, upstream=None, seed: int = 1):
    """``call(inputs, backend)`` -> a tuple of outputs, then the gradients of every input under
    upstream gradients (random float64 values rounded to each output's dtype, unless given);
    every allocation poisoned with NaN. Returns (outputs, {name: grad}, upstream)."""
    with poisoned():
        outs = call(inputs, backend)
        if upstream is None:
            g = torch.Generator().manual_seed(seed)
            upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
        else:
            upstream = [u.to(o.device, o.dtype) for u, o in zip(upstream, outs)]
        differentiable = [k for k, v in inputs.items() if v.requires_grad]
        grads = torch.autograd.grad(outs, [inputs[k] for k in differentiable], upstream)
    return outs, dict(zip(differentiable, grads)), upstream


def check_against_reference(
    call, inputs: dict, backend: str, dtype: torch.dtype | None = None, names=None, reference_call=None, floor=0.01
):
    """``backend`` on ``inputs`` against the "ref" backend on float64 copies of the same values,
    under the same upstream gradients (as rounded for the backend), every output and every
    gradient compared with :func:`assert_relative` at the tolerances of ``dtype`` (default: the
    dtype of the first input). Gradients must keep their inputs' dtypes. ``reference_call``
    (default ``call``) is what runs "ref"; ``floor``: :func:`assert_relative`'s. Returns the
    backend's (outputs, grads)."""
    dtype = dtype or next(iter(inputs.values())).dtype
    fwd_tol, grad_tol = REFERENCE_TOLERANCES[dtype]
    outs, grads, upstream = run_with_grads(call, inputs, backend)
    ref_outs, ref_grads, _ = run_with_grads(
        reference_call or call, as_float64(inputs), "ref", [u.double() for u in upstream]
    )
    names = names or [f"output {i}" for i in range(len(outs))]
    for name, out, ref in zip(names, outs, ref_outs):
        assert_relative(out, ref, fwd_tol, f"{backend} {name}", floor)
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, f"{backend} d{name}: dtype {grad.dtype} != {inputs[name].dtype}"
        assert_relative(grad, ref_grads[name], grad_tol, f"{backend} d{name}", floor)
    return outs, grads


def _uniform(g: torch.Generator, dtype: torch.dtype):
    def rand(*shape, lo=-1.0, hi=1.0, dt=None):
        return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).to(dt or dtype)

    return rand


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of states and of A, D and the biases for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- selective_scan

SELECTIVE_FORMS = ["fixed", "varying", "grouped"]  # B/C as (D, N), (B, N, L), (B, G, N, L)


def selective_inputs(
    length: int,
    *,
    batch: int = 2,
    dim: int = 6,
    N: int = 4,
    groups: int = 3,
    B_form: str = "varying",
    C_form: str | None = None,
    D: bool = True,
    z: bool = True,
    bias: bool = True,
    initial_state: bool = True,
    wide_delta: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Inputs for selective_scan in the ranges a Mamba layer sees, as leaf tensors. With a bias,
    Δ = softplus(delta + bias) lies around 0.05..1; ``wide_delta`` spreads the pre-softplus
    value over [-12, 26], across softplus's threshold (20) and far below 0."""
    g = torch.Generator().manual_seed(seed)
    rand = _uniform(g, dtype)

    def bc(form):
        return {
            "fixed": lambda: rand(dim, N),
            "varying": lambda: rand(batch, N, length),
            "grouped": lambda: rand(batch, groups, N, length),
        }[form]()

    fp32 = state_dtype(dtype)
    if wide_delta:
        delta = rand(batch, dim, length, lo=-10.0, hi=28.0)
    elif bias:
        delta = rand(batch, dim, length, lo=-1.0, hi=0.5)
    else:
        delta = rand(batch, dim, length, lo=0.01, hi=0.8)
    x = dict(
        u=rand(batch, dim, length),
        delta=delta,
        A=-rand(dim, N, lo=0.1, hi=3.0, dt=fp32),
        B=bc(B_form),
        C=bc(C_form or B_form),
    )
    if D:
        x["D"] = rand(dim, dt=fp32)
    if z:
        x["z"] = rand(batch, dim, length)
    if bias:
        x["delta_bias"] = rand(dim, lo=-2.0, hi=-1.0, dt=fp32)
    if initial_state:
        x["initial_state"] = rand(batch, dim, N, dt=fp32)
    for t in x.values():
        t.requires_grad_(True)
    return x


def selective_call(inputs: dict, backend: str, **kw):
    """(out, last_state) of selective_scan on ``inputs``, with softplus when there is a bias."""
    return selective_scan(
        **inputs, delta_softplus="delta_bias" in inputs, return_last_state=True, backend=backend, **kw
    )


def check_selective(inputs: dict, backend: str, dtype: torch.dtype | None = None):
    """``backend`` against the float64 reference; out in u's dtype, the state in float32 (or
    float64)."""
    (out, last), grads = check_against_reference(selective_call, inputs, backend, dtype, ["out", "last_state"])
    assert out.dtype == inputs["u"].dtype
    assert last.dtype == state_dtype(inputs["u"].dtype)
    return (out, last), grads


# ----------------------------------------------------------------------------- linear_scan


def linear_inputs(shape, dim, *, initial_state=True, dtype=torch.float32, seed=0) -> dict:
    """Gates in [0, 1.05) (some above 1), inputs and initial state standard normal."""
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand(shape, generator=g, dtype=torch.float64).mul(1.05).to(dtype)
    inputs = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    x = dict(gates=gates, inputs=inputs)
    if initial_state:
        state_shape = list(shape)
        del state_shape[dim]
        x["initial_state"] = torch.randn(state_shape, generator=g, dtype=torch.float64).to(dtype)
    for t in x.values():
        t.requires_grad_(True)
    return x


def linear_call(dim: int, reverse: bool):
    def call(inputs, backend):
        return (linear_scan(**inputs, dim=dim, reverse=reverse, backend=backend),)

    return call


def check_linear(inputs: dict, backend: str, dim: int, reverse: bool, dtype: torch.dtype | None = None):
    (states,), grads = check_against_reference(linear_call(dim, reverse), inputs, backend, dtype, ["states"])
    assert states.dtype == inputs["inputs"].dtype
    return states, grads


# ----------------------------------------------------------------------------- ssd


def ssd_inputs(
    length,
    *,
    batch=2,
    heads=4,
    head_dim=3,
    groups=2,
    N=5,
    D="heads",
    z=True,
    bias=True,
    initial_state=True,
    dtype=torch.float32,
    seed=0,
) -> dict:
    """Inputs for ssd, as leaf tensors; ``D`` is "none", "heads" (H,) or "channels" (H, P)."""
    g = torch.Generator().manual_seed(seed)
    rand = _uniform(g, dtype)
    fp32 = state_dtype(dtype)
    x = dict(
        x=rand(batch, length, heads, head_dim),
        dt=rand(batch, length, heads, lo=-2.0, hi=1.0),
        A=-rand(heads, lo=0.5, hi=4.0, dt=fp32),
        B=rand(batch, length, groups, N),
        C=rand(batch, length, groups, N),
    )
    if D == "heads":
        x["D"] = rand(heads, dt=fp32)
    elif D == "channels":
        x["D"] = rand(heads, head_dim, dt=fp32)
    if z:
        x["z"] = rand(batch, length, heads, head_dim)
    if bias:
        x["dt_bias"] = rand(heads, lo=-3.0, hi=-1.0, dt=fp32)
    if initial_state:
        x["initial_state"] = rand(batch, heads, head_dim, N, dt=fp32)
    for t in x.values():
        t.requires_grad_(True)
    return x


def ssd_call(chunk_size: int = 8, dt_limit=(0.0, math.inf)):
    def call(inputs, backend):
        return ssd(
            **inputs,
            dt_softplus=True,
            dt_limit=dt_limit,
            return_last_state=True,
            chunk_size=chunk_size,
            backend=backend,
        )

    return call


def check_ssd(
    inputs: dict,
    backend: str,
    dtype: torch.dtype | None = None,
    chunk_size: int = 8,
    dt_limit=(0.0, math.inf),
    floor: float | Callable[[int], float] = 0.01,
):
    (out, last), grads = check_against_reference(
        ssd_call(chunk_size, dt_limit), inputs, backend, dtype, ["out", "last_state"], floor=floor
    )
    assert out.dtype == inputs["x"].dtype
    assert last.dtype == state_dtype(inputs["x"].dtype)
    return (out, last), grads


# ----------------------------------------------------------------------------- trapezoidal_scan


def trapezoidal_inputs(
    length,
    *,
    batch=2,
    heads=4,
    head_dim=3,
    groups=2,
    N=8,
    M=2,
    ranks=None,
    D=True,
    z=True,
    bias=True,
    mimo=True,
    initial_state=True,
    packed=None,
    dtype=torch.float32,
    seed=0,
) -> dict:
    """Inputs for trapezoidal_scan (Mamba-3) in the ranges its layer gives them, as leaf tensors.
    ``ranks=None``: B, C (batch, L, G, N) without a rank axis (SISO); an int R: (batch, L, R, G, N),
    with mimo_x, mimo_z (when z), mimo_o when ``mimo``. ``packed``: a list of sequence lengths
    laid end to end in a batch of one (their sum is ``length``); the initial state is then per
    sequence. Δ around 0.05..0.6, A in [-3, -0.1], λ in [0, 1], rotary rates up to ±π."""
    g = torch.Generator().manual_seed(seed)
    rand = _uniform(g, dtype)
    fp32 = state_dtype(dtype)
    if packed is not None:
        assert sum(packed) == length, (packed, length)
        batch = 1
    rank_shape = () if ranks is None else (ranks,)
    x = dict(
        x=rand(batch, length, heads, head_dim),
        dt=rand(batch, length, heads, lo=0.05, hi=0.6),
        A=rand(batch, length, heads, lo=-3.0, hi=-0.1),
        B=rand(batch, length, *rank_shape, groups, N),
        C=rand(batch, length, *rank_shape, groups, N),
        trap=rand(batch, length, heads, lo=0.0, hi=1.0),
        angles=rand(batch, length, heads, M, lo=-math.pi, hi=math.pi),
    )
    if D:
        x["D"] = rand(heads, dt=fp32)
    if z:
        x["z"] = rand(batch, length, heads, head_dim)
    if bias:
        x["B_bias"] = rand(heads, *rank_shape, N, lo=0.5, hi=1.5, dt=fp32)
        x["C_bias"] = rand(heads, *rank_shape, N, lo=0.5, hi=1.5, dt=fp32)
    if ranks is not None and mimo:
        x["mimo_x"] = rand(heads, ranks, head_dim, dt=fp32)
        if z:
            x["mimo_z"] = rand(heads, ranks, head_dim, dt=fp32)
        x["mimo_o"] = rand(heads, ranks, head_dim, dt=fp32)
    rows = batch if packed is None else len(packed)
    for t in x.values():
        t.requires_grad_(True)
    if initial_state:
        state = TrapezoidalState(
            rand(rows, heads, M, lo=-4.0, hi=4.0, dt=fp32),
            rand(rows, heads, head_dim, N, dt=fp32),
            rand(rows, *rank_shape, heads, N, dt=fp32),
            rand(rows, heads, head_dim, dt=fp32),
        )
        for t in state:
            t.requires_grad_(True)
        x.update({f"initial_{name}": t for name, t in zip(TrapezoidalState._fields, state)})
    if packed is not None:
        x["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(packed)])
    return x


# A name the trapezoidal tests take beside the backends': the "cpu" backend with its core forced
# onto the chunked form's products (which it runs above N·P = SWEEPS_UP_TO), so that the contract's
# every case runs on both of its cores at the tests' small sizes.
CPU_PRODUCTS = "cpu:products"


@contextlib.contextmanager
def trapezoidal_backend(backend: str):
    """The backend name to pass to trapezoidal_scan for ``backend``, CPU_PRODUCTS included (only
    the forward chooses the core: the backward may run after the block)."""
    if backend != CPU_PRODUCTS:
        yield backend
        return
    import ssm.scan.trapezoidal_cpu as cpu_backend

    limit = cpu_backend.SWEEPS_UP_TO
    cpu_backend.SWEEPS_UP_TO = 0
    try:
        yield "cpu"
    finally:
        cpu_backend.SWEEPS_UP_TO = limit


def trapezoidal_call(rotary="interleaved", chunk_size=8):
    """(out, *last state) of trapezoidal_scan on inputs from :func:`trapezoidal_inputs`."""

    def call(inputs, backend):
        kw = {k: v for k, v in inputs.items() if not k.startswith("initial_")}
        parts = [inputs.get(f"initial_{name}") for name in TrapezoidalState._fields]
        state = TrapezoidalState(*parts) if parts[0] is not None else None
        with trapezoidal_backend(backend) as name:
            out, last = trapezoidal_scan(
                **kw, rotary=rotary, initial_state=state, return_last_state=True, chunk_size=chunk_size, backend=name
            )
        return (out, *last)

    return call


def check_trapezoidal(inputs: dict, backend: str, dtype=None, rotary="interleaved", chunk_size=8, floor=0.01):
    """``backend`` against the float64 reference: out and every part of the last state, every
    gradient; out in x's dtype, the state in float32 (or float64). ``floor``: see
    :func:`assert_relative` (``rounding_noise_floor`` for a backend whose products take 16-bit
    operands that it computed itself, such as rotated keys)."""
    inputs = dict(inputs)
    cu_seqlens = inputs.pop("cu_seqlens", None)
    call = trapezoidal_call(rotary, chunk_size)
    names = ["out", *(f"last {name}" for name in TrapezoidalState._fields)]
    wrapped = call if cu_seqlens is None else (lambda i, b: call({**i, "cu_seqlens": cu_seqlens}, b))
    outs, grads = check_against_reference(wrapped, inputs, backend, dtype, names, floor=floor)
    assert outs[0].dtype == inputs["x"].dtype
    assert all(o.dtype == state_dtype(inputs["x"].dtype) for o in outs[1:])
    return outs, grads


# ----------------------------------------------------------------------------- packed sequences


def packed_lengths(T: int) -> list[int]:
    """Sequence lengths for packing, around chunks of T steps: a boundary after step 1, an empty
    sequence, a boundary exactly on a chunk edge (T), boundaries inside a chunk (T + 3, T + 4)
    around a sequence of length 1, another on an edge (2T), a sequence across chunks, and an
    empty one at the end. L = 3T + 5."""
    return [1, 0, T - 1, 3, 1, T - 4, T + 5, 0]


def cu_seqlens_of(lengths, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device=device)


def _bounds(cu_seqlens):
    values = cu_seqlens.tolist()
    return list(zip(values[:-1], values[1:]))


def selective_packed_call(cu_seqlens):
    """(out, per-sequence last states) of selective_scan on packed ``inputs`` (batch 1)."""

    def call(inputs, backend):
        return selective_call(inputs, backend, cu_seqlens=cu_seqlens)

    return call


def selective_solo_call(cu_seqlens):
    """The same as :func:`selective_packed_call`, with each sequence run alone (no cu_seqlens)
    and the results put together: the oracle packing must match."""

    def call(inputs, backend):
        outs, lasts = [], []
        for s, (start, end) in enumerate(_bounds(cu_seqlens)):
            part = {
                k: v[..., start:end] if k in ("u", "delta", "z") or (k in ("B", "C") and v.ndim >= 3) else v
                for k, v in inputs.items()
            }
            if "initial_state" in inputs:
                part["initial_state"] = inputs["initial_state"][s : s + 1]
            out, last = selective_call(part, backend)
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=-1), torch.cat(lasts)

    return call


def linear_packed_call(cu_seqlens, dim: int, reverse: bool):
    def call(inputs, backend):
        return (linear_scan(**inputs, dim=dim, reverse=reverse, cu_seqlens=cu_seqlens, backend=backend),)

    return call


def linear_solo_call(cu_seqlens, dim: int, reverse: bool):
    def call(inputs, backend):
        parts = []
        for s, (start, end) in enumerate(_bounds(cu_seqlens)):
            if end == start:
                continue
            part = {k: inputs[k].narrow(dim, start, end - start) for k in ("gates", "inputs")}
            if "initial_state" in inputs:
                part["initial_state"] = inputs["initial_state"][s].reshape(
                    part["inputs"].shape[:dim] + part["inputs"].shape[dim + 1 :]
                )
            parts.append(linear_scan(**part, dim=dim, reverse=reverse, backend=backend))
        return (torch.cat(parts, dim=dim),)

    return call


def ssd_packed_call(cu_seqlens, chunk_size: int = 8):
    def call(inputs, backend):
        return ssd(
            **inputs,
            dt_softplus=True,
            return_last_state=True,
            chunk_size=chunk_size,
            cu_seqlens=cu_seqlens,
            backend=backend,
        )

    return call


def ssd_solo_call(cu_seqlens, chunk_size: int = 8):
    def call(inputs, backend):
        outs, lasts = [], []
        for s, (start, end) in enumerate(_bounds(cu_seqlens)):
            part = {k: v[:, start:end] if k in ("x", "dt", "B", "C", "z") else v for k, v in inputs.items()}
            if "initial_state" in inputs:
                part["initial_state"] = inputs["initial_state"][s : s + 1]
            out, last = ssd(**part, dt_softplus=True, return_last_state=True, chunk_size=chunk_size, backend=backend)
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=1), torch.cat(lasts)

    return call


def with_sequence_states(inputs: dict, num_seqs: int, seed: int = 5) -> dict:
    """``inputs`` (batch 1) with an initial state per packed sequence: (S, ...) drawn like the
    batch-1 one it replaces."""
    g = torch.Generator().manual_seed(seed)
    state = inputs["initial_state"]
    per_seq = (torch.rand(num_seqs, *state.shape[1:], generator=g, dtype=torch.float64) * 2 - 1).to(state.dtype)
    return {**inputs, "initial_state": per_seq.to(state.device).requires_grad_()}


# ----------------------------------------------------------------------------- torch.compile


def assert_compiled_matches_eager(f, inputs, **tolerance):
    """``torch.compile(f, fullgraph=True)`` (any graph break is an error) gives the eager loss
    and gradients (within ``tolerance`` when the two run different algorithms). The
    "aot_eager" compiler traces forward and backward as inductor would, but runs them eagerly."""
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")

    def loss_and_grads(fn):
        loss = fn(*inputs)
        return [loss, *torch.autograd.grad(loss, inputs)]

    for got, expected in zip(loss_and_grads(compiled), loss_and_grads(f)):
        torch.testing.assert_close(got, expected, **tolerance)


def assert_generate_takes_the_fused_step_and_keeps_its_tokens(model, monkeypatch, vocab: int = 45) -> None:
    """generate (batch 2, left-padded prompts of different lengths) with the fused decoding step
    prepared once, and with it refused: the same greedy tokens."""
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    prepare, prepared = model.backbone.prepare_fused_step, []

    def spy(*args):
        step = prepare(*args)
        prepared.append(step is not None)
        return step

    monkeypatch.setattr(model.backbone, "prepare_fused_step", spy)
    fused = model.generate(ids, 20, temperature=0, attention_mask=mask)
    assert prepared == [True], "generate did not take the fused step"
    monkeypatch.setattr(model.backbone, "prepare_fused_step", lambda *args: None)
    assert torch.equal(fused, model.generate(ids, 20, temperature=0, attention_mask=mask))


# ----------------------------------------------------------------------------- kernel custom ops


def kernel_op_calls(monkeypatch, module, attributes, run) -> dict[str, tuple[tuple, dict]]:
    """The arguments of the first call of each kernel op ``module.<attribute>`` (registered by
    ``ssm._custom_op.kernel_op``) while ``run()`` runs, as the library passes them (a forward
    op's from a public function, a backward op's from the forward's autograd formula), by the
    op's name (``"ssm::..."``). Each tensor is a leaf copy, needing a gradient where a forward
    op's argument did, so that ``opcheck`` tests the autograd formula too; a backward op's need
    none (it has no autograd of its own)."""
    from ssm._custom_op import KERNEL_OPS

    calls = {}

    def copy(t, grad: bool):
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone().requires_grad_(grad and t.requires_grad)

    for attribute in attributes:
        op = getattr(module, attribute)
        name = next(name for name, registered in KERNEL_OPS.items() if registered is op)

        def spy(*args, _name=name, _op=op, **kwargs):
            if _name not in calls:
                grad = torch.is_grad_enabled()
                calls[_name] = (tuple(copy(a, grad) for a in args), {k: copy(v, grad) for k, v in kwargs.items()})
            return _op(*args, **kwargs)

        monkeypatch.setattr(module, attribute, spy)
    run()
    return calls


def assert_kernel_ops_agree_with_their_fakes(calls: dict[str, tuple[tuple, dict]]) -> None:
    """``torch.library.opcheck`` of each recorded call: the op's schema (no input written or
    aliased by an output), its fake against the kernel (each output's shape, dtype, strides and
    device), its autograd registration, and a trace through AOT autograd with dynamic shapes."""
    from ssm._custom_op import KERNEL_OPS

    for name, (args, kwargs) in calls.items():
        try:
            torch.library.opcheck(KERNEL_OPS[name], args, kwargs)
        except Exception as e:
            raise AssertionError(f"{name} fails torch.library.opcheck: {e}") from e
