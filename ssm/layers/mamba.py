"""The Mamba-1 (S6) mixer, with mamba-ssm's parameter names, shapes and initialisation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import (
    conv_state_from_previous_rank,
    from_last_rank,
    scan_with_passed_state,
    slice_packing,
    summed_softplus,
)
from ..ops import MambaBlockWeights, causal_conv1d_silu, causal_conv1d_step
from ..scan import selective_scan, selective_scan_step
from .arguments import check_dt_range, check_int, check_number
from .cache import LayerCache, check_packing, check_sequence, check_token
from .context import check_context_parallel
from .linear import Linear
from .norm import RMSNorm, upcast
from .quant import decoding_matrix


def no_weight_decay(p: nn.Parameter) -> nn.Parameter:
    """Mark a parameter to be excluded from weight decay (read by the training optimiser)."""
    p._no_weight_decay = True
    return p


def dt_bias_init(n: int, dt_min: float, dt_max: float, dt_init_floor: float, device=None) -> torch.Tensor:
    """Inverse softplus of Δ drawn log-uniformly in [dt_min, dt_max] (floored), so that
    softplus(bias) starts there."""
    dt = torch.exp(torch.rand(n, device=device) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt)


class Mamba(nn.Module):
    """The Mamba-1 mixer: in_proj → causal depthwise conv1d → SiLU → x_proj (Δ, B, C) → dt_proj
    → selective scan → gate with SiLU(z) → out_proj.

    Input and output (batch, L, d_model). D = expand·d_model channels (d_inner), N = d_state.
    Parameters (as mamba-ssm's ``Mamba``, so state dicts are interchangeable):
        in_proj (2·D, d_model), conv1d (D, 1, d_conv) + bias, x_proj (dt_rank + 2N, D),
        dt_proj (D, dt_rank) + bias (the Δ bias), A_log (D, N), D (D,), out_proj (d_model, D).
    ``backend`` is passed to ``ssm.scan.selective_scan``.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,  # accepted for mamba-ssm compatibility; no effect
        layer_idx: int | None = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.d_inner, self.dt_rank = self.check_arguments(
            d_model, d_state, d_conv, expand, dt_rank, dt_min, dt_max, dt_init, dt_scale, dt_init_floor
        )
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.layer_idx, self.backend = layer_idx, backend
        D = self.d_inner

        self.in_proj = Linear(d_model, 2 * D, bias=bias, **kw)
        self.conv1d = nn.Conv1d(D, D, d_conv, groups=D, padding=d_conv - 1, bias=conv_bias, **kw)
        self.x_proj = Linear(D, self.dt_rank + 2 * d_state, bias=False, **kw)
        self.dt_proj = Linear(self.dt_rank, D, bias=True, **kw)
        std = self.dt_rank**-0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt_bias_init(D, dt_min, dt_max, dt_init_floor, device))
        self.dt_proj.bias._no_reinit = True
        no_weight_decay(self.dt_proj.bias)
        # S4D-real: A = -(1, 2, ..., N) for every channel.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(D, 1)  # (D, N)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(A)))
        self.D = no_weight_decay(nn.Parameter(torch.ones(D, device=device)))
        self.out_proj = Linear(D, d_model, bias=bias, **kw)

    @staticmethod
    def check_arguments(
        d_model, d_state, d_conv, expand, dt_rank, dt_min, dt_max, dt_init, dt_scale, dt_init_floor, **_
    ) -> tuple[int, int]:
        """The constructor's checks of its arguments (also run on a config's ssm_cfg by
        ``MambaConfig``, through ``ssm.layers.arguments.check_mixer_arguments``): every size
        an int >= 1. Returns (d_inner, dt_rank)."""
        check_int("Mamba", "d_model", d_model)
        check_int("Mamba", "d_state", d_state, what=" (the state size N)")
        check_int("Mamba", "d_conv", d_conv, what=" (the causal convolution's width)")
        check_int("Mamba", "expand", expand, what=" (d_inner = expand·d_model)")
        if dt_rank != "auto":
            check_int("Mamba", "dt_rank", dt_rank, what=" or 'auto'")
        if dt_init not in ("random", "constant"):
            raise ValueError(f"Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")
        check_number("Mamba", "dt_scale", dt_scale)
        check_dt_range("Mamba", dt_min, dt_max, dt_init_floor)
        return expand * d_model, math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank

    def allocate_inference_cache(self, batch: int, dtype=None, device=None) -> LayerCache:
        return LayerCache.zeros(batch, self.conv1d, (self.d_inner, self.d_state), dtype, device)

    computes_last = True  # forward(last=k): see Block.forward
    context_parallel = True  # forward(cp_group=): see ssm.distributed

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: LayerCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        last: int = 0,
        cp_group=None,
    ) -> torch.Tensor:
        """(batch, L, d_model) → (batch, L, d_model). With ``cache``, continue from its state and
        leave the state after the last token in it (prefill).

        ``cp_group``: context parallelism over a torch.distributed process group, as in
        ``Mamba2.forward``: this rank's ``hidden_states`` are its slice [r·L/W, (r+1)·L/W) of
        the whole sequence, and its output that slice of the whole's; a ``cache`` (the same on
        every rank) is continued and left holding the state after the whole sequence. Not with
        ``last``; ``cu_seqlens`` then holds the whole row's boundaries, as there.

        ``cu_seqlens`` (S + 1,): S sequences packed along L in a batch of one (see
        ``ssm.scan.selective_scan``); neither the convolution nor the scan crosses a boundary,
        so each sequence's outputs are those it would get alone. With a cache, the cache holds
        one state per sequence (batch S): each continues from its own and keeps its own.

        ``last`` > 0 (without ``cu_seqlens``): only the outputs of the last ``last`` positions,
        (batch, last, d_model); the scan still runs over all L for the state, but the gate and
        out_proj (and their transposed copies) only over those positions."""
        if last > 0 and cu_seqlens is not None:
            raise ValueError("last: only without cu_seqlens (packed sequences have no common last positions)")
        check_sequence("hidden_states", hidden_states, self.d_model)
        packing = None
        if cp_group is not None:
            check_context_parallel("Mamba", cache, cu_seqlens, last)
            if cu_seqlens is not None:  # the whole row's boundaries, seen from this slice
                packing = slice_packing(cu_seqlens, hidden_states.shape[1], cp_group, hidden_states.device)
                cu_seqlens = packing.local
        packed = check_packing(cu_seqlens, hidden_states)  # validated once; the ops take its tensor
        cu_seqlens = None if packed is None else packed.cu_seqlens
        if cache is not None:
            cache.check_batch(hidden_states.shape[0] if packed is None else packed.num_sequences)
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # (b, l, d) each
        conv_state = None if cache is None else cache.conv_state
        if cp_group is not None:  # the previous rank's last d_conv - 1 inputs
            conv_state = conv_state_from_previous_rank(x, self.d_conv, cp_group, packing, conv_state)
        # u (b, d, l), the scan's layout; x_proj reads it seen as (b, l, d). (The C conv also
        # writes a (b, l, d) copy, dropped here at once: read by x_proj it would be kept for the
        # backward beside u, a seventh of the layer's activations; the tensor path's is a view.)
        (_, u), conv_state = causal_conv1d_silu(x, self.conv1d.weight, self.conv1d.bias, conv_state, cu_seqlens, True)
        proj = self.x_proj(u.transpose(1, 2))
        # the scan's (b, d, l) and (b, n, l), as views
        z, dt, B, C = (t.transpose(1, 2) for t in (z, *proj.split([self.dt_rank, self.d_state, self.d_state], -1)))
        # Δ = W·dt as (b, d, l), its steps adjacent as the scan reads them: no transposed copy of
        # it, nor of its gradient for dt_proj's backward
        dt = torch.bmm(self.dt_proj.weight.expand(dt.shape[0], -1, -1), dt)
        # the gate outside the scan, on the last positions only, where the scan's output is in
        # its compute dtype (a 16-bit one is rounded before the gate, which the scan's own gate
        # avoids: there the scan gates every position and only out_proj is cut)
        wide = u.dtype in (torch.float32, torch.float64)
        gate, z = (z[:, :, -last:], None) if last > 0 and wide else (None, z)
        A = -torch.exp(upcast(self.A_log))

        def scan(initial_state=None, gated=True):  # gated=False: without the gate nor the skip term
            return selective_scan(
                u,
                dt,
                A,
                B,
                C,
                upcast(self.D) if gated else None,
                z if gated else None,
                upcast(self.dt_proj.bias),
                delta_softplus=True,
                return_last_state=True,
                initial_state=initial_state,
                cu_seqlens=packed,
                backend=self.backend,
            )

        if cp_group is not None:
            # log of the slice's decay per (batch, channel, state): A·Σ_t softplus(Δ_t + bias)
            # (in the scan's compute dtype: float64 for float64 inputs, though A_log is float32)
            dt_wide, bias = dt.to(torch.promote_types(dt.dtype, A.dtype)), upcast(self.dt_proj.bias)

            def log_decay(start):  # Σ_t Δ_t from start, (batch, D, 1): the ranks exchange it, then times A
                return summed_softplus(dt_wide[..., start:], bias)[..., None]

            def summary():  # the last states from zero: no gate nor skip term (the rescan has them)
                return scan(gated=False)[1]

            initial = None if cache is None else cache.ssm_state
            y, whole = scan_with_passed_state(scan, log_decay, cp_group, packing, None, initial, summary, A)
            if cache is not None:  # the state after the whole sequence, on every rank
                cache.ssm_state = whole
                if conv_state is not None:
                    cache.conv_state = from_last_rank(conv_state, cp_group)
            return self.out_proj(y.transpose(1, 2))
        y, last_state = scan(None if cache is None else cache.ssm_state)
        if cache is not None:
            cache.conv_state, cache.ssm_state = conv_state, last_state
        if gate is not None:  # the gate the scan would have applied
            y = y[:, :, -last:] * F.silu(gate)
        elif last > 0:
            y = y[:, :, -last:]
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """One token: (batch, d_model) or (batch, 1, d_model) → the same shape. O(1) in the
        number of tokens seen; updates ``cache``."""
        x_t = check_token("hidden_states", hidden_states, self.d_model)
        cache.check_batch(x_t.shape[0])
        x, z = self.in_proj(x_t).chunk(2, dim=-1)  # (B, D) each
        x, cache.conv_state = causal_conv1d_step(x, self.conv1d.weight, self.conv1d.bias, cache.conv_state)
        x = F.silu(x)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        y, cache.ssm_state = selective_scan_step(
            cache.ssm_state,
            x,
            F.linear(dt, self.dt_proj.weight),
            -torch.exp(upcast(self.A_log)),
            B,
            C,
            upcast(self.D),
            z,
            upcast(self.dt_proj.bias),
            delta_softplus=True,
        )
        out = self.out_proj(y)
        return out if hidden_states.ndim == 2 else out[:, None]

    def step_weights(self, norm: nn.Module, cache: LayerCache, mlp=None) -> MambaBlockWeights | None:
        """What ``ssm.ops.mamba_blocks_step`` needs to run the decoding step of a block around
        this mixer (residual, ``norm``, this mixer's step, which updates ``cache`` in place) in
        C, or None where it cannot (a norm other than RMSNorm, a block MLP ``mlp``: the Mamba-1
        step has none yet). The model's backbone collects these from every block and steps the
        whole stack in one call."""
        if not isinstance(norm, RMSNorm) or mlp is not None:
            return None
        return MambaBlockWeights(
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            in_proj_weight=decoding_matrix(self.in_proj),
            in_proj_bias=self.in_proj.bias,
            conv_weight=self.conv1d.weight,
            conv_bias=self.conv1d.bias,
            conv_state=cache.conv_state,
            x_proj_weight=decoding_matrix(self.x_proj),
            dt_proj_weight=self.dt_proj.weight,
            dt_proj_bias=self.dt_proj.bias,
            A=decoding_A(self),
            D=self.D,
            ssm_state=cache.ssm_state,
            out_proj_weight=decoding_matrix(self.out_proj),
            out_proj_bias=self.out_proj.bias,
        )


def decoding_A(mixer: nn.Module) -> torch.Tensor:
    """-exp(mixer.A_log), detached, computed again only when A_log changes (decoding reads it
    once per token and layer): the A that a fused decoding step reads."""
    key = (mixer.A_log._version, mixer.A_log.data_ptr(), mixer.A_log.dtype)
    memo = getattr(mixer, "_decay_memo", None)
    if memo is None or memo[0] != key:
        with torch.no_grad():
            memo = mixer._decay_memo = (key, -torch.exp(upcast(mixer.A_log)))
    return memo[1]
