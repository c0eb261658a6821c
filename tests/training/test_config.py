"""Configs: every file in configs/ loads; overrides are typed; mistakes name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ssm import MambaConfig
from ssm.training import ConfigError, TrainConfig, load_config
from ssm.training.config import ModelSection
from ssm.training.data import TaskDataModule
from ssm.training.run import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
DEFAULT = CONFIGS[0].parent / "default.yaml"


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "induction_heads.yaml", "text.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_builds(path, tmp_path):
    overrides = [f"data.paths=[{tmp_path}/*.txt]"]
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "b.txt").write_text("other text " * 200)
    config = load_config(path, overrides + ["data.val_fraction=0.5"])
    assert isinstance(config, TrainConfig)
    data = TaskDataModule(config.data, seed=config.seed)
    model = build_model(config, data.vocab_size)
    assert model.config.vocab_size == data.vocab_size


def test_base_files_hold_only_changes():
    config = load_config(CONFIGS[0].parent / "induction_heads.yaml")
    default = load_config(CONFIGS[0].parent / "default.yaml")
    assert config.data.task == "induction_heads" and config.data.seq_len == 256
    assert config.optim == default.optim  # inherited


def test_overrides_are_parsed_by_field_type():
    c = load_config(
        None,
        [
            "trainer.max_steps=7",
            "optim.lr=1e-3",
            "model.rms_norm=false",
            "run_dir=null",
            "trainer.devices=2",
            "trainer.precision=bf16-mixed",
            "model.ssm_cfg.d_state=4",
            "optim.betas=[0.8, 0.9]",
            "trainer.limit_val_batches=0.5",
        ],
    )
    assert c.trainer.max_steps == 7 and c.optim.lr == 1e-3 and c.model.rms_norm is False
    assert c.run_dir is None and c.trainer.devices == 2 and c.trainer.precision == "bf16-mixed"
    assert c.model.ssm_cfg == {"d_state": 4} and c.optim.betas == [0.8, 0.9]
    assert c.trainer.limit_val_batches == 0.5


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_stpes=3", r"unknown key 'trainer.max_stpes' in trainer; valid keys: \['max_steps'"),
        ("modle.d_model=3", r"unknown key 'modle' in the top level; valid keys: \['model', 'data'"),
        ("trainer.max_steps=ten", r"trainer.max_steps must be int, got 'ten'"),
        ("optim.lr=fast", r"optim.lr must be float, got 'fast'"),
        ("model.rms_norm=maybe", r"model.rms_norm must be bool"),
        ("trainer=3", r"'trainer' is a section"),
        ("max_steps", r"must look like key=value"),
    ],
)
def test_mistakes_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_mistakes_in_files_name_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  tsak: text\n")
    with pytest.raises(ConfigError, match=r"unknown key 'data.tsak' in data; valid keys: \['task'"):
        load_config(path)
    path.write_text("trainer:\n  max_steps: 1.5\n")
    with pytest.raises(ConfigError, match="trainer.max_steps must be int, got 1.5"):
        load_config(path)


def test_misspelt_mixer_argument_fails_before_training():
    config = load_config(DEFAULT, ["model.ssm_cfg.d_sate=4"])
    with pytest.raises(ConfigError, match=r"unknown ssm_cfg key\(s\) \['d_sate'\]"):
        build_model(config, 10)


def test_model_section_is_mamba_config_plus_the_backend():
    mamba = {f.name: f for f in dataclasses.fields(MambaConfig)}
    section = {f.name: f for f in dataclasses.fields(ModelSection)}
    assert set(section) == set(mamba) | {"backend"}
    defaults, theirs = ModelSection(), MambaConfig()
    for name in mamba:
        if name != "vocab_size":  # None: the task's vocabulary
            assert getattr(defaults, name) == getattr(theirs, name), name
    assert defaults.vocab_size is None and defaults.backend == "auto"


def test_model_section_builds_the_config_it_names():
    config = load_config(
        DEFAULT,
        [
            "model.d_model=24",
            "model.n_layer=3",
            "model.d_intermediate=8",
            "model.rms_norm=false",
            "model.tie_embeddings=false",
            "model.pad_vocab_size_multiple=4",
            "model.backend=pscan",
        ],
    )
    model = build_model(config, vocab_size=10)
    assert model.config == MambaConfig(
        d_model=24,
        n_layer=3,
        d_intermediate=8,
        rms_norm=False,
        tie_embeddings=False,
        pad_vocab_size_multiple=4,
        vocab_size=10,
        ssm_cfg={"layer": "Mamba1", "d_state": 16},
    )
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {"pscan"}
    with pytest.raises(ConfigError, match=r"model.vocab_size = 6 is smaller than the task's vocabulary \(10\)"):
        build_model(load_config(DEFAULT, ["model.vocab_size=6"]), vocab_size=10)


def test_unknown_model_key_lists_mamba_config_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_modle: 8\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'model.d_modle' in model; valid keys: \['d_model', .*'backend'\]"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"model.n_layer must be int, got 'two'"):
        load_config(None, ["model.n_layer=two"])
