"""The "cpu" backend beyond the cross-backend tests (test_selective_scan.py, test_linear_scan.py
run it against the reference at many shapes): its C kernels at sizes around the chunk length and
at the usual state size, packed sequences against each sequence run alone by the reference,
what it keeps for the backward, that every input variant runs the compiled kernels in one
process, the fallback without a compiler, and the build cache.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch

from ssm import native
from ssm.scan import cpu, linear_scan, selective_scan
from ssm.scan.linear import BACKENDS as LINEAR_BACKENDS
from ssm.scan.reference import linear_scan_ref, selective_scan_ref
from ssm.scan.selective import BACKENDS as SELECTIVE_BACKENDS
from tests.helpers import (
    REFERENCE_TOLERANCES,
    as_float64,
    assert_relative,
    check_linear,
    check_selective,
    linear_inputs,
    run_with_grads,
    selective_call,
    selective_inputs,
)

T = cpu.CHUNK
needs_kernels = pytest.mark.skipif(native.library() is None, reason="the C kernels could not be built here")


def test_auto_picks_cpu_for_cpu_tensors():
    assert SELECTIVE_BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"
    assert LINEAR_BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"


@needs_kernels
@pytest.mark.parametrize("length", [T - 1, T, T + 1, 2 * T + 3])
@pytest.mark.parametrize("form", ["fixed", "grouped"])
def test_selective_chunk_boundaries(length, form):
    check_selective(selective_inputs(length, B_form=form, C_form="varying", wide_delta=True), "cpu")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_unrolled_state_sizes(dtype):
    """N = 16 and 32 take the kernels' whole-vector path (N a multiple of 8), N = 4 the general one."""
    for N in (16, 32):
        check_selective(selective_inputs(2 * T + 5, N=N, groups=2, B_form="grouped", dtype=dtype), "cpu")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_state_size_64_with_one_decay_per_channel(dtype):
    """N = 64 with the same A for every n of a channel (Mamba-2's and Mamba-3's d_state 64) has a
    specialised sweep; A varying over n, the general one. B and C are laid out (batch, L, G, N),
    as a layer's keys are, and their gradients come back in that layout."""
    for same_A in (True, False):
        x = selective_inputs(2 * T + 5, dim=4, N=64, groups=2, B_form="grouped", dtype=dtype, seed=5)
        if same_A:
            x["A"] = x["A"].detach()[:, :1].expand(-1, 64).clone().requires_grad_()
        for name in ("B", "C"):  # (batch, G, N, L) views of (batch, L, G, N) memory
            x[name] = x[name].detach().permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1).requires_grad_()
        _, grads = check_selective(x, "cpu")
        for name in ("B", "C"):
            assert grads[name].stride() == x[name].stride(), f"d{name} laid out {grads[name].stride()}"


@needs_kernels
@pytest.mark.parametrize("length", [T - 1, T + 1, 3 * T + 2])
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_lengths(length, reverse):
    check_linear(linear_inputs((2, length, 3), 1), "cpu", 1, reverse)
    check_linear(linear_inputs((3, 5, length), 2), "cpu", 2, reverse)  # F = 1: one column per row


@needs_kernels
def test_linear_wide_rows_span_several_column_blocks():
    check_linear(linear_inputs((1, 37, 2, 300), 1), "cpu", 1, False)  # F = 600: three blocks of 256


@needs_kernels
def test_linear_strided_inputs():
    x = linear_inputs((4, 23, 6), 1)
    x = {
        k: (v.detach().transpose(0, -1).contiguous().transpose(0, -1).requires_grad_() if v.ndim == 3 else v)
        for k, v in x.items()
    }
    assert not x["gates"].is_contiguous()
    check_linear(x, "cpu", 1, True)


@needs_kernels
def test_selective_upstream_gradient_in_a_layers_layout():
    """out's gradient as a Mamba layer hands it back, (B, L, D) seen as (B, D, L): the backward
    copies it to its own layout first; the gradients must be the reference's."""
    x = selective_inputs(2 * T + 3, batch=2, B_form="varying", wide_delta=True, initial_state=False)
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(2, 2 * T + 3, x["u"].shape[1], generator=g, dtype=torch.float64).transpose(1, 2)
    x64 = as_float64(x)
    want = torch.autograd.grad(selective_scan(**x64, delta_softplus=True, backend="ref"), list(x64.values()), upstream)
    out = selective_scan(**x, delta_softplus=True, backend="cpu")
    got = torch.autograd.grad(out, list(x.values()), upstream.to(out.dtype))
    assert not upstream.is_contiguous()
    for name, w, h in zip(x, want, got):
        assert_relative(h, w, REFERENCE_TOLERANCES[torch.float32][1], f"d {name}")


