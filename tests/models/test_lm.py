"""MambaLM: keys as mamba-ssm, prefill + step equals forward, O(1) decoding, generation, errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ssm import MambaConfig, MambaLM
from ssm.models import sample

CONFIGS = {
    "mamba1": dict(ssm_cfg={"d_state": 8}),
    "mamba2+mlp": dict(ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4}, d_intermediate=40),
    "layernorm-fp16-residual": dict(rms_norm=False, residual_in_fp32=False, tie_embeddings=False),
}


def tiny(kind="mamba1", **kw) -> MambaLM:
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layer=2, vocab_size=45, **{**CONFIGS[kind], **kw})
    return MambaLM(cfg).double().eval()


def test_state_dict_keys_are_mamba_ssm_s():
    model = MambaLM(MambaConfig(d_model=768, n_layer=24, vocab_size=50277), device="meta")
    sd = model.state_dict()
    assert sd["backbone.embedding.weight"].shape == (50280, 768)  # padded to a multiple of 8
    assert sd["lm_head.weight"].shape == (50280, 768)
    assert sd["backbone.norm_f.weight"].shape == (768,)
    assert sd["backbone.layers.23.norm.weight"].shape == (768,)
    assert sd["backbone.layers.0.mixer.x_proj.weight"].shape == (80, 1536)
    assert len(sd) == 3 + 24 * 10
    assert model.lm_head.weight is model.backbone.embedding.weight


@pytest.mark.parametrize("kind", CONFIGS)
def test_prefill_then_steps_equals_forward(kind):
    model = tiny(kind)
    ids = torch.randint(0, 45, (3, 17), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = model.allocate_inference_cache(3, dtype=torch.float64)
    logits = [model(ids[:, :7], cache=cache)]
    logits += [model.step(ids[:, t], cache)[:, None] for t in range(7, 17)]
    assert cache.seqlen_offset == 17
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_num_last_tokens(kind, dtype):
    """num_last_tokens = k gives the last k rows of the full logits, and leaves the same states
    in a cache, whether the last block computes only those positions (Mamba-1) or cuts them; k
    above L gives all L. In bfloat16 the same bits: the gate is not moved out of the scan there,
    where it would round the scan's output to 16 bits before gating it."""
    model = tiny(kind).to(dtype)
    ids = torch.randint(0, 45, (2, 9), generator=torch.Generator().manual_seed(3))
    full_cache, cache = (model.allocate_inference_cache(2, dtype=dtype) for _ in range(2))
    full = model(ids, cache=full_cache)
    for k in (1, 2, 9, 20):
        if dtype == torch.bfloat16:
            assert torch.equal(model(ids, num_last_tokens=k), full[:, -k:]), k
        torch.testing.assert_close(model(ids, num_last_tokens=k), full[:, -k:])
    torch.testing.assert_close(model(ids, cache=cache, num_last_tokens=1), full[:, -1:])
    for mine, want in zip(cache.layers, full_cache.layers):
        torch.testing.assert_close(mine.ssm_state, want.ssm_state)
        torch.testing.assert_close(mine.conv_state, want.conv_state)


@pytest.mark.parametrize("kind", ["mamba1", "mamba2+mlp"])
def test_num_last_tokens_spares_the_last_blocks_work_on_other_positions(kind):
    """With num_last_tokens = 1 the last Mamba-1 or Mamba-2 block runs its gate and out_proj on
    one position, not L: the forward's matmul FLOPs drop by at least out_proj's on L - 1 rows."""
    model = tiny(kind)
    ids = torch.randint(0, 45, (2, 64))

    def flops(**kw):
        with FlopCounterMode(display=False) as counter:
            model(ids, **kw)
        return counter.get_total_flops()

    block = model.backbone.layers[-1]
    per_row = [model.lm_head.weight, block.mixer.out_proj.weight]  # the matmuls on each position
    per_row += [] if block.mlp is None else [block.mlp.fc1.weight, block.mlp.fc2.weight]
    spared = sum(2 * 2 * 63 * w.numel() for w in per_row)  # batch 2, 63 positions, 2 FLOPs a multiply-add
    assert flops() - flops(num_last_tokens=1) >= spared


