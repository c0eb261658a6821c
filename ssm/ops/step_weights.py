"""The public weight types of the fused decoding step (ssm.ops.decode, ``mamba_blocks_step``):
what a layer hands over for one block, ``MambaBlockWeights``, ``Mamba2BlockWeights``,
``Mamba3BlockWeights`` or ``AttentionBlockWeights`` (with a ``GatedMLPWeights`` for a block's
MLP), and what the model hands over for its head, ``LMHeadWeights``: typed, documented fields,
so that the step knows no module's parameter names. Plain frozen dataclasses of tensors: no C
code here (the step's ctypes mirrors are in decode.py).

Dtypes the step reads (it declines any others, and the caller steps its layers one by one):

    float64 everything: the step computes in float64;
    float32 (or a bfloat16 / float16 ``hidden``, copied into float32): the step computes in
    float32, the two states float32, the other vectors float32 or bfloat16 / float16 (widened
    once), each matrix (the projections, the MLP's, the head) float32, bfloat16, float16 or an
    int8 / int4 ``QuantizedMatrix`` (ssm.ops.quant), read as stored and widened in registers
    (ssm/native/decode_weights.c). The output (logits, or hidden and residual) is float32.

Shape symbols: B batch, M d_model, D the mixer's channels (d_inner), N state size, R dt_rank,
K the conv's width, V the vocabulary; for Mamba-2, H heads, P head dim, S = H·P (d_ssm),
G groups, C = S + 2·G·N the conv's channels, Q = d_inner − S (the mixer's MLP branch, usually
0), E = 2·Q + S + C + H in_proj's rows, F the block MLP's hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor

from .quant import QuantizedMatrix


@dataclass(frozen=True)
class MambaBlockWeights:
    """One Mamba-1 block's decoding step: residual ← hidden + residual (the first block:
    residual ← hidden); x = RMSNorm(residual); the mixer's step on x (in_proj, the causal conv's
    step and SiLU, x_proj, dt_proj with softplus, the selective step gated by SiLU(z), out_proj).
    Dtypes: see the module's docstring (a matrix may be narrower, or a QuantizedMatrix);
    contiguous; a bias may be None. The two states are updated in
    place."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (2·D, M): x rows then z rows
    in_proj_bias: Tensor | None  # (2·D,)
    conv_weight: Tensor  # (D, 1, K) or (D, K)
    conv_bias: Tensor | None  # (D,)
    conv_state: Tensor  # (B, D, K): the last K conv inputs, most recent last
    x_proj_weight: Tensor | QuantizedMatrix  # (R + 2·N, D): dt rows, B rows, C rows
    dt_proj_weight: Tensor | QuantizedMatrix  # (D, R)
    dt_proj_bias: Tensor | None  # (D,)
    A: Tensor  # (D, N) = -exp(A_log)
    D: Tensor | None  # (D,): the skip
    ssm_state: Tensor  # (B, D, N)
    out_proj_weight: Tensor | QuantizedMatrix  # (M, D)
    out_proj_bias: Tensor | None  # (M,)

    def tensors(self) -> list[Tensor | None]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "norm_eps"]


