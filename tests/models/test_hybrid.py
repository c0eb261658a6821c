"""Hybrid MambaLMs (mamba-ssm's attn_layer_idx / attn_cfg): attention layers among Mamba-1, Mamba-2
and Mamba-3 layers. Prefill + steps equal the forward, packed sequences equal each alone,
left-padded batched generation equals each prompt alone, checkpoints in mamba-ssm's layout
round-trip, and bad hybrid configs are errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from ssm import Mamba, Mamba2, Mamba3, MambaConfig, MambaLM
from ssm.layers import MHA
from tests.helpers import cu_seqlens_of

ATTN = dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=4, d_conv=3)
HYBRIDS = {
    "mamba1": dict(ssm_cfg={"d_state": 8}, attn_layer_idx=[1], attn_cfg=ATTN),
    "mamba2": dict(
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4, "A_init_range": (0.01, 0.1)},
        d_intermediate=40,
        attn_layer_idx=[0, 2],
        attn_cfg={**ATTN, "mlp_dim": 20, "rotary_emb_interleaved": True},
    ),
    "mamba3": dict(
        ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4},
        attn_layer_idx=[2],
        attn_cfg=dict(num_heads=2, num_heads_kv=1, head_dim=12, causal=True, rotary_emb_dim=12),
    ),
}
MIXER = {"mamba1": Mamba, "mamba2": Mamba2, "mamba3": Mamba3}


def tiny(kind) -> MambaLM:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=32, n_layer=3, vocab_size=45, **HYBRIDS[kind]))
    with torch.no_grad():  # larger embeddings than mamba-ssm's N(0, 0.02²): greedy tokens that vary
        model.backbone.embedding.weight.normal_()
    return model.double().eval()


def ids(shape, seed=1):
    return torch.randint(0, 45, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", HYBRIDS)
def test_attention_layers_sit_where_attn_layer_idx_says(kind):
    model = tiny(kind)
    for i, block in enumerate(model.backbone.layers):
        expected = MHA if i in model.config.attn_layer_idx else MIXER[kind]
        assert type(block.mixer) is expected and block.mixer.layer_idx == i
    attn = model.backbone.layers[model.config.attn_layer_idx[0]].mixer
    assert attn.causal and attn.in_proj.bias is not None and not attn.in_proj.bias.any()  # mamba-ssm zeroes it


def test_state_dict_keys_are_mamba_ssms():
    """MixerModel's create_block puts MHA at backbone.layers.{i}.mixer: in_proj, conv1d, out_proj."""
    model = tiny("mamba2")
    keys = {k for k in model.state_dict() if k.startswith("backbone.layers.0.")}
    assert keys == {
        "backbone.layers.0.norm.weight",
        "backbone.layers.0.norm2.weight",
        "backbone.layers.0.mlp.fc1.weight",
        "backbone.layers.0.mlp.fc2.weight",
        *(f"backbone.layers.0.mixer.{p}.{w}" for p in ("in_proj", "conv1d", "out_proj") for w in ("weight", "bias")),
    }
    sd = model.state_dict()
    assert sd["backbone.layers.0.mixer.in_proj.weight"].shape == (8 * (4 + 2 * 2) + 256, 32)
    assert sd["backbone.layers.0.mixer.out_proj.weight"].shape == (32, 32 + 128)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_prefill_then_steps_equals_forward(kind):
    model = tiny(kind)
    x = ids((2, 15))
    full = model(x)
    cache = model.allocate_inference_cache(2)
    logits = [model(x[:, :6], cache=cache), model(x[:, 6:9], cache=cache)]
    with torch.no_grad():  # decoding: the attention's one-token path, the blocks' C step
        logits += [model.step(x[:, t], cache)[:, None] for t in range(9, 15)]
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_packed_forward_equals_each_sequence_alone(kind):
    model = tiny(kind)
    lengths = [3, 1, 0, 8, 5]
    x = ids((1, sum(lengths)))
    cu = cu_seqlens_of(lengths, dtype=torch.int32)
    packed = model(x, cu_seqlens=cu)
    bounds = cu.tolist()
    alone = torch.cat([model(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(packed, model(x), atol=1e-3)  # unpacked, the documents would mix


@pytest.mark.parametrize("kind", HYBRIDS)
def test_left_padded_prompts_generate_what_each_prompt_gets_alone(kind):
    """Prompts of 3, 17 and 40 tokens, greedy; the padding holds random ids."""
    model = tiny(kind)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 45, (n,), generator=g) for n in (3, 17, 40)]
    L = 40
    batch = torch.randint(0, 45, (3, L), generator=g)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, L - len(p) :], mask[i, L - len(p) :] = p, 1
    out = model.generate(batch, 10, temperature=0, attention_mask=mask)
    assert out.shape == (3, 50) and torch.equal(out[:, :L], batch)
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], 10, temperature=0)
        assert torch.equal(out[i, L:], alone[0, len(prompt) :]), f"row {i} (prompt of {len(prompt)} tokens)"
    assert len({tuple(row.tolist()) for row in out[:, L:]}) > 1  # the rows do differ


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("kind", HYBRIDS)
def test_packed_prefill_then_steps_give_each_prompt_its_solo_logits(kind, grad):
    """What generate(attention_mask=...) does, compared by logits: S prompts (one empty) packed
    into one prefill of a cache of batch S, then one token per row; the steps with gradients
    enabled, and without (decoding: the attention's one-token path over rows of different
    lengths, and the C step of the Mamba blocks)."""
    model = tiny(kind)
    lengths = [4, 0, 9, 1]
    prompts, tokens = ids((1, sum(lengths))), ids((4, 3), seed=2)
    cu = cu_seqlens_of(lengths)
    cache = model.allocate_inference_cache(4)
    prefill = model(prompts, cache=cache, cu_seqlens=cu)
    with torch.set_grad_enabled(grad):
        steps = torch.stack([model.step(tokens[:, t], cache) for t in range(3)], 1)
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = model(torch.cat([prompts[:, a:b], tokens[s : s + 1]], 1))
        torch.testing.assert_close(prefill[:, a:b], alone[:, : b - a], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(steps[s : s + 1], alone[:, b - a :], rtol=1e-10, atol=1e-10)


def test_greedy_generation_equals_recomputing():
    model = tiny("mamba1")
    prompt = ids((2, 5))
    out = model.generate(prompt, 6, temperature=0)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1, :45].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("safe", [False, True])
