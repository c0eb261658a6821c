"""Weight-only quantisation of a MambaLM (``MambaLM.quantize``), and the record of it that a
checkpoint keeps (quantization_config.json beside config.json) so that ``from_pretrained``
rebuilds the same layers and loads their integers as saved, without quantising again.

What is quantised: the matrices that a decoding step reads in bulk, each an ``nn.Linear``
replaced by a ``ssm.layers.quant.QuantLinear`` — every Mamba-1 mixer's in_proj, x_proj and
out_proj, every Mamba-2, Mamba-3 and attention (MHA) mixer's in_proj and out_proj, every block
MLP's fc1 and fc2, and the LM head (with tied embeddings the embedding then reads the head's
integers: ``QuantEmbedding``). They hold nearly all of a model's bytes (about 98% of
mamba-130m's outside the embedding).

What stays in the model's float dtype, and why:
  - dt_proj (the Δ projection, rank R = d_model / 16): 2% of a block's weights, and Δ enters
    exp(Δ·A) and the input's scale, where an error compounds along the sequence;
  - the causal conv (K = 4 taps a channel), A_log, D, dt_bias, every norm's weight, the biases:
    vectors, a fraction of a percent of the bytes, each read once per token;
  - an untied embedding: decoding reads one row of it per token, so quantising it would save
    disk, not time;
  - Mamba-3's B / C norms and biases, its MIMO projections (mimo_x, mimo_z, mimo_o: vectors);
The recurrent states and every sum of the fused step stay float32 (see ssm.ops.quant for the
format and its block size).

What the quantised layers multiply their weights by, ``activations``: "int8" (the default: each
input rounded to int8 per block of 32, as llama.cpp's q8_0 / q4_0 do, so that the fused step runs
integer instructions) or "float32" (the inputs as they are). It is recorded in
quantization_config.json and can be changed at any time (``set_activations``): the stored
integers do not depend on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..layers import MHA, GatedMLP, Mamba, Mamba2, Mamba3
from ..layers.quant import QuantEmbedding, QuantLinear
from ..ops.quant import BLOCK, check_activations, check_scheme

QUANT_CONFIG = "quantization_config.json"


def quantizable(model) -> list[str]:
    """The names of the linear layers ``quantize`` replaces, in module order."""
    names = []
    for i, block in enumerate(model.backbone.layers):
        prefix = f"backbone.layers.{i}."
        if isinstance(block.mixer, Mamba):
            names += [prefix + "mixer." + n for n in ("in_proj", "x_proj", "out_proj")]
        elif isinstance(block.mixer, (Mamba2, Mamba3, MHA)):
            names += [prefix + "mixer." + n for n in ("in_proj", "out_proj")]
        if isinstance(block.mlp, GatedMLP):
            names += [prefix + "mlp.fc1", prefix + "mlp.fc2"]
    return names + ["lm_head"]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _tie(model) -> None:
    """With tied embeddings, the embedding reads the quantised head."""
    if model.config.tie_embeddings and isinstance(model.lm_head, QuantLinear):
        dtype = model.backbone.norm_f.weight.dtype
        model.backbone.embedding = QuantEmbedding(model.lm_head, dtype)


def quantize_model(model, scheme, activations: str = "int8") -> None:
    """Replace ``quantizable(model)`` by QuantLinear layers of ``scheme`` taking ``activations``,
    in place."""
    check_scheme(scheme)
    check_activations(activations)
    if model.quantization is not None:
        raise ValueError(
            f"scheme {scheme!r}: this model is already quantised ({model.quantization['scheme']}); "
            "quantize a float model (quantising again would round the rounded weights)"
        )
    names = quantizable(model)
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"cannot quantise {name}: a {type(linear).__name__}, not an nn.Linear")
        _replace(model, name, QuantLinear.from_linear(linear, scheme, activations))
    _tie(model)
    _own_storage(model)
    model.quantization = {"scheme": scheme, "block_size": BLOCK, "activations": activations, "modules": names}


def set_activations(model, activations: str) -> None:
    """Make every quantised layer of ``model`` take ``activations`` ("int8" or "float32")."""
    check_activations(activations)
    if model.quantization is None:
        raise ValueError(f"activations={activations!r} applies to a quantised model; this one is not quantised")
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.activations = activations
    model.quantization["activations"] = activations


def _own_storage(model) -> None:
    """Give every tensor that stays in float (norms, conv, A, D, dt_proj, an untied embedding) a
    storage of its own. Those loaded from a safetensors file are views of its memory map, and
    one such view keeps the whole file mapped: after quantising, the float matrices' pages (read
    while quantising) stayed resident, 4x the int8 weights at mamba-130m's size (measured with
    --op memory: 1,022 MiB resident before decoding against 629 for bfloat16)."""
    seen = set()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):  # each shared tensor once
            if id(t) not in seen and t.is_floating_point() and t.device.type == "cpu":
                seen.add(id(t))
                t.data = t.data.clone()


def save_quantization(model, directory: Path) -> None:
    """quantization_config.json for a quantised model; none (a stale one removed) otherwise."""
    path = directory / QUANT_CONFIG
    if model.quantization is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(model.quantization, indent=2) + "\n")


def read_quantization(directory: Path) -> dict | None:
    """The checkpoint's quantization_config.json, checked, or None."""
    path = directory / QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(spec, dict) or not isinstance(spec.get("modules"), list):
        raise ValueError(f"{path} must hold an object with 'scheme', 'block_size' and 'modules'")
    check_scheme(spec.get("scheme"), f"{path}'s 'scheme'")
    if spec.get("block_size") != BLOCK:
        raise ValueError(f"{path}: block_size {spec.get('block_size')!r} is not supported (only {BLOCK})")
    check_activations(spec.setdefault("activations", "int8"), f"{path}'s 'activations'")
    return spec


def build_quantized(model, spec: dict) -> None:
    """Give ``model`` (on the meta device) the empty QuantLinear layers ``spec`` names, ready to
    load a quantised checkpoint's tensors."""
    for name in spec["modules"]:
        try:
            linear = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"{QUANT_CONFIG} names {name!r}, which the model has not") from err
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{QUANT_CONFIG} names {name!r}, a {type(linear).__name__}, not an nn.Linear")
        bias = linear.bias is not None
        quant = QuantLinear(
            linear.in_features,
            linear.out_features,
            spec["scheme"],
            bias,
            device="meta",
            activations=spec["activations"],
        )
        _replace(model, name, quant)
    _tie(model)
    model.quantization = dict(spec)
