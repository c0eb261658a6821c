"""The attention mixer (ssm.layers.MHA) against a float64 re-implementation written here, sharing
nothing with the layer: explicit softmax(Q·Kᵀ)·V per head with causal and block masks built by
loops, its own rotary (complex multiplication), its own convolution loop and gated MLP. Forward
and every gradient, for MHA, GQA and MQA, rotary in both layouts, conv and mlp_dim; packed
sequences; prefill + steps; the cache; parameter names; bad arguments."""

from __future__ import annotations

import pytest
import torch

from ssm.layers import MHA, AttentionCache
from tests.helpers import assert_relative, cu_seqlens_of

D_MODEL = 24
CONFIGS = {
    "mha": dict(num_heads=4, causal=True),
    "gqa-rotary": dict(num_heads=6, num_heads_kv=2, head_dim=6, causal=True, rotary_emb_dim=4),
    "mqa-rotary-interleaved": dict(
        num_heads=3, num_heads_kv=1, head_dim=10, causal=True, rotary_emb_dim=6, rotary_emb_interleaved=True
    ),
    "conv-mlp": dict(
        num_heads=4, num_heads_kv=2, causal=True, d_conv=3, mlp_dim=40, rotary_emb_dim=6, rotary_emb_base=500.0
    ),
    "full-rotary-no-bias-scale": dict(
        num_heads=2,
        head_dim=8,
        causal=True,
        rotary_emb_dim=8,
        qkv_proj_bias=False,
        out_proj_bias=False,
        softmax_scale=0.3,
        d_conv=4,
    ),
    "bidirectional": dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=4, d_conv=2),
}


def build(name: str) -> MHA:
    torch.manual_seed(0)
    layer = MHA(D_MODEL, **CONFIGS[name], dtype=torch.float64)
    with torch.no_grad():  # non-zero biases, so that a dropped bias shows
        for p in layer.parameters():
            if p.ndim == 1:
                p.normal_()
    return layer


# ----------------------------------------------------------------------------- the reference


def rotate_ref(x, pos, dim, base, interleaved):
    """x (L, P) at positions pos (L,): each channel pair as a complex number times e^{i·pos·f}."""
    if dim == 0:
        return x
    half = dim // 2
    freq = torch.tensor([base ** (-2.0 * i / dim) for i in range(half)], dtype=torch.float64)
    turn = torch.polar(torch.ones(len(pos), half, dtype=torch.float64), pos[:, None].double() * freq)
    if interleaved:
        z = torch.complex(x[:, 0:dim:2], x[:, 1:dim:2]) * turn
        rotated = torch.stack([z.real, z.imag], dim=-1).reshape(len(pos), dim)
    else:
        z = torch.complex(x[:, :half], x[:, half:dim]) * turn
        rotated = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rotated, x[:, dim:]], dim=-1)


