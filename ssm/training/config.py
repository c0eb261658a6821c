"""Training configuration: YAML files mapped onto typed dataclasses, with dotted overrides.

A config file holds any of the sections ``model``, ``data``, ``optim``, ``trainer`` and the
top-level keys below. ``model`` takes the fields of ssm.models.MambaConfig (their names, types
and defaults, read from that dataclass) plus ``backend``; ``model.vocab_size`` left unset is the
task's vocabulary. ``base: other.yaml`` (relative to the file) starts from another file, so
an experiment file holds only what it changes. Overrides on the command line are dotted keys,
``trainer.max_steps=500``, parsed by the type of the field they set. An unknown key or a value
of the wrong type raises ``ConfigError`` naming the key and listing the valid ones; so does a
value outside its range (``check_config``: each key's range is in ``RANGES`` below).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from ..models import MambaConfig
from ..scan import backends as scan_backends


class ConfigError(ValueError):
    """A config key that does not exist, a value of the wrong type or out of its range, or a
    combination that cannot run; one line, naming the key."""


def _model_section() -> type:
    """The ``model`` section: every field of ssm.models.MambaConfig, by name and type, plus the
    scan ``backend``. Derived from the dataclass, so that a field added there is a key here and
    no field is restated. Defaults are MambaConfig's, except ``vocab_size``: None means the
    task's vocabulary. configs/default.yaml sets the small model the runs use."""
    hints = typing.get_type_hints(MambaConfig)
    fields = []
    for f in dataclasses.fields(MambaConfig):
        kind, default = hints[f.name], field(default=f.default, default_factory=f.default_factory)
        if f.name == "vocab_size":
            kind, default = int | None, field(default=None)
        fields.append((f.name, kind, default))
    fields.append(("backend", str, field(default="auto")))  # scan backend of every mixer (ssm.scan.backends)

    def mamba_config(self, vocab_size: int) -> MambaConfig:
        """The MambaConfig of this section; ``vocab_size`` is the task's vocabulary, used when
        the section leaves it unset."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(MambaConfig)}
        if values["vocab_size"] is None:
            values["vocab_size"] = vocab_size
        elif values["vocab_size"] < vocab_size:
            raise ConfigError(
                f"model.vocab_size = {values['vocab_size']} is smaller than the task's vocabulary ({vocab_size})"
            )
        try:
            return MambaConfig(**copy.deepcopy(values))
        except ValueError as err:
            raise ConfigError(f"model: {err}") from err

    return dataclasses.make_dataclass(
        "ModelSection",
        fields,
        namespace={"mamba_config": mamba_config, "__doc__": _model_section.__doc__, "__module__": __name__},
    )


ModelSection = _model_section()


TASKS = ("selective_copying", "induction_heads", "parity", "modular_arithmetic", "text")


@dataclass
class DataSection:
    task: str = "selective_copying"  # selective_copying | induction_heads | parity | modular_arithmetic | text
    seq_len: int = 64  # context length L (synthetic tasks) or window length in bytes (text)
    # parity and modular_arithmetic, training only: each optimiser step's length drawn uniformly
    # from [min_seq_len, seq_len] (the same for every sequence of the step); 0: every step at seq_len
    min_seq_len: int = 0
    # with min_seq_len: a length curriculum, the drawn maximum max_len_from at step 0 growing
    # linearly to seq_len at step max_len_steps (the Mamba-3 paper's: 40 to 160); 0: seq_len throughout
    max_len_from: int = 0
    max_len_steps: int = 0
    val_seq_len: int = 0  # validation length; 0: seq_len (state tracking: trained short, validated long)
    brackets: bool = False  # modular_arithmetic: expressions with brackets (else without)
    batch_size: int = 32  # sequences per device per step
    num_tokens: int = 8  # size of the data alphabet (synthetic tasks)
    num_memorize: int = 8  # K: tokens to copy (selective_copying)
    val_samples: int = 512  # validation sequences
    # induction_heads, training split only: the share of sequences whose first trigger is drawn
    # among the last short_gap_window positions (key at most that many tokens before the final
    # trigger) instead of uniformly. A long training length shows that short case once in L - 2
    # sequences; this keeps it in view. Validation and test sequences are always drawn uniformly,
    # as the paper's.
    short_gap_prob: float = 0.0
    short_gap_window: int = 16
    paths: list = field(default_factory=list)  # text: file globs; empty = the Python standard library's sources
    val_fraction: float = 0.1  # text: share of files held out for validation
    # text: each file is a document; a row holding several restarts the model at each document
    # start (packed sequences, cu_seqlens) and never scores a document's first byte as the next
    # byte of the one before. false: the files joined by blank lines, read as one stream.
    pack_documents: bool = True
    # text: truncated back-propagation through time. Each batch row reads its own stream of the
    # corpus, one seq_len segment per step, and the model carries every layer's state (SSM state
    # and conv window) from one step to the next, detached. One device (trainer.devices=1).
    stateful: bool = False
    # text: what a token is. bytes (vocabulary 256); a path to a tokenizer.json (the tokenizers
    # library's format, as pretrained models ship it); or bpe:SIZE, a byte-level BPE of SIZE ids
    # trained on the training split at the start of the run. The run saves it beside the weights
    # (model/tokenizer.json), where generate.py and evaluate.py find it.
    tokenizer: str = "bytes"
    num_workers: int = 0  # DataLoader workers


@dataclass
class OptimSection:
    lr: float = 3e-3  # peak learning rate of AdamW
    weight_decay: float = 0.1  # not applied to A_log, D, the Δ bias, norms and biases
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 100  # linear warmup, then cosine decay to min_lr_ratio·lr at max_steps
    min_lr_ratio: float = 0.1
    # the last decay_steps steps of the run (trainer.max_steps) take the rate linearly to 0; with
    # min_lr_ratio 1, warmup-stable-decay. A curriculum's last stage can anneal this way.
    decay_steps: int = 0


@dataclass
class TrainerSection:
    """Passed to pytorch_lightning.Trainer."""

    max_steps: int = 2000
    accelerator: str = "auto"  # auto | cpu | gpu | ...
    devices: int | str | list = "auto"  # e.g. 2 with strategy=ddp
    strategy: str = "auto"  # auto | ddp | fsdp (sharded: ssm/training/sharding.py) | Lightning's others
    num_nodes: int = 1
    precision: str | None = None  # None: bf16-mixed on CUDA, 32-true elsewhere
    gradient_clip_val: float | None = 1.0  # None or 0: no clipping
    val_check_interval: int = 200  # training steps between validations
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1
    limit_val_batches: int | float | None = None  # None: all; an int: batches; a float: a share
    deterministic: bool = False
    # processes that share each sequence (context parallelism, ssm.distributed; not passed to the
    # Trainer): the processes form groups of this many consecutive ranks, each group splitting
    # every sequence of the same batch along its length; the groups run data parallel. 1: none.
    context_parallel: int = 1


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    seed: int = 0
    run_dir: str | None = None  # None: a new timestamped folder under runs/
    resume: str | None = None  # a checkpoint, or a run dir (its checkpoints/last.ckpt)
    checkpoint_every: int = 200  # training steps between checkpoints/last.ckpt
    # training steps between checkpoints kept for good, checkpoints/step-NNNNNNN.ckpt (every one
    # of them, none replaced: to evaluate the run at several points of its training); 0: none
    keep_checkpoint_every: int = 0
    log_every: int = 50  # steps between log lines when not on a terminal
    progress_bar: bool | None = None  # None: a bar on a terminal, log lines otherwise
    # the weights model/ gets at the end: "last" (the final step's) or "best" (checkpoints/best.ckpt's,
    # the lowest validation loss of the run's validations: early stopping chosen on the validation split)
    export: str = "last"


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The config of ``path`` (or the defaults) with ``overrides`` ("a.b=value") applied."""
    raw = _load_yaml(Path(path)) if path is not None else {}
    config = from_dict(TrainConfig, raw, "")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. trainer.max_steps=100")
        set_key(config, key.strip(), value)
    check_config(config)
    return config


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, but for numbers in exponent form without a dot (``1e-6``, ``3E4``),
    which PyYAML (YAML 1.1) reads as strings and YAML 1.2 as floats: so ``dt_min: 1e-6`` in a
    free-keyed section such as model.ssm_cfg, or ``model.ssm_cfg.dt_min=1e-6`` on the command
    line, is the number it looks like."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str):
    """``text`` parsed as the config files are (see _Loader)."""
    return yaml.load(text, Loader=_Loader)


