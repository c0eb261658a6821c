"""The attention mixer of hybrid models: mamba-ssm's ``MHA`` (mamba_ssm/modules/mha.py) with its
constructor, defaults, parameter names and shapes, on torch's scaled_dot_product_attention (no
flash-attn needed), with rotary embeddings in both layouts, packed sequences and a KV cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import (
    conv_state_from_previous_rank,
    from_last_rank,
    gather_sequence,
    group_rank_and_size,
    slice_packing,
)
from ..ops import AttentionBlockWeights, GatedMLPWeights, causal_conv1d, causal_conv1d_step
from ..scan import PackedSequences
from .cache import AttentionCache, check_packing, check_sequence, check_token
from .context import check_context_parallel
from .linear import Linear
from .norm import RMSNorm
from .quant import decoding_matrix, float_dtype_and_device


def rotary_frequencies(dim: int, base: float, dtype: torch.dtype, device) -> torch.Tensor:
    """(dim/2,) the rotary frequencies base^(-2i/dim), formed in ``dtype`` (rotary's and the C
    decoding step's)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))


def rotary(x: torch.Tensor, positions: torch.Tensor, dim: int, base: float, interleaved: bool) -> torch.Tensor:
    """x (B, L, H, P) with its first ``dim`` channels of every head rotated by position:
    the pair (a, b) at frequency f_i = base^(-2i/dim) becomes (a·cos θ − b·sin θ, b·cos θ + a·sin θ),
    θ = position·f_i. Pairs are (i, i + dim/2) (GPT-NeoX, flash-attn's default) or (2i, 2i + 1)
    with ``interleaved`` (GPT-J). ``positions`` (L,) or (B, L). Computed in float32 (float64 for
    float64 x), cast back."""
    if dim == 0:
        return x
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = rotary_frequencies(dim, base, work, x.device)  # (dim/2,)
    angle = positions.to(work)[..., None] * inv_freq  # (L, dim/2) or (B, L, dim/2)
    cos, sin = angle.cos()[..., None, :], angle.sin()[..., None, :]  # a head axis to broadcast over
    rot = x[..., :dim].to(work)
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, dim=-1)
    a, b = a * cos - b * sin, b * cos + a * sin
    rot = torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., dim:]], dim=-1)


