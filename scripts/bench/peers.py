"""The peers the benchmark compares against, each loaded only when importable (None or nothing
otherwise): mambapy's parallel scan and its Mamba stack, mamba-ssm's CUDA selective scan,
transformers' MambaForCausalLM, Mamba2ForCausalLM and Mamba2Mixer; and ssm's MambaLM built on a peer's weights."""

from __future__ import annotations

import importlib.metadata
import math
import tempfile
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

PEER_MAMBA2 = "transformers Mamba2"


def versions() -> dict[str, str]:
    """Installed versions of the scan peers."""
    found = {}
    for package in ("mambapy", "mamba_ssm"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


# ----------------------------------------------------------------------------- scans


def mambapy_selective_scan(pscan, x, delta, A, B, C, D, z, delta_bias) -> torch.Tensor:
    """The selective scan as mambapy's MambaBlock computes it (``ssm``, ``selective_scan`` and
    the output gate of ``forward``), in its layout: x, delta, z (batch, L, dim); B, C (batch,
    L, N); A (dim, N); D, delta_bias (dim,)."""
    delta = F.softplus(delta + delta_bias)
    deltaA = torch.exp(delta.unsqueeze(-1) * A)  # (batch, L, dim, N)
    BX = delta.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)  # (batch, L, dim, N)
    # PScan.forward copies its arguments (clone, or F.pad when it pads L to a power of two)
    # before scanning in place, so the caller's tensors are never modified.
    hs = pscan(deltaA, BX)
    # With 16-bit inputs, Δ and so the states are float32 (as delta_bias is); C follows.
    y = (hs @ C.unsqueeze(-1).to(hs.dtype)).squeeze(3) + D * x  # (batch, L, dim)
    return y * F.silu(z)


def scan_peers(op: str, device: torch.device) -> list[tuple[str, Callable[..., torch.Tensor], bool]]:
    """(name, fn, swapped) of each peer of scan ``op`` that is installed and runs on ``device``;
    ``swapped``: fn takes and returns the (batch, L, dim, ...) layout instead of ours."""
    found = []
    if op not in ("selective_scan", "linear_scan"):
        return found
    try:
        from mambapy.pscan import pscan
    except ImportError:
        pass
    else:
        fn = pscan if op == "linear_scan" else partial(mambapy_selective_scan, pscan)
        found.append(("mambapy.pscan (peer)", fn, True))
    # mamba-ssm's CUDA kernel has our signature and layout, so it runs on our very inputs.
    if op == "selective_scan" and device.type == "cuda":
        try:
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        except ImportError:
            pass
        else:
            found.append(("mamba_ssm.selective_scan_fn (peer)", partial(selective_scan_fn, delta_softplus=True), False))
    return found


# ----------------------------------------------------------------------------- models


def transformers_mamba(args, device, vocab_size: int = 256):
    """transformers' MambaForCausalLM with fresh weights at the benchmark's sizes, or None."""
    try:
        from transformers import MambaConfig as HFMambaConfig
        from transformers import MambaForCausalLM
    except ImportError:
        return None
    config = HFMambaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        state_size=16,
        num_hidden_layers=args.layers,
        expand=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(args.seed)
    return MambaForCausalLM(config).to(device).float().train()


def transformers_mamba2(args, device, vocab_size: int = 256):
    """transformers' Mamba2ForCausalLM with fresh weights at the benchmark's sizes (mamba2-130m's
    shapes at d_model 768: N 128, head dim 64, one group), or None."""
    try:
        from transformers import Mamba2Config, Mamba2ForCausalLM
    except ImportError:
        return None
    head_dim = math.gcd(2 * args.d_model, 64)
    config = Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        state_size=128,
        head_dim=head_dim,
        num_heads=2 * args.d_model // head_dim,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        num_hidden_layers=args.layers,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(args.seed)
    return Mamba2ForCausalLM(config).to(device).float().train()


def mambapy_lm(args, hf_state: dict, device):
    """mambapy's Mamba stack (mambapy.mamba: blocks, parallel scan) between an embedding and a
    final RMSNorm with a tied LM head, with transformers' weights (the same names as
    mamba-ssm's, the prefixes aside); None when mambapy is not importable. (mambapy.lm.LM
    imports mamba-ssm's Triton kernels for its Mamba-2 path, so it is not used.)"""
    try:
        from mambapy.mamba import Mamba, RMSNorm
        from mambapy.mamba import MambaConfig as MambapyConfig
    except ImportError:
        return None

    class MambapyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = MambapyConfig(
                d_model=args.d_model, n_layers=args.layers, d_state=16, expand_factor=2, d_conv=4, rms_norm_eps=1e-5
            )
            self.embedding = torch.nn.Embedding(256, args.d_model)
            self.mamba = Mamba(config)
            self.norm_f = RMSNorm(args.d_model, 1e-5)

        def forward(self, tokens):
            return F.linear(self.norm_f(self.mamba(self.embedding(tokens))), self.embedding.weight)

    model = MambapyLM()
    state = {}
    for key, value in hf_state.items():
        if key in ("backbone.embeddings.weight", "backbone.norm_f.weight"):
            state[key.split(".")[1].replace("embeddings", "embedding") + ".weight"] = value
        elif key.startswith("backbone."):
            state["mamba." + key[len("backbone.") :]] = value
    model.load_state_dict(state)
    return model.to(device).train()


def ssm_lm(args, hf_model, device, vocab_size: int = 256, ssm_cfg: dict | None = None):
    """ssm's MambaLM with transformers' weights, read the way users load them (from_pretrained);
    fresh weights (seeded) when there is no transformers model, with mixer ``ssm_cfg`` (Mamba-1,
    N 16 by default)."""
    from ssm import MambaConfig, MambaLM

    if hf_model is None:
        torch.manual_seed(args.seed)
        config = MambaConfig(
            d_model=args.d_model, n_layer=args.layers, vocab_size=vocab_size, ssm_cfg=ssm_cfg or {"d_state": 16}
        )
        return MambaLM(config).to(device).train()
    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        return MambaLM.from_pretrained(directory, device=device).train()


def transformers_mamba2_mixer(ours, d_model: int, N: int, P: int):
    """transformers' Mamba2Mixer (its pure-PyTorch chunked path on CPU) holding the weights of
    ``ours`` (the same parameter names), or None when transformers is not importable."""
    try:
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    except ImportError:
        return None
    config = Mamba2Config(
        hidden_size=d_model,
        state_size=N,
        head_dim=P,
        num_heads=2 * d_model // P,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=ours.chunk_size,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        num_hidden_layers=1,
    )
    peer = Mamba2Mixer(config, layer_idx=0).to(device=ours.in_proj.weight.device, dtype=ours.in_proj.weight.dtype)
    peer.load_state_dict(ours.state_dict())
    return peer
