"""The checks of the Mamba mixers' constructor arguments, shared by the mixers (each checks its
own in its constructor, before it builds a parameter) and by ``MambaConfig`` (which checks a
config's ``ssm_cfg`` when it is made, without building a layer: ``check_mixer_arguments``).

A size the kernels index or loop by must be at least 1 (a convolution of width 0 made the C
backward divide by zero; a state of size 0 overran the C sweeps' scratch). Every error is a
``ValueError`` naming the mixer, the argument, what it must be and what it was.
"""

from __future__ import annotations

import inspect
import math

# constructor arguments that are not options of a config (the model supplies them)
_NOT_OPTIONS = ("self", "d_model", "layer_idx", "device", "dtype")


def check_int(owner: str, name: str, value, minimum: int = 1, what: str = "") -> int:
    """``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}{what}, got {value!r}")
    return value


def check_number(owner: str, name: str, value, minimum: float = 0.0, strict: bool = True, what: str = "") -> float:
    """``value`` is a finite real number > ``minimum`` (>= with ``strict=False``)."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (value <= minimum if strict else value < minimum):
        raise ValueError(
            f"{owner}: {name} must be a finite number {'>' if strict else '>='} {minimum}{what}, got {value!r}"
        )
    return float(value)


def check_dt_range(owner: str, dt_min, dt_max, dt_init_floor) -> None:
    """The range Δ is initialised in: 0 < dt_min <= dt_max (log-uniform between them), floor >= 0."""
    check_number(owner, "dt_min", dt_min)
    check_number(owner, "dt_max", dt_max)
    if dt_min > dt_max:
        raise ValueError(f"{owner}: dt_min must be <= dt_max, got dt_min = {dt_min!r} > dt_max = {dt_max!r}")
    check_number(owner, "dt_init_floor", dt_init_floor, strict=False)


def check_divides(owner: str, name: str, value: int, whole_name: str, whole: int) -> None:
    """``value`` divides ``whole`` (both checked >= 1 before)."""
    if whole % value:
        raise ValueError(f"{owner}: {name} = {value} must divide {whole_name} = {whole}")


def mixer_options(cls) -> list[str]:
    """The constructor arguments of mixer ``cls`` that a config's ``ssm_cfg`` may set."""
    return [p for p in inspect.signature(cls).parameters if p not in _NOT_OPTIONS]


def check_mixer_arguments(cls, d_model: int, options: dict) -> None:
    """What ``cls(d_model, **options)`` would check of its arguments, without building it: the
    options bound to its constructor's signature (its defaults filled in) and handed to the
    class's ``check_arguments``. An option the constructor does not take is refused by name."""
    valid = mixer_options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown ssm_cfg key(s) {unknown} for {cls.__name__}; valid keys: {['layer', *valid]}")
    bound = inspect.signature(cls).bind_partial(d_model, **options)
    bound.apply_defaults()
    arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", "layer_idx", "device", "dtype")}
    cls.check_arguments(**arguments)
