"""Saving and loading models from local directories, in mamba-ssm's and transformers' formats.

mamba-ssm:     config.json = MambaConfig fields; pytorch_model.bin; keys backbone.embedding.weight, ...
transformers:  config.json = hidden_size, state_size, num_hidden_layers, ... with model_type "mamba"
               (Mamba-1) or "mamba2"; model.safetensors or pytorch_model.bin, or either split in
               shards listed by model.safetensors.index.json / pytorch_model.bin.index.json; keys
               backbone.embeddings.weight, ...; lm_head.weight may be absent when tied.
A directory holds one model: save_pretrained writes one weight set and removes the others'
files, and from_pretrained refuses a local directory holding two (weight_files.py).
Nothing here touches the network (resolve.py turns a hub repo id into a local directory first), and
nothing read from a file runs code: safetensors files hold only tensors, and pytorch_model.bin
files are unpickled with torch's weights-only unpickler.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..ops.quant import BLOCK, check_scheme, quantize_matrix
from .config import MambaConfig
from .quantize import build_quantized, quantizable, read_quantization, save_quantization, set_activations
from .resolve import resolve_model_dir
from .transformers_config import config_from_transformers
from .weight_files import (
    BIN,
    INDEX_SUFFIX,
    SAFETENSORS,
    remove_orphans,
    remove_other_weights,
    temporary_path,
    weight_set,
    weight_sets,
)

CONFIG = "config.json"


def save_pretrained(model, directory, safe_serialization: bool = False) -> None:
    """config.json and the weights (model.safetensors, or pytorch_model.bin) into ``directory``;
    then the other weight files there (the other format, index files, shards) are removed, so
    that the directory holds this model only. The weights are written to a temporary file and
    renamed into place after config.json: a save that fails (a full disk) leaves the old ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = SAFETENSORS if safe_serialization else BIN
    remove_orphans(directory, (name, CONFIG))  # what a save killed while writing left
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights, config = temporary_path(directory / name), temporary_path(directory / CONFIG)
    try:
        if safe_serialization:
            if model.config.tie_embeddings:
                state.pop("lm_head.weight", None)  # safetensors stores no shared tensors
            save_file(state, weights, metadata={"format": "pt"})
        else:
            torch.save(state, weights)
        config.write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        os.replace(config, directory / CONFIG)
        save_quantization(model, directory)
        os.replace(weights, directory / name)
    except BaseException:
        weights.unlink(missing_ok=True)
        config.unlink(missing_ok=True)
        raise
    remove_other_weights(directory, keep=name)


def from_pretrained(
    cls, name_or_path, *, device=None, dtype=None, backend="auto", revision=None, quantize=None, activations=None
):
    """See MambaLM.from_pretrained. With ``dtype`` or ``quantize`` each tensor is converted (or
    quantised) as it is read, so that a float32 checkpoint never stands in memory whole beside
    its converted copy: the peak is the converted model plus one tensor of the file."""
    dtype = parse_dtype(dtype)
    directory = resolve_model_dir(name_or_path, revision=revision)
    # a local directory must hold one weight set; a hub snapshot may hold its repo's several copies
    strict = isinstance(name_or_path, (str, os.PathLike)) and Path(name_or_path).is_dir()
    config_path = directory / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG} in {directory} (from_pretrained reads a local directory)")
    raw = read_config(config_path)
    if "model_type" in raw or "hidden_size" in raw:
        config, rename = config_from_transformers(raw), {"backbone.embeddings.": "backbone.embedding."}
    elif "d_model" in raw:
        config, rename = MambaConfig.from_dict(raw), {}
    else:
        raise ValueError(
            f"{config_path} is neither mamba-ssm's format (a 'd_model' field) nor transformers' "
            "(a 'model_type' and a 'hidden_size' field)"
        )

    model = cls(config, backend=backend, device="meta")
    quantization = read_quantization(directory)
    if quantization is not None:  # the quantised layers, to take the saved integers as they are
        if quantize is not None:
            raise ValueError(
                f"quantize={quantize!r}: {directory} holds a model already quantised ({quantization['scheme']}); "
                "load it without quantize (quantising again would round the rounded weights)"
            )
        build_quantized(model, quantization)
    elif quantize is not None:  # quantised layers, filled from the float matrices as they are read
        spec = {"scheme": check_scheme(quantize), "block_size": BLOCK, "activations": activations or "int8"}
        build_quantized(model, {**spec, "modules": quantizable(model)})
    transform = _reading_transform(model, rename, dtype, None if quantization is not None else quantize)
    state = read_weights(directory, transform, strict=strict)
    if transform is None:  # (the transform renames as it reads)
        for old, new in rename.items():
            state = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}
    load_state_dict_strict(model, state)
    if activations is not None:
        set_activations(model, activations)
    return model.to(device=device, dtype=dtype)