def _room(cache: AttentionCache, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's key and value with room for ``needed`` tokens per row: themselves, or new
    tensors holding them, grown to at least twice the old capacity (so that decoding copies
    O(tokens) in all)."""
    key, value = cache.key, cache.value
    if needed <= key.shape[1]:
        return key, value
    extra = max(needed, 2 * key.shape[1]) - key.shape[1]
    return tuple(torch.cat([c, c.new_zeros(c.shape[0], extra, *c.shape[2:])], dim=1) for c in (key, value))


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MHA: {name} must be an int >= {minimum}, got {value!r}")


class MHA(nn.Module):
    """Multi-head self-attention as a mixer: in_proj → [q, k, v | MLP] → (causal depthwise conv
    on qkv) → rotary on q and k → softmax(q·kᵀ·scale)·v per head → [context | MLP] → out_proj.

    Input and output (batch, L, d_model = embed_dim). H = num_heads query heads, Hk =
    num_heads_kv key/value heads (H/Hk query heads share each: GQA; Hk = 1: MQA), P = head_dim
    (embed_dim / H by default). ``mlp_dim`` (rounded up to a multiple of 256, as mamba-ssm does)
    fuses a gated MLP into the projections: in_proj also yields [up | gate], and up·silu(gate)
    joins the context before out_proj. ``causal=False`` is mamba-ssm's default; a language model
    needs True. ``softmax_scale`` None is 1/√P. ``rotary_emb_dim`` channels of each q and k head
    are rotated (0: none), with ``rotary_emb_base`` and layout ``rotary_emb_interleaved``.
    Parameters (mamba-ssm's names and shapes): in_proj ((H + 2·Hk)·P + mlp_dim, d_model)
    (+ bias with qkv_proj_bias), conv1d ((H + 2·Hk)·P, 1, d_conv) + bias when d_conv > 0,
    out_proj (d_model, H·P + mlp_dim/2) (+ bias with out_proj_bias). No buffers.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_heads_kv: int | None = None,
        head_dim: int | None = None,
        mlp_dim: int = 0,
        qkv_proj_bias: bool = True,
        out_proj_bias: bool = True,
        softmax_scale: float | None = None,
        causal: bool = False,
        layer_idx: int | None = None,
        d_conv: int = 0,
        rotary_emb_dim: int = 0,
        rotary_emb_base: float = 10000.0,
        rotary_emb_interleaved: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        _check_int("embed_dim", embed_dim, 1)
        _check_int("num_heads", num_heads, 1)
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        _check_int("num_heads_kv", num_heads_kv, 1)
        if num_heads % num_heads_kv:
            raise ValueError(
                f"MHA: num_heads = {num_heads} must be divisible by num_heads_kv = {num_heads_kv} "
                "(each key/value head serves num_heads / num_heads_kv query heads)"
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"MHA: embed_dim = {embed_dim} must be divisible by num_heads = {num_heads} when head_dim is "
                    "not given"
                )
            head_dim = embed_dim // num_heads
        _check_int("head_dim", head_dim, 1)
        _check_int("mlp_dim", mlp_dim, 0)
        _check_int("d_conv", d_conv, 0)
        _check_int("rotary_emb_dim", rotary_emb_dim, 0)
        if rotary_emb_dim % 2:
            raise ValueError(f"MHA: rotary_emb_dim = {rotary_emb_dim} must be even (it rotates pairs of channels)")
        if rotary_emb_dim > head_dim:
            raise ValueError(f"MHA: rotary_emb_dim = {rotary_emb_dim} must be at most head_dim = {head_dim}")
        if not (isinstance(rotary_emb_base, (int, float)) and rotary_emb_base > 0):
            raise ValueError(f"MHA: rotary_emb_base must be a number > 0, got {rotary_emb_base!r}")
        if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
            raise ValueError(f"MHA: softmax_scale must be None or a number > 0, got {softmax_scale!r}")

        self.embed_dim, self.layer_idx, self.causal = embed_dim, layer_idx, bool(causal)
        self.num_heads, self.num_heads_kv, self.head_dim = num_heads, num_heads_kv, head_dim
        self.softmax_scale, self.d_conv = softmax_scale, d_conv
        self.rotary_emb_dim, self.rotary_emb_base = rotary_emb_dim, float(rotary_emb_base)
        self.rotary_emb_interleaved = bool(rotary_emb_interleaved)
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        self.qkv_dim = head_dim * (num_heads + 2 * num_heads_kv)
        out_dim = head_dim * num_heads

        self.in_proj = Linear(embed_dim, self.qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **kw)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(self.qkv_dim, self.qkv_dim, d_conv, padding=d_conv - 1, groups=self.qkv_dim, **kw)
        self.out_proj = Linear(out_dim + self.mlp_dim // 2, embed_dim, bias=out_proj_bias, **kw)

    # ------------------------------------------------------------------ pieces

    def _project(self, x: torch.Tensor):
        """x (..., d_model) → qkv (..., (H + 2Hk)·P), and the MLP branch up·silu(gate) or None."""
        h = self.in_proj(x)
        if self.mlp_dim == 0:
            return h, None
        qkv, up, gate = h.split([self.qkv_dim, self.mlp_dim // 2, self.mlp_dim // 2], dim=-1)
        return qkv, up * F.silu(gate)

    def _heads(self, qkv: torch.Tensor):
        """(..., (H + 2Hk)·P) → q (..., H, P), k and v (..., Hk, P)."""
        H, Hk, P = self.num_heads, self.num_heads_kv, self.head_dim
        q, k, v = qkv.split([H * P, Hk * P, Hk * P], dim=-1)
        return q.unflatten(-1, (H, P)), k.unflatten(-1, (Hk, P)), v.unflatten(-1, (Hk, P))

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotary(x, positions, self.rotary_emb_dim, self.rotary_emb_base, self.rotary_emb_interleaved)

    def _sdpa(self, q, k, v, mask=None, is_causal: bool = False) -> torch.Tensor:
        """q (B, L, H, P), k and v (B, Lk, Hk, P), mask (L, Lk) or (B, 1, L, Lk) bool (True:
        attend) → (B, L, H, P)."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_heads_kv,
        )
        return out.transpose(1, 2)

    def _finish(self, context: torch.Tensor, mlp: torch.Tensor | None) -> torch.Tensor:
        """context (..., H, P) → [context | MLP] → out_proj."""
        context = context.flatten(-2)
        if mlp is not None:
            context = torch.cat([context, mlp], dim=-1)
        return self.out_proj(context)

    # ------------------------------------------------------------------ inference cache

    def allocate_inference_cache(self, batch: int, dtype=None, device=None, max_seqlen: int = 0) -> AttentionCache:
        """An empty cache for ``batch`` rows; ``max_seqlen`` reserves room for that many tokens
        per row (it grows past them on demand). Keys and values in ``dtype`` (default: the
        layer's)."""
        own_dtype, own_device = float_dtype_and_device(self.out_proj)
        dtype, device = dtype or own_dtype, device or own_device
        shape = (batch, max_seqlen, self.num_heads_kv, self.head_dim)
        conv_state = None
        if self.d_conv > 0:
            conv_state = torch.zeros(batch, self.qkv_dim, self.d_conv, dtype=dtype, device=device)
        return AttentionCache(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.int64, device=device),
            conv_state=conv_state,
        )

    def _attend_cached(self, q, k, v, cache: AttentionCache, counts=None, inplace: bool = False) -> torch.Tensor:
        """Attention of new tokens q (B, L, H, P), k and v (B, L, Hk, P) over each row's cached
        keys and themselves; row b's first ``counts[b]`` tokens are real (all L when None), the
        rest padding whose outputs are to be discarded. The new tokens continue each row at its
        own position ``cache.lengths[b]`` (rotary), their keys and values are written there and
        ``lengths`` advances. ``inplace``: write into the cache's tensors (decoding without
        gradients); else the cache gets new tensors and the old ones are left as they were."""
        batch, length = q.shape[:2]
        t = torch.arange(length, device=q.device)
        start = cache.lengths.to(q.device)  # (B,)
        counts = torch.full_like(start, length) if counts is None else counts
        positions = start[:, None] + t  # (B, L)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        new_lengths = start + counts
        keys_needed = int(new_lengths.max()) if batch else 0
        key, value = _room(cache, keys_needed)
        inplace = inplace or key is not cache.key  # new tensors of our own
        rows, steps = (t < counts[:, None]).nonzero(as_tuple=True)  # the real tokens
        where = (rows, positions[rows, steps])
        if inplace:
            key.index_put_(where, k[rows, steps].to(key.dtype))
            value.index_put_(where, v[rows, steps].to(value.dtype))
        else:
            key = key.index_put(where, k[rows, steps].to(key.dtype))
            value = value.index_put(where, v[rows, steps].to(value.dtype))
        cache.key, cache.value, cache.lengths = key, value, new_lengths

        j = torch.arange(keys_needed, device=q.device)
        mask = (j < new_lengths[:, None])[:, None, :]  # (B, 1, Lk): the row's keys
        if self.causal:
            mask = mask & (j <= positions[..., None])  # (B, L, Lk): and none after the query
        # A padded query of an empty row sees nothing; give it key 0 (finite, and discarded): some
        # SDPA kernels return NaN for a row with no key, which would reach the gradients.
        mask = mask | (~mask.any(-1, keepdim=True) & (j == 0))
        keys, values = key[:, :keys_needed].to(q.dtype), value[:, :keys_needed].to(q.dtype)
        return self._sdpa(q, keys, values, mask=mask[:, None])

    def _attend_one(self, q, k, v, cache: AttentionCache) -> torch.Tensor:
        """``_attend_cached`` for one new token per row, without gradients (decoding): q (B, 1,
        H, P), k and v (B, 1, Hk, P); the cache is written in place. Two matmuls and a softmax
        (in float32, or float64) over each row's keys instead of SDPA with a mask; rows of
        different lengths are masked."""
        batch, H, Hk, P = q.shape[0], self.num_heads, self.num_heads_kv, self.head_dim
        start = cache.lengths.to(q.device)  # (B,): each row's position
        q, k = self._rotate(q, start[:, None]), self._rotate(k, start[:, None])
        n = int(start.max()) + 1 if batch else 0
        key, value = _room(cache, n)
        rows = torch.arange(batch, device=q.device)
        key[rows, start] = k[:, 0].to(key.dtype)
        value[rows, start] = v[:, 0].to(value.dtype)
        cache.key, cache.value, cache.lengths = key, value, start + 1
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        scale = self.softmax_scale if self.softmax_scale is not None else P**-0.5
        keys, values = key[:, :n].to(q.dtype), value[:, :n].to(q.dtype)  # (B, n, Hk, P)
        grouped = q[:, 0].unflatten(1, (Hk, H // Hk))  # (B, Hk, G, P): the query heads of each key head
        scores = torch.einsum("bkgp,bnkp->bkgn", grouped, keys).to(work) * scale
        if bool((start != start[0]).any()):  # rows of different lengths: each sees its own keys
            seen = torch.arange(n, device=q.device) <= start[:, None]  # (B, n)
            scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        return torch.einsum("bkgn,bnkp->bkgp", probs, values).flatten(1, 2)[:, None]  # (B, 1, H, P)

    # ------------------------------------------------------------------ forward and step

    context_parallel = True  # forward(cp_group=): see ssm.distributed

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: AttentionCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cp_group=None,
    ) -> torch.Tensor:
        """(batch, L, d_model) → (batch, L, d_model). With ``cache``, continue each row from the
        tokens it holds and append these (prefill, or a chunk of one).

        ``cu_seqlens`` (S + 1,): S sequences packed along L in a batch of one. No query attends
        to another sequence's keys, and positions (rotary) and the convolution restart at each
        sequence's start: each sequence's outputs are those it would get alone. With a cache,
        the cache has batch S: each sequence continues its own row.

        ``cp_group``: context parallelism, as in ``Mamba2.forward``: this rank holds positions
        [r·L/W, (r+1)·L/W). Its queries attend to every rank's keys and values, gathered
        (``ssm.distributed.gather_sequence``), under the causal mask of the whole sequence;
        rotary positions count from the sequence's start; the conv, if any, takes the
        previous rank's last d_conv - 1 inputs. A ``cache`` (the same on every rank) is continued
        and every rank's is left holding the whole sequence's keys and values. ``cu_seqlens``
        (not with a cache) then holds the whole row's boundaries (a sequence may cross ranks;
        the mask keeps each query to its own sequence's keys, and rotary counts from each
        sequence's start)."""
        check_sequence("hidden_states", hidden_states, self.embed_dim)
        batch, length, _ = hidden_states.shape
        packing = None
        if cp_group is not None:
            check_context_parallel("MHA", cache, cu_seqlens, 0)
            if cu_seqlens is not None:
                packing = slice_packing(cu_seqlens, length, cp_group, hidden_states.device)
                cu_seqlens = packing.local
        packed = check_packing(cu_seqlens, hidden_states)
        cu_seqlens = None if packed is None else packed.cu_seqlens
        if cache is not None:
            cache.check_batch(batch if packed is None else packed.num_sequences)
        qkv, mlp = self._project(hidden_states)
        if self.d_conv > 0:
            conv_state = None if cache is None else cache.conv_state
            if cp_group is not None:
                conv_state = conv_state_from_previous_rank(qkv, self.d_conv, cp_group, packing, conv_state)
            conv, conv_state = causal_conv1d(
                qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, conv_state, cu_seqlens
            )
            qkv = conv.transpose(1, 2)
            if cache is not None:  # under cp_group: the last rank's, after the whole sequence
                cache.conv_state = conv_state if cp_group is None else from_last_rank(conv_state, cp_group)
        if cp_group is not None and cache is not None:
            context = self._context_parallel_cached(qkv, cp_group, cache)
        elif cp_group is not None:
            context = self._context_parallel(qkv, cp_group, packing)
        elif length == 0:
            context = qkv.new_zeros(batch, 0, self.num_heads, self.head_dim)
        elif cu_seqlens is not None:
            context = self._packed(qkv, packed, cache)
        elif cache is not None:
            context = self._attend_cached(*self._heads(qkv), cache)
        else:
            q, k, v = self._heads(qkv)
            positions = torch.arange(length, device=qkv.device)
            context = self._sdpa(self._rotate(q, positions), self._rotate(k, positions), v, is_causal=self.causal)
        return self._finish(context, mlp)

    def _context_parallel(self, qkv: torch.Tensor, group, packing) -> torch.Tensor:
        """This rank's queries against the whole row's keys and values (one all_gather of both),
        positions counted from the row's start, or with ``packing`` from each sequence's."""
        q, k, v = self._heads(qkv)
        length, device = qkv.shape[1], qkv.device
        rank, size = group_rank_and_size(group)
        total, offset = length * size, length * rank
        where = torch.arange(total, device=device)  # positions in the whole row
        if packing is not None:
            cu_seqlens = packing.whole.cu_seqlens
            seq = torch.repeat_interleave(
                torch.arange(cu_seqlens.numel() - 1, device=device), cu_seqlens.diff(), output_size=total
            )
            positions = where - cu_seqlens[seq]  # from each sequence's start
        else:
            positions = where
        mine = slice(offset, offset + length)
        q, k = self._rotate(q, positions[mine]), self._rotate(k, positions[mine])
        k, v = gather_sequence(torch.cat([k, v], dim=-1), group).chunk(2, dim=-1)
        mask = None
        if self.causal:
            mask = where[mine, None] >= where  # (L / W, L)
        if packing is not None:
            same = seq[mine, None] == seq
            mask = same if mask is None else mask & same
        return self._sdpa(q, k, v, mask=mask)

    def _context_parallel_cached(self, qkv: torch.Tensor, group, cache: AttentionCache) -> torch.Tensor:
        """``_context_parallel`` continuing ``cache``: each row's positions count from the tokens
        it holds; the whole sequence's keys and values (gathered, rotated) are written into every
        rank's cache, and this rank's queries attend to the row's cached keys and those up to
        their own position."""
        q, k, v = self._heads(qkv)
        rank, size = group_rank_and_size(group)
        length, device = qkv.shape[1], qkv.device
        start = cache.lengths.to(device)  # (B,)
        positions = start[:, None] + rank * length + torch.arange(length, device=device)  # (B, L / W)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        k, v = gather_sequence(torch.cat([k, v], dim=-1), group).chunk(2, dim=-1)  # (B, L, Hk, P)
        total = length * size
        new_lengths = start + total
        keys_needed = int(new_lengths.max())
        key, value = _room(cache, keys_needed)
        rows, steps = torch.ones(k.shape[0], total, dtype=torch.bool, device=device).nonzero(as_tuple=True)
        where = (rows, start[rows] + steps)
        key = key.index_put(where, k[rows, steps].to(key.dtype))
        value = value.index_put(where, v[rows, steps].to(value.dtype))
        cache.key, cache.value, cache.lengths = key, value, new_lengths
        j = torch.arange(keys_needed, device=device)
        mask = (j < new_lengths[:, None])[:, None, :]  # (B, 1, Lk): the row's keys
        if self.causal:
            mask = mask & (j <= positions[..., None])  # (B, L / W, Lk): and none after the query
        keys, values = key[:, :keys_needed].to(q.dtype), value[:, :keys_needed].to(q.dtype)
        return self._sdpa(q, keys, values, mask=mask[:, None])

    def _packed(self, qkv: torch.Tensor, packed: PackedSequences, cache: AttentionCache | None) -> torch.Tensor:
        """Packed attention: qkv (1, L, (H + 2Hk)·P) → context (1, L, H, P). One call over the
        whole row with a block-diagonal mask when that is the cheaper (L² against S·Lmax²,
        Lmax the longest sequence), else the sequences as rows of a right-padded batch
        (S, Lmax), where causal attention needs no mask at all."""
        length = qkv.shape[1]
        cu_seqlens, bounds = packed.cu_seqlens, packed.bounds
        starts, counts = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
        num_seqs, longest = counts.numel(), max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=qkv.device), counts, output_size=length)  # (L,)
        offset = torch.arange(length, device=qkv.device) - starts[seq]  # (L,) position in its sequence
        if cache is None and length * length < num_seqs * longest * longest:
            q, k, v = self._heads(qkv)
            q, k = self._rotate(q, offset), self._rotate(k, offset)
            mask = seq[:, None] == seq[None, :]  # (L, L)
            if self.causal:
                mask = mask & (offset[:, None] >= offset[None, :])
            return self._sdpa(q, k, v, mask=mask)
        t = torch.arange(longest, device=qkv.device)
        rows = qkv[0, (starts[:, None] + t).clamp(max=length - 1)]  # (S, Lmax, ·), padded with repeats
        q, k, v = self._heads(rows)
        if cache is not None:
            context = self._attend_cached(q, k, v, cache, counts)
        else:
            q, k = self._rotate(q, t), self._rotate(k, t)
            if self.causal:  # a real query never reaches the padding after its sequence
                context = self._sdpa(q, k, v, is_causal=True)
            else:
                mask = (t < counts[:, None]) | (t == 0)  # (S, Lmax); key 0 for an empty row (discarded)
                context = self._sdpa(q, k, v, mask=mask[:, None, None, :])
        return context[seq, offset][None]

    def step_weights(
        self, norm: nn.Module, cache: AttentionCache, mlp: GatedMLPWeights | None = None
    ) -> AttentionBlockWeights | None:
        """What ``ssm.ops.mamba_blocks_step`` needs to run the decoding step of a block around
        this mixer (residual, ``norm``, this mixer's step, which appends to ``cache`` in place,
        then the block's ``mlp`` if any) in C, or None where it cannot (a norm other than
        RMSNorm). Makes the cache fit that step first, in place of its tensors: room for one more
        token in every row (grown as the tensor step grows it), contiguous, and a bfloat16 /
        float16 cache widened to float32, the step's states' dtype (the tensor step reads
        either)."""
        if not isinstance(norm, RMSNorm):
            return None
        needed = int(cache.lengths.max()) + 1 if cache.batch_size else 1
        cache.key, cache.value = _room(cache, needed)
        wide = {torch.bfloat16: torch.float32, torch.float16: torch.float32}

        def fit(t):  # a packed prefill leaves the conv state strided; the C step reads it contiguous
            return t.to(wide.get(t.dtype, t.dtype)).contiguous()

        cache.key, cache.value = fit(cache.key), fit(cache.value)
        if cache.conv_state is not None:
            cache.conv_state = fit(cache.conv_state)
        inv_freq = None
        if self.rotary_emb_dim > 0:  # in the dtype rotary() forms them in
            dtype, device = float_dtype_and_device(self.out_proj)
            work = torch.float64 if dtype == torch.float64 else torch.float32
            inv_freq = rotary_frequencies(self.rotary_emb_dim, self.rotary_emb_base, work, device)
        conv = self.d_conv > 0
        return AttentionBlockWeights(
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            in_proj_weight=decoding_matrix(self.in_proj),
            in_proj_bias=self.in_proj.bias,
            conv_weight=self.conv1d.weight if conv else None,
            conv_bias=self.conv1d.bias if conv else None,
            conv_state=cache.conv_state,
            num_heads=self.num_heads,
            num_heads_kv=self.num_heads_kv,
            softmax_scale=self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5,
            inv_freq=inv_freq,
            rotary_interleaved=self.rotary_emb_interleaved,
            key=cache.key,
            value=cache.value,
            lengths=cache.lengths,
            out_proj_weight=decoding_matrix(self.out_proj),
            out_proj_bias=self.out_proj.bias,
            mlp=mlp,
        )

    def step(self, hidden_states: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """One token per row: (batch, d_model) or (batch, 1, d_model) → the same shape; appends
        it to ``cache``. Reads every cached key of the row: the cost grows with the tokens seen.
        Without gradients the cache's tensors are written in place."""
        x = check_token("hidden_states", hidden_states, self.embed_dim)
        cache.check_batch(x.shape[0])
        qkv, mlp = self._project(x)  # (B, (H + 2Hk)·P)
        if self.d_conv > 0:
            qkv, cache.conv_state = causal_conv1d_step(qkv, self.conv1d.weight, self.conv1d.bias, cache.conv_state)
        heads = self._heads(qkv[:, None])
        if torch.is_grad_enabled():
            context = self._attend_cached(*heads, cache)
        else:
            context = self._attend_one(*heads, cache)
        out = self._finish(context[:, 0], mlp)
        return out if hidden_states.ndim == 2 else out[:, None]