@pytest.mark.parametrize("kind", HYBRIDS)
def test_checkpoint_round_trip(tmp_path, kind, safe):
    model = tiny(kind).float()
    model.save_pretrained(tmp_path, safe_serialization=safe)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["attn_layer_idx"] == HYBRIDS[kind]["attn_layer_idx"]
    assert written["attn_cfg"] == HYBRIDS[kind]["attn_cfg"]
    loaded = MambaLM.from_pretrained(tmp_path)
    assert loaded.config.to_dict() == written  # (JSON has no tuples: ssm_cfg's come back as lists)
    x = ids((2, 9))
    assert torch.equal(loaded(x), model(x))


def test_loads_a_hybrid_as_mamba_ssm_writes_it(tmp_path):
    """config.json with exactly mamba-ssm's MambaConfig fields (its save_pretrained writes
    ``self.config.__dict__``) and a state dict under its names, as plain tensors."""
    source = tiny("mamba1").float()
    upstream_config = {
        "d_model": 32,
        "d_intermediate": 0,
        "n_layer": 3,
        "vocab_size": 45,
        "ssm_cfg": {"d_state": 8},
        "attn_layer_idx": [1],
        "attn_cfg": ATTN,
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 8,
        "tie_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(upstream_config))
    torch.save({k: v.clone() for k, v in source.state_dict().items()}, tmp_path / "pytorch_model.bin")
    loaded = MambaLM.from_pretrained(tmp_path)
    assert loaded.config.to_dict() == upstream_config  # and ours writes the same fields back
    x = ids((1, 12))
    assert torch.equal(loaded(x), source(x))


def test_gradients_reach_the_attention_layers():
    model = tiny("mamba3").float().train()
    x = ids((2, 10))
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    attn = model.backbone.layers[2].mixer
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(attn_layer_idx=[3]), r"attn_layer_idx \[3\] holds \[3\], outside \[0, n_layer = 3\)"),
        (dict(attn_layer_idx=[-1]), r"attn_layer_idx .* outside"),
        (dict(attn_layer_idx=[1, 1]), r"attn_layer_idx \[1, 1\] repeats \[1\]"),
        (dict(attn_layer_idx=["1"]), r"attn_layer_idx must be a list"),
        (dict(attn_layer_idx=[1], attn_cfg="heads"), r"attn_cfg must be a dict"),
        (dict(attn_layer_idx=[1], attn_cfg={"causal": True}), r"attn_cfg must give num_heads"),
        (dict(attn_layer_idx=[1], attn_cfg={"num_heads": 4}), r"attn_cfg\['causal'\] must be true"),
    ],
)
def test_bad_hybrid_configs_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        MambaConfig(d_model=32, n_layer=3, vocab_size=45, **kw)


