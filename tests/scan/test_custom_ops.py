"""The scans' kernels as torch custom ops (ssm._custom_op.kernel_op: the C sweeps of
ssm/scan/cpu.py, the Triton launchers of ssm/scan/triton/) pass ``torch.library.opcheck`` on the
arguments the library gives them: each fake gives its kernel's output shapes, dtypes and
strides, the schema holds (nothing written in place), and the autograd formula traces. A fake
that disagrees with its kernel breaks ``torch.compile`` of a model; the compile tests
(test_compile.py) catch only the disagreements that the traced graph happens to depend on.

The Triton ops run in Triton's interpreter here, at tiny shapes. Every scan op registered
through kernel_op is checked by one of these tests."""

from __future__ import annotations

import importlib.util
import pkgutil

import pytest

from ssm._custom_op import KERNEL_OPS
from ssm.scan import cpu, trapezoidal_cpu
from tests.helpers import (
    CPU_PRODUCTS,
    assert_kernel_ops_agree_with_their_fakes,
    cu_seqlens_of,
    kernel_op_calls,
    linear_call,
    linear_inputs,
    run_with_grads,
    selective_call,
    selective_inputs,
    ssd_call,
    ssd_inputs,
    ssd_packed_call,
    trapezoidal_call,
    trapezoidal_inputs,
    with_sequence_states,
)

TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="the triton package is not installed (it is on Linux)")
T = cpu.CHUNK

# the attributes of the op modules that hold their kernel ops, by module
CPU_OPS = ["_selective_fwd", "_selective_bwd", "_linear_fwd", "_linear_bwd"]
TRAPEZOIDAL_CPU_OPS = [
    "_trap_out_fwd",
    "_trap_out_bwd",
    "_trap_rot_fwd",
    "_trap_rot_bwd",
    "_trap_phase_fwd",
    "_trap_phase_bwd",
]  # of ssm.scan.trapezoidal_cpu
TRITON_OPS = {
    "selective_scan": ["selective_scan_fwd", "selective_scan_bwd"],
    "linear_scan": ["linear_scan_fwd", "linear_scan_bwd"],
    "trapezoidal_scan": ["trapezoidal_scan_fwd", "trapezoidal_scan_bwd"],
    "ssd": ["ssd_fwd", "ssd_bwd"],
}


def triton_module(name: str):
    return importlib.import_module(f"ssm.scan.triton.{name}")


