"""The generic scan (jax.lax.scan semantics, checkpointed backward) and associative_scan."""

from __future__ import annotations

import operator

import pytest
import torch

from ssm.memory import saved_bytes
from ssm.scan import associative_scan, linear_scan, scan
from tests.helpers import GRADCHECK_TOL, assert_close, poisoned

CHECKPOINTS = [None, 1, 3, "sqrt"]


def loop_scan(fn, init, xs, length=None, reverse=False):
    """What scan must equal: a Python loop over xs indexed with pytree map."""
    L = length if xs is None else len(torch.utils._pytree.tree_leaves(xs)[0])
    carry, ys = init, [None] * L
    for i in reversed(range(L)) if reverse else range(L):
        x = None if xs is None else torch.utils._pytree.tree_map(lambda leaf: None if leaf is None else leaf[i], xs)
        carry, ys[i] = fn(carry, x)
    return carry, ys


# --------------------------------------------------------------------------------------------
# the seed example (torch_xla scan notebook), exactly


def seed_step(carry, x):
    return carry + x, carry * x


@pytest.mark.parametrize("checkpoint", CHECKPOINTS + [2, 100])
def test_seed_example_exact(checkpoint):
    init = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    xs = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], requires_grad=True)
    final, ys = scan(seed_step, init, xs, checkpoint=checkpoint)
    loss = ys.sum()
    loss.backward()
    assert loss.item() == 249.0
    assert final.tolist() == [13.0, 16.0, 19.0]
    assert ys.tolist() == [[1.0, 2.0, 3.0], [8.0, 15.0, 24.0], [42.0, 64.0, 90.0]]
    assert init.grad.tolist() == [12.0, 15.0, 18.0]
    assert xs.grad.tolist() == [[12.0, 14.0, 16.0], [9.0, 11.0, 13.0], [6.0, 8.0, 10.0]]


# --------------------------------------------------------------------------------------------
# forward semantics


def tree_step(carry, x):
    """dict carry with a tuple inside; xs a tuple with a None; y a dict with a None."""
    h, (count, scale) = carry["h"], carry["aux"]
    u, none, v = x
    assert none is None
    h = torch.tanh(h * scale + u) + v.sum()
    return {"h": h, "aux": (count + 1, scale)}, {"out": h.sum(-1), "skip": None, "pair": (h[0], u)}


def tree_inputs(L, g):
    init = {
        "h": torch.randn(2, 3, generator=g),
        "aux": (torch.zeros((), dtype=torch.int64), torch.rand(3, generator=g)),
    }
    xs = (torch.randn(L, 2, 3, generator=g), None, torch.randn(L, 4, generator=g))
    return init, xs


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_pytrees_and_reverse_match_a_loop(reverse, checkpoint):
    g = torch.Generator().manual_seed(0)
    init, xs = tree_inputs(7, g)
    with poisoned():
        final, ys = scan(tree_step, init, xs, reverse=reverse, checkpoint=checkpoint)
    ref_final, ref_ys = loop_scan(tree_step, init, xs, reverse=reverse)
    assert final["aux"][0].item() == 7 and final["aux"][0].dtype == torch.int64
    assert_close(final["h"], ref_final["h"], torch.float32, "final h")
    assert ys["skip"] is None and set(ys) == {"out", "skip", "pair"}
    assert_close(ys["out"], torch.stack([y["out"] for y in ref_ys]), torch.float32, "ys out")
    for m in range(2):
        assert_close(ys["pair"][m], torch.stack([y["pair"][m] for y in ref_ys]), torch.float32, f"ys pair {m}")


def test_reverse_stores_ys_at_their_positions():
    # y_i = the step count before step i: 0 at the end, L-1 at the start when reversed
    step = lambda c, x: (c + 1, c + x)  # noqa: E731
    _, ys = scan(step, torch.tensor(0.0), torch.zeros(5), reverse=True)
    assert ys.tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]
    _, ys = scan(step, torch.tensor(0.0), torch.zeros(5), reverse=True, checkpoint=2)
    assert ys.tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize("checkpoint", [None, 2])