def _reading_transform(model, rename: dict, dtype, scheme):
    """What each tensor becomes as it is read: its name in this library's layout (``rename``'s
    prefixes), then in ``dtype`` (floats), and with ``scheme`` the weight of a layer that
    ``model`` (built quantised) holds as a QuantLinear is quantised into its qweight and scales
    (with tied embeddings the head's integers come from the embedding's matrix). None when
    nothing is to be done but renaming: the tensors are then taken as stored (a safetensors
    file's are views of its memory map, read when first used) and renamed after."""
    if dtype is None and scheme is None:
        return None
    tied = model.config.tie_embeddings
    sources = {}  # the checkpoint's name (after renaming) of each quantised matrix -> its layer
    if scheme is not None:
        for name in model.quantization["modules"]:
            sources[name + ".weight"] = name
        if tied and "lm_head" in model.quantization["modules"]:
            sources.pop("lm_head.weight")
            sources["backbone.embedding.weight"] = "lm_head"

    def transform(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        for old, new in rename.items():
            if key.startswith(old):
                key = new + key[len(old) :]
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if key in sources:
            q = quantize_matrix(t, scheme)
            return {sources[key] + ".qweight": q.data, sources[key] + ".scales": q.scales}
        if tied and scheme is not None and key == "lm_head.weight":
            return {}  # the embedding's matrix, quantised above
        return {key: t}

    return transform


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(dtype):
    """None or "auto" (keep the checkpoint's dtype), a torch floating dtype, or its name."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"dtype must be None, 'auto', a torch dtype or one of {list(_DTYPES)}, got {dtype!r}")
        return _DTYPES[name]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be None, 'auto', a floating torch dtype or its name, got {dtype!r}")
    return dtype


# transformers writes the floats JSON lacks (its time_step_limit's upper end) as {"__float__": tag}.
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _decode_special_float(obj: dict):
    if len(obj) == 1 and "__float__" in obj:
        tag = obj["__float__"]
        if tag not in _SPECIAL_FLOATS:
            raise ValueError(f"config.json holds {{'__float__': {tag!r}}}; expected one of {list(_SPECIAL_FLOATS)}")
        return _SPECIAL_FLOATS[tag]
    return obj


def read_config(path: Path) -> dict:
    """config.json as a dict; reads the bare Infinity / NaN that Python's json writes as well as
    transformers' {"__float__": "Infinity"}."""
    try:
        raw = json.loads(path.read_text(), object_hook=_decode_special_float)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_weights(directory: Path, transform=None, strict: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of model.safetensors, of the shards model.safetensors.index.json lists,
    of pytorch_model.bin or of pytorch_model.bin.index.json's shards (tensors only: a pickle
    that would build any other object, code included, is refused before it runs). ``strict``:
    a directory holding more than one of them is refused, naming them; else the first in that
    order is read. ``transform`` (name, tensor) -> {name: tensor}, applied to each tensor as it
    is read."""
    found = weight_sets(directory)
    if strict and len(found) > 1 and _copies_of_one_model(directory, found):
        strict = False  # e.g. a clone of a hub repo that publishes one model as .safetensors and .bin
    name = weight_set(directory, strict)
    if name is not None:
        path = directory / name
        if name.endswith(INDEX_SUFFIX):
            return read_sharded(path, transform)
        return read_weight_file(path, transform=transform)
    raise FileNotFoundError(
        f"no weights in {directory}: expected {SAFETENSORS}, {BIN} or a sharded checkpoint's index "
        f"({SAFETENSORS + INDEX_SUFFIX}, {BIN + INDEX_SUFFIX})"
    )


def _copies_of_one_model(directory: Path, names: list[str]) -> bool:
    """Whether the weight sets ``names`` of ``directory`` hold the same tensors, bit for bit (a
    tied lm_head.weight that safetensors leaves out is not a difference). Reads every set once:
    only a directory holding several sets pays it."""
    states = []
    for name in names:
        path = directory / name
        states.append(read_sharded(path) if name.endswith(INDEX_SUFFIX) else read_weight_file(path))
    first = states[0]
    for other in states[1:]:
        for key in first.keys() | other.keys():
            a, b = first.get(key), other.get(key)
            if a is None or b is None:
                if key == "lm_head.weight":
                    continue
                return False
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return False
    return True


def read_weight_file(path: Path, keys=None, transform=None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (by its suffix) or torch pickle, all or only ``keys``,
    each through ``transform`` (see read_weights) when given. A safetensors file is then opened
    once a tensor, so that the file's pages a tensor was read from leave memory with it (its
    memory map goes when no tensor refers to it)."""
    if path.suffix == ".safetensors":
        try:
            if keys is None and transform is None:
                return load_file(path)
            with safe_open(path, "pt") as f:
                stored = list(f.keys())
                present = frozenset(stored)
                wanted = stored if keys is None else [k for k in keys if k in present]
                if transform is None:
                    return {k: f.get_tensor(k) for k in wanted}
            state = {}
            for k in wanted:
                with safe_open(path, "pt") as f:
                    t = f.get_tensor(k)
                    out = transform(k, t)
                    # a tensor kept as read is a view of the map: a copy of its own lets the map go
                    state.update({name: v.clone() if v.data_ptr() == t.data_ptr() else v for name, v in out.items()})
                    del t, out
            return state
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{path} holds pickled objects other than tensors, which could run code when loaded; "
                f"refusing it. Load only files you trust, and convert them to {SAFETENSORS}. ({err})"
            ) from err
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{path} must hold a dict of named tensors (a state dict), got {type(state).__name__}")
    return state if transform is None else _transformed(state, transform)


