"""Bad input gets a ValueError that names the argument, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

from ssm.scan import backends, linear_scan, selective_scan
from ssm.scan.linear import BACKENDS as LINEAR_BACKENDS
from ssm.scan.selective import BACKENDS as SELECTIVE_BACKENDS

BATCH, DIM, L, N = 2, 6, 5, 4


def good():
    return dict(
        u=torch.randn(BATCH, DIM, L),
        delta=torch.rand(BATCH, DIM, L),
        A=-torch.rand(DIM, N),
        B=torch.randn(BATCH, N, L),
        C=torch.randn(BATCH, N, L),
        D=torch.randn(DIM),
        z=torch.randn(BATCH, DIM, L),
        delta_bias=torch.randn(DIM),
        initial_state=torch.randn(BATCH, DIM, N),
    )


SELECTIVE_CASES = {
    "u not 3-D": (dict(u=torch.randn(DIM, L)), ["u", "3-D"]),
    "u integer": (dict(u=torch.ones(BATCH, DIM, L, dtype=torch.long)), ["u", "floating", "torch.int64"]),
    "u not a tensor": (dict(u=[[1.0]]), ["u", "torch.Tensor"]),
    "delta shape": (dict(delta=torch.rand(BATCH, DIM, L + 1)), ["delta", "(2, 6, 5)", "(2, 6, 6)"]),
    "A not 2-D": (dict(A=-torch.rand(DIM)), ["A", "2-D"]),
    "A wrong dim": (dict(A=-torch.rand(DIM + 1, N)), ["A", "(dim, N)", "(7, 4)"]),
    "A complex": (dict(A=torch.randn(DIM, N, dtype=torch.complex64)), ["A", "real floating"]),
    "B wrong N": (dict(B=torch.randn(BATCH, N + 1, L)), ["B", "(batch, N, L)", "(2, 4, 5)", "(2, 5, 5)"]),
    "C wrong length": (dict(C=torch.randn(BATCH, 2, N, L - 1)), ["C", "(batch, G, N, L)", "(2, 2, 4, 5)"]),
    "B fixed wrong": (dict(B=torch.randn(DIM, N + 2)), ["B", "(dim, N)", "(6, 4)"]),
    "B groups": (dict(B=torch.randn(BATCH, 4, N, L)), ["B", "G = 4", "dim = 6", "divisible"]),
    "B 5-D": (dict(B=torch.randn(1, BATCH, 1, N, L)), ["B", "2-D or 3-D or 4-D"]),
    "D shape": (dict(D=torch.randn(DIM + 1)), ["D", "(dim,)", "(6,)", "(7,)"]),
    "delta_bias shape": (dict(delta_bias=torch.randn(1, DIM)), ["delta_bias", "1-D"]),
    "z shape": (dict(z=torch.randn(BATCH, DIM, L + 2)), ["z", "(batch, dim, L)"]),
    "initial_state shape": (
        dict(initial_state=torch.randn(BATCH, DIM, N + 1)),
        ["initial_state", "(batch, dim, N)", "(2, 6, 4)"],
    ),
    "initial_state integer": (
        dict(initial_state=torch.zeros(BATCH, DIM, N, dtype=torch.int32)),
        ["initial_state", "floating"],
    ),
}


@pytest.mark.parametrize("case", list(SELECTIVE_CASES))
def test_selective_scan_errors(case):
    change, words = SELECTIVE_CASES[case]
    with pytest.raises(ValueError) as err:
        selective_scan(**{**good(), **change}, backend="ref")
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"


def test_selective_scan_good_inputs_pass():
    assert selective_scan(**good(), backend="ref").shape == (BATCH, DIM, L)


def test_device_mismatch_names_the_argument():
    meta_D = torch.randn(DIM, device="meta")
    with pytest.raises(ValueError, match="D is on device 'meta'"):
        selective_scan(**{**good(), "D": meta_D}, backend="ref")


LINEAR_CASES = {
    "gates shape": (dict(gates=torch.rand(3, 8)), ["gates", "(3, 7)", "(3, 8)"]),
    "integer inputs": (
        dict(inputs=torch.ones(3, 7, dtype=torch.long), gates=torch.ones(3, 7, dtype=torch.long)),
        ["floating"],
    ),
    "dim out of range": (dict(dim=2), ["dim", "[-2, 1]", "2"]),
    "dim not int": (dict(dim=1.0), ["dim", "int"]),
    "initial_state shape": (dict(initial_state=torch.zeros(7)), ["initial_state", "(3,)", "(7,)"]),
    "scalar inputs": (dict(inputs=torch.tensor(1.0), gates=torch.tensor(1.0)), ["inputs", "0-D"]),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_scan_errors(case):
    change, words = LINEAR_CASES[case]
    args = {"gates": torch.rand(3, 7), "inputs": torch.randn(3, 7), **change}
    with pytest.raises(ValueError) as err:
        linear_scan(args.pop("gates"), args.pop("inputs"), backend="pscan", **args)
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"


@pytest.mark.parametrize("fn", ["selective", "linear"])
def test_unknown_backend_lists_available(fn):
    with pytest.raises(ValueError) as err:
        if fn == "selective":
            selective_scan(**good(), backend="cuda-magic")
        else:
            linear_scan(torch.rand(3, 7), torch.rand(3, 7), backend="cuda-magic")
    message = str(err.value)
    assert "cuda-magic" in message
    for name in ["auto", "ref", "pscan"]:
        assert repr(name) in message


def test_backend_that_cannot_run_on_the_device_is_refused_not_replaced():
    calls = []
    LINEAR_BACKENDS.add("gpu-only", lambda *a: calls.append(a), devices=("cuda",))
    try:
        assert "gpu-only" in backends("linear_scan") and "gpu-only" not in backends("linear_scan", "cpu")
        with pytest.raises(ValueError) as err:
            linear_scan(torch.rand(3, 7), torch.rand(3, 7), backend="gpu-only")
        assert "cannot run on device 'cpu'" in str(err.value) and "'pscan'" in str(err.value)
        assert calls == []
    finally:
        LINEAR_BACKENDS.remove("gpu-only")


def test_auto_uses_a_registered_backend():
    a, x = torch.rand(3, 7), torch.rand(3, 7)
    torch.testing.assert_close(linear_scan(a, x), linear_scan(a, x, backend="ref"))
    assert SELECTIVE_BACKENDS.resolve("auto", torch.device("cpu")).name in backends("selective_scan", "cpu")


def test_backends_rejects_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        backends("quadratic_scan")


def test_where_a_backend_runs_is_asked_when_resolving(monkeypatch):
    """A backend's device list is read at each call (e.g. the Triton backend follows
    TRITON_INTERPRET as it is then), never frozen when the table was built."""
    where = ["cuda"]
    LINEAR_BACKENDS.add("movable", lambda gates, inputs, *rest: inputs.clone(), devices=lambda: tuple(where))
    try:
        a, x = torch.rand(3, 7), torch.rand(3, 7)
        with pytest.raises(ValueError, match="cannot run on device 'cpu'"):
            linear_scan(a, x, backend="movable")
        where.append("cpu")
        assert torch.equal(linear_scan(a, x, backend="movable"), x)
    finally:
        LINEAR_BACKENDS.remove("movable")


CU_SEQLENS_CASES = {
    "not a tensor": ([0, 2, 5], 5, 1, ["cu_seqlens", "torch.Tensor"]),
    "float": (torch.tensor([0.0, 5.0]), 5, 1, ["cu_seqlens", "int32 or torch.int64", "float32"]),
    "2-D": (torch.tensor([[0, 5]]), 5, 1, ["cu_seqlens", "1-D", "(1, 2)"]),
    "one entry": (torch.tensor([0]), 5, 1, ["cu_seqlens", "at least 2"]),
    "not from 0": (torch.tensor([1, 5]), 5, 1, ["cu_seqlens", "start at 0", "got 1"]),
    "not to L": (torch.tensor([0, 2, 4]), 5, 1, ["cu_seqlens", "end at", "L = 5", "got 4"]),
    "decreasing": (torch.tensor([0, 3, 2, 5]), 5, 1, ["cu_seqlens", "not decrease", "cu_seqlens[2] = 2"]),
    "batch 2": (torch.tensor([0, 5]), 5, 2, ["cu_seqlens", "batch of 1", "batch = 2"]),
}


@pytest.mark.parametrize("case", list(CU_SEQLENS_CASES))
def test_cu_seqlens_errors(case):
    from ssm.scan._checks import check_cu_seqlens

    value, length, batch, words = CU_SEQLENS_CASES[case]
    with pytest.raises(ValueError) as err:
        check_cu_seqlens(value, length, batch, torch.device("cpu"))
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"


def test_cu_seqlens_accepts_empty_sequences_and_int32():
    from ssm.scan._checks import check_cu_seqlens

    got = check_cu_seqlens(torch.tensor([0, 0, 3, 3, 5], dtype=torch.int32), 5, 1, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [0, 0, 3, 3, 5]