def test_length_without_xs(checkpoint):
    def fib(c, x):
        assert x is None
        a, b = c
        return (b, a + b), a

    (a, b), ys = scan(fib, (torch.tensor(0), torch.tensor(1)), length=10, checkpoint=checkpoint)
    assert ys.tolist() == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
    assert (a.item(), b.item()) == (55, 89)
    # an xs pytree without tensors is the same as none, with length
    _, ys = scan(lambda c, x: (c, x), torch.zeros(1), xs={"a": None}, length=3)
    assert ys == {"a": None}


@pytest.mark.parametrize("checkpoint", [None, "sqrt"])
def test_length_zero_and_one(checkpoint):
    init = torch.randn(3, requires_grad=True)
    final, ys = scan(lambda c, x: (c * x, (c + x, None)), init, torch.randn(0, 3), checkpoint=checkpoint)
    assert final is init
    assert ys[0].shape == (0, 3) and ys[1] is None
    final, ys = scan(lambda c, x: (c + 1, c.sum()), init, length=0)
    assert final is init and ys.shape == (0,)

    x = torch.randn(1, 3, requires_grad=True)
    final, ys = scan(lambda c, x: (c * x, c + x), init, x, checkpoint=checkpoint)
    assert_close(final, init * x[0], torch.float32, "L=1 carry")
    assert_close(ys, (init + x[0])[None], torch.float32, "L=1 ys")
    (final.sum() + ys.sum()).backward()
    assert_close(init.grad, x[0].detach() + 1, torch.float32, "L=1 d/dinit")


def test_y_none_gives_ys_none():
    final, ys = scan(lambda c, x: (c + x, None), torch.zeros(2), torch.ones(4, 2), checkpoint=2)
    assert ys is None and final.tolist() == [4.0, 4.0]


# --------------------------------------------------------------------------------------------
# errors


