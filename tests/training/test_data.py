"""The tasks' examples keep their invariants over many seeds and indices, each example is a pure
function of (seed, split, index), and the step-indexed stream splits between ranks."""

from __future__ import annotations

import pytest
import torch

from ssm.training.config import DataSection, load_config
from ssm.training.data import (
    IGNORE,
    ByteText,
    InductionHeads,
    ModularArithmetic,
    Parity,
    SelectiveCopying,
    StepSampler,
    TaskDataModule,
    evaluate_expression,
    split_files,
)

SEEDS = range(12)
PER_SEED = 60


@pytest.mark.parametrize("seq_len,num_tokens,num_memorize", [(12, 5, 3), (9, 2, 9), (30, 8, 1)])
def test_selective_copying_targets_are_the_data_tokens_in_order(seq_len, num_tokens, num_memorize):
    L, K, marker = seq_len, num_memorize, num_tokens + 1
    positions_seen, tokens_seen = set(), set()
    for seed in SEEDS:
        ds = SelectiveCopying(L, num_tokens, K, seed=seed, split="train", size=PER_SEED)
        assert ds.vocab_size == num_tokens + 2 and ds.marker == marker
        for i in range(PER_SEED):
            inputs, targets = ds[i]
            assert inputs.shape == targets.shape == (L + K,)
            context = inputs[:L]
            positions = (context != 0).nonzero().flatten()  # noise is 0; data tokens are 1..num_tokens
            assert len(positions) == K, (seed, i, inputs)
            data = context[positions]  # in order of position
            assert ((data >= 1) & (data <= num_tokens)).all()
            assert (inputs[L:] == marker).all() and not (context == marker).any()
            assert (targets[:L] == IGNORE).all(), "only the positions after the context are scored"
            assert torch.equal(targets[L:], data), (seed, i, inputs, targets)
            positions_seen.update(positions.tolist())
            tokens_seen.update(data.tolist())
    assert positions_seen == set(range(L)), "every context position holds a data token in some example"
    assert tokens_seen == set(range(1, num_tokens + 1)), "every data token occurs"


@pytest.mark.parametrize("seq_len,num_tokens", [(6, 3), (20, 4), (64, 16)])
def test_induction_heads_key_follows_the_first_trigger_and_never_sits_on_the_last(seq_len, num_tokens):
    L, trigger = seq_len, num_tokens
    first_seen, keys_seen = set(), set()
    for seed in SEEDS:
        ds = InductionHeads(L, num_tokens, seed=seed, split="val", size=PER_SEED)
        assert ds.vocab_size == num_tokens + 1 and ds.trigger == trigger
        for i in range(PER_SEED):
            inputs, targets = ds[i]
            assert inputs.shape == targets.shape == (L,)
            assert ((inputs >= 0) & (inputs <= trigger)).all()
            triggers = (inputs == trigger).nonzero().flatten().tolist()
            assert len(triggers) == 2 and triggers[-1] == L - 1, (seed, i, inputs)  # one trigger, then the last
            first = triggers[0]
            key = int(inputs[first + 1])
            assert first + 1 < L - 1 and key != trigger, "the key never sits on the final trigger"
            assert (targets[:-1] == IGNORE).all() and int(targets[-1]) == key
            first_seen.add(first)
            keys_seen.add(key)
    assert first_seen == set(range(L - 2)), "the first trigger takes every position that leaves room for the key"
    assert keys_seen == set(range(num_tokens))


