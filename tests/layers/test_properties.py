"""Property-based tests of the Mamba mixers (hypothesis): drawn constructor arguments (sizes of 0
and sizes that do not divide included), dtypes, strides, packings and non-finite inputs, on every
scan backend that runs on the CPU (Triton in its interpreter, at small sizes). A drawn layer is
refused with a ValueError naming the argument made invalid, by the layer and by a MambaConfig
holding it; a valid one gives, forward and in the input's gradient, what the same layer gives in
float64 on the "ref" backend, and a NaN or ±inf in one token changes no output before it nor
in another sequence (tests/properties.py).

Settings: the "ci" profile (fixed seed, bounded) or "long" (SSM_HYPOTHESIS_PROFILE=long), see
tests/conftest.py.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ssm import MambaConfig
from ssm.layers import Mamba, Mamba2, Mamba3
from ssm.scan import backends
from tests.properties import Case, causal, matches_reference, strided

CPU = torch.device("cpu")
SCAN = {Mamba: "selective_scan", Mamba2: "ssd", Mamba3: "trapezoidal_scan"}
NAME = {Mamba: "Mamba1", Mamba2: "Mamba2", Mamba3: "Mamba3"}
FEWER = settings(max_examples=max(settings().max_examples // 4, 5))  # Triton's interpreter: slow
# the interpreter computes in numpy, which warns at each NaN it makes: the planted ones make them
QUIET = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0] or [1]


@st.composite
def arguments(draw, cls):
    """(d_model, the constructor's options, the option a ValueError must name or None): about
    one draw in five has one option made invalid."""
    d_model = draw(st.integers(2, 8))
    # (Mamba-3 rotates d_state / 4 state pairs: at least 4)
    options = {"d_state": draw(st.integers(2, 4)) * 2 if cls is Mamba3 else draw(st.integers(1, 4))}
    if cls is Mamba:
        options |= {"d_conv": draw(st.integers(1, 4)), "expand": draw(st.integers(1, 2))}
        options["dt_rank"] = draw(st.sampled_from(["auto", 1, 2]))
        bad = {"d_state": 0, "d_conv": 0, "expand": 0, "dt_rank": 0}
    else:
        expand = draw(st.integers(1, 2))
        inner = expand * d_model
        headdim = draw(st.sampled_from(divisors(inner)))
        ngroups = draw(st.sampled_from(divisors(inner // headdim)))
        options |= {"expand": expand, "headdim": headdim, "ngroups": ngroups, "chunk_size": draw(st.integers(1, 6))}
        bad = {"d_state": 0, "headdim": 0, "ngroups": inner // headdim + 1, "expand": 0, "chunk_size": 0}
        if cls is Mamba2:
            options["d_conv"] = draw(st.integers(1, 4))
            bad["d_conv"] = 0
        else:
            mimo = draw(st.booleans())
            options |= {"is_mimo": mimo, "mimo_rank": draw(st.integers(1, 2)), "is_outproj_norm": draw(st.booleans())}
            bad["headdim"] = inner + 1
    if draw(st.sampled_from([False] * 4 + [True])):
        name = draw(st.sampled_from(sorted(bad)))
        return d_model, options | {name: bad[name]}, name
    return d_model, options, None


@st.composite
def packing(draw, small: bool):
    top = 5 if small else 10
    if draw(st.booleans()):
        lengths = draw(st.lists(st.sampled_from(list(range(1, top + 1)) * 2 + [0]), min_size=1, max_size=3))
        bounds = tuple([0, *torch.tensor(lengths).cumsum(0).tolist()])
        return 1, bounds[-1], bounds
    return draw(st.integers(1, 2)), draw(st.integers(1, top + 3)), None


def refused_everywhere(cls, d_model: int, options: dict, name: str) -> None:
    """The layer and a MambaConfig holding its options both refuse them, naming ``name``."""
    for build in (
        lambda: cls(d_model, **options),
        lambda: MambaConfig(d_model=d_model, ssm_cfg={"layer": NAME[cls], **options}),
    ):
        with pytest.raises(ValueError) as err:
            build()
        assert re.search(rf"(^|\W){name}(\W|$)", str(err.value)), f"the error should name {name!r}: {err.value}"


def check_layer(data, cls, backend: str) -> None:
    draw = data.draw
    small = backend == "triton"
    d_model, options, invalid = draw(arguments(cls))
    event(f"{backend}, {'refused' if invalid else 'built'}")
    if invalid is not None:
        refused_everywhere(cls, d_model, options, invalid)
        return
    torch.manual_seed(draw(st.integers(0, 3)))
    layer = cls(d_model, backend=backend, **options)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    layers = {torch.float32: layer.float(), torch.float64: copy.deepcopy(layer).double()}
    batch, L, bounds = draw(packing(small))
    cu = None if bounds is None else torch.tensor(bounds)
    hidden = torch.randn(batch, L, d_model, dtype=dtype, generator=torch.Generator().manual_seed(1))
    inputs = {"hidden": strided(hidden.requires_grad_()) if draw(st.booleans()) else hidden.requires_grad_()}

    def call(x, b):
        mixer = layers[x["hidden"].dtype]
        mixer.backend = b
        return (mixer(x["hidden"], cu_seqlens=cu),)

    case = Case(inputs, call, {"hidden": 1}, 1, dtype, bounds, info={"L": L})
    event(f"{dtype}, {'packed' if bounds else 'rows'}")
    matches_reference(case, backend)
    if L:
        t, row, value = (
            draw(st.integers(0, L - 1)),
            draw(st.integers(0, batch - 1)),
            draw(st.sampled_from([math.nan, math.inf, -math.inf])),
        )
        causal(case, backend, "hidden", row, t, value)


def layer_backends(cls, triton: bool) -> list[str]:
    found = [b for b in backends(SCAN[cls], CPU) if b not in ("ref", "auto")]
    return [b for b in found if (b == "triton") == triton]


@pytest.mark.parametrize("cls", [Mamba, Mamba2, Mamba3])
@given(data=st.data())
def test_mixer(cls, data):
    check_layer(data, cls, data.draw(st.sampled_from(layer_backends(cls, False))))


@pytest.mark.parametrize("cls", [c for c in (Mamba, Mamba3) if layer_backends(c, True)])
@QUIET
@FEWER
@given(data=st.data())
def test_mixer_triton(cls, data):
    check_layer(data, cls, "triton")