# ----------------------------------------------------------------------------- packed sequences

# Zero-length sequences at the start, in the middle and at the end; boundaries inside chunks and
# on chunk edges.
PACKINGS = [[0, 0, 5, 5, T, T + 9, 3 * T + 1], [0, 3 * T + 1], [0, 1, 2, 3 * T, 3 * T + 1, 3 * T + 1]]


def _packed_selective(form: str, cu: list[int], dtype=torch.float64, seed=0):
    x = selective_inputs(
        cu[-1], batch=1, B_form=form, C_form="varying", wide_delta=True, initial_state=False, dtype=dtype, seed=seed
    )
    g = torch.Generator().manual_seed(seed + 1)
    x["initial_state"] = torch.randn(len(cu) - 1, 6, 4, generator=g, dtype=x["A"].dtype).requires_grad_()
    return x


def _selective_per_sequence(x: dict, cu: list[int]):
    """The reference, one sequence at a time (a zero-length one returns its initial state)."""
    outs, lasts = [], []
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        h0 = x["initial_state"][s : s + 1]
        if lo == hi:
            outs.append(x["u"][..., :0])
            lasts.append(h0)
            continue
        part = {k: (v[..., lo:hi] if v.ndim >= 3 and k != "initial_state" else v) for k, v in x.items()}
        part["initial_state"] = h0
        out, last = selective_scan_ref(
            part["u"],
            part["delta"],
            part["A"],
            part["B"] if part["B"].ndim == 2 else part["B"].unsqueeze(1),
            part["C"].unsqueeze(1),
            part["D"],
            part["z"],
            part["delta_bias"],
            True,
            part["initial_state"],
        )
        outs.append(out)
        lasts.append(last)
    return torch.cat(outs, -1), torch.cat(lasts, 0)


def _packed_call(x: dict, cu: list[int]):
    B = x["B"] if x["B"].ndim == 2 else x["B"].unsqueeze(1)
    return cpu.selective_scan_cpu(
        x["u"],
        x["delta"],
        x["A"],
        B,
        x["C"].unsqueeze(1),
        x["D"],
        x["z"],
        x["delta_bias"],
        True,
        x["initial_state"],
        torch.tensor(cu),
    )


