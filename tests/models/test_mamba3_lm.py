"""MambaLM with Mamba-3 mixers: mamba-ssm's state-dict keys, prefill + steps equal to the
forward, greedy generation equal to recomputing the forward for every token, and loading
mamba-ssm's Mamba-3 checkpoints (config.json as mamba-ssm writes it)."""

from __future__ import annotations

import json

import pytest
import torch

from ssm import MambaConfig, MambaLM

CONFIGS = {
    "siso+mlp": dict(
        ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4}, d_intermediate=40
    ),
    "mimo, outproj norm": dict(
        ssm_cfg={
            "layer": "Mamba3",
            "d_state": 8,
            "headdim": 8,
            "is_mimo": True,
            "mimo_rank": 2,
            "is_outproj_norm": True,
            "chunk_size": 4,
        }
    ),
}


def tiny(kind, **kw) -> MambaLM:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=32, n_layer=2, vocab_size=45, **{**CONFIGS[kind], **kw}))
    with torch.no_grad():  # move the parameters off their (symmetric) initial values
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.double().eval()


def test_state_dict_keys_are_mamba_ssm_s():
    model = MambaLM(
        MambaConfig(d_model=768, n_layer=2, vocab_size=50277, ssm_cfg={"layer": "Mamba3", "is_mimo": True}),
        device="meta",
    )
    mixer = {
        "in_proj.weight",
        "dt_bias",
        "B_bias",
        "C_bias",
        "B_norm.weight",
        "C_norm.weight",
        "mimo_x",
        "mimo_z",
        "mimo_o",
        "D",
        "out_proj.weight",
    }
    expected = {"backbone.embedding.weight", "backbone.norm_f.weight", "lm_head.weight"}
    for i in range(2):
        expected |= {f"backbone.layers.{i}.norm.weight"} | {f"backbone.layers.{i}.mixer.{k}" for k in mixer}
    assert set(model.state_dict()) == expected


@pytest.mark.parametrize("kind", CONFIGS)
def test_prefill_then_steps_equals_forward(kind):
    model = tiny(kind)
    ids = torch.randint(0, 45, (3, 17), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = model.allocate_inference_cache(3, dtype=torch.float64)
    logits = [model(ids[:, :7], cache=cache)]
    logits += [model.step(ids[:, t], cache)[:, None] for t in range(7, 17)]
    assert cache.seqlen_offset == 17
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", CONFIGS)
def test_greedy_generation_equals_recomputing(kind):
    """generate (one prefill, then cached steps) picks the tokens that the full forward over
    the growing sequence picks."""
    model = tiny(kind)
    prompt = torch.randint(0, 45, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, max_new_tokens=8, temperature=0)
    ids = prompt
    for _ in range(8):
        ids = torch.cat([ids, model(ids)[:, -1, :45].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def mamba_ssm_files(model: MambaLM, directory) -> None:
    """config.json as mamba-ssm's MambaLMHeadModel.save_pretrained writes it (every MambaConfig
    field, ssm_cfg with mamba-ssm's Mamba3 arguments) and pytorch_model.bin under its key names."""
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save({k: v.float() for k, v in model.state_dict().items()}, directory / "pytorch_model.bin")


@pytest.mark.parametrize("kind", CONFIGS)
def test_loads_mamba_ssm_mamba3_checkpoints(tmp_path, kind):
    source = tiny(kind).float()
    ssm_cfg = dict(source.config.ssm_cfg)
    # mamba-ssm's Mamba3 also takes these (its kernels' choices), as its config files may hold
    ssm_cfg.update(dropout=0.0, fuse_pregate_headwise_norm=True)
    source.config.ssm_cfg = ssm_cfg
    mamba_ssm_files(source, tmp_path)
    loaded = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 45, (2, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), source(ids))
    assert getattr(loaded.backbone.layers[0].mixer.dt_bias, "_no_weight_decay", False)


@pytest.mark.parametrize("safe", [False, True])
def test_round_trip(tmp_path, safe):
    model = tiny("mimo, outproj norm").float()
    model.save_pretrained(tmp_path, safe_serialization=safe)
    loaded = MambaLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 45, (2, 9), generator=torch.Generator().manual_seed(0))
    assert loaded.config == model.config
    assert torch.equal(loaded(ids), model(ids))


def test_unknown_mixer_option_is_named():
    with pytest.raises(ValueError, match=r"unknown ssm_cfg key\(s\) \['d_conv'\] for Mamba3"):
        MambaLM(MambaConfig(d_model=32, n_layer=1, vocab_size=10, ssm_cfg={"layer": "Mamba3", "d_conv": 4}))
