"""Configs: every file in configs/ loads; overrides are typed; mistakes name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

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
    path.write_text("trainer:\n  max_steps: [1\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not valid YAML: .* line 2") as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_exponent_numbers_without_a_dot_are_numbers_in_free_keyed_sections(tmp_path):
    """PyYAML reads 1e-6 as a string; model.ssm_cfg passes its values on untyped, so the layer
    got '1e-6' and refused it. From a file and from the command line it is the float."""
    path = tmp_path / "c.yaml"
    path.write_text(f"base: {DEFAULT}\nmodel:\n  ssm_cfg: {{layer: Mamba1, dt_min: 1e-5, dt_max: 2E-1}}\n")
    config = load_config(path, ["model.ssm_cfg.dt_init_floor=1e-7", "model.ssm_cfg.d_state=8"])
    assert config.model.ssm_cfg["dt_min"] == 1e-5 and config.model.ssm_cfg["dt_max"] == 0.2
    assert config.model.ssm_cfg["dt_init_floor"] == 1e-7 and config.model.ssm_cfg["d_state"] == 8
    mixer = build_model(config, 10).backbone.layers[0].mixer
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias.detach().double())
    assert dt.min() >= 1e-5 * (1 - 1e-6) and dt.max() <= 0.2 * (1 + 1e-6)
    assert load_config(DEFAULT, ["model.ssm_cfg.name=e5"]).model.ssm_cfg["name"] == "e5"  # words stay words


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


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.min_lr_ratio=-1", r"optim.min_lr_ratio must be a number in \[0, 1\] .*, got -1.0"),
        ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio must be a number in \[0, 1\]"),
        ("optim.warmup_steps=-50", r"optim.warmup_steps must be an int >= 0, got -50"),
        ("optim.decay_steps=-1", r"optim.decay_steps must be an int >= 0 \(0: no final decay\), got -1"),
        ("optim.lr=0", r"optim.lr must be a finite number > 0, got 0.0"),
        ("optim.lr=-1e-3", r"optim.lr must be a finite number > 0"),
        ("optim.lr=nan", r"optim.lr must be a finite number > 0, got nan"),
        ("optim.lr=inf", r"optim.lr must be a finite number > 0, got inf"),
        ("optim.eps=0", r"optim.eps must be a finite number > 0"),
        ("optim.betas=[0.9]", r"optim.betas must be a list of two numbers in \[0, 1\), e.g. .*, got \[0.9\]"),
        ("optim.betas=[0.9, 1.0]", r"optim.betas must be a list of two numbers in \[0, 1\)"),
        ("optim.betas=[0.9, fast]", r"optim.betas must be a list of two numbers"),
        ("optim.weight_decay=-0.1", r"optim.weight_decay must be a finite number >= 0"),
        ("checkpoint_every=0", r"checkpoint_every must be an int >= 1, got 0"),
        (
            "keep_checkpoint_every=-1",
            r"keep_checkpoint_every must be an int >= 0 \(0: keep no step checkpoints\), got -1",
        ),
        ("log_every=0", r"log_every must be an int >= 1, got 0"),
        ("seed=-1", r"seed must be an int in \[0, 2\*\*32\), got -1"),
        ("trainer.val_check_interval=0", r"trainer.val_check_interval must be an int >= 1, got 0"),
        ("trainer.log_every_n_steps=0", r"trainer.log_every_n_steps must be an int >= 1"),
        ("trainer.max_steps=-1", r"trainer.max_steps must be an int >= 1 \(the tasks have no epochs"),
        ("trainer.max_steps=0", r"trainer.max_steps must be an int >= 1"),
        ("trainer.accumulate_grad_batches=0", r"trainer.accumulate_grad_batches must be an int >= 1"),
        ("trainer.gradient_clip_val=-1", r"trainer.gradient_clip_val must be null or a number >= 0, got -1.0"),
        ("trainer.num_nodes=0", r"trainer.num_nodes must be an int >= 1"),
        ("trainer.limit_val_batches=0", r"trainer.limit_val_batches must be null \(all\), an int >= 1"),
        ("trainer.limit_val_batches=1.5", r"trainer.limit_val_batches must be null \(all\)"),
        (
            "data.task=copying",
            r"data.task must be one of \['selective_copying', 'induction_heads', 'parity', "
            r"'modular_arithmetic', 'text'\]",
        ),
        ("data.seq_len=0", r"data.seq_len must be an int >= 1, got 0"),
        ("data.batch_size=0", r"data.batch_size must be an int >= 1"),
        ("data.num_tokens=0", r"data.num_tokens must be an int >= 1"),
        ("data.num_memorize=0", r"data.num_memorize must be an int >= 1"),
        ("data.val_samples=0", r"data.val_samples must be an int >= 1"),
        ("data.short_gap_prob=1.5", r"data.short_gap_prob must be a number in \[0, 1\], got 1.5"),
        ("data.short_gap_window=0", r"data.short_gap_window must be an int >= 1"),
        ("data.val_fraction=0", r"data.val_fraction must be a number in \(0, 1\)"),
        ("data.val_fraction=1", r"data.val_fraction must be a number in \(0, 1\)"),
        ("data.num_workers=-1", r"data.num_workers must be an int >= 0"),
        ("data.tokenizer=bpe:100", r"data.tokenizer must be 'bytes', 'bpe:SIZE' with SIZE >= 257"),
        ("data.paths=[1, 2]", r"data.paths must be a list of file globs"),
        ("model.backend=fast", r"model.backend must be one of \['auto', 'cpu', 'pscan', 'ref', 'triton'\] \(the"),
        ("model.backend=chunked", r"model.backend must be one of .* \(the backends of selective_scan, the scan of Mam"),
        ("model.ssm_cfg.backend=pscan", None),  # Mamba1's: fine (see below for Mamba2)
    ],
)
def test_values_out_of_range_name_the_key(override, message):
    if message is None:
        load_config(DEFAULT, [override])
        return
    with pytest.raises(ConfigError, match=message) as err:
        load_config(DEFAULT, [override])
    assert "\n" not in str(err.value)


def test_the_backend_must_be_one_of_the_mixers_scan():
    for layer, good, bad in (("Mamba2", "chunked", "pscan"), ("Mamba3", "cpu", "pscan")):
        cfg = f"model.ssm_cfg={{layer: {layer}, d_state: 4, headdim: 8}}"
        assert load_config(DEFAULT, [cfg, f"model.backend={good}"]).model.backend == good
        with pytest.raises(ConfigError, match=rf"model.backend must be one of .* got '{bad}'"):
            load_config(DEFAULT, [cfg, f"model.backend={bad}"])
    with pytest.raises(ConfigError, match=r"model.ssm_cfg.backend must be one of .* the scan of Mamba2"):
        load_config(DEFAULT, ["model.ssm_cfg={layer: Mamba2, backend: pscan}"])


def test_a_decay_longer_than_the_run_is_refused_when_it_starts(tmp_path):
    from ssm.training import train

    config = load_config(DEFAULT, ["optim.decay_steps=300", "trainer.max_steps=200", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError, match=r"optim.decay_steps must be <= trainer.max_steps = 200 .*, got 300"):
        train(config)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        # a ValueError of the data (here, of the task) and of the model config: one line each
        (["data.num_memorize=20", "data.seq_len=12"], "error: data.num_memorize (20) must be <= data.seq_len (12)"),
        (["model.ssm_cfg.layer=Mamba9"], "error: model: MambaConfig.ssm_cfg['layer'] must be one of"),
        (["data.task=text", "data.paths=[/nonexistent/*.txt]"], "error: data.paths ['/nonexistent/*.txt'] match no"),
        # what Lightning refuses: one line too
        (["trainer.accelerator=abacus"], "error: trainer: "),
        (["optim.min_lr_ratio=-1"], "error: optim.min_lr_ratio must be a number in [0, 1]"),
        (["trainer.gradient_clip_val=fast"], "error: trainer.gradient_clip_val must be float or null, got 'fast'"),
    ],
)
def test_the_train_script_reports_a_config_value_error_in_one_line(overrides, message, tmp_path, capsys):
    import runpy

    main = runpy.run_path(str(DEFAULT.parent.parent / "scripts" / "train.py"))["main"]
    assert main([*overrides, f"run_dir={tmp_path / 'r'}", "trainer.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()  # nothing left behind
