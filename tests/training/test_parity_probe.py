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


def test_probe_reads_each_bit_as_computed_from_the_projection(tmp_path, capsys):
    run = tmp_path / "parity"
    overrides = ["model.d_model=16", "model.n_layer=1", "model.ssm_cfg={layer: Mamba3, d_state: 8, headdim: 8}",
                 "data.task=parity", "data.seq_len=16", "data.min_seq_len=3", "data.batch_size=4",
                 "data.val_samples=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
                 "checkpoint_every=2", "progress_bar=false", f"run_dir={run}"]  # fmt: skip
    train(load_config(None, overrides))
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
        A = -torch.where(a >= 0, 1 + a, 1 / (1 - a)).clamp(min=mixer.A_floor)
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