@pytest.mark.parametrize(
    "attn_cfg,message",
    [
        ({"num_heads": 6, "num_heads_kv": 4}, r"attn_cfg.*num_heads = 6 must be divisible by num_heads_kv = 4"),
        ({"num_heads": 4, "rotary_emb_dim": 5}, r"attn_cfg.*rotary_emb_dim = 5 must be even"),
        ({"num_heads": 4, "rotary_emb_dim": 10}, r"attn_cfg.*rotary_emb_dim = 10 must be at most head_dim = 8"),
        ({"num_heads": 4, "heads_kv": 2}, r"unknown attn_cfg key\(s\) \['heads_kv'\] for MHA"),
        ({"num_heads": 4, "embed_dim": 32}, r"unknown attn_cfg key\(s\) \['embed_dim'\]"),
    ],
)
def test_bad_attention_arguments_name_the_field(attn_cfg, message):
    config = MambaConfig(
        d_model=32, n_layer=2, vocab_size=45, attn_layer_idx=[0], attn_cfg={**attn_cfg, "causal": True}
    )
    with pytest.raises(ValueError, match=message):
        MambaLM(config)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", HYBRIDS)
def test_decoding_steps_the_mamba_blocks_in_c_between_attention_blocks(kind, dtype, monkeypatch):
    """On the CPU a hybrid's runs of blocks of one kind step in C (one call per run of Mamba
    blocks, one per run of attention blocks; the head in C where a run ends the stack): it must
    be taken, and give the tensor path's logits and every layer's cache (keys and values
    written in place, lengths, conv states)."""
    from ssm.ops import MambaBlocksStep

    model = tiny(kind).to(dtype)
    prepare, prepared = MambaBlocksStep.prepare, []

    def spy(*args, **kwargs):
        step = prepare(*args, **kwargs)
        prepared.append(step is not None)
        return step

    def decode(fused: bool):
        if not fused:
            monkeypatch.setattr(model.backbone, "fused_step", lambda *args: None)
        cache = model.allocate_inference_cache(3, dtype=dtype)
        with torch.no_grad():
            model(ids((3, 5)), cache=cache)
            logits = torch.stack([model.step(t, cache) for t in ids((3, 7), seed=2).T], 1)
        return logits, cache

    monkeypatch.setattr(MambaBlocksStep, "prepare", spy)
    fused_logits, fused_cache = decode(True)
    runs = {"mamba1": 3, "mamba2": 3, "mamba3": 2}[kind]  # runs of blocks of one kind: M A M, A M A, M M A
    assert prepared == [True] * (7 * runs), "the C step was not taken for every run of blocks"
    logits, cache = decode(False)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(fused_logits, logits, rtol=tol, atol=tol)
    for mine, theirs in zip(fused_cache.layers, cache.layers):
        for a, b in zip(mine.tensors(), theirs.tensors()):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_greedy_generation_gives_the_same_tokens_with_the_fused_runs(kind, monkeypatch):
    from tests.helpers import assert_generate_takes_the_fused_step_and_keeps_its_tokens

    assert_generate_takes_the_fused_step_and_keeps_its_tokens(tiny(kind).float(), monkeypatch)


def test_the_prepared_attention_step_follows_its_cache_as_it_grows(monkeypatch):
    """generate's prepared step writes keys and values into the cache in place; a cache without
    room reserved (max_seqlen 0) fills up after a few tokens and grows (new tensors), and the
    step must be prepared again on them: the same logits and cache as the tensor path."""
    from ssm.ops import MambaBlocksStep

    model = tiny("mamba1").float()
    prompt, tokens = ids((2, 5)), ids((2, 12), seed=3)
    prepare, prepared = MambaBlocksStep.prepare, []
    monkeypatch.setattr(MambaBlocksStep, "prepare", lambda *a, **k: prepared.append(1) or prepare(*a, **k))

    def decode(fused: bool):
        cache = model.allocate_inference_cache(2)
        with torch.no_grad():
            model(prompt, cache=cache)
            step = model.backbone.prepare_fused_step(cache, model.lm_head) if fused else None
            if not fused:
                monkeypatch.setattr(model.backbone, "fused_step", lambda *args: None)
            logits = [step(t).clone() if fused else model.step(t, cache) for t in tokens.T]
        return torch.stack(logits, 1), cache

    fused_logits, fused_cache = decode(True)
    attention = fused_cache.layers[1]
    assert attention.key.shape[1] >= 17 and len(prepared) > 3, "the cache did not grow under the prepared step"
    logits, cache = decode(False)
    torch.testing.assert_close(fused_logits, logits, rtol=2e-5, atol=2e-5)
    for a, b in zip(attention.tensors(), cache.layers[1].tensors()):
        torch.testing.assert_close(a[:, :17] if a.ndim == 4 else a, b[:, :17] if b.ndim == 4 else b)
