"""A generic scan for PyTorch: ``jax.lax.scan`` and ``jax.lax.associative_scan`` over pytrees.

``scan(fn, init, xs)`` runs an arbitrary step function ``fn(carry, x) -> (carry, y)`` along the
leading dimension of ``xs`` and stacks the ``y``; with ``checkpoint=`` its backward keeps only
every k-th carry and recomputes the steps in between, so a long scan differentiates in
O(L/k + k) carries (O(√L) with ``checkpoint="sqrt"``) instead of O(L).

``associative_scan(fn, elems)`` is an inclusive parallel prefix with an associative binary ``fn``
in O(log L) sequential rounds of batched calls to ``fn``.

Pytrees are nested tuples, lists, dicts (and namedtuples) of tensors, with ``None`` allowed as
an empty subtree; they are flattened with ``torch.utils._pytree``, the flattener torch itself
uses for ``torch.compile`` and ``torch.export``, so the same structures are accepted there.

The module name says what it is: the recurrence is the caller's, unlike the fixed recurrences
of ``selective.py`` and ``linear.py``; there are no backends to dispatch to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

__all__ = ["scan", "associative_scan"]


# --------------------------------------------------------------------------------------------
# pytree helpers


class _Structure(NamedTuple):
    """A pytree's structure: torch's TreeSpec plus which of its leaves are None (torch 2.13
    flattens None as a leaf, some older versions as an empty node; either way it holds no tensor)."""

    spec: pytree.TreeSpec
    is_none: tuple[bool, ...]

    def __str__(self) -> str:
        """The tree written out with ``tensor`` for each tensor, e.g. ``{'h': tensor, 'n': None}``."""
        return repr(pytree.tree_unflatten([None if none else _TENSOR for none in self.is_none], self.spec))


class _Placeholder:
    def __repr__(self) -> str:
        return "tensor"


_TENSOR = _Placeholder()


def _flatten(name: str, tree) -> tuple[list[torch.Tensor], _Structure, list[str]]:
    """The tensor leaves of ``tree``, its structure, and each tensor's path written as
    ``name['key'][0]``; a leaf that is neither a tensor nor None is a ValueError naming its path."""
    with_path, spec = pytree.tree_flatten_with_path(tree)
    tensors, paths = [], []
    for path, leaf in with_path:
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{name}{pytree.keystr(path)} must be a torch.Tensor (pytrees hold tensors, or None), "
                f"got {type(leaf).__name__}"
            )
        tensors.append(leaf)
        paths.append(name + pytree.keystr(path))
    return tensors, _Structure(spec, tuple(leaf is None for _, leaf in with_path)), paths


def _unflatten(tensors, structure: _Structure):
    it = iter(tensors)
    return pytree.tree_unflatten([None if none else next(it) for none in structure.is_none], structure.spec)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


# --------------------------------------------------------------------------------------------
# scan


def _check_like(what: str, leaves, structure, paths, ref_structure, ref_meta, step: int, ref: str, rule: str) -> None:
    """``leaves`` (with ``structure``) have the structure, shapes and dtypes of a reference,
    which the messages call ``ref``; ``rule`` ends them."""
    if structure != ref_structure:
        raise ValueError(
            f"fn returned a {what} of structure {structure} at step {step}, but {ref} {ref_structure}; {rule}"
        )
    for path, leaf, (shape, dtype) in zip(paths, leaves, ref_meta):
        if leaf.shape != shape or leaf.dtype != dtype:
            was = f"shape {tuple(shape)} {str(dtype).replace('torch.', '')}"
            raise ValueError(f"fn changed {path} at step {step}: {ref} {was}, fn returned {_describe(leaf)}; {rule}")


class _Step:
    """``fn`` on flat carry leaves: unflattens the carry and x, calls ``fn``, checks that the
    carry kept its structure, shapes and dtypes, and returns the new carry's leaves and y.
    It holds no state that changes (torch.compile refuses mutation inside a checkpoint)."""

    def __init__(self, fn, init_leaves, carry_structure, xs_structure):
        self.fn = fn
        self.carry_structure = carry_structure
        self.carry_meta = [(t.shape, t.dtype) for t in init_leaves]
        self.xs_structure = xs_structure  # None when scanning without xs

    def __call__(self, carry_leaves, x_leaves, i: int):
        carry = _unflatten(carry_leaves, self.carry_structure)
        x = None if self.xs_structure is None else _unflatten(x_leaves, self.xs_structure)
        out = self.fn(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                f"fn must return a pair (carry, y), got {type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
                + f" at step {i}"
            )
        new_carry, y = out
        leaves, structure, paths = _flatten("carry", new_carry)
        _check_like(
            "carry", leaves, structure, paths, self.carry_structure, self.carry_meta, i,
            "init has", "the carry must keep its structure, shapes and dtypes",
        )  # fmt: skip
        return leaves, y


def _scan_length(xs_leaves, xs_paths, length) -> int:
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise ValueError(f"length must be a non-negative int or None, got {length!r}")
    for path, leaf in zip(xs_paths, xs_leaves):
        if leaf.ndim == 0:
            raise ValueError(f"{path} must have a leading dimension to scan over, got a 0-D tensor")
    if not xs_leaves:
        if length is None:
            raise ValueError("scan needs xs with at least one tensor, or length=, to know how many steps to run")
        return length
    L = xs_leaves[0].shape[0]
    for path, leaf in zip(xs_paths[1:], xs_leaves[1:]):
        if leaf.shape[0] != L:
            raise ValueError(
                f"every leaf of xs must have the same leading dimension L: {xs_paths[0]} has "
                f"L = {L} but {path} has {leaf.shape[0]} (shape {tuple(leaf.shape)})"
            )
    if length is not None and length != L:
        raise ValueError(f"length = {length} disagrees with the leading dimension L = {L} of xs")
    return L


def _segment_size(checkpoint, L: int) -> int | None:
    if checkpoint is None:
        return None
    if checkpoint == "sqrt":
        return max(1, math.ceil(math.sqrt(L)))
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, int) or checkpoint < 1:
        raise ValueError(f'checkpoint must be None, a positive int or "sqrt", got {checkpoint!r}')
    return checkpoint


def scan(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    *,
    length: int | None = None,
    reverse: bool = False,
    checkpoint: int | str | None = None,
) -> tuple[Any, Any]:
    """Run ``carry, y = fn(carry, x)`` over the leading dimension of ``xs``; ``jax.lax.scan``
    semantics. Returns ``(final_carry, ys)``.

    Equivalent to::

        carry, ys = init, []
        for i in range(L):                       # reversed(range(L)) with reverse=True
            carry, y = fn(carry, xs[i])          # xs[i]: every leaf of xs indexed at i
            ys.append(y)                         # stored at position i either way
        return carry, stack(ys)                  # every leaf of y stacked along a new dim 0

    Shapes: every leaf of ``xs`` is (L, ...), and ``fn`` sees it as (...); every leaf of ``y``
    of shape (...) comes back in ``ys`` as (L, ...). ``init``, ``xs``, the carry and ``y`` are
    pytrees: nested tuples, lists, dicts (or namedtuples) whose leaves are tensors; ``None``
    is an empty subtree, so a step returning ``y = None`` gives ``ys = None``. The carry must keep
    its structure, and each leaf its shape and dtype, from step to step (a ValueError names the
    leaf that changed and the step); its dtype is the caller's, nothing is upcast.

    ``xs=None`` (or a pytree without tensors) scans ``length`` steps with ``x = None``. With xs,
    ``length`` may be given and must equal L. At L = 0 the result is ``(init, ys)`` with every
    leaf of ys of shape (0, ...); to learn the shapes of y, ``fn`` is called once under
    ``torch.no_grad()`` on ``init`` and a zero x, and that result is thrown away.

    ``reverse=True`` runs from i = L-1 down to 0 and stores each y at its own position i.

    Gradients flow to ``init``, ``xs`` and every tensor ``fn`` closes over (parameters).

    ``checkpoint``: what the backward keeps.
      - ``None``: whatever autograd keeps for each step: O(L) carries and activations.
      - ``k`` (int >= 1): the L steps are cut into segments of k; only each segment's first
        carry (and views of its xs) is kept, and the backward recomputes one segment at a time
        (``torch.utils.checkpoint``, non-reentrant, with the RNG state restored so that dropout
        in ``fn`` recomputes identically). Peak memory is O(L/k + k) carries.
      - ``"sqrt"``: k = ceil(√L), so O(√L) carries.
      The price is one extra forward of every step during the backward, plus the
      checkpoint's bookkeeping for each saved tensor; results and gradients are the same as
      with ``None``. Under ``torch.no_grad()`` nothing is kept and ``checkpoint`` is
      ignored. ``ys`` itself is O(L) and is the caller's; keep y small if memory matters.
      The first checkpointed call in a process imports ``torch._dynamo`` (which
      ``torch.utils.checkpoint`` uses), about a second once.

    Devices: any device PyTorch runs on (CPU, CUDA, ...); ``fn`` runs eagerly, one Python call
    per step, so on a GPU each step costs kernel launches: put the work in a few big ops.

    ``torch.compile``: the loop is plain Python, so dynamo unrolls it: one graph of L copies of
    ``fn`` (compile time grows with L, and a new L recompiles), traced without graph breaks when
    ``fn`` itself has none. With ``checkpoint=k`` each segment is traced as a
    ``torch.utils.checkpoint`` region, which the compiler recomputes in the backward instead of
    saving. Tested with ``fullgraph=True`` on the "aot_eager" backend. Bad input (a changed
    carry, mismatched xs) stops tracing: with ``fullgraph=True`` dynamo raises its own
    ``Unsupported`` error that quotes the ValueError, without it the ValueError itself comes
    from the eager fallback. For long scans compile the step instead,
    ``scan(torch.compile(fn), ...)``: one small graph, reused at every step and recomputation.
    """
    init_leaves, carry_structure, _ = _flatten("init", init)
    xs_leaves, xs_structure, xs_paths = _flatten("xs", xs)
    L = _scan_length(xs_leaves, xs_paths, length)
    k = _segment_size(checkpoint, L)
    step = _Step(fn, init_leaves, carry_structure, None if xs is None else xs_structure)

    if L == 0:
        return init, _empty_ys(step, init_leaves, xs_leaves)

    if k is None or not torch.is_grad_enabled():
        carry, ys = _run_steps(step, init_leaves, xs_leaves, 0, L, bool(reverse))
    else:
        carry, ys = _run_checkpointed(step, init_leaves, xs_leaves, L, k, bool(reverse))
    return _unflatten(carry, carry_structure), ys


Y_RULE = "every step's y must have one structure, shapes and dtypes, to be stacked"


def _run_steps(step: _Step, carry: list, xs_chunk: list, start: int, n: int, reverse: bool):
    """Steps start .. start+n-1 (in reverse order if ``reverse``) on ``xs_chunk``, whose leaves
    are (n, ...). Returns the last carry's leaves and the ys pytree, each leaf stacked to (n, ...)."""
    # unbind once rather than index per step: indexing makes the backward write a full-size
    # zero gradient per step (quadratic in L); unbind's backward stacks once.
    x_steps = [leaf.unbind(0) for leaf in xs_chunk]
    ys: list = [None] * n
    first = None
    for t in reversed(range(n)) if reverse else range(n):
        carry, y = step(carry, [x[t] for x in x_steps], start + t)
        ys[t], structure, paths = _flatten("y", y)
        if first is None:
            first = structure, [(leaf.shape, leaf.dtype) for leaf in ys[t]]
        else:
            _check_like("y", ys[t], structure, paths, *first, start + t, "the first y had", Y_RULE)
    stacked = [torch.stack([y[m] for y in ys]) for m in range(len(ys[0]))]
    return carry, _unflatten(stacked, first[0])


