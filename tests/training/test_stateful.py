"""Packed documents and the stateful (truncated BPTT) mode of the text task: examples mark each
document start and never score a document's first byte from the one before; streams continue
from one step to the next; a model carrying its state across segments equals the model run over
the concatenated segments, step for step; the LightningModule does exactly that."""

from __future__ import annotations

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.training.config import DataSection, OptimSection
from ssm.training.data import IGNORE, ByteText, TaskDataModule, read_documents
from ssm.training.module import LanguageModelTask, forward_rows, scored_token_metrics, sequence_boundaries


def test_documents_are_marked_and_their_first_byte_is_not_scored(tmp_path):
    for name, text in (("a", b"abc"), ("b", b""), ("c", b"de"), ("d", b"fghij")):
        (tmp_path / name).write_bytes(text)
    data, starts = read_documents([str(tmp_path / n) for n in "abcd"])
    assert bytes(data.tolist()) == b"abcdefghij" and starts.tolist() == [0, 3, 5]  # the empty file is skipped
    ds = ByteText(data, 4, seed=0, split="train", size=200, doc_starts=starts)
    seen = set()
    for i in range(200):
        x, y, resets = ds[i]
        start = data.tolist().index(int(x[0]))  # every byte is distinct
        seen.add(start)
        assert torch.equal(x, data[start : start + 4].long())
        for j in range(4):
            nxt = start + j + 1
            assert int(y[j]) == (IGNORE if nxt in (3, 5) else int(data[nxt])), (start, j)
            assert bool(resets[j]) == (start + j in (0, 3, 5)), (start, j)
    assert seen == set(range(6))
    # by hand: the window "cdef" starts inside "abc"; "de" and "fghij" start at inputs 1 and 3
    x, y, resets = next(ds[i] for i in range(200) if int(ds[i][0][0]) == ord("c"))
    assert bytes(x.tolist()) == b"cdef" and y.tolist() == [IGNORE, ord("e"), IGNORE, ord("g")]
    assert resets.tolist() == [False, True, False, True]


def test_streams_continue_from_one_step_to_the_next():
    n, L, R = 200, 7, 3
    data = torch.arange(n, dtype=torch.uint8)
    ds = ByteText(data, L, seed=1, split="train", size=10 * R, streams=R)
    for r in range(R):
        segments = [ds[k * R + r] for k in range(10)]
        stream = torch.cat([x for x, _ in segments])
        first = int(stream[0])
        assert torch.equal(stream, (first + torch.arange(10 * L)) % n), "each row reads on where it stopped"
        for x, y in segments:
            assert torch.equal(y, (x + 1) % n)
    assert len({int(ds[r][0][0]) for r in range(R)}) == R, "the streams start at different offsets"


def test_stateful_needs_text_and_one_device():
    with pytest.raises(ValueError, match="data.stateful needs data.task: text"):
        TaskDataModule(DataSection(task="induction_heads", stateful=True))


def test_sequence_boundaries():
    resets = torch.tensor([[False, False, True, False], [True, False, False, False], [False, True, True, False]])
    assert sequence_boundaries(resets).tolist() == [0, 2, 4, 8, 9, 10, 12]


CONFIGS = {
    "Mamba1": {"layer": "Mamba1", "d_state": 8},
    "Mamba2": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4, "A_init_range": (0.05, 0.2)},
}


def tiny(layer) -> MambaLM:
    torch.manual_seed(0)
    return MambaLM(MambaConfig(d_model=32, n_layer=2, vocab_size=256, ssm_cfg=CONFIGS[layer])).double()


def stream_case(B=3, L=6, steps=4, seed=0):
    """Streams (B, steps·L) with documents starting inside segments, exactly at a segment's
    first position (row 0 at step 2), and at a row's very first position (row 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, steps * L), generator=g)
    resets = torch.zeros(B, steps * L, dtype=torch.bool)
    resets[0, [3, 2 * L, 2 * L + 1]] = True
    resets[1, [0, L - 1, 2 * L + 4]] = True
    if B > 2:
        resets[2, [L + 2]] = True
    return ids, resets, L, steps


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("layer", CONFIGS)
def test_carried_state_equals_the_concatenated_run_step_for_step(layer, packed):
    model = tiny(layer)
    ids, resets, L, steps = stream_case()
    if not packed:
        resets = None
    whole, _ = forward_rows(model, ids, resets)  # (B, steps·L, V) in one run
    state = model.allocate_inference_cache(ids.shape[0], dtype=torch.float64)
    for k in range(steps):
        part = slice(k * L, (k + 1) * L)
        logits, state = forward_rows(model, ids[:, part], None if resets is None else resets[:, part], state)
        torch.testing.assert_close(logits, whole[:, part], rtol=1e-10, atol=1e-10, msg=lambda m: f"step {k}: {m}")
        assert all(not c.ssm_state.requires_grad and not c.conv_state.requires_grad for c in state.layers)
    fresh, _ = forward_rows(model, ids[:, L : 2 * L], None if resets is None else resets[:, L : 2 * L])
    assert not torch.allclose(fresh, whole[:, L : 2 * L], atol=1e-4), "the carried state matters"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_module_carries_state_per_micro_batch(accumulate):
    """training_step's losses, step after step, are those of the concatenated run; with
    gradient accumulation each micro-batch of a step carries its own rows' state."""
    model = tiny("Mamba1")
    ids, resets, L, steps = stream_case(B=2 * accumulate, steps=3)
    targets = torch.roll(ids, -1, 1)
    whole, _ = forward_rows(model, ids, resets)
    module = LanguageModelTask(model, OptimSection(), 10, stateful=True)
    B = 2
    for k in range(steps):
        for slot in range(accumulate):
            rows, part = slice(slot * B, (slot + 1) * B), slice(k * L, (k + 1) * L)
            batch = (ids[rows, part], targets[rows, part], resets[rows, part])
            loss, _, n = module._loss_and_accuracy(batch, slot)
            expected = scored_token_metrics(whole[rows, part], targets[rows, part])[0] / n
            torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    assert sorted(module.carried) == list(range(accumulate))
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    again = LanguageModelTask(tiny("Mamba1"), OptimSection(), 10, stateful=True)
    again.on_load_checkpoint(checkpoint)
    for slot in range(accumulate):
        for a, b in zip(module.carried[slot].layers, again.carried[slot].layers):
            assert torch.equal(a.ssm_state, b.ssm_state) and torch.equal(a.conv_state, b.conv_state)