def selective_run(backend: str, length: int, packed: bool):
    """selective_scan forward and backward: grouped time-varying B, fixed C, every option; or
    packed sequences (one of them empty) with an initial state per sequence."""
    if not packed:
        x = selective_inputs(length, B_form="grouped", C_form="fixed")
        return lambda: run_with_grads(selective_call, x, backend)
    lengths = [2, 0, length - 3, 1]
    x, cu_seqlens = with_sequence_states(selective_inputs(length, batch=1), len(lengths)), cu_seqlens_of(lengths)
    return lambda: run_with_grads(lambda inputs, b: selective_call(inputs, b, cu_seqlens=cu_seqlens), x, backend)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_the_cpu_selective_scan_ops_agree_with_their_fakes(packed, monkeypatch):
    run = selective_run("cpu", T + 5, packed)
    calls = kernel_op_calls(monkeypatch, cpu, CPU_OPS[:2], run)
    assert set(calls) == {"ssm::cpu_selective_scan_fwd", "ssm::cpu_selective_scan_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


def test_the_cpu_linear_scan_ops_agree_with_their_fakes(monkeypatch):
    x = linear_inputs((3, 21, 5), 1)
    calls = kernel_op_calls(monkeypatch, cpu, CPU_OPS[2:], lambda: run_with_grads(linear_call(1, True), x, "cpu"))
    assert set(calls) == {"ssm::cpu_linear_scan_fwd", "ssm::cpu_linear_scan_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


@pytest.mark.parametrize("core", ["sweeps", "products"])
@pytest.mark.parametrize("rotary", ["interleaved", "halved"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
def test_the_cpu_trapezoidal_ops_agree_with_their_fakes(gate, rotary, core, monkeypatch):
    """Mamba-3's C pieces (rank 1, the cpu backend): the rotary phase, the keys' rotation (in the
    sweeps' layout or heads first for the products) and the output pass (y in the sweep's layout,
    or heads first without the diagonal term); packed sequences (one empty) with the products."""
    if core == "sweeps":
        x = trapezoidal_inputs(5, batch=2, heads=2, head_dim=3, groups=1, N=4, M=1, z=gate)
    else:
        x = trapezoidal_inputs(9, heads=2, head_dim=3, groups=1, N=4, M=1, z=gate, packed=[4, 0, 5])
    backend = "cpu" if core == "sweeps" else CPU_PRODUCTS
    run = lambda: run_with_grads(trapezoidal_call(rotary), x, backend)  # noqa: E731
    calls = kernel_op_calls(monkeypatch, trapezoidal_cpu, TRAPEZOIDAL_CPU_OPS, run)
    ops = ("out_fwd", "out_bwd", "rot_fwd", "rot_bwd", "phase_fwd", "phase_bwd")
    assert set(calls) == {f"ssm::cpu_trap_{op}" for op in ops}
    assert_kernel_ops_agree_with_their_fakes(calls)


@needs_triton
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_the_triton_selective_scan_ops_agree_with_their_fakes(packed, monkeypatch):
    module = triton_module("selective_scan")
    run = selective_run("triton", module.CHUNK + 3, packed)
    calls = kernel_op_calls(monkeypatch, module, TRITON_OPS["selective_scan"], run)
    assert set(calls) == {"ssm::selective_scan_fwd", "ssm::selective_scan_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


@needs_triton
def test_the_triton_linear_scan_ops_agree_with_their_fakes(monkeypatch):
    x = linear_inputs((2, 9, 3), 1)
    run = lambda: run_with_grads(linear_call(1, False), x, "triton")
    calls = kernel_op_calls(monkeypatch, triton_module("linear_scan"), TRITON_OPS["linear_scan"], run)
    assert set(calls) == {"ssm::linear_scan_fwd", "ssm::linear_scan_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


@needs_triton
@pytest.mark.parametrize("ranks", [None, 2], ids=["siso", "mimo"])
def test_the_triton_trapezoidal_scan_ops_agree_with_their_fakes(ranks, monkeypatch):
    x = trapezoidal_inputs(5, batch=1, heads=2, head_dim=2, groups=1, N=4, M=1, ranks=ranks)
    run = lambda: run_with_grads(trapezoidal_call(), x, "triton")
    calls = kernel_op_calls(monkeypatch, triton_module("trapezoidal_scan"), TRITON_OPS["trapezoidal_scan"], run)
    assert set(calls) == {"ssm::trapezoidal_scan_fwd", "ssm::trapezoidal_scan_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


@needs_triton
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_the_triton_ssd_ops_agree_with_their_fakes(packed, monkeypatch):
    if packed:
        lengths = [3, 0, 9, 2]
        x = with_sequence_states(ssd_inputs(sum(lengths), batch=1, heads=2, head_dim=2, groups=1, N=4), len(lengths))
        call = ssd_packed_call(cu_seqlens_of(lengths))
    else:
        x, call = ssd_inputs(11, batch=1, heads=2, head_dim=2, groups=1, N=4), ssd_call()
    run = lambda: run_with_grads(call, x, "triton")
    calls = kernel_op_calls(monkeypatch, triton_module("ssd"), TRITON_OPS["ssd"], run)
    assert set(calls) == {"ssm::ssd_fwd", "ssm::ssd_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


def test_every_scan_kernel_op_is_checked_here():
    """A scan op registered through kernel_op (a launcher of a module under ssm.scan) without a
    test above fails here. Every module of ssm.scan is imported first, so that each registers its ops."""
    for package in ("ssm.scan", "ssm.scan.triton") if TRITON else ("ssm.scan",):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            importlib.import_module(f"{package}.{info.name}")
    modules = [cpu, trapezoidal_cpu] + ([triton_module(name) for name in TRITON_OPS] if TRITON else [])
    attributes = [CPU_OPS, TRAPEZOIDAL_CPU_OPS] + ([TRITON_OPS[name] for name in TRITON_OPS] if TRITON else [])
    checked = {getattr(m, a) for m, names in zip(modules, attributes) for a in names}
    scan_ops = {op for op in KERNEL_OPS.values() if op._init_fn.__module__.startswith("ssm.scan")}
    assert scan_ops <= checked, sorted(n for n, op in KERNEL_OPS.items() if op in scan_ops - checked)