@needs_kernels
@pytest.mark.parametrize("cu", PACKINGS)
@pytest.mark.parametrize("form", ["fixed", "varying"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_packed_sequences_match_each_sequence_alone(cu, form, dtype):
    """cu_seqlens: the state restarts at every sequence start from that sequence's initial
    state; the last states (S, D, N) and every gradient, initial states included, equal the
    float64 reference run sequence by sequence."""
    x = _packed_selective(form, cu, dtype)
    out, last = _packed_call(x, cu)
    g = torch.Generator().manual_seed(7)
    upstream = [
        torch.randn(out.shape, generator=g, dtype=torch.float64),
        torch.randn(last.shape, generator=g, dtype=torch.float64),
    ]
    grads = torch.autograd.grad((out, last), list(x.values()), [u.to(o.dtype) for u, o in zip(upstream, (out, last))])
    x64 = {k: v.detach().double().requires_grad_() for k, v in x.items()}
    ref_out, ref_last = _selective_per_sequence(x64, cu)
    ref_grads = torch.autograd.grad((ref_out, ref_last), list(x64.values()), upstream)
    fwd_tol, grad_tol = REFERENCE_TOLERANCES[dtype]
    assert_relative(out, ref_out, fwd_tol, "packed out")
    assert_relative(last, ref_last, fwd_tol, "packed last_state")
    for name, got, want in zip(x, grads, ref_grads):
        assert_relative(got, want, grad_tol, f"packed d{name}")


@needs_kernels
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_packed_sequences_match_each_sequence_alone(reverse):
    cu = [0, 0, 5, T + 9, T + 9, 3 * T + 1]
    g = torch.Generator().manual_seed(3)
    gates = torch.rand(1, cu[-1], 2, 5, generator=g, dtype=torch.float64).requires_grad_()
    inputs = torch.randn(1, cu[-1], 2, 5, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(len(cu) - 1, 2, 5, generator=g, dtype=torch.float64).requires_grad_()
    states = cpu.linear_scan_cpu(gates, inputs, 1, h0, reverse, torch.tensor(cu))
    upstream = torch.randn(states.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(states, (gates, inputs, h0), upstream)
    parts = [
        linear_scan_ref(gates[:, lo:hi], inputs[:, lo:hi], 1, h0[s : s + 1], reverse) if hi > lo else inputs[:, :0]
        for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:]))
    ]
    ref = torch.cat(parts, 1)
    ref_grads = torch.autograd.grad(ref, (gates, inputs, h0), upstream)
    assert_relative(states, ref, 1e-12, "packed states")
    for name, got, want in zip(("gates", "inputs", "initial_state"), grads, ref_grads):
        assert_relative(got, want, 1e-12, f"packed d{name}")


# ----------------------------------------------------------------------------- compiled code for every variant


@needs_kernels
def test_every_input_variant_runs_the_compiled_kernels(monkeypatch):
    """Ranks of B and C, with and without z, D, bias and initial state, three dtypes, packed or
    not: more than the 8 variants after which torch.compile gave up recompiling and ran eagerly.
    Every one runs the C kernels (the fallback is made to fail), and the ninth and later agree
    with the reference as the first do."""

    def no_fallback(*args):
        raise AssertionError("the cpu backend left its kernels")

    monkeypatch.setattr(cpu, "selective_scan_pscan", no_fallback)
    monkeypatch.setattr(cpu, "linear_scan_pscan", no_fallback)
    variants = [
        dict(B_form="fixed"),
        dict(B_form="varying"),
        dict(B_form="grouped"),
        dict(B_form="fixed", C_form="grouped"),
        dict(z=False),
        dict(D=False),
        dict(bias=False),
        dict(initial_state=False),
        dict(dtype=torch.float64),
        dict(dtype=torch.bfloat16),
        dict(B_form="grouped", z=False, D=False, dtype=torch.float64),
        dict(batch=3, dim=9, N=7, groups=3, B_form="grouped"),
    ]
    for i, variant in enumerate(variants):
        check_selective(selective_inputs(T + 7, seed=i, **variant), "cpu")
    check_linear(linear_inputs((2, T + 3, 3), 1, dtype=torch.float64), "cpu", 1, False)
    check_linear(linear_inputs((2, T + 3, 3), 1, initial_state=False), "cpu", 1, True)


@needs_kernels
def test_no_recompilation_by_torch_dynamo():
    """The backend compiles nothing through torch.compile: new shapes and variants leave
    dynamo's counters untouched."""
    from torch._dynamo.utils import counters

    counters.clear()
    for length, batch in ((T + 1, 2), (3 * T, 1), (7, 5)):
        x = selective_inputs(length, batch=batch, B_form="grouped")
        out, last = selective_call(x, "cpu")
        (out.sum() + last.sum()).backward()
    assert not counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------- memory


def saved_by(fn):
    """The shapes of the tensors autograd saves while running ``fn``, and its result."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return shapes, result


@needs_kernels
def test_no_grad_saves_nothing_and_grad_saves_chunk_states():
    x = selective_inputs(3 * T + 2)
    with torch.no_grad():
        shapes, (out, last) = saved_by(lambda: selective_call(x, "cpu"))
    assert shapes == [] and out.grad_fn is None and last.grad_fn is None

    detached = {k: v.detach() for k, v in x.items()}  # nothing requires grad
    shapes, (out, last) = saved_by(lambda: selective_call(detached, "cpu"))
    assert shapes == [] and out.grad_fn is None

    # With gradients the state entering each chunk is kept, and nothing saved is as large as
    # (batch, dim, L, N): memory is O(batch·dim·L).
    shapes, (out, last) = saved_by(lambda: selective_call(x, "cpu"))
    batch, dim, length = x["u"].shape
    N = x["A"].shape[1]
    assert (batch, -(-length // T), dim, N) in shapes
    assert max(torch.Size(s).numel() for s in shapes) <= batch * dim * length < batch * dim * length * N


@needs_kernels
def test_linear_no_grad_saves_nothing():
    x = linear_inputs((2, 2 * T + 3, 3), 1)
    with torch.no_grad():
        shapes, states = saved_by(lambda: linear_scan(**x, dim=1, backend="cpu"))
    assert shapes == [] and states.grad_fn is None
    shapes, states = saved_by(lambda: linear_scan(**x, dim=1, backend="cpu"))
    assert shapes and states.grad_fn is not None


# ----------------------------------------------------------------------------- without a compiler


def test_without_a_compiler_warns_once_and_runs_pscan(monkeypatch, tmp_path):
    """No working compiler: one warning naming the way out, then pscan's path, correct; a
    working compiler (another CC) is used again at once: nothing sticks for the process."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SSM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not build them") as record:
        check_selective(selective_inputs(T + 3), "cpu")
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning
        check_selective(selective_inputs(2 * T + 1, seed=2), "cpu")
        check_linear(linear_inputs((2, T + 1, 3), 1), "cpu", 1, False)
    assert native.library() is None
    monkeypatch.delenv("CC")
    if native.library() is not None:  # a compiler is installed here: back on the kernels
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            check_selective(selective_inputs(T + 3), "cpu")


