"""What the property-based tests (tests/scan/test_properties.py, tests/layers/test_properties.py)
share: the inputs they draw made concrete, and the three checks every drawn case goes through.

- ``refused``: a case drawn invalid (a state size of 0, groups that do not divide) raises a
  ValueError whose message names the argument the strategy said was wrong, before any kernel
  runs (a crash would end the test process: pytest reports it as such).
- ``matches_reference``: a valid case gives, forward and through autograd, what the "ref"
  backend gives on float64 copies of the same values, within the tolerances of the dtype.
- ``causal``: a NaN or ±inf planted at step t of one sequence changes no output before t
  (within the tolerances of two runs of our own code), and those outputs are finite; nothing in
  another sequence (another batch row, or another packed sequence) changes, its last state
  included.

Time axes: each positional input (one value per step) is named with the axis its steps lie on;
batch rows are axis 0 everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers import REFERENCE_TOLERANCES, TOLERANCES, assert_relative, poisoned


@dataclass
class Case:
    """One drawn call: ``call(inputs, backend)`` returns (out, *last states); ``time`` names the
    positional inputs with their time axis; ``out_time`` is out's; ``bounds`` the packed
    sequences' (cu_seqlens values) or None; ``reverse`` a scan run from the end;
    ``expect_error`` the argument a ValueError must name (None: the case is valid)."""

    inputs: dict
    call: Callable
    time: dict
    out_time: int
    dtype: torch.dtype
    bounds: tuple | None = None
    reverse: bool = False
    expect_error: str | None = None
    info: dict = field(default_factory=dict)


def strided(t: torch.Tensor) -> torch.Tensor:
    """A leaf tensor with t's values whose last dimension is every other element of a wider
    one (not contiguous whenever that dimension has 2 or more elements)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype) if t.ndim else t.detach().clone()
    view = wide[..., ::2] if t.ndim else wide
    with torch.no_grad():
        view.copy_(t)
    return view.requires_grad_(t.requires_grad)


def refused(case: Case, backend: str) -> None:
    with pytest.raises(ValueError) as err:
        case.call(case.inputs, backend)
    message = str(err.value)
    assert re.search(rf"(^|\W){re.escape(case.expect_error)}(\W|$)", message), (
        f"the error should name {case.expect_error!r}: {message}"
    )


def _flat(outputs) -> list[torch.Tensor]:
    flat = []
    for o in outputs:
        flat.extend(o if isinstance(o, (tuple, list)) else [o])
    return flat


def _run(case: Case, inputs: dict, backend: str, weights=None):
    """(outputs, gradients by input name or None, the weights of the loss) of one run."""
    with poisoned():
        outs = _flat(case.call(inputs, backend))
    if weights is None:
        g = torch.Generator().manual_seed(7)
        # rounded to each output's dtype: the backend's outputs receive exactly these gradients
        # (autograd rounds them so), and the reference's float64 outputs the same values
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).double() for o in outs]
    leaves = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    if not leaves or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return outs, None, weights
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return outs, dict(zip(leaves, grads)), weights


def matches_reference(case: Case, backend: str) -> None:
    fwd_tol, grad_tol = REFERENCE_TOLERANCES[case.dtype]
    outs, grads, weights = _run(case, case.inputs, backend)
    wide = {
        k: v.detach().double().requires_grad_(v.requires_grad) if _is_float(v) else v for k, v in case.inputs.items()
    }
    ref_outs, ref_grads, _ = _run(case, wide, "ref", weights)
    for i, (out, ref) in enumerate(zip(outs, ref_outs)):
        assert_relative(out, ref, fwd_tol, f"{backend} output {i}")
    if grads is not None and ref_grads is not None:
        for name, grad in grads.items():
            assert_relative(grad, ref_grads[name], grad_tol, f"{backend} d{name}")


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def causal(case: Case, backend: str, name: str, row: int, t: int, value: float) -> None:
    """Plant ``value`` at step t of batch row ``row`` of input ``name``; compare with the clean run."""
    with torch.no_grad():
        clean = _flat(case.call(case.inputs, backend))
        dirty_inputs = dict(case.inputs)
        planted = case.inputs[name].detach().clone()
        index = [slice(None)] * planted.ndim
        index[0], index[case.time[name]] = row, t
        planted[tuple(index)] = value
        dirty_inputs[name] = planted
        dirty = _flat(case.call(dirty_inputs, backend))
    out, dirty_out = clean[0], dirty[0]
    length = out.shape[case.out_time]
    if case.bounds is None:
        seq = row
        before = range(t + 1, length) if case.reverse else range(t)
        unchanged_rows = [r for r in range(out.shape[0]) if r != row]
        kept = {(row, s) for s in before}
    else:
        seq = max(i for i in range(len(case.bounds) - 1) if case.bounds[i] <= t < case.bounds[i + 1])
        start, end = case.bounds[seq], case.bounds[seq + 1]
        before = range(t + 1, end) if case.reverse else range(start, t)
        others = [s for s in range(length) if not start <= s < end]
        kept = {(0, s) for s in [*before, *others]}
        unchanged_rows = []
    tol = TOLERANCES[case.dtype]
    for r, s in sorted(kept) + [(r, s) for r in unchanged_rows for s in range(length)]:
        a, b = out.select(0, r).select(case.out_time - 1, s), dirty_out.select(0, r).select(case.out_time - 1, s)
        what = f"{backend}: {value} in {name} at row {row}, step {t}, changed the output at row {r}, step {s}"
        assert torch.isfinite(b).all(), what + " (not finite)"
        torch.testing.assert_close(b, a, **tol, msg=lambda m: f"{what}: {m}")
    # the last states of the other sequences (rows), one per sequence along axis 0
    for clean_last, dirty_last in zip(clean[1:], dirty[1:]):
        for other in range(clean_last.shape[0]):
            if other != seq:
                what = f"{backend}: {value} in {name} at step {t} changed the last state of sequence {other}"
                torch.testing.assert_close(dirty_last[other], clean_last[other], **tol, msg=lambda m: f"{what}: {m}")
