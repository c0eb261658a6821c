"""Storage for the CPU kernels' large outputs, handed out again once no tensor refers to it.

torch's CPU allocator takes every tensor from malloc and gives it back when the tensor dies, and
glibc serves a block above its mmap threshold with fresh pages from the kernel and unmaps them at
free. The threshold is at most 32 MiB by default (and 128 KiB where ``MALLOC_MMAP_THRESHOLD_`` is
set so), so at a real model's size every activation and gradient is faulted in page by page on
each step: at (8, 512, 1024) fp32 a fresh tensor costs about four times the arithmetic that fills
it. A training step asks for the same sizes on every step; the CPU kernels (``ssm.native``)
therefore take the storage of their outputs and scratch from ``pool``, which keeps each storage it
made and hands it out again when nothing but the pool refers to it: no tensor, view or autograd
graph (the storage's use count is the pool's one) and no Python reference to the storage object
itself (its reference count is the pool's, as measured on a storage of its own at import), so reuse
is as safe as a fresh allocation.

Storage comes in size classes, eight to an octave (``size_class``): a run whose lengths change from
step to step (parity's, drawn in [3, 160] per step) asks for a few dozen sizes, not one per length,
and finds its storage again. The tail a tensor leaves unused is never written, so above malloc's
mmap threshold its pages are never faulted in. Measured at the parity model's training step (batch
128, lengths in [3, 160], 2 threads): one storage per exact size missed at nearly every request and
made the step slower than plain allocations.

Only the kernels' own implementations call it (never code that ``torch.compile`` traces). What
the pool holds beyond what is in use is bounded by ``max_idle_bytes``: a miss first drops idle
storage beyond that. ``pool.clear()`` gives everything idle back, as ``torch.cuda.empty_cache``
does; ``pool.enabled = False``, or ``SSM_CPU_BUFFER_POOL=0`` in the environment, turns it off
(``ssm.memory`` does so while it counts allocations).
"""

from __future__ import annotations

import math
import os
import sys
import threading

import torch
from torch import Tensor

MIN_BYTES = 128 << 10  # below this malloc keeps freed blocks in its heap anyway (glibc's default threshold)
MAX_PER_SIZE = 64  # storages of one size tracked at once; beyond that, plain allocations


# How many tensors and storage objects share a storage: a private torch function, so a torch
# without it gets no pool (plain allocations), not a guess.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    return _storage_use_count(storage._cdata)


def _python_refs_in_a_list() -> int:
    """The reference count a storage object shows in ``_idle`` when a list holds it and nothing else."""
    storages = [torch.UntypedStorage(1)]
    for storage in storages:
        return sys.getrefcount(storage)
    raise AssertionError


_POOL_REFS = _python_refs_in_a_list()


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of an eighth of its octave: at most 12.5% more."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


def _idle(storages: list[torch.UntypedStorage]):
    """The storages of ``storages`` that nothing else refers to. A tensor's ``untyped_storage()``
    is the very object the pool holds (torch keeps one Python object per storage), so a caller
    keeping it shows in its Python reference count, not in the storage's use count."""
    for storage in storages:
        if _use_count(storage) == 1 and sys.getrefcount(storage) <= _POOL_REFS:
            yield storage


class BufferPool:
    def __init__(self, max_idle_bytes: int = 1 << 30):
        self.max_idle_bytes = max_idle_bytes
        self.enabled = _storage_use_count is not None and os.environ.get("SSM_CPU_BUFFER_POOL", "1") != "0"
        self._lock = threading.Lock()
        self._by_size: dict[int, list[torch.UntypedStorage]] = {}
        self._held = 0  # bytes of every storage tracked, idle or not: trimming is needed only above the bound

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous CPU tensor, like ``torch.empty(shape, dtype=dtype)``."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        size = size_class(nbytes)
        with self._lock:  # the use count is read and raised under the lock: no storage goes out twice
            storages = self._by_size.setdefault(size, [])
            storage = next(_idle(storages), None)
            if storage is None:
                if len(storages) >= MAX_PER_SIZE:
                    return torch.empty(shape, dtype=dtype)
                if self._held + size > self.max_idle_bytes:  # else the idle ones are under the bound already
                    self._trim(self.max_idle_bytes - size)
                storage = torch.empty(size, dtype=torch.uint8).untyped_storage()
                storages.append(storage)
                self._held += size
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def idle_bytes(self) -> int:
        """Bytes of storage the pool holds that no tensor refers to."""
        with self._lock:
            return sum(n for n, ss in self._by_size.items() for _ in _idle(ss))

    def clear(self) -> None:
        """Give back every storage no tensor refers to."""
        with self._lock:
            self._trim(0)

    def _trim(self, keep: int) -> None:
        """Drop idle storages, largest first, until at most ``keep`` bytes of them are left."""
        idle = sorted(((n, s) for n, ss in self._by_size.items() for s in _idle(ss)), key=lambda p: -p[0])
        held = sum(n for n, _ in idle)
        dropped: dict[int, set[int]] = {}
        for n, s in idle:
            if held <= max(keep, 0):
                break
            dropped.setdefault(n, set()).add(id(s))
            held -= n
            self._held -= n
        for n, ids in dropped.items():
            self._by_size[n] = [s for s in self._by_size[n] if id(s) not in ids]


pool = BufferPool()
