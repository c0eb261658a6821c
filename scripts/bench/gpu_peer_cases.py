"""The pairs that ``--op gpu-peers`` (gpu_peers.py) times: ssm and mamba-ssm on the same inputs
or the same weights, each built by one function below from a shape and a dtype.

A pair is a ``Pair``: the two sides as functions of one argument ``train`` (False: a forward
without autograd; True: forward and backward), what to compare (``check``: the peer's outputs
and gradients against ssm's) and how to read a time (``tokens``: a training step's tokens, for
tokens/s). A kernel pair takes one set of ``leaves`` (the tensors both sides derive their
inputs from) and a mapping per side, so that the gradients compared are those of the same
tensors: the mapping is the claim each case makes about the peer's arguments, and the check
tests it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MAMBA3_MAPPING = (
    "mamba3_siso_combined(Q=C, K=B, V=x, ADT=A·Δ, DT=Δ, Trap=λ before its sigmoid, Q_bias=C_bias, "
    "K_bias=B_bias, Angles=θ before π·tanh, D, Z=z), as mamba3_siso_fwd.py reads them (it applies the "
    "sigmoid and π·tanh itself; interleaved rotary pairs)"
)


@dataclass
class Pair:
    ssm: Callable[[bool], object]
    peer: Callable[[bool], object]
    check: Callable[[], dict]  # {"agree": bool, "diff": {name: relative difference}, ...}
    tokens: int | None = None  # a training step's tokens: the row's unit is tokens/s
    passes: tuple[bool, ...] = (False, True)  # which of forward (False) / forward+backward (True) to time
    notes: list[str] = field(default_factory=list)


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    """max|x - reference| / max|reference|, in float32."""
    x, reference = x.detach().float(), reference.detach().float()
    return ((x - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def relative_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    """‖x - reference‖ / ‖reference‖, in float32: a whole model's tensors under autocast differ
    in a few elements by more than their norm does."""
    x, reference = x.detach().float(), reference.detach().float()
    return (torch.linalg.vector_norm(x - reference) / torch.linalg.vector_norm(reference).clamp(min=1e-30)).item()


def verdict(diff: dict[str, float], tolerance: float) -> dict:
    worst = max(diff, key=lambda k: diff[k] if math.isfinite(diff[k]) else math.inf)
    ok = all(math.isfinite(d) and d <= tolerance for d in diff.values())
    rounded = {k: float(f"{v:.3g}") for k, v in diff.items()}
    return {"agree": ok, "diff": rounded, "worst": worst, "tolerance": tolerance}


def kernel_pair(leaves: dict, ssm_fn, ssm_args, peer_fn, peer_args, tolerance: float, seed: int = 0) -> Pair:
    """Both sides timed on their own inputs (``*_args(leaves)``, made once); the check runs
    the mappings under autograd and compares the outputs and every leaf's gradient."""
    with torch.no_grad():
        inputs = {"ssm": ssm_args(leaves), "peer": peer_args(leaves)}
        out = ssm_fn(*inputs["ssm"])
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(out.device)
    trainable = {side: [a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
                 for side, args in inputs.items()}  # fmt: skip

    def side(fn, name):
        def run(train: bool):
            if not train:
                with torch.no_grad():
                    return fn(*inputs[name])
            args = trainable[name]
            y = fn(*args)
            return torch.autograd.grad(y, [a for a in args if torch.is_tensor(a) and a.requires_grad], dout.to(y.dtype))

        return run

    def check() -> dict:
        grads = {}
        for name, fn, mapping in (("ssm", ssm_fn, ssm_args), ("peer", peer_fn, peer_args)):
            own = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in leaves.items()}
            y = fn(*mapping(own))
            wanted = [v for v in own.values() if v.requires_grad]
            grads[name] = (y, torch.autograd.grad(y, wanted, dout.to(y.dtype), allow_unused=True))
        names = [k for k, v in leaves.items() if v.is_floating_point()]
        diff = {"out": relative(grads["ssm"][0], grads["peer"][0])}
        for k, a, b in zip(names, grads["ssm"][1], grads["peer"][1]):
            if a is not None and b is not None:
                diff[f"d{k}"] = relative(a, b)
        return verdict(diff, tolerance)

    return Pair(side(ssm_fn, "ssm"), side(peer_fn, "peer"), check)


