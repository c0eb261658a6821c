"""MambaLM with packed sequences: a packed forward equals each sequence alone, and batched
generation of left-padded prompts gives every row the tokens its prompt gets alone."""

from __future__ import annotations

import pytest
import torch

from ssm import MambaConfig, MambaLM
from tests.helpers import cu_seqlens_of

CONFIGS = {
    "mamba1": dict(ssm_cfg={"d_state": 8}),
    # slowly decaying heads, so that whatever the padding left in the state would still show
    "mamba2": dict(
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4, "A_init_range": (0.01, 0.1)},
        d_intermediate=40,
    ),
    "mamba3": dict(ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4}),
    "mamba3-mimo": dict(
        ssm_cfg={
            "layer": "Mamba3",
            "d_state": 8,
            "headdim": 8,
            "is_mimo": True,
            "mimo_rank": 2,
            "is_outproj_norm": True,
            "chunk_size": 4,
        }
    ),
}


def tiny(kind) -> MambaLM:
    torch.manual_seed(0)
    return MambaLM(MambaConfig(d_model=32, n_layer=2, vocab_size=45, **CONFIGS[kind])).double().eval()


def left_padded(prompts, pad_ids):
    """(batch, L) ids with each prompt at the right end, padding ids before it, and the mask."""
    L = max(len(p) for p in prompts)
    ids = pad_ids[: len(prompts), :L].clone()
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = p
        mask[i, L - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize("kind", CONFIGS)
def test_packed_forward_equals_each_sequence_alone(kind):
    model = tiny(kind)
    lengths = [3, 1, 0, 8, 5]
    ids = torch.randint(0, 45, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    cu = cu_seqlens_of(lengths, dtype=torch.int32)
    packed = model(ids, cu_seqlens=cu)
    bounds = cu.tolist()
    alone = torch.cat([model(ids[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(packed, model(ids), atol=1e-3)  # unpacked, the documents would mix


@pytest.mark.parametrize("kind", CONFIGS)
def test_left_padded_prompts_generate_what_each_prompt_gets_alone(kind):
    """Prompts of 3, 17 and 40 tokens, greedy: every row equals its prompt generated alone.
    The padding holds random ids, which must change nothing."""
    model = tiny(kind)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 45, (n,), generator=g) for n in (3, 17, 40)]
    ids, mask = left_padded(prompts, torch.randint(0, 45, (3, 40), generator=g))
    out = model.generate(ids, 10, temperature=0, attention_mask=mask)
    assert out.shape == (3, 50) and torch.equal(out[:, :40], ids)
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], 10, temperature=0)
        assert torch.equal(out[i, 40:], alone[0, len(prompt) :]), f"row {i} (prompt of {len(prompt)} tokens)"
    assert len({tuple(row.tolist()) for row in out[:, 40:]}) > 1  # the rows do differ


def test_all_ones_mask_equals_no_mask():
    model = tiny("mamba1")
    ids = torch.randint(0, 45, (2, 6), generator=torch.Generator().manual_seed(4))
    assert torch.equal(
        model.generate(ids, 5, temperature=0, attention_mask=torch.ones_like(ids)),
        model.generate(ids, 5, temperature=0),
    )


def test_eos_with_padding():
    """Each row stops on its own, counted from its own prompt."""
    model = tiny("mamba2")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 45, (n,), generator=g) for n in (2, 7)]
    ids, mask = left_padded(prompts, torch.zeros(2, 7, dtype=torch.long))
    free = model.generate(ids, 6, temperature=0, attention_mask=mask)
    eos = int(free[0, 7 + 2])  # row 0's third new token
    out = model.generate(ids, 6, temperature=0, attention_mask=mask, eos_token_id=eos)
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], 6, temperature=0, eos_token_id=eos)[0, len(prompt) :]
        assert torch.equal(out[i, 7 : 7 + len(alone)], alone)


def test_bad_attention_masks():
    model = tiny("mamba1")
    ids = torch.randint(0, 45, (2, 4))
    cases = {
        "shape": (torch.ones(2, 3, dtype=torch.long), r"shaped like input_ids \(2, 4\), got \(2, 3\)"),
        "values": (
            torch.tensor([[0, 2, 1, 1], [1, 1, 1, 1]]),
            r"only 0 \(padding\) and 1 \(token\), got the values \[0, 1, 2\]",
        ),
        "float": (torch.ones(2, 4), "integer or bool dtype, got torch.float32"),
        "right padding": (torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), r"pad on the left .* rows \[0\]"),
        "empty row": (torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]), r"at least one token per row; rows \[0\]"),
    }
    for mask, message in cases.values():
        with pytest.raises(ValueError, match=message):
            model.generate(ids, 2, attention_mask=mask)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size = 45\)"):
        model.generate(torch.tensor([[0, 50]]), 2, attention_mask=torch.tensor([[0, 1]]))
    # padding may hold any id, even one outside the vocabulary
    model.generate(torch.tensor([[-1, 5]]), 2, attention_mask=torch.tensor([[0, 1]]))


def test_packed_cache_batch_must_be_the_number_of_sequences():
    model = tiny("mamba1")
    cache = model.allocate_inference_cache(2, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"cache was allocated for batch size 2, but cu_seqlens \(sequences\) has batch size 3"
    ):
        model(torch.randint(0, 45, (1, 6)), cache=cache, cu_seqlens=torch.tensor([0, 1, 2, 6]))