def test_kernel_switch_off_runs_pscan_silently(monkeypatch):
    monkeypatch.setenv("SSM_CPU_KERNEL", "0")
    calls = []
    original = cpu.selective_scan_pscan

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(cpu, "selective_scan_pscan", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_selective(selective_inputs(T + 3), "cpu")
    assert calls


@needs_kernels
def test_build_is_cached_on_disk_and_reused(tmp_path):
    """A fresh process with an empty cache directory builds the library there (one file, no
    temporaries left); a second process loads it without building it again."""
    code = (
        "import torch; from ssm import native; from ssm.scan import selective_scan; "
        "u = torch.randn(1, 4, 9); selective_scan(u, u, -torch.ones(4, 2), torch.randn(4, 2), torch.randn(4, 2)); "
        "assert native.library() is not None"
    )
    env = {**os.environ, "SSM_CACHE_DIR": str(tmp_path), "PYTHONWARNINGS": "error::RuntimeWarning"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("ssm_kernels-") and built[0].suffix == ".so", built
    stamp = built[0].stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp


@needs_kernels
def test_a_background_build_leaves_the_library_for_the_first_scan(tmp_path):
    """build_in_background in a fresh process with an empty cache: the thread builds the
    library, and the scan after it loads that library (no second build, no temporaries)."""
    code = (
        "import torch; from ssm import native; from ssm.scan import selective_scan; "
        "thread = native.build_in_background(); assert thread is not None; thread.join(); "
        "import os; assert len(os.listdir(os.environ['SSM_CACHE_DIR'])) == 1; "
        "from ssm.native import build; built = build._built[build._build_key()]; "
        "assert built is not None and not isinstance(built, str); "
        "u = torch.randn(1, 4, 9); selective_scan(u, u, -torch.ones(4, 2), torch.randn(4, 2), torch.randn(4, 2)); "
        "assert len(os.listdir(os.environ['SSM_CACHE_DIR'])) == 1"
    )
    env = {**os.environ, "SSM_CACHE_DIR": str(tmp_path), "PYTHONWARNINGS": "error::RuntimeWarning"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]


def test_no_background_build_when_the_kernels_are_switched_off(monkeypatch):
    monkeypatch.setenv("SSM_CPU_KERNEL", "0")
    assert native.build_in_background() is None


# ----------------------------------------------------------------------------- torch.compile


@needs_kernels
def test_inside_torch_compile_calls_the_kernels_without_graph_breaks():
    """Under a user's torch.compile the kernels are opaque custom ops: the graph holds them, and
    the compiled function gives the eager values and gradients."""
    x = selective_inputs(T + 5, B_form="grouped")
    names = list(x)

    def f(*tensors):
        out, last = selective_call(dict(zip(names, tensors)), "cpu")
        return (out * out).sum() + last.sum()

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    loss = compiled(*x.values())
    assert any("cpu_selective_scan_fwd" in t for t in seen)
    expected = f(*x.values())
    torch.testing.assert_close(loss, expected)


def test_gradients_are_the_same_bits_on_every_run():
    """The per-thread sums over channels of time-varying B and C are added in a fixed order:
    a training step repeated (or resumed) gives bitwise the same gradients."""
    inputs = selective_inputs(3 * T + 5, dim=64, N=8, groups=1, seed=3)
    first = run_with_grads(selective_call, inputs, "cpu")[1]
    for _ in range(3):
        again = run_with_grads(selective_call, inputs, "cpu")[1]
        for name, grad in first.items():
            assert torch.equal(again[name], grad), f"d{name} differs between two identical runs"


def _decaying_pulse(length: int, channels: int = 3) -> dict:
    """A unit pulse at step 0 into h_t = e^-1·h_{t-1} + u_t: h_t = e^-t, which leaves float's normal
    range (1.18e-38) after step 87 and its subnormal one (1.4e-45) after step 103."""
    u = torch.zeros(1, channels, length)
    u[:, :, 0] = 1
    ones = torch.ones(channels, 1)
    return dict(u=u, delta=torch.ones(1, channels, length), A=-ones, B=ones, C=ones.clone())


@needs_kernels
@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "aarch64", "arm64"),
    reason="the sweeps flush subnormals on x86 and aarch64 only (common.h); elsewhere they keep them",
)
def test_sweeps_flush_subnormals_to_zero():
    """The sweeps run with subnormals flushed (a decayed state or adjoint under 1.2e-38 is 0, as on a
    GPU): a backward that walks an adjoint down through the subnormal range otherwise runs several
    times slower. Forward: the state e^-t reads 0 from step 88 where float could still hold it;
    backward: the adjoint from the last step reaches step 0 as e^-99, flushed to 0."""
    x = _decaying_pulse(100)
    x["u"].requires_grad_()
    y = selective_scan(**x, backend="cpu")
    assert y[0, 0, 80].item() == pytest.approx(torch.tensor(-80.0, dtype=torch.float64).exp().item(), rel=1e-4)
    assert torch.tensor(-95.0).exp().item() > 0  # float holds e^-95 as a subnormal ...
    assert (y[:, :, 88:] == 0).all()  # ... the sweep has flushed it
    grad = torch.zeros_like(y)
    grad[:, :, -1] = 1
    (du,) = torch.autograd.grad(y, x["u"], grad)
    assert du[0, 0, 20].item() == pytest.approx(torch.tensor(-79.0, dtype=torch.float64).exp().item(), rel=1e-4)
    assert (du[:, :, :11] == 0).all()  # e^-89 and below
    h = linear_scan(torch.full((2, 100), torch.e**-1), torch.eye(1, 100).expand(2, 100).contiguous(), backend="cpu")
    assert h[0, 80].item() > 0 and (h[:, 88:] == 0).all()