def randn(g, *shape, scale=1.0, device, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- kernels


def selective(peer, shape: dict, dtype, device, tolerance) -> Pair:
    """ssm.scan.selective_scan(backend="triton") against selective_scan_fn: time-varying B, C,
    z, D, Δ bias and softplus, as mamba-ssm's own benchmark runs it."""
    from ssm.scan import selective_scan

    b, d, n, L = shape["batch"], shape["dim"], shape["N"], shape["L"]
    g = torch.Generator().manual_seed(0)
    leaves = {
        "u": randn(g, b, d, L, device=device, dtype=dtype),
        "delta": randn(g, b, d, L, scale=0.5, device=device, dtype=dtype),
        "A": -torch.arange(1, n + 1, dtype=torch.float32).repeat(d, 1).to(device),
        "B": randn(g, b, n, L, device=device, dtype=dtype),
        "C": randn(g, b, n, L, device=device, dtype=dtype),
        "D": randn(g, d, device=device),
        "z": randn(g, b, d, L, device=device, dtype=dtype),
        "delta_bias": (torch.rand(d, generator=g) * 4 - 5).to(device),  # softplus: Δ from 0.007 to 0.3
    }
    order = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")

    def args(leaves):
        return tuple(leaves[k] for k in order)

    def ours(*a):
        return selective_scan(*a, delta_softplus=True, backend="triton")

    def theirs(*a):
        return peer.selective.selective_scan_fn(*a, delta_softplus=True)

    return kernel_pair(leaves, ours, args, theirs, args, tolerance)


def ssd_inputs(shape: dict, dtype, device) -> dict:
    """Mamba-2's scan inputs at a layer's scales: Δ bias as its initialisation draws it
    (softplus(bias) from 0.001 to 0.1), A = −(1 .. 16), one group of B and C."""
    b, L, h, p, n = shape["batch"], shape["L"], shape["heads"], shape["P"], shape["N"]
    g = torch.Generator().manual_seed(0)
    dt0 = torch.exp(torch.rand(h, generator=g) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    return {
        "x": randn(g, b, L, h, p, device=device, dtype=dtype),
        "dt": randn(g, b, L, h, scale=0.5, device=device, dtype=dtype),
        "A": -(torch.rand(h, generator=g) * 15 + 1).to(device),
        "B": randn(g, b, L, 1, n, device=device, dtype=dtype),
        "C": randn(g, b, L, 1, n, device=device, dtype=dtype),
        "D": torch.ones(h, device=device),
        "z": randn(g, b, L, h, p, device=device, dtype=dtype),
        "dt_bias": (dt0 + torch.log(-torch.expm1(-dt0))).to(device),  # softplus^-1(dt0)
    }


def ssd(peer, shape: dict, dtype, device, tolerance) -> Pair:
    """ssm.scan.ssd(backend="triton") against mamba_chunk_scan_combined, the same chunk length
    (Mamba-2's 256; the dry run's 16), z, D, Δ bias and softplus."""
    from ssm.scan import ssd as ssm_ssd

    chunk = shape["chunk"]

    def args(leaves):
        return tuple(leaves[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))

    def ours(x, dt, A, B, C, D, z, bias):
        return ssm_ssd(x, dt, A, B, C, D, z, dt_bias=bias, dt_softplus=True, chunk_size=chunk, backend="triton")

    def theirs(x, dt, A, B, C, D, z, bias):
        combined = peer.ssd.mamba_chunk_scan_combined
        return combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=bias, dt_softplus=True)

    return kernel_pair(ssd_inputs(shape, dtype, device), ours, args, theirs, args, tolerance)


def mamba3(peer, shape: dict, dtype, device, tolerance) -> Pair:
    """ssm.scan.trapezoidal_scan(backend="auto": "triton-ssd" on CUDA for rank 1, the SSD kernels'
    chunk-parallel form) against mamba3_siso_combined (MAMBA3_MAPPING),
    one group of B and C, M = N/4 rotary pairs (mamba-ssm's Mamba3: rope_fraction 0.5), chunk 64.
    Δ, A and the rates are float32, as mamba-ssm's Mamba3 hands them over."""
    from ssm.scan import trapezoidal_scan

    b, L, h, p, n = shape["batch"], shape["L"], shape["heads"], shape["P"], shape["N"]
    m, chunk = n // 4, shape["chunk"]
    g = torch.Generator().manual_seed(0)
    leaves = {
        "x": randn(g, b, L, h, p, device=device, dtype=dtype),
        "dt": F.softplus(randn(g, b, L, h, scale=0.5, device=device) - 3),
        "A": -F.softplus(randn(g, b, L, h, device=device)).clamp(min=1e-4),
        "B": randn(g, b, L, 1, n, device=device, dtype=dtype),
        "C": randn(g, b, L, 1, n, device=device, dtype=dtype),
        "trap": randn(g, b, L, h, device=device, dtype=dtype),  # before the sigmoid
        "angles": randn(g, b, L, h, m, device=device),  # before π·tanh
        "D": torch.ones(h, device=device),
        "z": randn(g, b, L, h, p, device=device, dtype=dtype),
        "B_bias": 1 + randn(g, h, n, scale=0.1, device=device),
        "C_bias": 1 + randn(g, h, n, scale=0.1, device=device),
    }

    def ours_args(v):
        theta = math.pi * torch.tanh(v["angles"])
        return (v["x"], v["dt"], v["A"], v["B"], v["C"], torch.sigmoid(v["trap"]), theta, v["D"], v["z"],
                v["B_bias"], v["C_bias"])  # fmt: skip

    def ours(x, dt, A, B, C, trap, theta, D, z, B_bias, C_bias):
        return trapezoidal_scan(
            x, dt, A, B, C, trap, theta, D, z, B_bias=B_bias, C_bias=C_bias, chunk_size=chunk, backend="auto"
        )

    def peer_args(v):
        def heads_first(t):  # (b, L, H) -> (b, H, L)
            return t.transpose(1, 2).contiguous()

        adt, dt, trap = heads_first(v["A"] * v["dt"]), heads_first(v["dt"]), heads_first(v["trap"])
        return (v["C"], v["B"], v["x"], adt, dt, trap, v["C_bias"], v["B_bias"], v["angles"], v["D"], v["z"])

    def theirs(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z):
        combined = peer.mamba3.mamba3_siso_combined
        return combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=D, Z=Z, chunk_size=chunk)

    pair = kernel_pair(leaves, ours, ours_args, theirs, peer_args, tolerance)
    pair.notes.append(MAMBA3_MAPPING)
    return pair


