"""Measuring memory: what autograd keeps for a backward, and the most memory a call holds at
once. Used by scripts/benchmark.py, scripts/scan_memory.py and the tests."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch

from .native import pool


def saved_storages(run: Callable[[], object]) -> tuple[dict[int, int], object]:
    """({data pointer: bytes} of the distinct storages autograd keeps for the backward of
    ``run()``, its result). Every tensor packed is held until ``run()`` returns, so that no
    storage is freed within the call and its address given to a later one, which would count
    the two as one."""
    storages, held = {}, []

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return storages, out


def saved_bytes(run: Callable[[], object]) -> tuple[int, object]:
    """(Bytes of the distinct storages autograd keeps for the backward of ``run()``, its result)."""
    storages, out = saved_storages(run)
    return sum(storages.values()), out


def extra_peak_bytes(run: Callable[[], object], device: torch.device | str) -> tuple[int, object]:
    """Run ``run()`` once; return the most memory it held at once beyond what was allocated
    before it started, and its result. On CUDA from the allocator's peak statistics; on the CPU
    from the profiler's allocation events, with the CPU kernels' buffer pool off."""
    peak, _, result = _held(run, device)
    return peak, result


def extra_held_bytes(run: Callable[[], object], device: torch.device | str) -> tuple[int, object]:
    """Run ``run()`` once; return the memory still held when it returns beyond what was
    allocated before it started, and its result: its outputs, and whatever they keep alive (a
    graph's saved tensors, and tensors that a checkpoint's closure holds, which saved-tensor
    hooks do not see). Measured as :func:`extra_peak_bytes` measures."""
    _, held, result = _held(run, device)
    return held, result


def _held(run: Callable[[], object], device: torch.device | str) -> tuple[int, int, object]:
    """(the most bytes ``run()`` held at once, the bytes it still held at its end, its result)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = run()
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        return max(torch.cuda.max_memory_allocated(device) - before, 0), held, result

    # The CPU kernels' buffer pool hands out storage allocated before the run, which the
    # profiler would not see: it is off while the run is counted.
    enabled, pool.enabled = pool.enabled, False
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
    finally:
        pool.enabled = enabled
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    # Each "[memory]" event is one allocation (+Bytes) or free (-Bytes). Their running sum is
    # the memory held beyond the start. The events' "Total Allocated" is no substitute: it is a
    # process-wide counter that keeps tensors freed while no profiler ran, so it drifts upward
    # from one profiling session to the next.
    held = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        held += event["args"]["Bytes"]
        peak = max(peak, held)
    return peak, held, result
