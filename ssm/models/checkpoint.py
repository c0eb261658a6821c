"""Saving and loading models from local directories, in mamba-ssm's and transformers' formats.

mamba-ssm:     config.json = MambaConfig fields; pytorch_model.bin; keys backbone.embedding.weight, ...
transformers:  config.json = hidden_size, state_size, num_hidden_layers, ... with model_type "mamba"
               (Mamba-1) or "mamba2"; model.safetensors or pytorch_model.bin; keys
               backbone.embeddings.weight, ...; lm_head.weight may be absent when tied.
Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from .config import MambaConfig

CONFIG, BIN, SAFETENSORS = "config.json", "pytorch_model.bin", "model.safetensors"


def save_pretrained(model, directory, safe_serialization: bool = False) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if safe_serialization:
        if model.config.tie_embeddings:
            state.pop("lm_head.weight", None)  # safetensors stores no shared tensors
        save_safetensors(state, directory / SAFETENSORS)
    else:
        torch.save(state, directory / BIN)


def from_pretrained(cls, directory, *, device=None, dtype=None, backend="auto"):
    directory = Path(directory)
    config_path = directory / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG} in {directory} (from_pretrained reads a local directory)")
    raw = json.loads(config_path.read_text())
    if "d_model" in raw:
        config, rename = MambaConfig.from_dict(raw), {}
    elif "hidden_size" in raw:
        config, rename = config_from_transformers(raw), {"backbone.embeddings.": "backbone.embedding."}
    else:
        raise ValueError(
            f"{config_path} is neither mamba-ssm's format (a 'd_model' field) nor transformers' "
            "(a 'hidden_size' field)"
        )

    if (directory / SAFETENSORS).is_file():
        state = load_safetensors(directory / SAFETENSORS)
    elif (directory / BIN).is_file():
        state = torch.load(directory / BIN, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no weights in {directory}: expected {SAFETENSORS} or {BIN}")
    for old, new in rename.items():
        state = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}

    model = cls(config, backend=backend, device="meta")
    load_state_dict_strict(model, state)
    return model.to(device=device, dtype=dtype)


def load_state_dict_strict(model, state: dict) -> None:
    """Load ``state`` into ``model`` (built on the meta device), raising a ValueError that names
    every missing key, unexpected key and shape mismatch. A tied LM head may be absent."""
    expected = model.state_dict()
    tied = model.config.tie_embeddings
    missing = [k for k in expected if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
        for k in expected if k in state and state[k].shape != expected[k].shape
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
    if tied:
        model.lm_head.weight = model.backbone.embedding.weight
    # Buffers-free model: every parameter now holds checkpoint data; check nothing stayed on meta.
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"checkpoint left parameters uninitialised: {left}")


def config_from_transformers(raw: dict) -> MambaConfig:
    """A MambaConfig from transformers' MambaConfig / Mamba2Config fields."""
    kind = raw.get("model_type", "mamba")

    def get(key, default=None):
        if key in raw:
            return raw[key]
        if default is None:
            raise ValueError(f"transformers config ({kind}) lacks the field {key!r}")
        return default

    d_model = get("hidden_size")
    if kind == "mamba":
        rank = raw.get("time_step_rank", "auto")
        ssm_cfg = dict(
            layer="Mamba1", d_state=get("state_size", 16), d_conv=get("conv_kernel", 4), expand=get("expand", 2),
            dt_rank=math.ceil(d_model / 16) if rank == "auto" else rank,
            conv_bias=get("use_conv_bias", True), bias=get("use_bias", False),
        )
    elif kind == "mamba2":
        limit = raw.get("time_step_limit", (0.0, float("inf")))
        ssm_cfg = dict(
            layer="Mamba2", d_state=get("state_size", 128), d_conv=get("conv_kernel", 4), expand=get("expand", 2),
            headdim=get("head_dim", 64), ngroups=get("n_groups", 1), chunk_size=get("chunk_size", 256),
            conv_bias=get("use_conv_bias", True), bias=get("use_bias", False), rmsnorm=get("rms_norm", True),
            dt_limit=tuple(float(v) for v in limit),
        )
        heads = raw.get("num_heads")
        if heads is not None and heads * ssm_cfg["headdim"] != ssm_cfg["expand"] * d_model:
            ssm_cfg["d_ssm"] = heads * ssm_cfg["headdim"]
    else:
        raise ValueError(f"transformers model_type {kind!r} is not supported; expected 'mamba' or 'mamba2'")
    return MambaConfig(
        d_model=d_model,
        n_layer=get("num_hidden_layers"),
        vocab_size=get("vocab_size"),
        ssm_cfg=ssm_cfg,
        rms_norm=True,
        residual_in_fp32=get("residual_in_fp32", True),
        pad_vocab_size_multiple=1,  # transformers' vocab_size is already the embedding size
        tie_embeddings=get("tie_word_embeddings", True),
    )


# safetensors: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets: [begin, end]}} (offsets relative to the end of the header), then the raw bytes.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def load_safetensors(path) -> dict[str, torch.Tensor]:
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(info["shape"])
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path) -> None:
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data to 8 bytes, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for chunk in chunks:
            f.write(chunk)