# ----------------------------------------------------------------------------- modules


def module_pair(
    ours, theirs, forward: Callable, loss: Callable, inputs, autocast, tolerance: float, tokens=None, referee=False
):
    """Two modules holding the same weights: ``forward(module, inputs)`` and the scalar
    ``loss(output)`` that the backward starts from; the check compares outputs, losses, the
    input's gradient where it has one, and every parameter's, each as ``relative_l2``.

    ``referee``: under a 16-bit autocast two correct models differ in the gradients that sum many
    small terms (a dt_bias over 24 layers read 5.4e-2 in one run and 6.3e-2 in the next, the
    peer's backward not being deterministic). So the peer also runs in float32, autocast off,
    and a tensor past the tolerance still agrees when ssm's is no further from that float32 run
    than 1.5 times the peer's own is (the referee is the peer's code, not ssm's)."""

    def side(module):
        def run(train: bool):
            with autocast():
                if not train:
                    with torch.no_grad():
                        return loss(forward(module, inputs))
                value = loss(forward(module, inputs))
            params = [p for p in module.parameters() if p.requires_grad]
            return torch.autograd.grad(value, params + ([inputs] if inputs.requires_grad else []))

        return run

    def tensors(module, context) -> dict[str, torch.Tensor]:
        """out, loss, and d<name> for the input (where it has a gradient) and every parameter."""
        with context():
            out = forward(module, inputs)
            value = loss(out)
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        wanted = [p for p in module.parameters() if p.requires_grad] + ([inputs] if inputs.requires_grad else [])
        grads = torch.autograd.grad(value, wanted)
        return {"out": out, "loss": value} | {f"d{n}": g for n, g in zip(names + ["input"], grads)}

    def check() -> dict:
        ssm_t, peer_t = tensors(ours, autocast), tensors(theirs, autocast)
        every = {k: relative_l2(ssm_t[k], peer_t[k]) for k in peer_t}
        result = {"parameters": len(every) - 2 - ("dinput" in every)}
        if referee:
            ref = tensors(theirs, lambda: torch.autocast(inputs.device.type, enabled=False))
            off = {k: (relative_l2(ssm_t[k], ref[k]), relative_l2(peer_t[k], ref[k])) for k in every}
            past = [k for k, d in every.items() if not d <= tolerance]
            settled = [k for k in past if off[k][0] <= 1.5 * off[k][1]]
            worst_off = max(off, key=lambda k: off[k][0] if math.isfinite(off[k][0]) else math.inf)
            result["referee"] = {
                "ssm": float(f"{off[worst_off][0]:.3g}"), "peer": float(f"{off[worst_off][1]:.3g}"),
                "tensor": worst_off, "settled": settled,
            }  # fmt: skip
        diff = {k: every[k] for k in ("out", "loss", "dinput") if k in every}
        grads = {k: v for k, v in every.items() if k not in diff}
        worst = max(grads, key=lambda k: grads[k] if math.isfinite(grads[k]) else math.inf)
        diff[worst] = grads[worst]  # the parameter whose gradient differs most
        settled = set(result.get("referee", {}).get("settled", ()))
        agree = all(math.isfinite(d) and (d <= tolerance or k in settled) for k, d in every.items())
        return verdict(diff, tolerance) | result | {"agree": agree}

    return Pair(side(ours), side(theirs), check, tokens=tokens)