def _load_yaml(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"config files include each other in a loop: {[str(p) for p in seen]}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    return _merge(_load_yaml(path.parent / base, seen + (path.resolve(),)), raw)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "ssm_cfg":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def from_dict(cls, raw: dict, prefix: str):
    """Build dataclass ``cls`` from ``raw``, checking every key and type."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix + unknown[0]!r} in {where}; valid keys: {names}")
    values = {}
    for name, value in raw.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = from_dict(kind, value, f"{prefix}{name}.")
        else:
            values[name] = coerce(value, kind, f"{prefix}{name}")
    return cls(**values)


def set_key(config, key: str, text: str) -> None:
    """Apply one dotted override; ``text`` is parsed by the type of the field it sets."""
    parts, obj, path = key.split("."), config, ""
    for i, part in enumerate(parts):
        if isinstance(obj, dict):  # inside a dict-valued field such as model.ssm_cfg: free keys
            rest = ".".join(parts[i:])
            obj[rest] = _parse_yaml_scalar(text)
            return
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            where = path.rstrip(".") or "the top level"
            raise ConfigError(f"unknown key {path + part!r} in {where}; valid keys: {names}")
        kind = _hints(type(obj))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(kind):
                raise ConfigError(
                    f"{path + part!r} is a section; set one of its keys, "
                    f"e.g. {path + part}.{dataclasses.fields(kind)[0].name}=..."
                )
            setattr(obj, part, coerce(text, kind, path + part, from_text=True))
            return
        obj, path = getattr(obj, part), path + part + "."
        if not (dataclasses.is_dataclass(obj) or isinstance(obj, dict)):
            raise ConfigError(f"{path.rstrip('.')!r} is a {type(obj).__name__} value, not a section")


def _parse_yaml_scalar(text: str):
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text


_NONE_WORDS = {"none", "null", "~"}
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def coerce(value: Any, kind, key: str, from_text: bool = False):
    """``value`` as type ``kind``; ``from_text`` when it is a command-line string."""
    origin = typing.get_origin(kind)
    if origin in (Union, types.UnionType):
        options = typing.get_args(kind)
        if type(None) in options and (value is None or (from_text and str(value).lower() in _NONE_WORDS)):
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(value, option, key, from_text)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{key} must be {_type_name(kind)}, got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in _BOOL_WORDS:
            return _BOOL_WORDS[str(value).lower()]
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind in (list, dict) or origin in (list, dict):
        base = origin or kind
        if from_text and isinstance(value, str):
            value = _parse_yaml_scalar(value)
        if isinstance(value, base):
            return value
    raise ConfigError(f"{key} must be {_type_name(kind)}, got {value!r}")


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (Union, types.UnionType):
        return " or ".join(_type_name(k) for k in typing.get_args(kind))
    return {type(None): "null"}.get(kind, getattr(kind, "__name__", str(kind)))


# ----------------------------------------------------------------------------- ranges


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_from(low: int) -> tuple:
    return (lambda v: _is_int(v) and v >= low), f"an int >= {low}"


def _number(test, text: str) -> tuple:
    return (lambda v: _is_number(v) and test(v)), text


def _tokenizer_spec(v) -> bool:
    if not isinstance(v, str) or not v:
        return False
    if v.startswith("bpe:"):
        return v[4:].isdigit() and int(v[4:]) >= 257
    return True  # "bytes", or a path to a tokenizer.json (read when the run starts)


# The range of every key that has one, as (test, what is expected). Types are coerce's; these are
# the values that would train at a meaningless setting (a negative rate, a schedule started
# part-way, no checkpoint ever written) or fail deep inside Lightning or torch. trainer.accelerator,
# devices, strategy and precision are Lightning's to check (train() reports its refusal in one line).
RANGES: dict[str, tuple] = {
    "seed": ((lambda v: _is_int(v) and 0 <= v < 2**32), "an int in [0, 2**32)"),
    # 0 would write no checkpoints/last.ckpt at all, and a kill would lose every step
    "checkpoint_every": _int_from(1),
    "keep_checkpoint_every": ((lambda v: _is_int(v) and v >= 0), "an int >= 0 (0: keep no step checkpoints)"),
    "log_every": _int_from(1),
    "export": ((lambda v: v in ("last", "best")), '"last" or "best"'),
    "data.task": ((lambda v: v in TASKS), f"one of {list(TASKS)}"),
    "data.seq_len": _int_from(1),
    "data.min_seq_len": ((lambda v: _is_int(v) and v >= 0), "an int >= 0 (0: every step at data.seq_len)"),
    "data.val_seq_len": ((lambda v: _is_int(v) and v >= 0), "an int >= 0 (0: data.seq_len)"),
    "data.max_len_from": ((lambda v: _is_int(v) and v >= 0), "an int >= 0 (0: no length curriculum)"),
    "data.max_len_steps": ((lambda v: _is_int(v) and v >= 0), "an int >= 0"),
    "data.batch_size": _int_from(1),
    "data.num_tokens": _int_from(1),
    "data.num_memorize": _int_from(1),
    "data.val_samples": _int_from(1),
    "data.short_gap_prob": _number(lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "data.short_gap_window": _int_from(1),
    "data.paths": ((lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v)), "a list of file globs"),
    "data.val_fraction": _number(lambda v: 0 < v < 1, "a number in (0, 1), the share of files held out"),
    "data.tokenizer": (_tokenizer_spec, "'bytes', 'bpe:SIZE' with SIZE >= 257, or a path to a tokenizer.json"),
    "data.num_workers": _int_from(0),
    "optim.lr": _number(lambda v: v > 0, "a finite number > 0"),
    "optim.weight_decay": _number(lambda v: v >= 0, "a finite number >= 0"),
    "optim.betas": (
        (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v)),
        "a list of two numbers in [0, 1), e.g. [0.9, 0.95]",
    ),
    "optim.eps": _number(lambda v: v > 0, "a finite number > 0"),
    "optim.warmup_steps": _int_from(0),
    "optim.min_lr_ratio": _number(lambda v: 0 <= v <= 1, "a number in [0, 1] (the final rate over the peak)"),
    "optim.decay_steps": ((lambda v: _is_int(v) and v >= 0), "an int >= 0 (0: no final decay)"),
    # Lightning's -1 (no limit, epochs decide) does not apply: the tasks are streams without epochs
    "trainer.max_steps": ((lambda v: _is_int(v) and v >= 1), "an int >= 1 (the tasks have no epochs to end a run)"),
    "trainer.num_nodes": _int_from(1),
    "trainer.gradient_clip_val": ((lambda v: v is None or _is_number(v) and v >= 0), "null or a number >= 0"),
    "trainer.val_check_interval": _int_from(1),
    "trainer.log_every_n_steps": _int_from(1),
    "trainer.accumulate_grad_batches": _int_from(1),
    "trainer.context_parallel": _int_from(1),
    # 0 would validate nothing, and best.ckpt and the final metrics need a validation
    "trainer.limit_val_batches": (
        (lambda v: v is None or _is_int(v) and v >= 1 or isinstance(v, float) and 0 < v <= 1),
        "null (all), an int >= 1 (batches) or a number in (0, 1] (a share)",
    ),
}
# The scan op of each mixer, whose backends model.backend names (ssm.scan.backends).
SCAN_OF_LAYER = {"Mamba1": "selective_scan", "Mamba2": "ssd", "Mamba3": "trapezoidal_scan"}


def get_key(config, key: str):
    """The value of dotted ``key`` in ``config``."""
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_config(config: TrainConfig, run: bool = False) -> None:
    """Raise ConfigError (one line: the key, what it must be, what it is) for the first value
    out of its range (RANGES) or a scan backend the model's mixer does not have; with ``run``
    (the config a run starts with, every override given), also a decay longer than the run."""
    for key, (ok, expected) in RANGES.items():
        value = get_key(config, key)
        if not ok(value):
            raise ConfigError(f"{key} must be {expected}, got {value!r}")
    _check_backend(config.model)
    t = config.trainer
    if t.context_parallel > 1 and _is_int(t.devices) and (t.devices * t.num_nodes) % t.context_parallel:
        raise ConfigError(
            f"trainer.context_parallel = {t.context_parallel} must divide the number of processes, "
            f"trainer.devices × trainer.num_nodes = {t.devices * t.num_nodes}"
        )
    if t.context_parallel > 1 and config.data.stateful:
        raise ConfigError(
            f"trainer.context_parallel = {t.context_parallel} does not combine with data.stateful (which carries "
            "each row's state on one device)"
        )
    if config.export == "best" and t.strategy == "fsdp":
        raise ConfigError('export = "best" does not combine with trainer.strategy = fsdp (its checkpoints are sharded)')
    if run and config.optim.decay_steps > config.trainer.max_steps:
        raise ConfigError(
            f"optim.decay_steps must be <= trainer.max_steps = {config.trainer.max_steps} (the decay is the "
            f"run's last steps), got {config.optim.decay_steps}"
        )


def _check_backend(model) -> None:
    ssm_cfg = model.ssm_cfg if isinstance(model.ssm_cfg, dict) else {}
    key = "model.ssm_cfg.backend" if "backend" in ssm_cfg else "model.backend"
    backend, op = ssm_cfg.get("backend", model.backend), SCAN_OF_LAYER.get(ssm_cfg.get("layer", "Mamba1"))
    if op is None:  # an unknown mixer: MambaConfig names it when the model is built
        return
    valid = ["auto", *scan_backends(op)]
    if backend not in valid:
        raise ConfigError(
            f"{key} must be one of {valid} (the backends of {op}, the scan of {ssm_cfg.get('layer', 'Mamba1')} "
            f"layers), got {backend!r}"
        )


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def save_config(config: TrainConfig, path: Path) -> None:
    """``config`` as YAML at ``path``, written beside it and renamed over it (never half a file)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
