"""The tasks' examples, checked by hand on small cases, and the step-indexed data order."""

from __future__ import annotations

import torch

from ssm.training.config import DataSection
from ssm.training.data import IGNORE, ByteText, InductionHeads, SelectiveCopying, StepSampler, TaskDataModule, split_files


def test_selective_copying_example():
    ds = SelectiveCopying(seq_len=12, num_tokens=5, num_memorize=3, seed=0, split="train", size=10)
    assert ds.vocab_size == 7 and ds.marker == 6
    for i in range(10):
        inputs, targets = ds[i]
        assert inputs.shape == targets.shape == (15,)
        context = inputs[:12]
        data = context[context != 0]  # the data tokens in order of position
        assert len(data) == 3 and ((data >= 1) & (data <= 5)).all()
        assert (inputs[12:] == 6).all()  # the markers
        assert (targets[:12] == IGNORE).all() and torch.equal(targets[12:], data)


def test_induction_heads_example():
    ds = InductionHeads(seq_len=20, num_tokens=4, seed=0, split="val", size=10)
    for i in range(10):
        inputs, targets = ds[i]
        triggers = (inputs == 4).nonzero().flatten().tolist()
        assert len(triggers) in (2, 3) and triggers[-1] == 19  # trigger ... trigger at the end
        first = triggers[0]
        assert targets[-1] == inputs[first + 1] and (targets[:-1] == IGNORE).all()


def test_byte_text_windows_are_shifted_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    ds = ByteText(data, seq_len=10, seed=0, split="train", size=5)
    for i in range(5):
        x, y = ds[i]
        assert torch.equal(y[:-1], x[1:]) and int(y[-1]) == int(x[-1]) + 1


def test_examples_depend_only_on_seed_split_and_index():
    a = SelectiveCopying(16, 4, 4, seed=1, split="train", size=100)
    b = SelectiveCopying(16, 4, 4, seed=1, split="train", size=5)
    assert torch.equal(a[3][0], b[3][0])
    assert not torch.equal(a[3][0], SelectiveCopying(16, 4, 4, seed=2, split="train", size=5)[3][0])
    assert not torch.equal(a[3][0], SelectiveCopying(16, 4, 4, seed=1, split="val", size=5)[3][0])


def test_step_sampler_resumes_and_splits_between_ranks():
    full = list(StepSampler(0, 12))
    assert full == list(range(12))
    assert list(StepSampler(6, 12)) == full[6:]  # resumed after 6 examples
    ranks = [list(StepSampler(4, 12, rank=r, world=2)) for r in range(2)]
    assert ranks == [[4, 6, 8, 10], [5, 7, 9, 11]]
    step = [0]
    sampler = StepSampler(lambda: step[0] * 3, 12)  # 3 examples per step, start read at iter()
    step[0] = 2
    assert list(sampler) == list(range(6, 12))


def test_text_split_by_file(tmp_path):
    paths = [str(tmp_path / f"f{i}.txt") for i in range(40)]
    train, val = split_files(paths, 0.25)
    assert set(train) | set(val) == set(paths) and not set(train) & set(val)
    assert 3 <= len(val) <= 20


def test_text_defaults_to_the_standard_library():
    dm = TaskDataModule(DataSection(task="text", seq_len=32, val_samples=4, batch_size=2))
    assert dm.vocab_size == 256 and len(dm.train_files) > 100
    assert all(p.endswith(".py") for p in dm.train_files[:10])
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 32)
