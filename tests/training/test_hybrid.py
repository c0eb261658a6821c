"""Training hybrid models from YAML: configs/hybrid.yaml and configs/hybrid_text.yaml (packed
documents) load, train a few steps and save a hybrid config.json; stateful training refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssm import MambaLM
from ssm.layers import MHA
from ssm.training import ConfigError, load_config, train

ROOT = Path(__file__).resolve().parents[2]
QUICK = [
    "model.d_model=32",
    "data.batch_size=4",
    "data.val_samples=8",
    "data.seq_len=16",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "checkpoint_every=2",
    "progress_bar=false",
    "model.attn_cfg.rotary_emb_dim=4",
]


@pytest.mark.parametrize("name,layers", [("hybrid", [1]), ("hybrid_text", [2])])
def test_hybrid_configs_train_and_save_a_hybrid(tmp_path, name, layers):
    config = load_config(ROOT / "configs" / f"{name}.yaml", QUICK + [f"run_dir={tmp_path}"])
    assert config.model.attn_layer_idx == layers and config.model.attn_cfg["causal"] is True
    train(config)
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["attn_layer_idx"] == layers and saved["attn_cfg"]["rotary_emb_dim"] == 4
    model = MambaLM.from_pretrained(tmp_path / "model")
    assert [isinstance(block.mixer, MHA) for block in model.backbone.layers].count(True) == 1


def test_attention_keys_from_the_command_line():
    config = load_config(ROOT / "configs" / "default.yaml", ["model.n_layer=3", "model.attn_layer_idx=[0, 2]"])
    assert config.model.attn_layer_idx == [0, 2]
    with pytest.raises(ConfigError, match=r"attn_layer_idx \[0, 5\] holds \[5\]"):
        train(load_config(ROOT / "configs" / "hybrid.yaml", QUICK + ["model.attn_layer_idx=[0, 5]"]))


def test_stateful_training_refuses_a_hybrid(tmp_path):
    config = load_config(ROOT / "configs" / "hybrid_text.yaml", QUICK + ["data.stateful=true", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="data.stateful.*grow without bound"):
        train(config)