@needs_kernels
def test_sweeps_leave_the_callers_floating_point_mode_alone():
    """Flushing is the sweeps' own: once they return, torch's threads (the caller's and its
    intra-op pool's) still compute with subnormals."""
    x = _decaying_pulse(130, channels=64)
    x["u"].requires_grad_()
    y = selective_scan(**x, backend="cpu")
    y.sum().backward()
    linear_scan(torch.full((64, 130), 0.5), torch.rand(64, 130), backend="cpu")
    subnormal = torch.full((1 << 20,), 1e-39)  # big enough for torch to split over its threads
    assert (subnormal * 1.0).ne(0).all()
    assert (subnormal[:1] * 1.0).item() == pytest.approx(1e-39, rel=1e-3)


def test_selective_channel_blocks_that_span_two_groups():
    """The backward splits the channels into min(D, 4·threads) blocks, each summing dB and dC of
    its channels into rows of its own that only its groups' rows are zeroed in, and the final sum
    reads only the blocks of each group. With 2 threads, 8 blocks over 12 channels in 3 groups of
    4: block 5 holds channels 7 and 8, one in group 1, one in group 2 (scratch NaN-poisoned)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for form in ("grouped", "varying"):
            check_selective(selective_inputs(2 * T + 3, dim=12, groups=3, B_form=form, C_form="grouped"), "cpu")
    finally:
        torch.set_num_threads(threads)


def test_channel_blocks_own_whole_groups_when_there_are_enough():
    """Blocks of whole groups (written straight into dB, dC) when the groups give two blocks per
    thread; else min(D, 4·threads) blocks with scratch rows of their own."""
    assert cpu._channel_blocks(64, 2, []) == (8, False)  # B and C fixed: nothing to own
    assert cpu._channel_blocks(64, 2, [1, 1]) == (8, False)  # one group (Mamba-2's usual)
    assert cpu._channel_blocks(64, 2, [4, 4]) == (4, True)  # Mamba-3's parity model: a head a block
    assert cpu._channel_blocks(768, 2, [24, 24]) == (8, True)  # 24 heads: 3 per block
    assert cpu._channel_blocks(768, 16, [24, 24]) == (64, False)  # 24 blocks are too few for 16 threads
    assert cpu._channel_blocks(768, 16, [48]) == (48, True)
    assert cpu._channel_blocks(64, 2, [4, 2]) == (8, False)  # gcd 2: a block would split B's groups
    assert cpu._channel_blocks(64, 2, [26]) == (8, False)  # 26's divisors up to 8 are 1 and 2


@pytest.mark.parametrize("groups", [4, 8])
@pytest.mark.parametrize("N", [4, 16])  # 16: the sums over N in lanes
def test_selective_channel_blocks_that_own_their_groups(groups, N):
    """With 2 threads and 4 or 8 groups each block is whole groups and adds its channels' dB and
    dC into the gradients' rows itself, which it zeroes first (the pool hands out used storage)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu._channel_blocks(16, 2, [groups])[1]
        for form in ("grouped", "varying"):
            inputs = selective_inputs(2 * T + 3, dim=16, N=N, groups=groups, B_form=form, C_form="grouped")
            check_selective(inputs, "cpu")
    finally:
        torch.set_num_threads(threads)