def _run_checkpointed(step: _Step, init_leaves: list, xs_leaves: list, L: int, k: int, reverse: bool):
    chunks = [leaf.split(k, dim=0) for leaf in xs_leaves]  # views; split's backward concatenates once
    starts = list(range(0, L, k))
    n_carry = len(init_leaves)

    def segment(start: int, n: int, *flat):
        # returns a pytree (non-reentrant checkpoint allows it): no state escapes but the result
        carry, ys = _run_steps(step, list(flat[:n_carry]), list(flat[n_carry:]), start, n, reverse)
        return carry, ys

    carry, pieces = init_leaves, [None] * len(starts)
    for j in reversed(range(len(starts))) if reverse else range(len(starts)):
        start = starts[j]
        carry, pieces[j] = torch.utils.checkpoint.checkpoint(
            segment, start, min(k, L - start), *carry, *[c[j] for c in chunks],
            use_reentrant=False, preserve_rng_state=True,
        )  # fmt: skip
        carry = list(carry)
    flat = [_flatten("y", ys) for ys in pieces]
    leaves0, structure0, _ = flat[0]
    meta0 = [(leaf.shape[1:], leaf.dtype) for leaf in leaves0]
    for start, (leaves, structure, paths) in zip(starts[1:], flat[1:]):
        unstacked = [leaf[0] for leaf in leaves]  # a view, to compare shapes without the L dim
        _check_like("y", unstacked, structure, paths, structure0, meta0, start, "the first y had", Y_RULE)
    ys = [torch.cat([f[0][m] for f in flat]) if len(flat) > 1 else leaves0[m] for m in range(len(leaves0))]
    return carry, _unflatten(ys, structure0)


