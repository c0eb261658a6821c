"""scripts/dev/parity_probe.py (issue 48): per bit and head, Δ, Δ·A, λ and the turn Δ·θ of a
Mamba-3 parity checkpoint, against the same quantities computed here from in_proj's rows; the
accuracy with A scaled; and the layer left as it was."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ssm.layers import Mamba3
from ssm.training import load_config, train
from ssm.training.evaluate import load_checkpoint_model

ROOT = Path(__file__).resolve().parents[2]


def tiny_parity_run(run: Path, *extra: str) -> None:
    """A Mamba-3 parity run of a few steps at toy sizes in ``run``; ``extra``: more overrides."""
    overrides = ["model.d_model=16", "model.n_layer=1", "model.ssm_cfg={layer: Mamba3, d_state: 8, headdim: 8}",
                 "data.task=parity", "data.seq_len=16", "data.min_seq_len=3", "data.batch_size=4",
                 "data.val_samples=4", "progress_bar=false", f"run_dir={run}", *extra]  # fmt: skip
    train(load_config(None, overrides))


def test_probe_reads_each_bit_as_computed_from_the_projection(tmp_path, capsys):
    run = tmp_path / "parity"
    tiny_parity_run(run, "trainer.max_steps=2", "trainer.val_check_interval=2", "checkpoint_every=2")
    checkpoint = run / "checkpoints" / "last.ckpt"
    probe = runpy.run_path(str(ROOT / "scripts" / "dev" / "parity_probe.py"))
    _, model, _ = load_checkpoint_model(checkpoint)
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():  # by hand: the bits' embeddings, the block's RMSNorm, in_proj's rows in order
        e = model.backbone.embedding.weight[:2]
        u = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + model.backbone.layers[0].norm.eps)
        proj = (u * model.backbone.layers[0].norm.weight) @ mixer.in_proj.weight.T
        H, M, d_inner, N = mixer.nheads, mixer.num_rope_angles, mixer.d_inner, mixer.d_state
        start = 2 * d_inner + 2 * N
        dt = F.softplus(proj[:, start : start + H] + mixer.dt_bias)
        a = proj[:, start + H : start + 2 * H]
        A = -torch.log1p(torch.exp(a)).clamp(min=mixer.A_floor)
        lam = torch.sigmoid(proj[:, start + 2 * H : start + 3 * H])
        theta = math.pi * torch.tanh(proj[:, start + 3 * H : start + 3 * H + M])
    rows = probe["per_bit"](model)
    for bit in (0, 1):
        torch.testing.assert_close(torch.tensor(rows[bit]["delta"]), dt[bit])
        torch.testing.assert_close(torch.tensor(rows[bit]["delta_A"]), dt[bit] * A[bit])
        torch.testing.assert_close(torch.tensor(rows[bit]["trapezoid"]), lam[bit])
        torch.testing.assert_close(torch.tensor(rows[bit]["turn_over_pi"]), dt[bit][:, None] * theta[bit] / math.pi)
    original = Mamba3._inputs
    assert probe["main"]([str(checkpoint), "--scales", "1,0", "--lengths", "8,12", "--samples", "3"]) == 0
    assert Mamba3._inputs is original  # the scaling is undone
    out = capsys.readouterr().out
    assert out.count("A x 1: L") == 2 and out.count("A x 0: L") == 2 and "head 0: Δ" in out
    with pytest.raises(SystemExit):
        probe["main"]([str(checkpoint), "--scales", "one"])


def test_trajectory_reads_each_kept_checkpoint_and_finds_the_parity_pair(tmp_path, capsys):
    """scripts/dev/parity_trajectory.py: the pair closest to parity's turns (0 for bit 0, π for
    bit 1, modulo 2π) on hand-made turns; the exponential average by hand; one line per kept
    checkpoint in the step range."""
    trajectory = runpy.run_path(str(ROOT / "scripts" / "dev" / "parity_trajectory.py"))
    rows = [  # turns / π per head and pair, for bit 0 and bit 1
        {"turn_over_pi": [[0.5, 0.02], [1.98, 0.1]]},
        {"turn_over_pi": [[1.0, 1.01], [-1.004, 0.3]]},
    ]
    head, pair, error = trajectory["parity_pair"](rows)
    # head 0 pair 0: bit 0 off by 0.5π; head 0 pair 1: max(0.02, 0.01)π; head 1 pair 0: max(0.02, 0.004)π
    assert (head, pair) == (0, 1) and error == pytest.approx(0.02 * math.pi)
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    first = trajectory["averaged"](None, a, 0.25)
    torch.testing.assert_close(first["w"], a["w"])
    torch.testing.assert_close(trajectory["averaged"](first, b, 0.25)["w"], torch.tensor([2.5, 5.0]))

    run = tmp_path / "parity"
    tiny_parity_run(run, "trainer.max_steps=3", "trainer.val_check_interval=3", "keep_checkpoint_every=1")
    assert trajectory["main"]([str(run), "--from", "2", "--to", "3", "--lengths", "8", "--samples", "2",
                               "--half-lives", "1"]) == 0  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step") and "rate" in line]
    assert [line.split()[1] for line in lines] == ["2", "3"] and all("average (half-life 1)" in x for x in lines)
    with pytest.raises(SystemExit):
        trajectory["main"]([str(run), "--from", "50"])