def test_mismatched_leading_dims_of_xs():
    with pytest.raises(ValueError, match=r"xs\['b'\] has 4"):
        scan(seed_step, torch.zeros(3), {"a": torch.zeros(5, 3), "b": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="length = 4 disagrees with the leading dimension L = 5"):
        scan(seed_step, torch.zeros(3), torch.zeros(5, 3), length=4)
    with pytest.raises(ValueError, match=r"xs\[0\] must have a leading dimension"):
        scan(seed_step, torch.zeros(()), (torch.tensor(1.0),))


@pytest.mark.parametrize("checkpoint", [None, 2])
def test_carry_that_changes_is_named(checkpoint):
    def grows(c, x):
        return {"h": torch.cat([c["h"], x]), "n": c["n"]}, None

    with pytest.raises(
        ValueError, match=r"fn changed carry\['h'\] at step 0: init has shape \(2,\) float32, fn returned shape \(3,\)"
    ):
        scan(grows, {"h": torch.zeros(2), "n": torch.zeros(())}, torch.zeros(4, 1), checkpoint=checkpoint)
    with pytest.raises(
        ValueError,
        match=r"fn changed carry\[1\] at step 0: init has shape \(\) float32, fn returned shape \(\) float64",
    ):
        scan(lambda c, x: ((c[0], c[1].double()), None), (torch.zeros(2), torch.zeros(())), length=3)
    with pytest.raises(ValueError, match="structure of the carry|carry of structure"):
        scan(lambda c, x: ((c, c), None), torch.zeros(2), length=3, checkpoint=checkpoint)
    # the shape may change late, and the step is named
    with pytest.raises(ValueError, match="at step 2"):
        scan(lambda c, x: (c if x.item() < 2 else c[:1], None), torch.zeros(2), torch.arange(4.0))


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="length="):
        scan(seed_step, torch.zeros(3))
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        scan(seed_step, torch.zeros(3), length=-1)
    with pytest.raises(ValueError, match="checkpoint must be"):
        scan(seed_step, torch.zeros(3), torch.zeros(2, 3), checkpoint=0)
    with pytest.raises(ValueError, match="checkpoint must be"):
        scan(seed_step, torch.zeros(3), torch.zeros(2, 3), checkpoint="log")
    with pytest.raises(ValueError, match=r"init\[1\] must be a torch.Tensor.*got float"):
        scan(seed_step, (torch.zeros(3), 1.0), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="fn must return a pair"):
        scan(lambda c, x: c + x, torch.zeros(3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"fn changed y\[0\] at step 1"):
        scan(lambda c, x: (c, (c[: 1 + int(x.item())],)), torch.zeros(3), torch.arange(2.0))
    with pytest.raises(ValueError, match="y of structure"):
        scan(lambda c, x: (c, c if x.item() == 0 else (c, c)), torch.zeros(3), torch.arange(2.0))


# --------------------------------------------------------------------------------------------
# gradients


def rnn_inputs(L, g, dtype=torch.float32):
    W = (torch.randn(5, 5, generator=g, dtype=dtype) / 5**0.5).requires_grad_()
    init = {
        "h": torch.randn(2, 5, generator=g, dtype=dtype).requires_grad_(),
        "c": torch.randn(5, generator=g, dtype=dtype).requires_grad_(),
    }
    xs = (
        torch.randn(L, 2, 5, generator=g, dtype=dtype).requires_grad_(),
        torch.rand(L, generator=g, dtype=dtype).requires_grad_(),
    )
    return W, init, xs


def rnn_step(W):
    def step(carry, x):
        u, gate = x
        h = torch.tanh(carry["h"] @ W + u) * gate + carry["c"]
        return {"h": h, "c": carry["c"] * 0.9}, (h.pow(2).sum(-1), None)

    return step


@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_agree_across_checkpoints_and_with_a_loop(reverse):
    g = torch.Generator().manual_seed(1)
    L = 11  # 1, 3 and sqrt (4) cut it unevenly
    W, init, xs = rnn_inputs(L, g)
    dys, dh = torch.randn(L, 2, generator=g), torch.randn(2, 5, generator=g)
    wrt = [W, init["h"], init["c"], *xs]

    ref_final, ref_ys = loop_scan(rnn_step(W), init, xs, reverse=reverse)
    ref_loss = (torch.stack([y[0] for y in ref_ys]) * dys).sum() + (ref_final["h"] * dh).sum()
    expected = torch.autograd.grad(ref_loss, wrt)

    for checkpoint in CHECKPOINTS + [L, 20]:
        final, (ys, none) = scan(rnn_step(W), init, xs, reverse=reverse, checkpoint=checkpoint)
        assert none is None
        loss = (ys * dys).sum() + (final["h"] * dh).sum()
        assert_close(loss, ref_loss, torch.float32, f"loss, checkpoint={checkpoint}")
        for name, got, exp in zip(
            ["W", "init.h", "init.c", "xs.u", "xs.gate"], torch.autograd.grad(loss, wrt), expected
        ):
            assert_close(got, exp, torch.float32, f"d/d{name}, checkpoint={checkpoint}, reverse={reverse}")


@pytest.mark.parametrize("checkpoint", [None, 2, "sqrt"])
def test_gradcheck_float64(checkpoint):
    g = torch.Generator().manual_seed(2)
    W, init, xs = rnn_inputs(5, g, torch.float64)

    def f(W, h, c, u, gate):
        final, (ys, _) = scan(rnn_step(W), {"h": h, "c": c}, (u, gate), checkpoint=checkpoint)
        return ys, final["h"]

    assert torch.autograd.gradcheck(f, (W, init["h"], init["c"], *xs), **GRADCHECK_TOL)


def test_checkpoint_recomputes_dropout_identically():
    """The recomputed forward must draw the same random numbers as the first one."""
    g = torch.Generator().manual_seed(3)
    W, init, xs = rnn_inputs(9, g)

    def step(carry, x):
        h = torch.nn.functional.dropout(torch.tanh(carry["h"] @ W + x[0]), p=0.5)
        return {"h": h, "c": carry["c"]}, h.sum()

    grads = []
    for checkpoint in [None, 3]:
        torch.manual_seed(0)
        _, ys = scan(step, init, xs, checkpoint=checkpoint)
        grads.append(torch.autograd.grad((ys * torch.arange(9.0)).sum(), [W, xs[0]]))
    for got, exp in zip(*grads):
        assert_close(got, exp, torch.float32, "dropout gradient under checkpoint")


def test_gradient_of_length_without_xs_reaches_parameters():
    w = torch.tensor(0.5, requires_grad=True)
    for checkpoint in [None, 2]:
        final, _ = scan(lambda c, x: (c * w, None), torch.tensor(3.0), length=4, checkpoint=checkpoint)
        (grad,) = torch.autograd.grad(final, w)
        assert_close(grad, torch.tensor(3.0 * 4 * 0.5**3), torch.float32, "d(3 w^4)/dw")


# --------------------------------------------------------------------------------------------
# memory


@pytest.fixture
def one_thread():
    """400 steps of tiny ops: on a shared 2-core runner, intra-op threads make them 10-30x
    slower (measured), and the test is about bytes, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sqrt_checkpoint_keeps_well_under_a_quarter_at_L400(one_thread):
    g = torch.Generator().manual_seed(4)
    L, width = 400, 64
    W = (torch.randn(width, width, generator=g) / width**0.5).requires_grad_()
    init = torch.randn(width, width, generator=g, requires_grad=True)  # a 16 KiB carry
    xs = torch.randn(L, width, generator=g, requires_grad=True)

    def step(h, x):
        h = torch.tanh(h @ W + x)
        return h, h[0, 0]

    def run(checkpoint):
        final, ys = scan(step, init, xs, checkpoint=checkpoint)
        return final.sum() + ys.sum()

    full, loss_full = saved_bytes(lambda: run(None))
    sqrt, loss_sqrt = saved_bytes(lambda: run("sqrt"))
    carry_bytes = width * width * 4
    assert full >= L * carry_bytes  # at least one carry per step
    assert sqrt < full / 4, f"checkpoint='sqrt' keeps {sqrt} bytes, None keeps {full}"
    assert sqrt < 3 * 20 * carry_bytes  # O(sqrt L): 20 segment carries, and xs
    g_full = torch.autograd.grad(loss_full, [W, init, xs])
    g_sqrt = torch.autograd.grad(loss_sqrt, [W, init, xs])
    for got, exp in zip(g_sqrt, g_full):
        assert_close(got, exp, torch.float32, "gradient with checkpoint='sqrt'")


# --------------------------------------------------------------------------------------------
# associative_scan


def fold(fn, elems, reverse=False):
    """Sequential fold along dim 0 of a list of per-step pytrees, jax's order under reverse."""
    n = len(elems)
    out = [None] * n
    order = list(reversed(range(n))) if reverse else list(range(n))
    acc = elems[order[0]]
    out[order[0]] = acc
    for i in order[1:]:
        acc = fn(acc, elems[i])
        out[i] = acc
    return out


def matmul(a, b):
    return a @ b


def affine(p, q):
    """Compose h -> a1·h + x1, then h -> a2·h + x2."""
    (a1, x1), (a2, x2) = p, q
    return a2 * a1, a2 * x1 + x2


@pytest.mark.parametrize("L", [1, 2, 5, 8, 13, 33])
@pytest.mark.parametrize("reverse", [False, True])
def test_associative_scan_matches_a_fold(L, reverse):
    g = torch.Generator().manual_seed(L)
    x = torch.randn(L, 3, generator=g, dtype=torch.float64)
    for fn in [torch.add, torch.maximum]:
        expected = torch.stack(fold(fn, list(x), reverse))
        assert_close(associative_scan(fn, x, reverse=reverse), expected, torch.float64, f"{fn.__name__}, L={L}")
    # non-commutative: 3x3 matrices near the identity, on dim 1 of a (2, L, 3, 3) batch
    m = torch.eye(3, dtype=torch.float64) + 0.3 * torch.randn(2, L, 3, 3, generator=g, dtype=torch.float64)
    expected = torch.stack(fold(matmul, list(m.transpose(0, 1)), reverse), dim=1)
    assert_close(associative_scan(matmul, m, dim=1, reverse=reverse), expected, torch.float64, f"matmul, L={L}")


def test_associative_scan_reverse_argument_order_is_jax_s():
    a, b, c = (torch.randn(2, 2, dtype=torch.float64) for _ in range(3))
    got = associative_scan(matmul, torch.stack([a, b, c]), reverse=True)
    torch.testing.assert_close(got, torch.stack([(c @ b) @ a, c @ b, c]))
    assert not torch.allclose(got[0], a @ (b @ c))


@pytest.mark.parametrize("L", [1, 6, 17])
@pytest.mark.parametrize("reverse", [False, True])
def test_affine_composition_equals_linear_scan(L, reverse):
    g = torch.Generator().manual_seed(L)
    gates = torch.rand(3, L, 4, generator=g, requires_grad=True)
    inputs = torch.randn(3, L, 4, generator=g, requires_grad=True)
    with poisoned():
        _, h = associative_scan(affine, (gates, inputs), dim=-2, reverse=reverse)
        expected = linear_scan(gates, inputs, dim=1, reverse=reverse)
    assert_close(h, expected, torch.float32, "states")
    dh = torch.randn(3, L, 4, generator=g)
    got = torch.autograd.grad((h * dh).sum(), [gates, inputs], materialize_grads=True)
    exp = torch.autograd.grad((expected * dh).sum(), [gates, inputs])
    for name, a, b in zip(["gates", "inputs"], got, exp):
        assert_close(a, b, torch.float32, f"d/d{name}")


def test_associative_scan_gradcheck_and_pytree_with_none():
    g = torch.Generator().manual_seed(5)
    a = torch.rand(7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(a, x):
        def fn(p, q):
            assert p["none"] is None
            return {"ax": affine(p["ax"], q["ax"]), "none": None}

        return associative_scan(fn, {"ax": (a, x), "none": None}, reverse=True)["ax"]

    assert torch.autograd.gradcheck(f, (a, x), **GRADCHECK_TOL)


def test_associative_scan_errors():
    with pytest.raises(ValueError, match="same length along dim 0"):
        associative_scan(operator.add, (torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match=r"dim = 2 is out of range for elems\[1\]"):
        associative_scan(operator.add, (torch.zeros(3, 3, 3), torch.zeros(3, 3)), dim=2)
    with pytest.raises(ValueError, match="at least one tensor"):
        associative_scan(operator.add, {"a": None})
    with pytest.raises(ValueError, match="structure of elems"):
        associative_scan(lambda p, q: p[0], (torch.zeros(4), torch.zeros(4)))
    with pytest.raises(ValueError, match="combine elementwise"):
        associative_scan(lambda p, q: p.sum(0, keepdim=True), torch.zeros(4))


# --------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("checkpoint", [None, 2])
def test_scan_compiles_without_graph_breaks(checkpoint):
    g = torch.Generator().manual_seed(6)
    W, init, xs = rnn_inputs(5, g)

    def f(W, h, c, u, gate):
        final, (ys, _) = scan(rnn_step(W), {"h": h, "c": c}, (u, gate), checkpoint=checkpoint, reverse=True)
        return ys.sum() + final["h"].pow(2).sum()

    inputs = [W, init["h"], init["c"], *xs]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    exp = f(*inputs)
    torch.testing.assert_close(got, exp)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(exp, inputs)):
        torch.testing.assert_close(a, b)


def test_associative_scan_compiles_without_graph_breaks():
    g = torch.Generator().manual_seed(7)
    a = torch.rand(2, 11, generator=g, requires_grad=True)
    x = torch.randn(2, 11, generator=g, requires_grad=True)

    def f(a, x):
        return associative_scan(affine, (a, x), dim=1, reverse=True)[1].pow(2).sum()

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, x)
    exp = f(a, x)
    torch.testing.assert_close(got, exp)
    for p, q in zip(torch.autograd.grad(got, [a, x]), torch.autograd.grad(exp, [a, x])):
        torch.testing.assert_close(p, q)


def test_compiled_step_function_under_checkpoint():
    """What the docstring recommends for long scans: compile the step, not the loop."""
    g = torch.Generator().manual_seed(8)
    W, init, xs = rnn_inputs(20, g)
    inputs = [W, init["h"], init["c"], *xs]
    grads = []
    for step in [rnn_step(W), torch.compile(rnn_step(W), backend="aot_eager")]:
        final, (ys, _) = scan(step, init, xs, checkpoint=7)
        grads.append(torch.autograd.grad(ys.sum() + final["h"].pow(2).sum(), inputs))
    for got, exp in zip(*grads):
        torch.testing.assert_close(got, exp)