def _transformed(state: dict, transform) -> dict[str, torch.Tensor]:
    out = {}
    for k in list(state):
        out.update(transform(k, state.pop(k)))  # each tensor dropped once transformed
    return out


def _pairs_refusing_duplicates(path: Path):
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"{path} names {key!r} twice; each tensor must be listed once")
            seen.add(key)
        return dict(pairs)

    return hook


def read_sharded(index_path: Path, transform=None) -> dict[str, torch.Tensor]:
    """The state dict of a sharded checkpoint: ``index_path`` holds {"weight_map": {tensor name:
    shard file name}}, as transformers writes it; each shard is a file beside the index. Every
    listed tensor must be in its shard, and a shard must hold no tensor the index does not give it."""
    try:
        raw = json.loads(index_path.read_text(), object_pairs_hook=_pairs_refusing_duplicates(index_path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{index_path} is not valid JSON: {err}") from err
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} must hold a non-empty 'weight_map' of tensor name -> shard file name")
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    state: dict[str, torch.Tensor] = {}
    for shard, keys in shards.items():
        # a file name beside the index, never a path elsewhere (the index is untrusted input)
        if Path(shard).name != shard or shard in (".", ".."):
            raise ValueError(f"{index_path} lists shard {shard!r}; expected a file name in {index_path.parent}")
        path = index_path.parent / shard
        if not path.is_file():
            raise FileNotFoundError(
                f"shard {shard} listed in {index_path} is missing (it holds {len(keys)} tensor(s), e.g. {keys[0]!r})"
            )
        safetensors = shard.endswith(".safetensors")
        if safetensors:
            with safe_open_checked(path) as f:
                stored = set(f.keys())
            part = read_weight_file(path, keys, transform)  # its listed tensors, transformed as read
        else:  # a pickle is read whole, then checked, then transformed
            part = read_weight_file(path)
            stored = set(part)
        absent = [k for k in keys if k not in stored]
        if absent:
            raise ValueError(f"{index_path} puts {absent} in {shard}, which does not hold them")
        extra = sorted(stored - set(keys))
        if extra:
            raise ValueError(f"{shard} holds {extra}, which {index_path} does not list in it")
        if not safetensors:
            part = {k: part[k] for k in keys}
            part = _transformed(part, transform) if transform else part
        state.update(part)
    return state


def safe_open_checked(path: Path):
    try:
        return safe_open(path, "pt")
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err


def load_state_dict_strict(model, state: dict) -> None:
    """Load ``state`` into ``model`` (built on the meta device), raising a ValueError that names
    every missing key, unexpected key and shape mismatch. A tied LM head may be absent."""
    expected = model.state_dict()
    tied = model.config.tie_embeddings
    missing = [k for k in expected if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
        for k in expected
        if k in state and state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches {mismatched}")
    if problems:
        raise ValueError("checkpoint does not match the model built from its config: " + "; ".join(problems))
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    # assign=True keeps the checkpoint's tensors (and dtypes) instead of copying into meta ones;
    # it makes new Parameter objects, so carry over their markers (e.g. _no_weight_decay).
    markers = {n: dict(vars(p)) for n, p in model.named_parameters()}
    model.load_state_dict(state, strict=False, assign=True)
    for n, p in model.named_parameters():
        for key, value in markers.get(n, {}).items():
            setattr(p, key, value)
    if tied and isinstance(model.lm_head, torch.nn.Linear):  # (a quantised head is read by the embedding)
        model.lm_head.weight = model.backbone.embedding.weight
    # every parameter and buffer (a quantised layer's) now holds checkpoint data; check nothing stayed on meta
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ValueError(f"checkpoint left parameters uninitialised: {left}")
