"""``MambaLM.forward(input_ids, cp_group=group)``: hybrid models (Mamba-1, Mamba-2 or Mamba-3
layers; an MLP after each mixer; attention layers with rotary, and a conv) on 4 gloo processes, float64,
against the whole sequence in one process: the logits of each rank's slice, and every
parameter's gradient (the tied embedding included) summed over the ranks, for W = 4 and W = 2.
A packed row (``cu_seqlens`` of the whole row) whose document crosses every rank. Then the
arguments cp_group refuses, each by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ssm import MambaConfig, MambaLM
from ssm.distributed import shard_sequence
from ssm.layers import MHA, Mamba, Mamba2

from .harness import assert_gradients_match, groups, reference_gradients, run_ranks, shard

ATTN = dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=4, d_conv=3)
MODELS = {
    "mamba1": dict(ssm_cfg={"d_state": 8, "dt_min": 0.05, "dt_max": 0.3}, attn_layer_idx=[1], attn_cfg=ATTN),
    "mamba2": dict(
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4, "A_init_range": (0.2, 2.0)},
        d_intermediate=40,
        attn_layer_idx=[2],
        attn_cfg={**ATTN, "mlp_dim": 20, "rotary_emb_interleaved": True},
    ),
    "mamba3": dict(
        ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4, "dt_min": 0.05},
        attn_layer_idx=[1],
        attn_cfg=dict(num_heads=2, num_heads_kv=1, head_dim=12, causal=True, rotary_emb_dim=12),
    ),
}
BATCH, LENGTH, VOCAB = 2, 32, 45


def tiny(kind: str) -> MambaLM:
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=32, n_layer=3, vocab_size=VOCAB, **MODELS[kind]))
    with torch.no_grad():  # larger embeddings than N(0, 0.02²): states and logits that vary
        model.backbone.embedding.weight.normal_()
    return model.double()


def lm_body(rank: int, world: int, kind: str) -> None:
    check_lm(rank, world, kind, BATCH, None)
    check_lm(rank, world, kind, 1, torch.tensor([0, 5, 29, 32]))  # a document over ranks 0-3 (W = 4)
    refusals(rank, kind)


def check_lm(rank: int, world: int, kind: str, batch: int, cu_seqlens) -> None:
    model = tiny(kind)
    ids = torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(batch, LENGTH, model.config.padded_vocab_size, dtype=torch.float64)
    whole = model(ids, cu_seqlens=cu_seqlens)
    (whole * weights).sum().backward()
    grads = reference_gradients(model)
    for group in groups(rank, world):
        what = f"{kind}, W = {dist.get_world_size(group)}, cu_seqlens {cu_seqlens}"
        logits = model(shard_sequence(ids, group), cu_seqlens=cu_seqlens, cp_group=group)
        torch.testing.assert_close(logits, shard(whole.detach(), group), msg=lambda m: f"{what}: logits: {m}")
        (logits * shard(weights, group)).sum().backward()
        assert_gradients_match(model, grads, group, what)


def refusals(rank: int, kind: str) -> None:
    """Refused on every rank alike, before any exchange."""
    model = tiny(kind)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"input_ids: its length L = 30 .* not divisible .* W = 4"):
        shard_sequence(ids[:, :30], dist.group.WORLD)
    with pytest.raises(ValueError, match=r"input_ids: the ranks of cp_group hold slices of different shapes"):
        model(ids[:, : 8 + (rank == 2)], cp_group=dist.group.WORLD)  # rank 2 passes 9 positions
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length L = 32, got 31"):
        model(ids[:1, :8], cu_seqlens=torch.tensor([0, 31]), cp_group=dist.group.WORLD)  # the whole row's
    if kind != "mamba3":  # (its attention has no conv; Mamba-3's halo is one position)
        with pytest.raises(ValueError, match=r"hidden_states: this rank's slice has 2 positions, fewer than .* 3"):
            model(ids[:, 2 * rank : 2 * rank + 2], cp_group=dist.group.WORLD)  # d_conv 4: a halo of 3


def prefill_body(rank: int, world: int, layer: str) -> None:
    """A prompt prefilled over the ranks of the group (each its slice, into a cache of its own),
    then decoded: every rank's cache holds the whole prompt's state, and the next tokens'
    logits equal one process's prefill and steps."""
    torch.manual_seed(0)
    if layer in MODELS:  # a hybrid
        model = tiny(layer)
    else:
        heads = {} if layer == "Mamba1" else {"headdim": 8}
        config = MambaConfig(d_model=32, n_layer=2, vocab_size=VOCAB, ssm_cfg={"layer": layer, "d_state": 8, **heads})
        model = MambaLM(config).double()
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 3), generator=torch.Generator().manual_seed(1))
    prompt, continuation = ids[:, :LENGTH], ids[:, LENGTH:]
    with torch.no_grad():
        cache = model.allocate_inference_cache(BATCH, dtype=torch.float64)
        model(prompt, cache=cache)
        expected = [model.step(continuation[:, i], cache) for i in range(continuation.shape[1])]
        for group in groups(rank, world):
            what = f"{layer} prefill, W = {dist.get_world_size(group)}"
            mine = model.allocate_inference_cache(BATCH, dtype=torch.float64)
            model(shard_sequence(prompt, group), cache=mine, cp_group=group)
            assert mine.seqlen_offset == LENGTH
            for i, step in enumerate(expected):
                got = model.step(continuation[:, i], mine)
                torch.testing.assert_close(got, step, msg=lambda m, i=i: f"{what}: step {i}: {m}")


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2", "Mamba3", "mamba2"])  # the last a hybrid
def test_a_prompt_prefilled_over_ranks_decodes_as_one_process(tmp_path, layer):
    run_ranks(prefill_body, 4, tmp_path, layer)


