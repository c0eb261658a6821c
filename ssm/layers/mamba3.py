"""The Mamba-3 mixer, with mamba-ssm's constructor arguments, parameter names, shapes and
initialisation (``mamba_ssm/modules/mamba3.py``), SISO and MIMO."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import scan_with_passed_rotating_state, slice_packing
from ..ops import GatedMLPWeights, Mamba3BlockWeights
from ..scan import TrapezoidalState, trapezoidal_scan, trapezoidal_scan_step
from .arguments import check_dt_range, check_int, check_number
from .cache import Mamba3Cache, check_packing, check_sequence, check_token
from .context import check_context_parallel
from .linear import Linear
from .mamba import dt_bias_init, no_weight_decay
from .norm import RMSNorm, RMSNormGated, upcast
from .quant import decoding_matrix


def heavy_tail(x: torch.Tensor) -> torch.Tensor:
    """1 + x for x ≥ 0, 1 / (1 − x) below: positive, continuous, with a continuous derivative,
    and only polynomially small for very negative x. Not mamba-ssm's: ssm's Mamba3 took it for
    A until 2026-11-29, and the parity recipe (configs/paper/parity.yaml) was chosen with it."""
    return x.clamp(min=0) + 1 / (1 - x.clamp(max=0))


# What turns A's projection into the rate |A| (before the floor): softplus is mamba-ssm's
A_ACTIVATIONS = {"softplus": F.softplus, "heavy_tail": heavy_tail}


class Mamba3(nn.Module):
    """The Mamba-3 mixer: in_proj → (z, x, B, C, Δ, A, λ, θ); B and C RMS-normalised, then biased
    per head (and MIMO rank); the trapezoidal scan over H heads of P = headdim channels with a
    rotary state (``ssm.scan.trapezoidal_scan``); gated by silu(z) (or a per-head gated RMSNorm,
    ``is_outproj_norm``) → out_proj. No convolution: the trapezoidal rule mixes each step's
    input with the previous one instead.

    Input and output (batch, L, d_model). d_inner = expand·d_model = H·P; B and C have
    G = ngroups groups of N = d_state; R = mimo_rank with ``is_mimo`` (else 1). The rotary
    phase turns M = ⌊N·rope_fraction / 2⌋ state pairs: interleaved pairs (2m, 2m+1) in SISO,
    (m, m + N/2) in MIMO, as mamba-ssm's kernels do; ``rope_fraction=0.0`` turns none (Mamba-3
    without its rotary state, the Mamba-3 paper's ablation; mamba-ssm takes 0.5 and 1.0). Per token:
        A = −max(softplus(A_proj), A_floor),  Δ = softplus(Δ_proj + dt_bias),  λ = sigmoid(λ_proj),
        θ = π·tanh(θ_proj) (shared by the heads, each turning it by its own Δ).
    ``A_activation="heavy_tail"`` (not mamba-ssm's; the fused C decoding step does not take it)
    puts ``heavy_tail`` in softplus's place, what this layer computed until 2026-11-29.
    Parameters (as mamba-ssm's ``Mamba3``): in_proj (2·d_inner + 2·N·G·R + 3·H + M, d_model),
    dt_bias (H,), B_bias, C_bias (H, R, N), B_norm.weight, C_norm.weight (N,), MIMO only
    mimo_x, mimo_z, mimo_o (H, R, P), D (H,), norm.weight (d_inner,) with is_outproj_norm,
    out_proj (d_model, d_inner).

    ``fuse_pregate_headwise_norm``, ``dropout`` and ``n_layer`` are accepted for mamba-ssm
    compatibility and change nothing (the first is a kernel choice in mamba-ssm, with the same
    result either way). ``chunk_size`` and ``backend`` are passed to the scan.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        expand: float = 2,
        headdim: int = 64,
        ngroups: int = 1,
        rope_fraction: float = 0.5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        A_floor: float = 1e-4,
        A_activation: str = "softplus",
        is_outproj_norm: bool = False,
        is_mimo: bool = False,
        mimo_rank: int = 4,
        fuse_pregate_headwise_norm: bool = True,  # accepted for mamba-ssm compatibility; no effect
        chunk_size: int = 64,
        dropout: float = 0.0,  # accepted for mamba-ssm compatibility; no effect
        layer_idx: int | None = None,
        n_layer: int | None = None,  # accepted for mamba-ssm compatibility; no effect
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.d_inner, self.nheads, self.num_rope_angles = self.check_arguments(
            d_model, d_state, expand, headdim, ngroups, rope_fraction, dt_min, dt_max, dt_init_floor, A_floor,
            is_mimo, mimo_rank, chunk_size, A_activation,
        )  # fmt: skip
        self.A_activation = A_activation
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.ngroups = ngroups
        self.rope_fraction, self.A_floor, self.is_outproj_norm, self.is_mimo = (
            rope_fraction,
            A_floor,
            is_outproj_norm,
            is_mimo,
        )
        self.mimo_rank = mimo_rank if is_mimo else 1
        # mamba-ssm's attribute names, for code that reads them
        self.num_bc_heads = ngroups
        self.rotary_dim_divisor = int(2 / rope_fraction) if rope_fraction else 0
        self.split_tensor_size = 2 * self.num_rope_angles  # rotated state entries, 2·M (M pairs)
        # as mamba-ssm: true only where its fused kernel applies (MIMO with the output norm)
        self.fuse_pregate_headwise_norm = bool(fuse_pregate_headwise_norm and is_mimo and is_outproj_norm)
        self.chunk_size, self.layer_idx, self.backend = chunk_size, layer_idx, backend
        self.rotary = "halved" if is_mimo else "interleaved"

        H, R, N, G, P = self.nheads, self.mimo_rank, d_state, ngroups, headdim
        # in_proj's output, in order: z, x, B, C, Δ, A, λ (trapezoid), θ (rotary angles)
        self._sizes = [self.d_inner, self.d_inner, N * G * R, N * G * R, H, H, H, self.num_rope_angles]
        self.in_proj = Linear(d_model, sum(self._sizes), bias=False, **kw)
        self.dt_bias = no_weight_decay(nn.Parameter(dt_bias_init(H, dt_min, dt_max, dt_init_floor, device)))
        self.B_bias = nn.Parameter(torch.ones(H, R, N, device=device))
        self.C_bias = nn.Parameter(torch.ones(H, R, N, device=device))
        self.B_norm = RMSNorm(N, eps=1e-5, **kw)
        self.C_norm = RMSNorm(N, eps=1e-5, **kw)
        if is_mimo:
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1.0 / R, device=device))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P, device=device))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1.0 / R, device=device))
        self.D = no_weight_decay(nn.Parameter(torch.ones(H, device=device)))
        if is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, group_size=P, **kw)
        self.out_proj = Linear(self.d_inner, d_model, bias=False, **kw)

    @staticmethod
    def check_arguments(
        d_model, d_state, expand, headdim, ngroups, rope_fraction, dt_min, dt_max, dt_init_floor, A_floor,
        is_mimo, mimo_rank, chunk_size, A_activation="softplus", **_,
    ) -> tuple[int, int, int]:  # fmt: skip
        """The constructor's checks of its arguments (also run on a config's ssm_cfg by
        ``MambaConfig``): every size an int >= 1, headdim dividing d_inner = int(expand·d_model),
        ngroups dividing the heads, a state pair to rotate. Returns (d_inner, nheads, M)."""
        check_int("Mamba3", "d_model", d_model)
        check_int("Mamba3", "d_state", d_state, what=" (the state size N)")
        check_number("Mamba3", "expand", expand, what=" (d_inner = int(expand·d_model))")
        check_int("Mamba3", "headdim", headdim, what=" (the head dim P)")
        check_int("Mamba3", "ngroups", ngroups)
        check_int("Mamba3", "chunk_size", chunk_size)
        d_inner = int(expand * d_model)
        if d_inner < 1:
            raise ValueError(f"Mamba3: expand·d_model must be at least 1 (d_inner), got {expand!r}·{d_model}")
        if d_inner % headdim:
            raise ValueError(f"Mamba3: headdim = {headdim} must divide d_inner = expand·d_model = {d_inner}")
        nheads = d_inner // headdim
        if nheads % ngroups:
            raise ValueError(f"Mamba3: ngroups = {ngroups} must divide the number of heads {nheads}")
        if rope_fraction not in (0.0, 0.5, 1.0):
            raise ValueError(
                f"Mamba3: rope_fraction must be 0.5 or 1.0 (as in mamba-ssm), or 0.0 for no rotary state, "
                f"got {rope_fraction!r}"
            )
        if is_mimo and (isinstance(mimo_rank, bool) or not isinstance(mimo_rank, int) or mimo_rank < 1):
            raise ValueError(f"Mamba3: mimo_rank must be a positive int, got {mimo_rank!r}")
        rotated = int(d_state * rope_fraction)
        pairs = (rotated - rotated % 2) // 2
        if pairs < 1 and rope_fraction:
            raise ValueError(
                f"Mamba3: d_state·rope_fraction = {d_state * rope_fraction} leaves no state pair to rotate"
            )
        if is_mimo and d_state % 2:
            raise ValueError(
                f"Mamba3: MIMO pairs state entry m with m + d_state/2, so d_state must be even, got {d_state}"
            )
        check_number("Mamba3", "A_floor", A_floor, strict=False)
        if A_activation not in A_ACTIVATIONS:
            raise ValueError(f"Mamba3: A_activation must be one of {', '.join(A_ACTIVATIONS)}, got {A_activation!r}")
        check_dt_range("Mamba3", dt_min, dt_max, dt_init_floor)
        return d_inner, nheads, pairs

    # ------------------------------------------------------------------ the shared pieces

    def _inputs(self, u: torch.Tensor):
        """in_proj(u) (..., d_model) → the scan's inputs, over the leading dims (batch[, L])."""
        z, x, B, C, dt, A, trap, angles = self.in_proj(u).split(self._sizes, dim=-1)
        lead = u.shape[:-1]
        heads = (*lead, self.nheads, self.headdim)
        groups = (*lead, self.mimo_rank, self.ngroups, self.d_state)
        B, C = self.B_norm(B.reshape(groups)), self.C_norm(C.reshape(groups))
        A = (-A_ACTIVATIONS[self.A_activation](upcast(A))).clamp(max=-self.A_floor)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias))
        trap = torch.sigmoid(upcast(trap))
        theta = (math.pi * torch.tanh(upcast(angles))).unsqueeze(-2).expand(*lead, self.nheads, self.num_rope_angles)
        return z.reshape(heads), x.reshape(heads), B, C, dt, A, trap, theta

    def _scan_options(self, z):
        """The keyword arguments of the scan (and its step) that the parameters set, and whether
        the per-head norm and the rank contraction are left to _finish."""
        norm_here = self.is_outproj_norm
        options = dict(rotary=self.rotary)
        if self.is_mimo:
            options.update(B_bias=self.B_bias, C_bias=self.C_bias, mimo_x=self.mimo_x)
            if not norm_here:
                options.update(mimo_z=self.mimo_z, mimo_o=self.mimo_o)
        else:
            options.update(B_bias=self.B_bias[:, 0], C_bias=self.C_bias[:, 0])
        return options, None if norm_here else z

    def _finish(self, y: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """The scan's output → (per-head gated RMSNorm, rank contraction) → out_proj.
        y: (..., H, P), or (..., R, H, P) per rank (MIMO with is_outproj_norm)."""
        if self.is_outproj_norm and self.is_mimo:
            z = upcast(z).unsqueeze(-3) * upcast(self.mimo_z).transpose(0, 1)  # (..., R, H, P)
            y = self.norm(upcast(y).flatten(-2), z.flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
            y = (y * upcast(self.mimo_o).transpose(0, 1)).sum(-3)  # (..., H, P)
        elif self.is_outproj_norm:
            y = self.norm(upcast(y).flatten(-2), upcast(z).flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
        return self.out_proj(y.flatten(-2).to(dtype))

    def _BC(self, M):
        return M if self.is_mimo else M[..., 0, :, :]  # SISO: no rank axis

    # ------------------------------------------------------------------ the API

    def allocate_inference_cache(self, batch: int, dtype=None, device=None) -> Mamba3Cache:
        device = device or self.dt_bias.device  # (in_proj may be a QuantLinear: no .weight)
        state_dtype = torch.float64 if (dtype or self.dt_bias.dtype) == torch.float64 else torch.float32
        H, P, N, M = self.nheads, self.headdim, self.d_state, self.num_rope_angles
        key = (batch, self.mimo_rank, H, N) if self.is_mimo else (batch, H, N)
        zeros = [
            torch.zeros(shape, device=device, dtype=state_dtype)
            for shape in ((batch, H, M), (batch, H, P, N), key, (batch, H, P))
        ]
        return Mamba3Cache(TrapezoidalState(*zeros))

    context_parallel = True  # forward(cp_group=): see ssm.distributed

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Mamba3Cache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cp_group=None,
    ) -> torch.Tensor:
        """(batch, L, d_model) → (batch, L, d_model). With ``cache``, continue from its state and
        leave the state after the last token in it (prefill). With ``cu_seqlens`` (S + 1,), the
        batch of one holds S sequences end to end (and a cache, if any, is for S sequences).

        ``cp_group``: context parallelism over a torch.distributed process group, as in
        ``Mamba2.forward``: this rank's slice [r·L/W, (r+1)·L/W) in, that slice of the whole's
        output out. The rotary phase counts from the sequence's start, and the first step reads
        the previous rank's last position (``ssm.distributed.scan_with_passed_rotating_state``).
        A ``cache`` (the same on every rank) is continued and left holding the state after the
        whole sequence. ``cu_seqlens`` (not with a cache) then holds the whole row's boundaries (a sequence may
        cross ranks; the phase restarts at each sequence's start)."""
        check_sequence("hidden_states", hidden_states, self.d_model)
        packing = None
        if cp_group is not None:
            check_context_parallel("Mamba3", cache, cu_seqlens, 0)
            if cu_seqlens is not None:  # the whole row's boundaries, seen from this slice
                packing = slice_packing(cu_seqlens, hidden_states.shape[1], cp_group, hidden_states.device)
                cu_seqlens = packing.local
        packed = check_packing(cu_seqlens, hidden_states)
        if cache is not None:
            cache.check_batch(hidden_states.shape[0] if packed is None else packed.num_sequences)
        z, x, B, C, dt, A, trap, theta = self._inputs(hidden_states)
        options, z_scan = self._scan_options(z)
        B, C = self._BC(B), self._BC(C)

        def scan(initial_state, positions=slice(None), packed=packed):
            return trapezoidal_scan(
                x[:, positions],
                dt[:, positions],
                A[:, positions],
                B[:, positions],
                C[:, positions],
                trap[:, positions],
                theta[:, positions],
                self.D,
                None if z_scan is None else z_scan[:, positions],
                **options,
                initial_state=initial_state,
                return_last_state=True,
                chunk_size=self.chunk_size,
                cu_seqlens=packed,
                backend=self.backend,
            )

        if cp_group is not None:
            zeros = self.allocate_inference_cache(x.shape[0], dtype=x.dtype, device=x.device).state

            def last_step(phase):  # the state after this slice's last position alone, from ``phase``
                return scan(zeros._replace(phase=phase), slice(-1, None), None)[1]

            phase_steps = dt[..., None] * theta  # (batch, L, H, M): Δ_t·θ_t
            y, whole = scan_with_passed_rotating_state(
                scan,
                last_step,
                phase_steps,
                lambda start: (dt * A)[:, start:].sum(1)[..., None, None],
                cp_group,
                packing,
                None if cache is None else cache.state,
            )
            if cache is not None:  # the state after the whole sequence, on every rank
                cache.state = _wrapped(whole)
            return self._finish(y, z, hidden_states.dtype)
        y, last = scan(None if cache is None else cache.state)
        if cache is not None:
            cache.state = _wrapped(last)
        return self._finish(y, z, hidden_states.dtype)

    def step(self, hidden_states: torch.Tensor, cache: Mamba3Cache) -> torch.Tensor:
        """One token: (batch, d_model) or (batch, 1, d_model) → the same shape. O(1) in the
        number of tokens seen; updates ``cache``."""
        u = check_token("hidden_states", hidden_states, self.d_model)
        cache.check_batch(u.shape[0])
        z, x, B, C, dt, A, trap, theta = self._inputs(u)
        options, z_scan = self._scan_options(z)
        y, state = trapezoidal_scan_step(
            cache.state, x, dt, A, self._BC(B), self._BC(C), trap, theta, self.D, z_scan, **options
        )
        cache.state = _wrapped(state)
        out = self._finish(y, z, u.dtype)
        return out if hidden_states.ndim == 2 else out[:, None]

    def step_weights(
        self, norm: nn.Module, cache: Mamba3Cache, mlp: GatedMLPWeights | None = None
    ) -> Mamba3BlockWeights | None:
        """What ``ssm.ops.mamba_blocks_step`` needs to run the decoding step of a block around
        this mixer (residual, ``norm``, this mixer's step, which updates ``cache`` in place, then
        the block's ``mlp`` if any) in C, SISO or MIMO, or None where it cannot (a norm other than
        RMSNorm). The model's backbone collects these from every block and steps the whole stack
        in one call."""
        if not isinstance(norm, RMSNorm) or self.B_norm.eps != self.C_norm.eps or self.A_activation != "softplus":
            return None
        phase, ssm, key, value = cache.state
        gate = self.norm if self.is_outproj_norm else None
        mimo = (self.mimo_x, self.mimo_z, self.mimo_o) if self.is_mimo else (None, None, None)
        return Mamba3BlockWeights(
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            in_proj_weight=decoding_matrix(self.in_proj),
            B_norm_weight=self.B_norm.weight,
            C_norm_weight=self.C_norm.weight,
            bc_norm_eps=self.B_norm.eps,
            B_bias=self.B_bias,
            C_bias=self.C_bias,
            dt_bias=self.dt_bias,
            A_floor=self.A_floor,
            D=self.D,
            phase=phase,
            ssm_state=ssm,
            key=key,
            value=value,
            ngroups=self.ngroups,
            halved=self.rotary == "halved",
            gate_norm_weight=None if gate is None else gate.weight,
            gate_norm_eps=0.0 if gate is None else gate.eps,
            out_proj_weight=decoding_matrix(self.out_proj),
            mimo_x=mimo[0],
            mimo_z=mimo[1],
            mimo_o=mimo[2],
            mlp=mlp,
        )


def _wrapped(state: TrapezoidalState) -> TrapezoidalState:
    """The state with its phase taken modulo 2π: decoding stays as precise at any length."""
    return state._replace(phase=torch.remainder(state.phase, 2 * math.pi))