def test_decoding_is_constant_cost():
    """The cache keeps its size and a step costs the same at position 10 and at position 2000:
    the step reads the cache, never the prompt."""
    model = tiny().float()
    cache = model.allocate_inference_cache(1)
    shapes = [(c.conv_state.shape, c.ssm_state.shape) for c in cache.layers]

    def step_flops():
        with FlopCounterMode(display=False) as counter:
            model.step(torch.tensor([3]), cache)
        return counter.get_total_flops()

    model(torch.randint(0, 45, (1, 10)), cache=cache)
    early = step_flops()
    model(torch.randint(0, 45, (1, 1990)), cache=cache)
    late = step_flops()
    assert cache.seqlen_offset == 2002
    assert early == late > 0
    assert [(c.conv_state.shape, c.ssm_state.shape) for c in cache.layers] == shapes


@pytest.mark.parametrize("kind", ["mamba1", "mamba2+mlp"])
def test_greedy_generation_equals_repeated_full_forward(kind):
    model = tiny(kind)
    ids = torch.randint(0, 45, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, 8, temperature=0)
    seq = ids
    for _ in range(8):
        seq = torch.cat([seq, model(seq)[:, -1, :45].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_generation_runs_the_c_step_prepared_once(monkeypatch):
    """``generate`` on the CPU prepares the blocks' C step once and runs it for every token
    after the first (its arguments are not looked up again); the tokens are still those of
    repeated full forwards (which share none of its code), also past a sequence's first steps."""
    from ssm.native import library
    from ssm.ops import decode

    if library() is None:
        pytest.fail("the cpu kernels did not build: the prepared step is untested")
    calls, prepared = [], []
    run, prepare = decode.MambaBlocksStep.__call__, decode.MambaBlocksStep.prepare.__func__

    def spy_prepare(cls, *args, **kwargs):
        prepared.append(1)
        return prepare(cls, *args, **kwargs)

    def spy_run(self):
        calls.append(1)
        return run(self)

    monkeypatch.setattr(decode.MambaBlocksStep, "prepare", classmethod(spy_prepare))
    monkeypatch.setattr(decode.MambaBlocksStep, "__call__", spy_run)
    model = tiny("mamba1")
    ids = torch.randint(0, 45, (3, 5), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, 12, temperature=0)
    assert prepared == [1] and len(calls) == 11
    seq = ids
    for _ in range(12):
        seq = torch.cat([seq, model(seq)[:, -1, :45].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = tiny()
    ids = torch.randint(0, 45, (2, 4))
    a = model.generate(ids, 6, generator=torch.Generator().manual_seed(5))
    b = model.generate(ids, 6, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (2, 10) and torch.equal(a[:, :4], ids)
    assert torch.equal(model.generate(ids, 6, top_k=1), model.generate(ids, 6, temperature=0))


def test_padded_vocabulary_is_never_sampled():
    model = tiny()  # vocab 45 padded to 48
    with torch.no_grad():
        model.lm_head.weight[45:] = 100.0  # make the padding rows win any argmax
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0)
    assert out.max() < 45


def test_eos_stops_each_sequence():
    logits = torch.full((2, 10), -10.0)
    logits[0, 4], logits[1, 7] = 5.0, 5.0
    assert sample(logits, temperature=0).tolist() == [4, 7]
    model = tiny()
    ids = torch.randint(0, 45, (3, 4), generator=torch.Generator().manual_seed(3))
    greedy = model.generate(ids, 12, temperature=0)
    eos = int(greedy[0, 6])  # the 3rd generated token of the first sequence
    out = model.generate(ids, 12, temperature=0, eos_token_id=eos)
    for row, ref in zip(out, greedy):
        hits = (ref[4:] == eos).nonzero()
        if len(hits):
            stop = 4 + int(hits[0])
            assert torch.equal(row[: stop + 1], ref[: stop + 1])
            assert (row[stop:] == eos).all()
        else:
            assert torch.equal(row, ref[: len(row)])


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, top_p=0.7, generator=g)) for _ in range(200)}
    assert draws == {0, 1}


def test_bad_inputs():
    model = tiny()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size = 45\)"):
        model(torch.tensor([[1, 45]]))
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of shape \(batch, L\)"):
        model(torch.randn(2, 3))
    cache = model.allocate_inference_cache(2)
    with pytest.raises(ValueError, match="cache was allocated for batch size 2, but input_ids has batch size 3"):
        model.step(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.tensor([[1]]), 3, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.tensor([[1]]), -1)
    with pytest.raises(ValueError, match=r"ssm_cfg\['layer'\] must be one of"):
        MambaConfig(ssm_cfg={"layer": "Mamba4"})
    with pytest.raises(ValueError, match=r"unknown ssm_cfg key\(s\) \['d_sate'\] for Mamba"):
        MambaLM(MambaConfig(d_model=8, n_layer=1, vocab_size=5, ssm_cfg={"d_sate": 4}))