@pytest.mark.parametrize("kind", MODELS)
def test_lm_logits_and_gradients_equal_one_process(tmp_path, kind):
    run_ranks(lm_body, 4, tmp_path, kind)


def test_cp_group_refuses_what_it_does_not_take():
    model = tiny("mamba2")
    ids = torch.zeros(1, 8, dtype=torch.long)
    cu_seqlens = torch.tensor([0, 8])
    for kwargs, message in (
        (dict(cache=model.allocate_inference_cache(1), cu_seqlens=cu_seqlens), "cache together with cu_seqlens"),
        (dict(num_last_tokens=1), "num_last_tokens is not supported with cp_group"),
    ):
        with pytest.raises(ValueError, match=f"MambaLM.forward: {message}"):
            model(ids, cp_group=object(), **kwargs)
    x = torch.zeros(1, 8, 16, dtype=torch.float64)
    for mixer in (Mamba(16, dtype=torch.float64), Mamba2(16, headdim=8, dtype=torch.float64)):
        cache = mixer.allocate_inference_cache(1)
        with pytest.raises(ValueError, match=r"forward: cache together with cu_seqlens is not supported with cp_group"):
            mixer(x, cache=cache, cu_seqlens=cu_seqlens, cp_group=object())
        with pytest.raises(ValueError, match=r"forward: last is not supported with cp_group"):
            mixer(x, last=1, cp_group=object())
    attention = MHA(16, num_heads=2, causal=True, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"MHA.forward: cache together with cu_seqlens is not supported"):
        attention(x, cache=attention.allocate_inference_cache(1), cu_seqlens=cu_seqlens, cp_group=object())
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="cp_group: torch.distributed is not initialised"):
            model(ids, cp_group=object())


def test_a_model_with_a_mixer_without_context_parallelism_is_refused_by_name():
    config = MambaConfig(d_model=16, n_layer=1, vocab_size=VOCAB, ssm_cfg={"layer": "Mamba3", "headdim": 8})
    model = MambaLM(config)
    model.backbone.layers[0].mixer.context_parallel = False  # as a mixer without it would say
    with pytest.raises(ValueError, match="cp_group: layer 0's mixer Mamba3 has no context parallelism"):
        model(torch.zeros(1, 8, dtype=torch.long), cp_group=object())
