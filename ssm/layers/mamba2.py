"""The Mamba-2 (SSD) mixer, with mamba-ssm's parameter names, shapes and initialisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..distributed import conv_state_from_previous_rank, from_last_rank, scan_with_passed_state, slice_packing
from ..ops import GatedMLPWeights, Mamba2BlockWeights, causal_conv1d_silu, causal_conv1d_step
from ..scan import ssd, ssd_step
from .arguments import check_divides, check_dt_range, check_int, check_number
from .cache import LayerCache, check_packing, check_sequence, check_token
from .context import check_context_parallel
from .linear import Linear
from .mamba import decoding_A, dt_bias_init, no_weight_decay
from .norm import RMSNorm, RMSNormGated, upcast
from .quant import decoding_matrix


class Mamba2(nn.Module):
    """The Mamba-2 mixer: in_proj → (z, xBC, dt) → causal depthwise conv1d on xBC → SiLU →
    SSD scan over H heads of P = headdim channels → gated RMSNorm with z → out_proj.

    Input and output (batch, L, d_model). d_inner = expand·d_model; the SSM runs on
    d_ssm = H·P channels (d_inner by default); any remaining d_inner − d_ssm channels form a
    gated MLP branch, as in mamba-ssm. B and C have G = ngroups groups of N = d_state.
    Parameters (as mamba-ssm's ``Mamba2``): in_proj (2·d_inner + 2·G·N + H, d_model),
    conv1d (d_ssm + 2·G·N, 1, d_conv) + bias, dt_bias (H,), A_log (H,), D (H,) or (d_ssm,),
    norm.weight (d_ssm,), out_proj (d_model, d_inner).
    ``backend`` is passed to ``ssm.scan.ssd``. ``dt_limit`` clamps Δ in ``step`` as in
    ``forward`` (mamba-ssm's and transformers' steps ignore it), so decoding equals the forward.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        headdim: int = 64,
        d_ssm: int | None = None,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        use_mem_eff_path: bool = True,  # accepted for mamba-ssm compatibility; no effect
        layer_idx: int | None = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.d_inner, self.d_ssm, self.nheads = self.check_arguments(
            d_model, d_state, d_conv, conv_init, expand, headdim, d_ssm, ngroups, A_init_range,
            dt_min, dt_max, dt_init_floor, dt_limit, chunk_size,
        )  # fmt: skip
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.headdim, self.ngroups = headdim, ngroups
        self.D_has_hdim, self.rmsnorm = D_has_hdim, rmsnorm
        self.dt_limit, self.chunk_size = tuple(dt_limit), chunk_size
        self.layer_idx, self.backend = layer_idx, backend
        self.d_mlp = self.d_inner - self.d_ssm  # channels of the gated MLP branch (usually 0)
        self.conv_dim = self.d_ssm + 2 * ngroups * d_state

        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = Linear(d_model, d_in_proj, bias=bias, **kw)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1, bias=conv_bias, **kw
        )
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.dt_bias = no_weight_decay(nn.Parameter(dt_bias_init(self.nheads, dt_min, dt_max, dt_init_floor, device)))
        self.dt_bias._no_reinit = True
        lo, hi = A_init_range
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(lo, hi)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(A)))
        self.D = no_weight_decay(nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device)))
        if rmsnorm:
            self.norm = RMSNormGated(
                self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate, group_size=self.d_ssm // ngroups, **kw
            )
        self.out_proj = Linear(self.d_inner, d_model, bias=bias, **kw)

    @staticmethod
    def check_arguments(
        d_model, d_state, d_conv, conv_init, expand, headdim, d_ssm, ngroups, A_init_range,
        dt_min, dt_max, dt_init_floor, dt_limit, chunk_size, **_,
    ) -> tuple[int, int, int]:  # fmt: skip
        """The constructor's checks of its arguments (also run on a config's ssm_cfg by
        ``MambaConfig``): every size an int >= 1, headdim dividing d_ssm <= d_inner, ngroups
        dividing the heads. Returns (d_inner, d_ssm, nheads)."""
        check_int("Mamba2", "d_model", d_model)
        check_int("Mamba2", "d_state", d_state, what=" (the state size N)")
        check_int("Mamba2", "d_conv", d_conv, what=" (the causal convolution's width)")
        check_int("Mamba2", "expand", expand, what=" (d_inner = expand·d_model)")
        check_int("Mamba2", "headdim", headdim, what=" (the head dim P)")
        check_int("Mamba2", "ngroups", ngroups)
        check_int("Mamba2", "chunk_size", chunk_size)
        d_inner = expand * d_model
        if d_ssm is not None:
            check_int("Mamba2", "d_ssm", d_ssm, what=f" and <= d_inner = {d_inner}")
            if d_ssm > d_inner:
                raise ValueError(f"Mamba2: d_ssm must be <= d_inner = expand·d_model = {d_inner}, got {d_ssm}")
        d_ssm = d_inner if d_ssm is None else d_ssm
        check_divides("Mamba2", "headdim", headdim, "d_ssm", d_ssm)
        nheads = d_ssm // headdim
        if nheads % ngroups:
            raise ValueError(f"Mamba2: ngroups = {ngroups} must divide the number of heads {nheads}")
        if conv_init is not None:
            check_number("Mamba2", "conv_init", conv_init, strict=False)
        low, high = _pair("A_init_range", A_init_range)
        if not 0 < low <= high:
            raise ValueError(f"Mamba2: A_init_range must satisfy 0 < low <= high, got {A_init_range!r}")
        low, high = _pair("dt_limit", dt_limit)
        if not 0 <= low <= high:
            raise ValueError(f"Mamba2: dt_limit must be a pair (low, high) with 0 <= low <= high, got {dt_limit!r}")
        check_dt_range("Mamba2", dt_min, dt_max, dt_init_floor)
        return d_inner, d_ssm, nheads

    def _D(self) -> torch.Tensor:
        return upcast(self.D).view(self.nheads, self.headdim) if self.D_has_hdim else upcast(self.D)

    def _split(self, zxbcdt: torch.Tensor):
        """in_proj output (..., d_in_proj) → z0, x0 (MLP branch), z, xBC, dt."""
        m = self.d_mlp
        return zxbcdt.split([m, m, self.d_ssm, self.conv_dim, self.nheads], dim=-1)

    def _finish(self, y, z, z0, x0):
        """y (..., d_ssm) → gated norm → (MLP branch) → out_proj."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    def allocate_inference_cache(self, batch: int, dtype=None, device=None) -> LayerCache:
        return LayerCache.zeros(batch, self.conv1d, (self.nheads, self.headdim, self.d_state), dtype, device)

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

        ``cp_group``: a torch.distributed process group of W ranks over which each sequence is
        split (context parallelism): this rank's ``hidden_states`` are positions
        [r·L/W, (r+1)·L/W) of the whole, and its output those positions of the whole's output.
        The conv reads its halo from the previous rank and the scan starts from the state the
        ranks before pass it (``ssm.distributed``); every rank of the group must call this
        together. With ``cache`` (the same on every rank: the state before the whole sequence),
        every rank's cache is left holding the state after the whole sequence. Not with
        ``last``. With it, ``cu_seqlens`` holds the boundaries of the whole row (up to W·L), the
        same on every rank; a sequence may cross ranks (not with a cache).

        ``cu_seqlens`` (S + 1,): S sequences packed along L in a batch of one (see
        ``ssm.scan.ssd``); neither the convolution nor the scan crosses a boundary, so each
        sequence's outputs are those it would get alone. With a cache, the cache holds one
        state per sequence (batch S): each continues from its own and keeps its own.

        ``last`` > 0 (without ``cu_seqlens``): only the outputs of the last ``last`` positions,
        (batch, last, d_model); the gated norm, the MLP branch and out_proj run on those only."""
        if last > 0 and cu_seqlens is not None:
            raise ValueError("last: only without cu_seqlens (packed sequences have no common last positions)")
        check_sequence("hidden_states", hidden_states, self.d_model)
        batch, length, _ = hidden_states.shape
        packing = None
        if cp_group is not None:
            check_context_parallel("Mamba2", cache, cu_seqlens, last)
            if cu_seqlens is not None:  # the whole row's boundaries, seen from this slice
                packing = slice_packing(cu_seqlens, length, cp_group, hidden_states.device)
                cu_seqlens = packing.local
        packed = check_packing(cu_seqlens, hidden_states)  # validated once; the ops take its tensor
        cu_seqlens = None if packed is None else packed.cu_seqlens
        if cache is not None:
            cache.check_batch(batch if packed is None else packed.num_sequences)
        z0, x0, z, xBC, dt = self._split(self.in_proj(hidden_states))
        conv_state = None if cache is None else cache.conv_state
        if cp_group is not None:  # the previous rank's last d_conv - 1 inputs
            conv_state = conv_state_from_previous_rank(xBC, self.d_conv, cp_group, packing, conv_state)
        xBC, conv_state = causal_conv1d_silu(xBC, self.conv1d.weight, self.conv1d.bias, conv_state, cu_seqlens)
        x, B, C = xBC.split([self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        x = rearrange(x, "b l (h p) -> b l h p", p=self.headdim)
        B, C = (rearrange(t, "b l (g n) -> b l g n", g=self.ngroups) for t in (B, C))
        A = -torch.exp(upcast(self.A_log))

        def scan(initial_state):
            return ssd(
                x,
                dt,
                A,
                B,
                C,
                self._D(),
                None if self.rmsnorm else rearrange(z, "b l (h p) -> b l h p", p=self.headdim),
                dt_bias=upcast(self.dt_bias),
                dt_softplus=True,
                dt_limit=self.dt_limit,
                initial_state=initial_state,
                return_last_state=True,
                chunk_size=self.chunk_size,
                cu_seqlens=packed,
                backend=self.backend,
            )

        if cp_group is not None:
            # the gated norm leaves the scan linear in its state: add the entering state's part
            added = (lambda h, n: self._contribution(h, dt[:, :n], A, C[:, :n])) if self.rmsnorm else None
            initial = None if cache is None else cache.ssm_state
            y, whole = scan_with_passed_state(
                scan, lambda start: self._log_decay(dt[:, start:], A), cp_group, packing, added, initial
            )
            if cache is not None:  # the state after the whole sequence, on every rank
                cache.ssm_state = whole
                if conv_state is not None:
                    cache.conv_state = from_last_rank(conv_state, cp_group)
            return self._finish(rearrange(y, "b l h p -> b l (h p)"), z, z0, x0)
        y, last_state = scan(None if cache is None else cache.ssm_state)
        if cache is not None:
            cache.conv_state, cache.ssm_state = conv_state, last_state
        if last > 0:  # every op after the scan acts on each position alone
            y, z, z0, x0 = (t[:, -last:] for t in (y, z, z0, x0))
        return self._finish(rearrange(y, "b l h p -> b l (h p)"), z, z0, x0)

    def _delta(self, dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """Δ as ``ssd`` makes it from dt (bias, softplus, dt_limit), in the scan's compute dtype
        (float64 for float64 inputs, though A_log is float32; float32 for 16-bit ones)."""
        delta = F.softplus(dt.to(torch.promote_types(dt.dtype, A.dtype)) + upcast(self.dt_bias))
        if tuple(self.dt_limit) != (0.0, float("inf")):
            delta = delta.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        return delta

    def _log_decay(self, dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """log of the slice's total decay per head, (batch, H, 1, 1) against the state (batch,
        H, P, N): A·Σ_t Δ_t."""
        return (self._delta(dt, A).sum(1) * A)[..., None, None]

    def _contribution(self, state, dt, A, C) -> torch.Tensor:
        """What ``state`` (batch, H, P, N), entering before the first of dt's positions, adds
        to ``ssd``'s outputs there (no gate inside the scan): y_t += C_t·(exp(A·Σ_{s<=t} Δ_s)·h),
        (batch, n, H, P)."""
        decay = torch.exp(torch.cumsum(self._delta(dt, A), 1) * A)  # (batch, n, H)
        batch, heads, P, N = state.shape  # head h reads group h // (H / G): (G, H / G) heads
        grouped = state.view(batch, self.ngroups, heads // self.ngroups, P, N)
        y = torch.einsum("blgn,bgkpn->blgkp", C.to(state.dtype), grouped)  # no copy of C per head
        return y.reshape(batch, -1, heads, P) * decay[..., None]

    def step(self, hidden_states: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """One token: (batch, d_model) or (batch, 1, d_model) → the same shape. O(1) in the
        number of tokens seen; updates ``cache``."""
        u = check_token("hidden_states", hidden_states, self.d_model)
        batch = u.shape[0]
        cache.check_batch(batch)
        z0, x0, z, xBC, dt = self._split(self.in_proj(u))
        xBC, cache.conv_state = causal_conv1d_step(xBC, self.conv1d.weight, self.conv1d.bias, cache.conv_state)
        x, B, C = F.silu(xBC).split([self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        # Plain reshapes here: the one-token step runs once per layer per generated token, where
        # einops' per-call overhead (microseconds) is not negligible against the work.
        heads, groups = (batch, self.nheads, self.headdim), (batch, self.ngroups, self.d_state)
        y, cache.ssm_state = ssd_step(
            cache.ssm_state,
            x.reshape(heads),
            dt,
            -torch.exp(upcast(self.A_log)),
            B.reshape(groups),
            C.reshape(groups),
            self._D(),
            None if self.rmsnorm else z.reshape(heads),
            dt_bias=upcast(self.dt_bias),
            dt_softplus=True,
            dt_limit=self.dt_limit,
        )
        out = self._finish(y.reshape(batch, self.d_ssm), z, z0, x0)
        return out if hidden_states.ndim == 2 else out[:, None]

    def step_weights(
        self, norm: nn.Module, cache: LayerCache, mlp: GatedMLPWeights | None = None
    ) -> Mamba2BlockWeights | None:
        """What ``ssm.ops.mamba_blocks_step`` needs to run the decoding step of a block around
        this mixer (residual, ``norm``, this mixer's step, which updates ``cache`` in place, then
        the block's ``mlp`` if any) in C, or None where it cannot (a norm other than RMSNorm).
        The model's backbone collects these from every block and steps the whole stack in one
        call."""
        if not isinstance(norm, RMSNorm):
            return None
        gate = self.norm if self.rmsnorm else None
        return Mamba2BlockWeights(
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            in_proj_weight=decoding_matrix(self.in_proj),
            in_proj_bias=self.in_proj.bias,
            conv_weight=self.conv1d.weight,
            conv_bias=self.conv1d.bias,
            conv_state=cache.conv_state,
            dt_bias=self.dt_bias,
            A=decoding_A(self),
            D=self.D,
            ssm_state=cache.ssm_state,
            ngroups=self.ngroups,
            dt_limit=self.dt_limit,
            gate_norm_weight=None if gate is None else gate.weight,
            gate_norm_eps=0.0 if gate is None else gate.eps,
            gate_norm_group=self.d_ssm if gate is None else gate.group_size,
            norm_before_gate=False if gate is None else gate.norm_before_gate,
            out_proj_weight=decoding_matrix(self.out_proj),
            out_proj_bias=self.out_proj.bias,
            mlp=mlp,
        )


def _pair(name: str, value) -> tuple[float, float]:
    """A (low, high) pair of real numbers, or a ValueError naming it."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v != v for v in value):
        raise ValueError(f"Mamba2: {name} must be a pair of numbers (low, high), got {value!r}")
    return float(value[0]), float(value[1])