def _empty_ys(step: _Step, init_leaves: list, xs_leaves: list):
    """ys for L = 0: shapes learnt from one discarded call of fn (see the docstring)."""
    x_leaves = [leaf.new_zeros(leaf.shape[1:]) for leaf in xs_leaves]
    with torch.no_grad():
        _, y = step(init_leaves, x_leaves, 0)
    y_leaves, structure, _ = _flatten("y", y)
    return _unflatten([y.new_empty((0, *y.shape)) for y in y_leaves], structure)


# --------------------------------------------------------------------------------------------
# associative_scan


def _take(x: torch.Tensor, dim: int, start: int | None, stop: int | None, step: int | None = None):
    return x[(slice(None),) * dim + (slice(start, stop, step),)]


def associative_scan(fn: Callable[[Any, Any], Any], elems: Any, *, dim: int = 0, reverse: bool = False) -> Any:
    """Inclusive prefix of ``elems`` under an associative ``fn``; ``jax.lax.associative_scan``
    semantics.

    Returns a pytree like ``elems`` whose element i along ``dim`` is
    ``fn(...fn(fn(e_0, e_1), e_2)..., e_i)``. With ``reverse=True`` element i is
    ``fn(...fn(fn(e_{L-1}, e_{L-2}), e_{L-3})..., e_i)``: the scan of the flipped sequence,
    flipped back, so the first argument of ``fn`` always holds the part already combined (for
    ``fn(a, b) = a @ b`` and [a, b, c] the reverse result is [(c @ b) @ a, c @ b, c], as in jax).

    Shapes: ``elems`` is a pytree of tensors that all have the same length L along ``dim``
    (any other dimensions). ``fn(a, b)`` receives two pytrees like ``elems`` whose leaves have
    the same length along ``dim`` (any length from 1 to L // 2 + 1) and must return a pytree
    of the same structure and shapes, combining them elementwise along ``dim``: it is
    vectorised over ``dim``, like a ufunc. ``fn`` must be associative, not commutative.

    The combination takes about 2·log2(L) rounds of batched ``fn`` calls (the odd/even
    recursion of Blelloch's scan) and about 2L combined pairs in all, for any L; it is
    ordinary autograd, so gradients flow to ``elems`` and to tensors ``fn`` closes over, and it
    traces under ``torch.compile`` for a fixed L. Rounding follows the tree order of the
    combination, not a left fold.
    """
    leaves, spec, paths = _flatten("elems", elems)
    if not leaves:
        raise ValueError("elems must contain at least one tensor")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim must be an int, got {dim!r}")
    dims = []
    for path, leaf in zip(paths, leaves):
        if not -leaf.ndim <= dim < leaf.ndim:
            raise ValueError(
                f"dim = {dim} is out of range for {path} of shape {tuple(leaf.shape)}; "
                "every leaf of elems must have that dimension"
            )
        dims.append(dim % leaf.ndim)
    L = leaves[0].shape[dims[0]]
    for path, leaf, d in zip(paths, leaves, dims):
        if leaf.shape[d] != L:
            raise ValueError(
                f"every leaf of elems must have the same length along dim {dim}: {paths[0]} has "
                f"{L} but {path} has {leaf.shape[d]} (shape {tuple(leaf.shape)})"
            )

    def combine(a: list, b: list) -> list:
        out_leaves, out_spec, out_paths = _flatten("fn(a, b)", fn(_unflatten(a, spec), _unflatten(b, spec)))
        if out_spec != spec:
            raise ValueError(f"fn must return the structure of elems, {spec}; got {out_spec}")
        for path, out, x in zip(out_paths, out_leaves, a):
            if out.shape != x.shape:
                raise ValueError(
                    f"fn must combine elementwise: its arguments' leaves have shape {tuple(x.shape)} "
                    f"but {path} has {tuple(out.shape)}"
                )
        return out_leaves

    def prefix(xs: list) -> list:
        n = xs[0].shape[dims[0]]
        if n < 2:
            return xs
        # combine neighbours (0,1), (2,3), ...; their prefix gives the results at odd positions
        pairs = combine(
            [_take(x, d, 0, n - 1, 2) for x, d in zip(xs, dims)], [_take(x, d, 1, None, 2) for x, d in zip(xs, dims)]
        )
        odd = prefix(pairs)  # results at positions 1, 3, 5, ...
        # results at even positions 2, 4, ...: the odd result before each, combined with it
        n_even_rest = (n - 1) // 2
        even = combine(
            [_take(o, d, 0, n_even_rest) for o, d in zip(odd, dims)],
            [_take(x, d, 2, None, 2) for x, d in zip(xs, dims)],
        )
        return [_interleave(_take(x, d, 0, 1), e, o, d) for x, e, o, d in zip(xs, even, odd, dims)]

    if reverse:
        leaves = [leaf.flip(d) for leaf, d in zip(leaves, dims)]
    out = prefix(leaves)
    if reverse:
        out = [leaf.flip(d) for leaf, d in zip(out, dims)]
    return _unflatten(out, spec)


def _interleave(first: torch.Tensor, even_rest: torch.Tensor, odd: torch.Tensor, d: int) -> torch.Tensor:
    """[first, odd_0, even_rest_0, odd_1, even_rest_1, ...] along ``d``: positions 0, 1, 2, ..."""
    even = torch.cat([first, even_rest], dim=d)  # positions 0, 2, 4, ...
    n_odd = odd.shape[d]
    paired = torch.stack([_take(even, d, 0, n_odd), odd], dim=d + 1).flatten(d, d + 1)
    if even.shape[d] > n_odd:
        paired = torch.cat([paired, _take(even, d, n_odd, None)], dim=d)
    return paired
