"""Golden parity with transformers, without transformers.

tests/models/golden/ holds tiny MambaForCausalLM ("mamba") and Mamba2ForCausalLM ("mamba2")
directories exactly as transformers' save_pretrained wrote them, with random values in every
parameter and a layer_norm_epsilon of 1e-3, and next to each, NAME.outputs.safetensors: what
transformers computed from them (the metadata names its version and the pure-PyTorch code path).
scripts/make_golden.py regenerates them. These tests load the directories with
MambaLM.from_pretrained and compare.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ssm import MambaLM

GOLDEN = Path(__file__).parent / "golden"
NAMES = ["mamba", "mamba2"]
# The scan backend each model runs on here (tests/scan compares every backend with the reference).
BACKENDS = {"mamba": "pscan", "mamba2": "chunked"}
# Both sides compute in float32 on logits of order one; only the summation order differs.
TOL = dict(rtol=1e-4, atol=1e-4)


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / f"{name}.outputs.safetensors")


def load(directory) -> MambaLM:
    name = Path(directory).name.split("-")[0]
    return MambaLM.from_pretrained(directory, backend=BACKENDS[name]).eval()


def copy_with_config(name: str, tmp_path: Path, edit) -> Path:
    """The golden directory NAME copied to tmp_path, its config.json passed through ``edit``."""
    directory = tmp_path / f"{name}-edited"
    shutil.copytree(GOLDEN / name, directory)
    raw = json.loads((directory / "config.json").read_text())
    edit(raw)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_golden_files_came_from_transformers_pure_pytorch_path():
    for name in NAMES:
        with safe_open(GOLDEN / f"{name}.outputs.safetensors", "pt") as f:
            meta = f.metadata()
        assert meta["transformers"].startswith("5.") and meta["path"].startswith("pure PyTorch"), meta
        assert json.loads((GOLDEN / name / "config.json").read_text())["model_type"] == name


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    want = expected(name)
    with torch.no_grad():
        got = load(GOLDEN / name)(want["input_ids"])
    torch.testing.assert_close(got, want["logits"], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_matches_transformers_generate(name):
    """The tokens of transformers' greedy generate, and the logits of each of its cached steps."""
    want, model = expected(name), load(GOLDEN / name)
    prompt, greedy = want["prompt"], want["greedy"]
    assert torch.equal(model.generate(prompt, greedy.shape[1] - prompt.shape[1], temperature=0), greedy)
    with torch.no_grad():
        cache = model.allocate_inference_cache(prompt.shape[0])
        steps = [model(prompt, cache=cache, num_last_tokens=1)[:, -1]]
        for t in range(prompt.shape[1], greedy.shape[1] - 1):
            steps.append(model.step(greedy[:, t], cache))
    torch.testing.assert_close(torch.stack(steps, dim=1), want["greedy_logits"], **TOL)


def test_mamba2_time_step_limit_matches_transformers(tmp_path):
    """The same weights with a time_step_limit that clamps Δ from both sides."""
    want = expected("mamba2")
    low, high = want["dt_limit"].tolist()
    directory = copy_with_config("mamba2", tmp_path, lambda raw: raw.update(time_step_limit=[low, high]))
    model = load(directory)
    assert model.backbone.layers[0].mixer.dt_limit == (low, high)
    with torch.no_grad():
        got = model(want["input_ids"])
    torch.testing.assert_close(got, want["logits_dt_limit"], **TOL)
    assert not torch.allclose(want["logits_dt_limit"], want["logits"], **TOL)  # the clamp bites


def test_config_json_as_transformers_5_writes_it():
    """transformers 5 writes time_step_limit's infinite end as {"__float__": "Infinity"}, and
    layer_norm_epsilon reaches every norm (block norms, final norm, Mamba-2's gated norm)."""
    text = (GOLDEN / "mamba2" / "config.json").read_text()
    assert '"__float__": "Infinity"' in text
    model = load(GOLDEN / "mamba2")
    assert model.backbone.layers[0].mixer.dt_limit == (0.0, math.inf)
    for name in NAMES:
        model = load(GOLDEN / name)
        assert model.config.norm_epsilon == 1e-3
        norms = [m for m in model.modules() if hasattr(m, "eps")]
        assert len(norms) == 2 + 1 + (2 if name == "mamba2" else 0)  # 2 blocks, final, 2 gated
        assert {m.eps for m in norms} == {1e-3}


# Fields of the golden configs whose values are transformers 5's defaults (read from its
# MambaConfig and Mamba2Config): a config.json without them describes the same model.
DEFAULT_VALUED = {
    "mamba": ["expand", "conv_kernel", "use_conv_bias", "hidden_act", "residual_in_fp32", "tie_word_embeddings"],
    "mamba2": [
        "expand",
        "use_bias",
        "use_conv_bias",
        "hidden_act",
        "residual_in_fp32",
        "tie_word_embeddings",
        "time_step_limit",
    ],
}


@pytest.mark.parametrize("name", NAMES)
def test_fields_left_out_take_transformers_defaults(name, tmp_path):
    def drop(raw):
        for key in DEFAULT_VALUED[name]:
            del raw[key]

    want = expected(name)
    with torch.no_grad():
        got = load(copy_with_config(name, tmp_path, drop))(want["input_ids"])
    torch.testing.assert_close(got, want["logits"], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_saved_again_in_mamba_ssm_format_still_matches(name, tmp_path):
    """A transformers checkpoint re-saved by save_pretrained keeps its ε (config.json then holds
    norm_epsilon) and its logits."""
    want = expected(name)
    load(GOLDEN / name).save_pretrained(tmp_path / name, safe_serialization=True)
    assert json.loads((tmp_path / name / "config.json").read_text())["norm_epsilon"] == 1e-3
    with torch.no_grad():
        got = load(tmp_path / name)(want["input_ids"])
    torch.testing.assert_close(got, want["logits"], **TOL)
