"""What `scripts/benchmark.py --op context-parallel` reports each layer sends (its
``sent_per_layer``, from the layers' shapes) against what the layers hand to the collectives:
on 2 gloo processes, every call of ``all_gather_stacked`` (the summaries) and
``from_previous_rank`` (the halos) in ssm.distributed is counted during one forward of each
mixer, float32."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import torch

import ssm.distributed.state_passing as state_passing
from ssm.layers import Mamba, Mamba2, Mamba3

from .harness import run_ranks, shard

D_MODEL, BATCH, LENGTH, N = 16, 2, 32, 8
MIXERS = {
    "Mamba1": ({"d_state": N}, lambda: Mamba(D_MODEL, d_state=N, expand=2)),
    "Mamba2": ({"layer": "Mamba2", "d_state": N, "headdim": 8}, lambda: Mamba2(D_MODEL, d_state=N, headdim=8)),
    "Mamba3": ({"layer": "Mamba3", "d_state": N, "headdim": 8}, lambda: Mamba3(D_MODEL, d_state=N, headdim=8)),
}


def counted(function, counts: list):
    def spy(x, group):
        counts.append(x.numel())
        return function(x, group)

    return spy


def body(rank: int, world: int, expected: dict) -> None:
    import torch.distributed as dist

    for name, (_, make) in MIXERS.items():
        gathered, halos = [], []
        saved = state_passing.all_gather_stacked, state_passing.from_previous_rank
        state_passing.all_gather_stacked = counted(saved[0], gathered)
        state_passing.from_previous_rank = counted(saved[1], halos)
        try:
            torch.manual_seed(0)
            mixer = make()
            x = torch.randn(BATCH, LENGTH, D_MODEL)
            mixer(shard(x, dist.group.WORLD), cp_group=dist.group.WORLD)
        finally:
            state_passing.all_gather_stacked, state_passing.from_previous_rank = saved
        sent = {"summary": 4 * sum(gathered) * (world - 1), "halo": 4 * sum(halos)}
        assert sent == expected[name], (name, sent, expected[name])


def test_the_benchmarks_byte_counts_are_what_the_layers_send(tmp_path):
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from bench.context_parallel import sent_per_layer

    args = Namespace(d_model=D_MODEL, batch=BATCH)
    expected = {name: sent_per_layer(args, cfg, 2) for name, (cfg, _) in MIXERS.items()}
    assert all(v["summary"] > 0 and v["halo"] > 0 for v in expected.values())
    run_ranks(body, 2, tmp_path, expected)