@pytest.mark.parametrize("window", [16, 4, 1])
def test_induction_heads_short_gap_prob_moves_training_keys_near_the_end_only(window):
    L, n = 200, 16

    def first_triggers(split, p, size=400):
        ds = InductionHeads(L, n, seed=3, split=split, size=size, short_gap_prob=p, short_gap_window=window)
        firsts = []
        for i in range(size):
            inputs, targets = ds[i]
            triggers = (inputs == n).nonzero().flatten().tolist()
            assert len(triggers) == 2 and triggers[-1] == L - 1
            assert int(targets[-1]) == int(inputs[triggers[0] + 1])
            firsts.append(triggers[0])
        return firsts

    always = first_triggers("train", 1.0)
    assert set(always) == set(range(L - 2 - window, L - 2)), "p = 1: every first trigger among the last W slots"
    some = first_triggers("train", 0.5)
    near = sum(f >= L - 2 - window for f in some) / len(some)
    assert 0.4 < near < 0.65, near  # half drawn near the end, plus the uniform draws that land there
    # validation and test keep the paper's uniform draw, identical to short_gap_prob = 0
    assert first_triggers("test", 1.0) == first_triggers("test", 0.0)
    assert first_triggers("val", 1.0) == first_triggers("val", 0.0)
    with pytest.raises(ValueError, match="data.short_gap_prob"):
        InductionHeads(L, n, seed=0, split="train", size=1, short_gap_prob=1.5)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="data.short_gap_window must be an int >= 1"):
            InductionHeads(L, n, seed=0, split="train", size=1, short_gap_prob=0.2, short_gap_window=bad)


def test_the_data_module_hands_short_gap_window_to_induction_heads():
    config = load_config(None, ["data.task=induction_heads", "data.short_gap_prob=1", "data.short_gap_window=2"])
    ds = TaskDataModule(config.data, seed=0).dataset("train", 50, 64)
    firsts = {int((ds[i][0] == config.data.num_tokens).nonzero()[0]) for i in range(50)}
    assert firsts == {60, 61}


@pytest.mark.parametrize("seq_len,extra", [(10, 1), (10, 3), (7, 60)])
def test_byte_text_windows_are_contiguous_and_shifted_by_one(seq_len, extra):
    n = seq_len + extra  # < 256, so that a byte's value is its position
    data = torch.arange(n, dtype=torch.uint8)
    starts = set()
    for seed in SEEDS:
        ds = ByteText(data, seq_len, seed=seed, split="train", size=PER_SEED)
        for i in range(PER_SEED):
            x, y = ds[i]
            assert x.shape == y.shape == (seq_len,) and x.dtype == y.dtype == torch.long
            start = int(x[0])
            assert torch.equal(x, torch.arange(start, start + seq_len)), "a contiguous window"
            assert torch.equal(y, x + 1), "the targets are the next bytes"
            starts.add(start)
    assert starts == set(range(n - seq_len)), "every window of seq_len + 1 bytes is drawn"


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
    x, y, resets = next(iter(dm.val_dataloader()))  # documents packed (data.pack_documents, the default)
    assert x.shape == y.shape == resets.shape == (2, 32) and resets.dtype == torch.bool
    unpacked = TaskDataModule(DataSection(task="text", seq_len=32, val_samples=4, batch_size=2, pack_documents=False))
    x, y = next(iter(unpacked.val_dataloader()))
    assert x.shape == (2, 32)


def test_parity_targets_are_the_running_parity_at_every_position():
    """Against a parity kept by hand (xor, one bit at a time): every position is a target, none
    ignored; the inputs are bits; the vocabulary is the two bits."""
    for seed in SEEDS:
        ds = Parity(37, seed, "val", PER_SEED)
        assert ds.vocab_size == 2
        for i in range(PER_SEED):
            inputs, targets = ds[i]
            assert inputs.shape == targets.shape == (37,) and set(inputs.tolist()) <= {0, 1}
            running, expected = 0, []
            for bit in inputs.tolist():
                running ^= bit
                expected.append(running)
            assert targets.tolist() == expected


def test_parity_training_lengths_are_drawn_per_step_and_other_splits_are_fixed():
    """Training: one length per optimiser step (per_step consecutive examples), drawn in
    [min, max] and covering it; validation: seq_len; bad bounds are refused by name."""
    train = Parity(20, 0, "train", 400, min_len=3, per_step=8)
    lengths = [len(train[i][0]) for i in range(400)]
    for step in range(50):
        assert len(set(lengths[8 * step : 8 * step + 8])) == 1
    assert min(lengths) >= 3 and max(lengths) <= 20 and len(set(lengths)) >= 10
    assert {len(Parity(20, 0, "val", 5, min_len=3, per_step=8)[i][0]) for i in range(5)} == {20}
    with pytest.raises(ValueError, match="min_seq_len"):
        Parity(5, 0, "train", 1, min_len=6)