def autocast_for(device, dtype):
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def mamba2_layer(peer, shape: dict, dtype, device, tolerance) -> Pair:
    """ssm.Mamba2 against mamba_ssm.modules.mamba2.Mamba2 holding the same weights (ssm loads
    the peer's state dict: the names are mamba-ssm's), float32 weights under autocast to
    ``dtype``; the peer on its fused path (use_mem_eff_path) when causal-conv1d is built."""
    import ssm

    fused = peer.built["causal_conv1d_cuda"]
    cfg = dict(d_state=shape["N"], headdim=shape["P"], chunk_size=shape["chunk"], use_mem_eff_path=fused)
    torch.manual_seed(0)
    theirs = peer.mamba2.Mamba2(shape["d_model"], **cfg, device=device)
    ours = ssm.Mamba2(shape["d_model"], **cfg, device=device)
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(0)
    u = randn(g, shape["batch"], shape["L"], shape["d_model"], device=device).requires_grad_()
    dout = randn(g, shape["batch"], shape["L"], shape["d_model"], device=device)
    pair = module_pair(
        ours, theirs, lambda m, x: m(x), lambda y: (y.float() * dout).sum(), u,
        lambda: autocast_for(device, dtype), tolerance, referee=dtype != torch.float32,
    )  # fmt: skip
    pair.notes.append(
        "peer use_mem_eff_path=True (its fused conv, scan, norm, out_proj)"
        if fused
        else "peer use_mem_eff_path=False: causal-conv1d not built, so its nn.Conv1d path"
    )
    return pair


def train_step(peer, shape: dict, dtype, device, tolerance) -> Pair:
    """A whole language model's training step (forward, cross-entropy over every position,
    backward; no optimizer) of ssm.MambaLM against MambaLMHeadModel, the same weights (ssm loads
    the peer's state dict), float32 weights under autocast to ``dtype``; Mamba-1 or Mamba-2
    mixers (shape["mixer"])."""
    import ssm

    fused = peer.built["causal_conv1d_cuda"]
    if shape["mixer"] == "Mamba2":
        mixer = {"layer": "Mamba2", "d_state": 128, "headdim": 64, "chunk_size": 256, "use_mem_eff_path": fused}
        if "N" in shape:  # the dry run's small mixer
            mixer |= {"d_state": shape["N"], "headdim": shape["P"], "chunk_size": shape["chunk"]}
    else:
        mixer = {"layer": "Mamba1", "d_state": 16}
    cfg = dict(d_model=shape["d_model"], n_layer=shape["layers"], vocab_size=shape["vocab"], ssm_cfg=mixer)
    torch.manual_seed(0)
    theirs = peer.models.MambaLMHeadModel(peer.config.MambaConfig(**cfg | {"ssm_cfg": dict(mixer)}), device=device)
    ours = ssm.MambaLM(ssm.MambaConfig(**cfg), device=device)
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["L"] + 1), generator=g).to(device)

    def forward(model, ids):
        logits = model(ids[:, :-1])
        return getattr(logits, "logits", logits)  # the peer returns a namedtuple

    def loss(logits):
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    tokens = shape["batch"] * shape["L"]
    pair = module_pair(
        ours, theirs, forward, loss, ids, lambda: autocast_for(device, dtype), tolerance, tokens,
        referee=dtype != torch.float32,
    )  # fmt: skip
    if shape["mixer"] == "Mamba2":
        pair.notes.append("peer Mamba2 use_mem_eff_path=" + str(fused))
    else:
        pair.notes.append("peer Mamba fast path (mamba_inner_fn)" if fused else "peer Mamba without causal-conv1d")
    return pair
