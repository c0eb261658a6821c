"""The GPU peer harness's own judgement, on the CPU with small stand-in modules: a 16-bit
disagreement is settled against the peer's float32 run (ssm no further from it than 1.5 times
the peer is), and a pair that runs past its time is stopped with the phase it was in, the next
pair still running."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench import gpu_peer_cases as cases  # noqa: E402
from bench import gpu_peers  # noqa: E402


class Rounded(torch.nn.Module):
    """y = x·w, plus ``sign · noise · |y|`` under autocast: a stand-in for a 16-bit kernel that
    rounds. Autocast off (the referee's run), it is exact."""

    def __init__(self, w: torch.Tensor, noise: float, sign: float):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())
        self.noise, self.sign = noise, sign

    def forward(self, x):
        y = x * self.w
        if torch.is_autocast_enabled("cpu"):
            pattern = torch.linspace(0.5, 1.5, y.numel()).reshape(y.shape)  # not a rescaling: shapes the error
            y = y * (1 + (self.sign * self.noise) * pattern)  # its gradients off by as much
        return y


def judge(ssm_noise: float, peer_noise: float, referee: bool = True) -> dict:
    w = torch.linspace(-1.0, 2.0, 16)
    x = torch.linspace(1.0, 3.0, 16).requires_grad_()
    ours, theirs = Rounded(w, ssm_noise, +1.0), Rounded(w, peer_noise, -1.0)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    pair = cases.module_pair(ours, theirs, lambda m, v: m(v), lambda y: y.sum(), x, autocast, 0.05, referee=referee)
    return pair.check()


def test_two_sides_equally_far_from_float32_agree():
    """Each 4% off float32 on opposite sides: 8% apart, past the 5% tolerance, settled by the referee."""
    verdict = judge(0.04, 0.04)
    assert verdict["diff"]["out"] > 0.05
    assert verdict["agree"] is True
    assert set(verdict["referee"]["settled"]) >= {"out", "dinput", "dw"}
    assert abs(verdict["referee"]["ssm"] - verdict["referee"]["peer"]) < 1e-3


def test_without_the_referee_the_same_pair_disagrees():
    assert judge(0.04, 0.04, referee=False)["agree"] is False


def test_ssm_further_from_float32_than_the_peer_disagrees():
    """ssm 10% off, the peer 2%: the referee does not excuse ssm."""
    verdict = judge(0.10, 0.02)
    assert verdict["agree"] is False and verdict["referee"]["settled"] == []
    assert verdict["referee"]["ssm"] > 4 * verdict["referee"]["peer"]


def test_a_pair_past_its_time_is_stopped_in_its_phase_and_the_next_runs(monkeypatch):
    def slow_check_pair(peer, shape, dtype, device, tolerance):
        def check():
            time.sleep(30)  # a compile that does not end

        return cases.Pair(lambda train: None, lambda train: None, check)

    def quick_pair(peer, shape, dtype, device, tolerance):
        return cases.Pair(lambda train: None, lambda train: None, lambda: {"agree": True}, passes=(False,))

    monkeypatch.setattr(gpu_peers, "BUILDERS", {"ssd": slow_check_pair, "mamba2_layer": quick_pair})
    monkeypatch.setattr(gpu_peers, "peer_skip", lambda *a: None)
    plan = [("ssd", dict(batch=1), "float32"), ("mamba2_layer", dict(batch=1), "float32")]
    monkeypatch.setattr(gpu_peers, "plan", lambda tiny: plan)
    monkeypatch.setattr(gpu_peers.mamba_ssm_peer, "source_problem", lambda: None)
    peer = SimpleNamespace(version="x", built={}, stubs=[], errors={})
    monkeypatch.setattr(gpu_peers.mamba_ssm_peer, "load", lambda interpreting, shard=None: peer)
    args = SimpleNamespace(
        device="cpu", cases=["ssd", "mamba2_layer"], tiny=True, budget=None, pair_seconds=0.5,
        warmup=0, repeats=1, json=None,
    )  # fmt: skip
    monkeypatch.setattr(gpu_peers, "config_of", lambda args: {})
    start = time.perf_counter()
    code, result = gpu_peers.run(args)
    assert time.perf_counter() - start < 10
    first, second = result["rows"]
    assert first["skipped"].startswith("stopped after 0.5 s, while checking"), first
    assert second["op"] == "mamba2_layer" and second["agree"] is True and "ssm" in second
    assert second["first_call_s"].keys() == {"ssm", "peer"}

    # a side whose first call (its compile) does not end is named; --compile-only stops there
    def slow_peer_pair(peer, shape, dtype, device, tolerance):
        return cases.Pair(lambda train: None, lambda train: time.sleep(30), lambda: {"agree": True})

    monkeypatch.setattr(gpu_peers, "BUILDERS", {"ssd": slow_peer_pair, "mamba2_layer": quick_pair})
    code, result = gpu_peers.run(args)
    first, second = result["rows"]
    assert first["skipped"].startswith("stopped after 0.5 s, while first call of peer's side"), first
    args.compile_only = True
    code, result = gpu_peers.run(args)
    second = result["rows"][1]
    assert second["compiled"] is True and "ssm" not in second and "agree" not in second, second
    assert second["first_call_s"].keys() == {"ssm", "peer"}