def test_the_data_module_validates_parity_at_val_seq_len():
    config = load_config(None, ["data.task=parity", "data.seq_len=16", "data.min_seq_len=3", "data.val_seq_len=48"])
    module = TaskDataModule(config.data, seed=0)
    inputs, targets = next(iter(module.val_dataloader()))
    assert inputs.shape[1] == 48 and module.vocab_size == 2


# ModularArithmetic's tokens as Python reads them: Python's own int arithmetic (× before + and −,
# left to right, brackets first), taken mod 5, is the reference the task's values are checked on
PYTHON_SYMBOLS = {5: "+", 6: "-", 7: "*", 9: "(", 10: ")"}


def python_value(tokens: list[int]) -> int:
    return eval("".join(str(t) if t < 5 else PYTHON_SYMBOLS[t] for t in tokens)) % 5


def test_expressions_by_hand():
    """3 + 4 × 2 − 1 = 10 = 0 (mod 5); (3 + 4) × 2 = 14 = 4; 2 − 3 × 4 = −10 = 0; 4 − 1 + 1 = 4; ((1)) = 1;
    2 × (3 − (4 + 1)) × 3 = −12 = 3; malformed expressions are refused by position."""
    assert evaluate_expression([3, 5, 4, 7, 2, 6, 1]) == 0
    assert evaluate_expression([9, 3, 5, 4, 10, 7, 2]) == 4
    assert evaluate_expression([2, 6, 3, 7, 4]) == 0
    assert evaluate_expression([4, 6, 1, 5, 1]) == 4  # 4 − 1 + 1: the sign stays with its term
    assert evaluate_expression([9, 9, 1, 10, 10]) == 1
    assert evaluate_expression([2, 7, 9, 3, 6, 9, 4, 5, 1, 10, 10, 7, 3]) == 3
    for bad, where in (([3, 5], "ends unfinished"), ([3, 3], "position 1"), ([9, 3], "ends unfinished"),
                       ([3, 10], "position 1"), ([5, 3], "position 0")):  # fmt: skip
        with pytest.raises(ValueError, match=where):
            evaluate_expression(bad)


@pytest.mark.parametrize("brackets", [False, True])
def test_modular_arithmetic_answers_against_python(brackets):
    """Every example at lengths 2 to 60 (odd ones included): the last input is "=", the only
    scored position, and its target is Python's value of the expression mod 5; the expression
    follows the grammar (residues and operators alternating without brackets; balanced brackets
    nested more than one deep somewhere with them); every answer 0..4 occurs."""
    answers, deepest = set(), 0
    for L in range(2, 61):
        ds = ModularArithmetic(L, L, "val", 30, brackets=brackets)
        assert ds.vocab_size == (11 if brackets else 9)
        for i in range(30):
            inputs, targets = ds[i]
            assert inputs.shape == targets.shape == (L - L % 2,)
            assert inputs[-1] == 8 and (targets[:-1] == IGNORE).all()
            tokens = inputs[:-1].tolist()
            assert int(targets[-1]) == python_value(tokens)
            answers.add(int(targets[-1]))
            if not brackets:
                assert all(t < 5 for t in tokens[::2]) and all(t in (5, 6, 7) for t in tokens[1::2])
            depth = 0
            for t in tokens:
                depth += (t == 9) - (t == 10)
                assert depth >= 0
                deepest = max(deepest, depth)
            assert depth == 0
    assert answers == set(range(5))
    assert (deepest > 1) == brackets


def test_modular_arithmetic_lengths_and_bad_settings():
    """Training lengths drawn per step and shared by the step, as parity's; at long lengths
    (no recursion limit with brackets) the value still agrees with a plain evaluation; bad
    lengths refused by name."""
    train = ModularArithmetic(40, 0, "train", 160, min_len=4, per_step=8, brackets=True)
    lengths = [len(train[i][0]) for i in range(160)]
    assert all(len(set(lengths[8 * k : 8 * k + 8])) == 1 for k in range(20)) and len(set(lengths)) > 5
    long = ModularArithmetic(4096, 1, "val", 2, brackets=True)
    for i in range(2):
        inputs, targets = long[i]
        assert inputs.shape == (4096,) and 0 <= int(targets[-1]) < 5
    with pytest.raises(ValueError, match="data.seq_len >= 2"):
        ModularArithmetic(1, 0, "val", 1)
    with pytest.raises(ValueError, match="data.min_seq_len >= 2"):
        ModularArithmetic(8, 0, "train", 1, min_len=1)


