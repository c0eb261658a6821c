"""MambaConfig stays mamba-ssm's field for field in config.json; norm_epsilon; and what
from_pretrained does with each field of a transformers config.json."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.models.checkpoint import read_config
from ssm.models.transformers_config import config_from_transformers

# mamba-ssm 2.x's MambaConfig (mamba_ssm/models/config_mamba.py), in its order.
MAMBA_SSM_FIELDS = [
    "d_model",
    "d_intermediate",
    "n_layer",
    "vocab_size",
    "ssm_cfg",
    "attn_layer_idx",
    "attn_cfg",
    "rms_norm",
    "residual_in_fp32",
    "fused_add_norm",
    "pad_vocab_size_multiple",
    "tie_embeddings",
]


def test_config_json_is_mamba_ssms_while_epsilon_is_mamba_ssms():
    assert list(MambaConfig().to_dict()) == MAMBA_SSM_FIELDS
    assert list(MambaConfig(norm_epsilon=1e-5).to_dict()) == MAMBA_SSM_FIELDS
    assert MambaConfig(norm_epsilon=1e-3).to_dict() == {**MambaConfig().to_dict(), "norm_epsilon": 1e-3}


@pytest.mark.parametrize("rms_norm", [True, False])
def test_norm_epsilon_reaches_every_norm_and_survives_a_round_trip(tmp_path, rms_norm):
    config = MambaConfig(
        d_model=16,
        n_layer=2,
        vocab_size=20,
        d_intermediate=16,
        rms_norm=rms_norm,
        ssm_cfg={"layer": "Mamba2", "d_state": 4, "headdim": 8, "ngroups": 2},
        norm_epsilon=0.25,
    )
    model = MambaLM(config)
    norms = [m for m in model.modules() if hasattr(m, "eps")]
    assert len(norms) == 2 * 2 + 1 + 2  # norm and norm2 per block, final norm, gated norm per mixer
    assert {m.eps for m in norms} == {0.25}
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["norm_epsilon"] == 0.25
    assert MambaLM.from_pretrained(tmp_path).config == config


@pytest.mark.parametrize("eps", [0, -1e-5, math.inf, math.nan, "1e-5", True, None])
def test_bad_norm_epsilon_is_refused(eps):
    with pytest.raises(ValueError, match=r"MambaConfig.norm_epsilon must be a finite number > 0"):
        MambaConfig(norm_epsilon=eps)


# A complete config.json as transformers 5 writes it, from which the cases below change one field.
HF = {
    "mamba": {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "vocab_size": 24,
        "state_size": 4,
        "expand": 2,
        "conv_kernel": 4,
        "intermediate_size": 32,
        "time_step_rank": "auto",
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "initializer_range": 0.1,
        "rescale_prenorm_residual": False,
        "time_step_floor": 1e-4,
        "time_step_init_scheme": "random",
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_scale": 1.0,
        "use_associative_scan": True,
        "use_cache": True,
        "use_mambapy": False,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "transformers_version": "5.23.0",
    },
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "vocab_size": 24,
        "state_size": 4,
        "expand": 2,
        "conv_kernel": 4,
        "head_dim": 8,
        "num_heads": 4,
        "n_groups": 2,
        "chunk_size": 8,
        "time_step_rank": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "dtype": "float32",
        "initializer_range": 0.1,
        "rescale_prenorm_residual": False,
        "time_step_floor": 1e-4,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "use_cache": True,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "transformers_version": "5.23.0",
    },
}


def write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def config_of(tmp_path, raw: dict) -> MambaConfig:
    return config_from_transformers(read_config(write(tmp_path, raw) / "config.json"))


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_transformers_fields_are_honoured(tmp_path, kind):
    base = config_of(tmp_path, HF[kind])
    changes = {  # field: (value, what it changes in our config)
        "layer_norm_epsilon": (1e-3, lambda c: c.norm_epsilon == 1e-3),
        "residual_in_fp32": (False, lambda c: c.residual_in_fp32 is False),
        "tie_word_embeddings": (kind == "mamba2", lambda c: c.tie_embeddings is (kind == "mamba2")),
        "use_bias": (True, lambda c: c.ssm_cfg["bias"] is True),
        "use_conv_bias": (False, lambda c: c.ssm_cfg["conv_bias"] is False),
        "conv_kernel": (3, lambda c: c.ssm_cfg["d_conv"] == 3),
        "state_size": (6, lambda c: c.ssm_cfg["d_state"] == 6),
    }
    if kind == "mamba":
        changes["time_step_rank"] = (3, lambda c: c.ssm_cfg["dt_rank"] == 3)
    else:
        changes["chunk_size"] = (4, lambda c: c.ssm_cfg["chunk_size"] == 4)
        changes["n_groups"] = (4, lambda c: c.ssm_cfg["ngroups"] == 4)
        changes["time_step_limit"] = ([0.01, 0.5], lambda c: c.ssm_cfg["dt_limit"] == (0.01, 0.5))
    for field, (value, holds) in changes.items():
        assert not holds(base), field
        assert holds(config_of(tmp_path, {**HF[kind], field: value})), field
    if kind == "mamba2":
        assert base.ssm_cfg["dt_limit"] == (0.0, math.inf)
        # Python's json writes a bare Infinity (transformers 4 did too)
        assert config_of(tmp_path, {**HF[kind], "time_step_limit": [0.0, math.inf]}) == base


REFUSED = [
    ("mamba", "hidden_act", "gelu", "'hidden_act' must be 'silu'"),
    ("mamba2", "hidden_act", "relu", "'hidden_act' must be 'silu'"),
    ("mamba", "rms_norm", False, "'rms_norm' must be true"),
    ("mamba2", "norm_before_gate", True, "'norm_before_gate' must be false"),
    ("mamba", "intermediate_size", 48, "'intermediate_size' must be expand \\* hidden_size = 32"),
    ("mamba", "n_layer", 3, "'n_layer' must be num_hidden_layers = 1"),
    ("mamba2", "num_heads", 8, "'num_heads' must be expand \\* hidden_size / head_dim"),
    ("mamba2", "n_groups", 3, "'n_groups' must be a divisor of num_heads = 4"),
    ("mamba2", "time_step_limit", [0.5, 0.1], "'time_step_limit' must be two numbers"),
    ("mamba2", "time_step_limit", [0.1], "'time_step_limit' must be two numbers"),
    ("mamba", "layer_norm_epsilon", 0, "'layer_norm_epsilon' must be a finite number > 0"),
    ("mamba", "expand", 1.5, "'expand' must be a positive int"),
    ("mamba", "time_step_rank", "half", "'time_step_rank' must be a positive int"),
    ("mamba", "tie_word_embeddings", "yes", "'tie_word_embeddings' must be true or false"),
    ("mamba", "n_groups", 2, r"field\(s\) \['n_groups'\] that this loader does not know"),
    ("mamba2", "use_D", False, r"field\(s\) \['use_D'\] that this loader does not know"),
    ("mamba", "model_type", "gpt2", "model_type 'gpt2' is not supported"),
]


@pytest.mark.parametrize("kind, field, value, message", REFUSED, ids=[f"{k}-{f}-{v}" for k, f, v, _ in REFUSED])
def test_transformers_fields_that_cannot_be_honoured_are_refused(tmp_path, kind, field, value, message):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=message):
        MambaLM.from_pretrained(write(tmp_path, {**HF[kind], field: value}))


def test_transformers_config_without_model_type_is_refused(tmp_path):
    raw = {k: v for k, v in HF["mamba"].items() if k != "model_type"}
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="transformers model_type None is not supported"):
        MambaLM.from_pretrained(write(tmp_path, raw))
