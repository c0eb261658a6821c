"""Optimiser groups and the learning-rate schedule."""

from __future__ import annotations

import math

from ssm import MambaConfig, MambaLM
from ssm.training.module import parameter_groups, warmup_cosine


def test_weight_decay_skips_ssm_parameters_norms_and_biases():
    for layer in ("Mamba1", "Mamba2"):
        model = MambaLM(MambaConfig(d_model=16, n_layer=2, vocab_size=10, ssm_cfg={"layer": layer, "headdim": 8, "d_state": 4} if layer == "Mamba2" else {"d_state": 4}, d_intermediate=32))
        decay, no_decay = parameter_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)].split("layers.0.")[-1] for p in decay["params"]}
        skipped = {names[id(p)].split("layers.0.")[-1] for p in no_decay["params"]}
        assert {"mixer.A_log", "mixer.D", "norm.weight", "mixer.conv1d.bias", "backbone.norm_f.weight"} <= skipped
        assert ("mixer.dt_bias" if layer == "Mamba2" else "mixer.dt_proj.bias") in skipped
        assert {"mixer.in_proj.weight", "mixer.out_proj.weight", "backbone.embedding.weight", "mlp.fc1.weight"} <= decayed
        assert not decayed & skipped
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied head once
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_warmup_then_cosine():
    assert warmup_cosine(0, 10, 100, 0.1) == 0.1
    assert warmup_cosine(9, 10, 100, 0.1) == 1.0
    assert math.isclose(warmup_cosine(55, 10, 100, 0.1), 0.1 + 0.9 * 0.5)
    assert math.isclose(warmup_cosine(100, 10, 100, 0.1), 0.1)
    assert math.isclose(warmup_cosine(500, 10, 100, 0.1), 0.1)