def test_the_data_module_reads_modular_arithmetic_from_the_config():
    config = load_config(None, ["data.task=modular_arithmetic", "data.brackets=true", "data.seq_len=16",
                                "data.min_seq_len=4", "data.val_seq_len=64"])  # fmt: skip
    module = TaskDataModule(config.data, seed=0)
    inputs, targets = next(iter(module.val_dataloader()))
    assert inputs.shape[1] == 64 and module.vocab_size == 11 and (targets[:, :-1] == IGNORE).all()


@pytest.mark.parametrize("task", ["induction_heads", "selective_copying", "parity"])
@pytest.mark.parametrize("seq_len", [64, 4096])
def test_the_splits_are_streams_of_their_own(task, seq_len):
    """No example of one split is an example of another (issue 46: the test split is a stream
    that nothing chose on; issue 48: parity's second, third and fourth ones), at a short and a long length,
    for two seeds."""
    from ssm.training.data import (
        PARITY_B128_TEST_SPLIT,
        PARITY_DENSE_TEST_SPLIT,
        PARITY_TEST_SPLIT,
        SPLITS,
        TEST_SPLIT,
        VALIDATION_SPLIT,
    )

    tests = {TEST_SPLIT, PARITY_TEST_SPLIT, PARITY_B128_TEST_SPLIT, PARITY_DENSE_TEST_SPLIT, VALIDATION_SPLIT}
    assert len(set(SPLITS)) == 7 and len(tests) == 5 and tests <= set(SPLITS)
    for seed in (0, 1):
        data = TaskDataModule(DataSection(task=task, seq_len=seq_len, num_memorize=4), seed=seed)
        drawn = {split: {tuple(data.dataset(split, 64)[i][0].tolist()) for i in range(64)} for split in SPLITS}
        for a in SPLITS:
            assert len(drawn[a]) == 64
            for b in SPLITS:
                if a < b:
                    assert not drawn[a] & drawn[b], f"{a} and {b} share examples"


def test_a_misspelt_split_is_refused_by_name():
    from ssm.training.data import check_split

    data = TaskDataModule(DataSection(task="induction_heads", seq_len=16))
    with pytest.raises(ValueError, match=r"split must be one of .*got 'tset'"):
        data.dataset("tset", 4)
    assert check_split("test46") == "test46"


def test_a_length_curriculum_grows_the_drawn_maximum_step_by_step():
    """data.max_len_from / max_len_steps (the Mamba-3 paper's 40 → 160): at step s the training
    lengths lie in [min, 40 + (160 − 40)·min(s, S)/S], each step's shared by its examples, and
    they reach that bound; other splits stay at their length; bad settings are refused."""
    per_step, steps = 4, 300
    train = Parity(160, 0, "train", per_step * 2 * steps, min_len=3, per_step=per_step, grow_from=40, grow_steps=steps)
    lengths = [len(train[i][0]) for i in range(0, per_step * 2 * steps, per_step)]  # one per step
    for step, n in enumerate(lengths):
        assert 3 <= n <= 40 + 120 * min(step, steps) // steps
    assert max(lengths[:30]) <= 52 and max(lengths[steps:]) == 160 and max(lengths[:30]) >= 30
    assert len({len(train[i][0]) for i in range(8, 12)}) == 1  # the examples of step 2 share theirs
    config = load_config(None, ["data.task=parity", "data.seq_len=160", "data.min_seq_len=3", "data.max_len_from=40",
                                "data.max_len_steps=100", "data.val_seq_len=256"])  # fmt: skip
    module = TaskDataModule(config.data, seed=0)
    assert {len(module.dataset("train", 1)[0][0])} <= set(range(3, 41))  # step 0
    assert len(module.dataset("val", 1)[0][0]) == 160
    with pytest.raises(ValueError, match="data.max_len_from"):
        TaskDataModule(load_config(None, ["data.task=parity", "data.seq_len=64", "data.max_len_from=40"]).data)
    with pytest.raises(ValueError, match="data.max_len_steps >= 1"):
        Parity(64, 0, "train", 1, min_len=3, grow_from=40)