def test_training_step_reduces_loss():
    """The model trains: a few AdamW steps on one batch lower its loss."""
    model = tiny().float().train()
    ids = torch.randint(0, 45, (4, 12), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


FUSED_CONFIGS = {
    "default": dict(ssm_cfg={"d_state": 8}),
    # odd sizes (d_model 22, d_inner 22: projections not a multiple of 4 rows), biases on the
    # projections, no conv bias, dt_rank 3
    "odd-biased": dict(d_model=22, ssm_cfg={"d_state": 5, "expand": 1, "dt_rank": 3, "bias": True, "conv_bias": False}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", FUSED_CONFIGS)
def test_the_blocks_step_in_one_c_call_equals_the_tensor_path(kind, dtype, monkeypatch):
    """On the CPU without gradients the step of every Mamba-1 block (residual, RMSNorm, the
    mixer) is one C call; it must be taken, and give what the tensor formulas give (the C
    one-step kernel of the scan switched off too, so that nothing is shared), logits and both
    cache states of every layer. Three layers: the blocks' outputs alternate between two
    buffers."""
    import ssm.models.fused_step as fused_module
    import ssm.scan.step as step_module
    from ssm.native import library

    if library() is None:
        pytest.fail("the cpu kernels did not build: the fused block step is untested")
    cfg = FUSED_CONFIGS[kind]
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(n_layer=3, vocab_size=45, **{"d_model": 32, **cfg})).to(dtype).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(0, 45, (3, 12), generator=torch.Generator().manual_seed(1))
    taken = []
    fused_step, c_step = fused_module.mamba_blocks_step, step_module.selective_step_cpu

    def spy(*args, **kwargs):
        out = fused_step(*args, **kwargs)
        taken.append(out is not None)
        return out

    def decode(fused: bool):
        monkeypatch.setattr(fused_module, "mamba_blocks_step", spy if fused else lambda *a, **k: None)
        monkeypatch.setattr(step_module, "selective_step_cpu", c_step if fused else lambda *a: None)
        cache = model.allocate_inference_cache(3, dtype=dtype)
        with torch.no_grad():
            model(ids[:, :5], cache=cache)
            for layer_cache in cache.layers:
                layer_cache.conv_state = layer_cache.conv_state.contiguous()
            logits = torch.stack([model.step(ids[:, t], cache) for t in range(5, 12)], 1)
        return logits, cache

    fused_logits, fused_cache = decode(True)
    assert taken and all(taken), "the fused step was not taken"
    logits, cache = decode(False)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(fused_logits, logits, rtol=tol, atol=tol)
    for mine, theirs in zip(fused_cache.layers, cache.layers):
        torch.testing.assert_close(mine.conv_state, theirs.conv_state, rtol=tol, atol=tol)
        torch.testing.assert_close(mine.ssm_state, theirs.ssm_state, rtol=tol, atol=tol)


def test_the_fused_blocks_step_is_not_taken_where_it_does_not_apply(monkeypatch):
    """LayerNorm blocks, a gradient to keep: the tensor path (and still prefill + steps = forward)."""
    import ssm.models.fused_step as fused_module

    calls = []
    fused_step = fused_module.mamba_blocks_step

    def spy(*args, **kwargs):
        out = fused_step(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_module, "mamba_blocks_step", spy)
    ids = torch.randint(0, 45, (2, 6), generator=torch.Generator().manual_seed(1))
    for kind, grad in (("layernorm-fp16-residual", False), ("mamba1", True)):
        model = tiny(kind)
        cache = model.allocate_inference_cache(2, dtype=torch.float64)
        with torch.set_grad_enabled(grad):
            model(ids[:, :5], cache=cache)
            step = model.step(ids[:, 5], cache)
        assert step.requires_grad == grad
        torch.testing.assert_close(step, model(ids)[:, -1], rtol=1e-9, atol=1e-9)
    assert calls == [False]  # LayerNorm: never asked; with a gradient: declined


class _CountingSyncs(torch.Tensor):
    """A tensor that counts the host reads (tolist, item, int, bool) made of it and of every
    tensor computed from it: on CUDA each one waits for the device."""

    reads = 0
    _READS = (
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # integer tensors only: the boundaries and what is computed from them (the data a mask
        # built from them touches is a subclass too; the chunked CPU forms' cheap finiteness
        # check reads a bool on the CPU only, never on CUDA)
        if func in cls._READS and args[0].dtype in (torch.int32, torch.int64):
            _CountingSyncs.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_cu_seqlens_is_read_once_per_forward():
    """A hybrid (Mamba-1, attention, Mamba-1, Mamba-2, Mamba-3 blocks) validates its packing where it enters,
    once, and hands it down validated: one host read of cu_seqlens for the whole forward, and
    the same logits as with a plain tensor. A layer called alone validates a tensor once, and a
    ``PackedSequences`` not at all."""
    from ssm import Mamba
    from ssm.scan import PackedSequences, packed_sequences

    torch.manual_seed(0)
    config = MambaConfig(
        d_model=32,
        n_layer=3,
        vocab_size=45,
        ssm_cfg={"d_state": 8},
        attn_layer_idx=[1],
        attn_cfg={"num_heads": 4, "causal": True},
    )
    model = MambaLM(config).double().eval()
    for layer in ("Mamba2", "Mamba3"):  # a Mamba-2 and a Mamba-3 block last (Mamba-3's chunked backend)
        other = MambaLM(MambaConfig(d_model=32, n_layer=1, ssm_cfg={"layer": layer, "headdim": 8})).double()
        model.backbone.layers.append(other.backbone.layers[0])
    ids = torch.randint(0, 45, (1, 20), generator=torch.Generator().manual_seed(1))
    plain = torch.tensor([0, 5, 5, 12, 20])
    counted = plain.clone().as_subclass(_CountingSyncs)
    _CountingSyncs.reads = 0
    with torch.no_grad():
        logits = model(ids, cu_seqlens=counted)
        assert _CountingSyncs.reads == 1
        torch.testing.assert_close(logits.as_subclass(torch.Tensor), model(ids, cu_seqlens=plain), rtol=0, atol=0)

    layer = Mamba(32, d_state=8).double()
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    _CountingSyncs.reads = 0
    layer(x, cu_seqlens=plain.clone().as_subclass(_CountingSyncs))
    assert _CountingSyncs.reads == 1
    packed = packed_sequences(plain, 20)
    assert isinstance(packed, PackedSequences) and packed.bounds == (0, 5, 5, 12, 20) and packed.num_sequences == 4
    packed = PackedSequences(plain.clone().as_subclass(_CountingSyncs), packed.bounds)
    _CountingSyncs.reads = 0
    torch.testing.assert_close(
        layer(x, cu_seqlens=packed).as_subclass(torch.Tensor), layer(x, cu_seqlens=plain), rtol=0, atol=0
    )
    assert _CountingSyncs.reads == 0
    with pytest.raises(ValueError, match="cu_seqlens must end at the packed length L = 19, got 20"):
        layer(x[:, :19], cu_seqlens=packed)