def attention_ref(layer: MHA, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """x (B, L, d_model) → (B, L, d_model), every step spelled out. With cu_seqlens (batch 1),
    each position belongs to a sequence, and nothing (attention, positions, conv) crosses."""
    batch, length, _ = x.shape
    H, Hk, P = layer.num_heads, layer.num_heads_kv, layer.head_dim
    seq = torch.zeros(length, dtype=torch.long)
    pos = torch.arange(length)
    if cu_seqlens is not None:
        for s, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            seq[a:b], pos[a:b] = s, torch.arange(b - a)
    h = x @ layer.in_proj.weight.T
    if layer.in_proj.bias is not None:
        h = h + layer.in_proj.bias
    width = (H + 2 * Hk) * P
    qkv, mlp = h[..., :width], h[..., width:]
    if layer.d_conv > 0:
        w, K = layer.conv1d.weight[:, 0, :], layer.d_conv  # (channels, K), tap K - 1 on the newest input
        conv = []
        for t in range(length):
            acc = layer.conv1d.bias.expand(batch, -1)
            for k in range(K):
                src = t - (K - 1 - k)
                if src >= 0 and seq[src] == seq[t]:
                    acc = acc + w[:, k] * qkv[:, src]
            conv.append(acc)
        qkv = torch.stack(conv, dim=1)
    q = qkv[..., : H * P].reshape(batch, length, H, P)
    k = qkv[..., H * P : (H + Hk) * P].reshape(batch, length, Hk, P)
    v = qkv[..., (H + Hk) * P :].reshape(batch, length, Hk, P)
    scale = layer.softmax_scale if layer.softmax_scale is not None else P**-0.5
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            allowed[i, j] = seq[i] == seq[j] and (not layer.causal or j <= i)
    rot = dict(dim=layer.rotary_emb_dim, base=layer.rotary_emb_base, interleaved=layer.rotary_emb_interleaved)
    heads = []
    for head in range(H):
        g = head // (H // Hk)  # the key/value head this query head reads
        outs = []
        for b in range(batch):
            qh, kh = rotate_ref(q[b, :, head], pos, **rot), rotate_ref(k[b, :, g], pos, **rot)
            scores = (qh @ kh.T * scale).masked_fill(~allowed, float("-inf"))
            weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            outs.append(weights / weights.sum(dim=-1, keepdim=True) @ v[b, :, g])
        heads.append(torch.stack(outs))
    context = torch.cat(heads, dim=-1)  # (B, L, H·P), head-major
    if layer.mlp_dim:
        up, gate = mlp[..., : layer.mlp_dim // 2], mlp[..., layer.mlp_dim // 2 :]
        context = torch.cat([context, up * gate * torch.sigmoid(gate)], dim=-1)
    out = context @ layer.out_proj.weight.T
    return out + layer.out_proj.bias if layer.out_proj.bias is not None else out


def check_forward_and_grads(layer, x, y, y_ref, what):
    assert_relative(y, y_ref, 1e-10, f"{what} output")
    upstream = torch.randn_like(y)
    params = [x, *layer.parameters()]
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad(y, params, upstream)
    grads_ref = torch.autograd.grad(y_ref, params, upstream)
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert_relative(g, g_ref, 1e-9, f"{what} d{name}")


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_and_every_gradient_equal_the_reference(name):
    layer = build(name)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, requires_grad=True)
    check_forward_and_grads(layer, x, layer(x), attention_ref(layer, x), name)


# Equal lengths take the padded-rows path (S·Lmax² < L²); one long sequence among short ones the
# block-diagonal mask (L² < S·Lmax²). Both with an empty sequence.
LAYOUTS = {"rows": [4, 0, 4, 3, 4], "block": [1, 0, 11, 1, 1, 2]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_forward_equals_the_reference_and_each_sequence_alone(name, layout):
    layer = build(name)
    cu = cu_seqlens_of(LAYOUTS[layout])
    x = torch.randn(1, int(cu[-1]), D_MODEL, dtype=torch.float64, requires_grad=True)
    y = layer(x, cu_seqlens=cu)
    check_forward_and_grads(layer, x, y, attention_ref(layer, x, cu), f"{name} packed ({layout})")
    bounds = cu.tolist()
    alone = torch.cat([layer(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1)
    assert_relative(y, alone, 1e-10, f"{name} packed against each alone")


def test_packed_paths_agree():
    """The block-mask and padded-rows paths on the same inputs (the choice is by cost only)."""
    layer = build("conv-mlp")
    cu = cu_seqlens_of([1, 0, 11, 1, 1, 2])
    x = torch.randn(1, 16, D_MODEL, dtype=torch.float64)
    block = layer(x, cu_seqlens=cu)
    rows = layer(x, cu_seqlens=cu, cache=layer.allocate_inference_cache(6))  # the cached path is row-wise
    assert_relative(block, rows, 1e-12, "block mask against rows")


# ----------------------------------------------------------------------------- inference


@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n].get("causal")])
def test_prefill_then_steps_equal_the_forward(name):
    layer = build(name)
    x = torch.randn(3, 14, D_MODEL, dtype=torch.float64)
    full = layer(x)
    cache = layer.allocate_inference_cache(3)
    outs = [layer(x[:, :4], cache=cache), layer(x[:, 4:9], cache=cache)]  # a prefill in two chunks
    with torch.no_grad():  # in place
        outs += [layer.step(x[:, t], cache)[:, None] for t in range(9, 12)]
    outs += [layer.step(x[:, t : t + 1], cache) for t in range(12, 14)]  # with gradients on: new tensors
    assert_relative(torch.cat(outs, dim=1), full, 1e-10, f"{name} prefill + steps")
    assert cache.lengths.tolist() == [14, 14, 14] and cache.key.shape[1] >= 14


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("name", ["conv-mlp", "bidirectional"])
def test_packed_prefill_then_steps_equal_each_sequence_alone(name, grad):
    """A packed prefill of S prompts (one empty) into a cache of batch S, then one token per row
    (with gradients enabled, and without: decoding's one-token path, rows of different lengths);
    the prefill's gradients too (a padded row must not leak NaN into them)."""
    layer = build(name)
    lengths = [3, 0, 7, 1]
    cu = cu_seqlens_of(lengths)
    prompts = torch.randn(1, sum(lengths), D_MODEL, dtype=torch.float64, requires_grad=True)
    tokens = torch.randn(4, 3, D_MODEL, dtype=torch.float64)
    cache = layer.allocate_inference_cache(4)
    prefill = layer(prompts, cache=cache, cu_seqlens=cu)
    check_forward_and_grads(layer, prompts, prefill, layer(prompts, cu_seqlens=cu), f"{name} packed prefill")
    if not layer.causal:
        return  # the steps of a bidirectional layer see only the past: not its forward
    with torch.set_grad_enabled(grad):
        steps = torch.stack([layer.step(tokens[:, t], cache) for t in range(3)], dim=1)
    assert cache.lengths.tolist() == [n + 3 for n in lengths]
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = layer(torch.cat([prompts[:, a:b].detach(), tokens[s : s + 1]], dim=1))
        assert_relative(prefill[:, a:b], alone[:, : b - a], 1e-10, f"sequence {s} prefill")
        assert_relative(steps[s : s + 1], alone[:, b - a :], 1e-10, f"sequence {s} steps")


def test_cache_capacity_and_forward_leave_old_tensors_alone():
    layer = build("gqa-rotary")
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    roomy = layer.allocate_inference_cache(2, max_seqlen=32)
    tight = layer.allocate_inference_cache(2)
    assert roomy.key.shape == (2, 32, 2, 6) and tight.key.shape == (2, 0, 2, 6)
    assert roomy.lengths.dtype == torch.int64 and roomy.conv_state is None
    a, b = layer(x[:, :5], cache=roomy), layer(x[:, :5], cache=tight)
    assert torch.equal(a, b)
    before = [t.clone() for t in roomy.tensors()]
    held = roomy.map(lambda t: t)  # another cache over the same tensors
    layer(x[:, 5:], cache=roomy)
    for t, old in zip(held.tensors(), before):
        assert torch.equal(t, old), "a forward with a cache changed the cache's old tensors in place"
    assert roomy.key.shape[1] == 32 and int(roomy.lengths[0]) == 9


def test_cache_round_trips_through_tensors():
    layer = build("conv-mlp")
    cache = layer.allocate_inference_cache(2)
    layer(torch.randn(2, 5, D_MODEL, dtype=torch.float64), cache=cache)
    again = cache.replace([t.clone() for t in cache.tensors()])
    assert isinstance(again, AttentionCache) and len(cache.tensors()) == 4
    token = torch.randn(2, D_MODEL, dtype=torch.float64)
    assert torch.equal(layer.step(token, cache), layer.step(token, again))


# ----------------------------------------------------------------------------- parameters, errors


def test_parameter_names_and_shapes_are_mamba_ssms():
    """mamba_ssm/modules/mha.py: in_proj (qkv_dim + mlp_dim, d), conv1d (qkv_dim, 1, d_conv) with
    bias, out_proj (d, H·P + mlp_dim / 2); mlp_dim rounded up to 256; no buffers."""
    layer = MHA(64, num_heads=4, num_heads_kv=2, head_dim=24, mlp_dim=300, d_conv=4, rotary_emb_dim=8)
    qkv = 24 * (4 + 2 * 2)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (qkv + 512, 64),
        "in_proj.bias": (qkv + 512,),
        "conv1d.weight": (qkv, 1, 4),
        "conv1d.bias": (qkv,),
        "out_proj.weight": (64, 4 * 24 + 256),
        "out_proj.bias": (64,),
    }
    plain = MHA(64, num_heads=8, qkv_proj_bias=False, out_proj_bias=False)
    assert {k: tuple(v.shape) for k, v in plain.state_dict().items()} == {
        "in_proj.weight": (3 * 64, 64),
        "out_proj.weight": (64, 64),
    }
    assert plain.causal is False and plain.head_dim == 8 and plain.num_heads_kv == 8  # mamba-ssm's defaults


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_heads=6, num_heads_kv=4), "num_heads_kv"),
        (dict(num_heads=5), "num_heads"),  # 24 % 5, no head_dim
        (dict(num_heads=4, rotary_emb_dim=3), "rotary_emb_dim"),
        (dict(num_heads=4, rotary_emb_dim=8), "rotary_emb_dim"),  # > head_dim 6
        (dict(num_heads=4, d_conv=-1), "d_conv"),
        (dict(num_heads=0), "num_heads"),
    ],
)
def test_bad_arguments_are_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MHA(D_MODEL, **kwargs)


def test_bad_inputs_are_errors():
    layer = build("mha")
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(2, 5, D_MODEL + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch size"):
        layer(torch.randn(2, 5, D_MODEL, dtype=torch.float64), cache=layer.allocate_inference_cache(3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(1, 5, D_MODEL, dtype=torch.float64), cu_seqlens=torch.tensor([0, 2, 4]))