@dataclass(frozen=True)
class GatedMLPWeights:
    """A block's MLP after its mixer: residual ← hidden + residual;
    (f, g) = fc1 · RMSNorm(residual); hidden = fc2 · (f·SiLU(g))."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    fc1_weight: Tensor | QuantizedMatrix  # (2·F, M): f rows then g rows
    fc2_weight: Tensor | QuantizedMatrix  # (M, F)


def _tensors_and_mlp(weights) -> list:
    """The tensors of a block's weights (Mamba2BlockWeights, Mamba3BlockWeights), then its MLP's."""
    out = [getattr(weights, f.name) for f in fields(weights) if isinstance(getattr(weights, f.name), Tensor)]
    if weights.mlp is not None:
        out += [weights.mlp.norm_weight, weights.mlp.fc1_weight, weights.mlp.fc2_weight]
    return out


@dataclass(frozen=True)
class Mamba2BlockWeights:
    """One Mamba-2 block's decoding step: residual ← hidden + residual (the first block:
    residual ← hidden); u = RMSNorm(residual); (z0, x0, z, xBC, dt) = in_proj u; the causal
    conv's step and SiLU on xBC → (x, B, C); per head h (group h // (H/G)):
    Δ = clamp(softplus(dt + dt_bias), *dt_limit), h ← exp(Δ·A)·h + Δ·B·xᵀ, y = C·h + D·x;
    y = RMSNorm(y·SiLU(z)) per group of ``gate_norm_group`` channels (or RMSNorm(y)·SiLU(z) with
    ``norm_before_gate``, or y·SiLU(z) without a gate norm); hidden = out_proj [SiLU(z0)·x0, y];
    then the block's ``mlp`` if any. Dtypes: see the module's docstring; contiguous; a bias may
    be None.
    The two states are updated in place."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): z0, x0 (Q each), z (S), xBC (C), dt (H) rows
    in_proj_bias: Tensor | None  # (E,)
    conv_weight: Tensor  # (C, 1, K) or (C, K)
    conv_bias: Tensor | None  # (C,)
    conv_state: Tensor  # (B, C, K): the last K conv inputs, most recent last
    dt_bias: Tensor  # (H,)
    A: Tensor  # (H,) = -exp(A_log)
    D: Tensor | None  # (H,), or (S,) per channel
    ssm_state: Tensor  # (B, H, P, N)
    ngroups: int  # G
    dt_limit: tuple[float, float]  # Δ's clamp; (0, inf) clamps nothing
    gate_norm_weight: Tensor | None  # (S,); None: no norm, y·SiLU(z)
    gate_norm_eps: float
    gate_norm_group: int  # channels per norm group: a multiple of P dividing S
    norm_before_gate: bool
    out_proj_weight: Tensor | QuantizedMatrix  # (M, Q + S)
    out_proj_bias: Tensor | None  # (M,)
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class Mamba3BlockWeights:
    """One Mamba-3 block's decoding step, SISO or MIMO of rank R: residual ← hidden + residual
    (the first block: residual ← hidden); u = RMSNorm(residual); (z, x, B, C, dt, a, λ, θ) =
    in_proj u; B and C RMS-normalised per rank and group, plus their per-head biases; per head h
    (group h // (H/G)): Δ = softplus(dt + dt_bias), A = min(−softplus(a), −A_floor),
    λ = sigmoid(λ), the phase φ ← φ + Δ·π·tanh(θ) turning the T rotary pairs of k_r = B_r + B_bias
    and q_r = C_r + C_bias (``halved``: pairs (m, m + N/2), else (2m, 2m + 1)); with v_r =
    x ⊙ mimo_x_r (SISO: x) the trapezoidal step h ← exp(Δ·A)·h + Σ_r ((1 − λ)·Δ·exp(Δ·A)·v'_r·key_rᵀ
    + λ·Δ·v_r·k_rᵀ) (v'_r from the last step's x), y_r = h·q_r + D·v_r, key ← k, value ← x; each
    y_r gated by SiLU(z ⊙ mimo_z_r) (or with ``gate_norm_weight`` RMSNorm(y_r) per head · weight ·
    that), summed over the ranks with mimo_o; hidden = out_proj y; then the block's ``mlp`` if
    any. Dtypes: see the module's docstring; contiguous. The four state tensors are updated in
    place (the phase kept in [0, 2π))."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): z, x (S each), B, C (R·G·N each), dt, a, λ (H each), θ (T)
    B_norm_weight: Tensor  # (N,)
    C_norm_weight: Tensor  # (N,)
    bc_norm_eps: float
    B_bias: Tensor  # (H, R, N)
    C_bias: Tensor  # (H, R, N)
    dt_bias: Tensor  # (H,)
    A_floor: float
    D: Tensor | None  # (H,)
    phase: Tensor  # (B, H, T)
    ssm_state: Tensor  # (B, H, P, N)
    key: Tensor  # (B, R, H, N), or (B, H, N) for SISO: the last step's rotated keys
    value: Tensor  # (B, H, P): the last step's x
    ngroups: int  # G
    halved: bool
    gate_norm_weight: Tensor | None  # (S,); None: y·SiLU(z)
    gate_norm_eps: float
    out_proj_weight: Tensor | QuantizedMatrix  # (M, S)
    mimo_x: Tensor | None = None  # (H, R, P) each, MIMO only
    mimo_z: Tensor | None = None
    mimo_o: Tensor | None = None
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class AttentionBlockWeights:
    """A hybrid model's attention block (``ssm.layers.MHA`` in a Block), one token per row:
    residual ← hidden + residual (the first block: residual ← hidden); u = RMSNorm(residual);
    (qkv, up, gate) = in_proj u; with a conv, its step (no activation) on qkv; q (H heads of P),
    k, v (Hk heads); the first ``rotary_dim`` channels of each q and k head rotated to the row's
    position t = lengths[b] (pairs (i, i + R/2), or (2i, 2i + 1) with ``rotary_interleaved``, at
    angle t·inv_freq[i]); k and v written into the cache at t, lengths[b] ← t + 1; each query
    head h attends to the row's t + 1 keys and values of head h // (H / Hk) with softmax(scale·q·kᵀ);
    hidden = out_proj [context, up·SiLU(gate)]; then the block's ``mlp`` if any. Dtypes: see the
    module's docstring (the key/value cache and the conv state are states: the compute dtype).
    The cache has room for one more token in every row (lengths[b] < capacity)."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): q (H·P), k, v (Hk·P each), up, gate (U each) rows
    in_proj_bias: Tensor | None  # (E,)
    conv_weight: Tensor | None  # (Z, 1, K) or (Z, K), Z = (H + 2·Hk)·P; None: no conv
    conv_bias: Tensor | None  # (Z,)
    conv_state: Tensor | None  # (B, Z, K)
    num_heads: int  # H
    num_heads_kv: int  # Hk
    softmax_scale: float
    inv_freq: Tensor | None  # (R/2,) the rotary frequencies; None: no rotary
    rotary_interleaved: bool
    key: Tensor  # (B, capacity, Hk, P)
    value: Tensor  # (B, capacity, Hk, P)
    lengths: Tensor  # (B,) int64: the tokens each row holds
    out_proj_weight: Tensor | QuantizedMatrix  # (M, H·P + U)
    out_proj_bias: Tensor | None  # (M,)
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class LMHeadWeights:
    """After the last block: residual ← hidden + residual; logits = weight · RMSNorm(residual)."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    weight: Tensor | QuantizedMatrix  # (V, M)
