"""scripts/evaluate_checkpoints.py (issue 46): a run's kept checkpoints on the test split at
several lengths, the table in the paper's layout and the curve against steps, accumulated over
calls."""

from __future__ import annotations

import csv
import json
import runpy
from pathlib import Path

import pytest
import torch

from ssm.training import load_config, train
from ssm.training.data import SELECTION_SPLIT, TEST_SPLIT, VALIDATION_SPLIT, TaskDataModule
from ssm.training.evaluate import load_checkpoint_model

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.ssm_cfg={layer: Mamba1, d_state: 4}",
    "data.batch_size=4",
    "data.val_samples=8",
    "data.seq_len=16",
    "trainer.val_check_interval=2",
    "checkpoint_every=2",
    "keep_checkpoint_every=2",
    "progress_bar=false",
    "trainer.max_steps=4",
    "seed=3",
]


def script():
    return runpy.run_path(str(ROOT / "scripts" / "evaluate_checkpoints.py"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ih") / "tiny-ih"
    train(load_config(ROOT / "configs" / "paper" / "induction_heads.yaml", TINY + [f"run_dir={path}"]))
    return path


def by_hand(checkpoint: Path, length: int, samples: int) -> tuple[int, float]:
    """(correct, mean loss) on the test split's first ``samples`` sequences at ``length``, each
    read in one plain pass: the last position's logits against its target."""
    config, model, _ = load_checkpoint_model(checkpoint)
    dataset = TaskDataModule(config.data, seed=config.seed).dataset(TEST_SPLIT, samples, length)
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(samples):
            inputs, targets = dataset[i]
            logits = model(inputs[None])[0][-1]
            correct += int(logits.argmax() == targets[-1])
            loss += float(torch.nn.functional.cross_entropy(logits[None], targets[-1:]))
    return correct, loss / samples


def test_checkpoints_on_the_test_split_table_and_curve(run_dir, tmp_path, capsys):
    main = script()["main"]
    out = tmp_path / "eval"
    args = [str(run_dir), "--out", str(out), "--samples", "8@32,4", "--curve-lengths", "16,256", "--chunk", "8"]
    assert main([*args, "--lengths", "16,64"]) == 0
    records = json.loads((out / "evaluations.json").read_text())["records"]
    assert [(r["step"], r["length"], r["samples"]) for r in records] == [(2, 16, 8), (2, 64, 4), (4, 16, 8), (4, 64, 4)]
    assert {r["split"] for r in records} == {TEST_SPLIT} and {r["seed"] for r in records} == {3}
    for r in records:
        correct, loss = by_hand(Path(r["checkpoint"]), r["length"], r["samples"])
        assert r["correct"] == correct and r["loss"] == pytest.approx(loss, abs=1e-4)
        assert r["scored"] == r["samples"] and r["acc"] == r["correct"] / r["scored"]
    # a second call adds 2^8 and measures nothing twice
    capsys.readouterr()
    assert main([*args, "--lengths", "16,2^8"]) == 0
    printed = capsys.readouterr().out
    assert "L   2^4" not in printed and printed.count("L   2^8") == 2
    records = json.loads((out / "evaluations.json").read_text())["records"]
    assert len(records) == 6
    table = (out / "results.md").read_text().splitlines()
    assert table[0] == "| run | seed | steps | 2^4 | 2^6 | 2^8 |"
    row = {r["length"]: r for r in records if r["step"] == 4}
    cells = ["100" if row[n]["correct"] == row[n]["scored"] else f"{100 * row[n]['acc']:.1f}" for n in (16, 64, 256)]
    assert table[3] == "| tiny-ih | 3 | 4 | " + " | ".join(cells) + " |"
    assert f"split '{TEST_SPLIT}'" in (out / "results.md").read_text()
    with open(out / "steps.csv") as f:
        points = list(csv.DictReader(f))
    assert [(int(p["step"]), int(p["length"])) for p in points] == [(2, 16), (2, 256), (4, 16), (4, 256)]
    assert (out / "steps.png").is_file()


def test_merge_joins_runs_and_redraws_without_evaluating(tmp_path, capsys):
    """--merge: the records of other OUTs (a run evaluated elsewhere, or docs/bench's published
    ones) in one table and one curve; with no checkpoint, nothing is evaluated."""
    main = script()["main"]
    rec = lambda run, step, length, correct: {  # noqa: E731
        "run": run, "seed": int(run[-1]), "step": step, "length": length, "samples": 4, "split": TEST_SPLIT,
        "acc": correct / 4, "correct": correct, "scored": 4, "checkpoint": f"{run}/step-{step}.ckpt",
    }  # fmt: skip
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"records": [rec("r0", 2, 16, 4), rec("r0", 4, 16, 3)]}))
    b.write_text(json.dumps({"records": [rec("r1", 2, 16, 1), rec("r1", 2, 64, 2)]}))
    out = tmp_path / "all"
    assert main(["--out", str(out), "--merge", str(a), "--merge", str(b), "--curve-lengths", "16"]) == 0
    assert "acc " not in capsys.readouterr().out  # no evaluation line
    stored = json.loads((out / "evaluations.json").read_text())["records"]
    assert sorted((r["run"], r["step"], r["length"], r["correct"]) for r in stored) == [
        ("r0", 2, 16, 4), ("r0", 4, 16, 3), ("r1", 2, 16, 1), ("r1", 2, 64, 2)
    ]  # fmt: skip
    assert (out / "results.md").read_text().splitlines()[2:5] == [
        "| r0 | 0 | 2 | 100 | - |", "| r0 | 0 | 4 | 75.0 | - |", "| r1 | 1 | 2 | 25.0 | 50.0 |"
    ]  # fmt: skip
    with open(out / "steps.csv") as f:
        assert [(p["run"], p["step"]) for p in csv.DictReader(f)] == [("r0", "2"), ("r0", "4"), ("r1", "2")]
    # merged again: nothing doubles; another split, a file that is not records, or nothing at all: refused
    assert main(["--out", str(out), "--merge", str(a)]) == 0
    assert len(json.loads((out / "evaluations.json").read_text())["records"]) == 4
    capsys.readouterr()
    val = tmp_path / "val.json"
    val.write_text(json.dumps({"records": [{**rec("r2", 2, 16, 1), "split": VALIDATION_SPLIT}]}))
    missing = tmp_path / "none.json"
    for bad, named in ((val, "holds evaluations on another split"), (missing, "not an evaluations.json")):
        with pytest.raises(SystemExit):
            main(["--out", str(out), "--merge", str(bad)])
        assert f"--merge {bad}: {named}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "empty")])
    assert "nothing was evaluated: give a checkpoint" in capsys.readouterr().err


def test_published_paper_protocol_records_agree_with_the_docs_table():
    """docs/bench/induction-heads-paper-protocol.json holds what docs/paper-results.md reports:
    each record's acc is its correct/scored, and the final rows read as the docs print them."""
    records = json.loads((ROOT / "docs" / "bench" / "induction-heads-paper-protocol.json").read_text())["records"]
    assert {r["split"] for r in records} == {TEST_SPLIT}
    for r in records:
        assert r["acc"] == r["correct"] / r["scored"] and r["scored"] == r["samples"]
    table = script()["table"]([r for r in records if r["step"] == 204800 and r["seed"] == 0])
    assert "| 100 | 100 | 100 | 100 | 99.4 | 64.8 | 30.3 | 21.9 | 11.7 | 5.5 | 9.4 | 6.2 | 3.1 | 0.0 | 9.4 |" in table
    docs = (ROOT / "docs" / "paper-results.md").read_text()
    assert table.splitlines()[2].split("| 204,800 |")[1] in docs


def test_published_variant_records_agree_with_the_docs_table():
    """docs/bench/induction-heads-variant.json (issue 46's short-gap variant) holds what
    docs/paper-results.md reports: each record's acc is its correct/scored, on the test split,
    and each seed's final row of the table built from the records is the one the docs print."""
    records = json.loads((ROOT / "docs" / "bench" / "induction-heads-variant.json").read_text())["records"]
    assert {r["split"] for r in records} == {TEST_SPLIT} and {r["seed"] for r in records} == {0, 1, 2}
    for r in records:
        assert r["acc"] == r["correct"] / r["scored"] and r["scored"] == r["samples"]
    docs = (ROOT / "docs" / "paper-results.md").read_text()
    for seed in (0, 1, 2):
        table = script()["table"]([r for r in records if r["step"] == 204800 and r["seed"] == seed])
        row = table.splitlines()[2]
        assert row.count("|") == 19 and "-" not in row.split("| 204,800 |")[1], row  # every length measured
        assert row in docs, row


def test_two_calls_on_one_out_keep_each_others_records(tmp_path):
    """A final evaluation beside a loop over the checkpoints, both writing OUT/evaluations.json:
    each read the file once at its start, so the later writer dropped the other's records."""
    save = script()["save_record"]
    store = tmp_path / "evaluations.json"
    rec = lambda ckpt, length: {"checkpoint": ckpt, "length": length, "samples": 8, "split": TEST_SPLIT}  # noqa: E731
    loop = save(store, [], rec("a.ckpt", 16))  # the loop's view: its own record
    final = save(store, [], rec("b.ckpt", 2**20))  # the final one started before it wrote
    loop = save(store, loop, rec("a.ckpt", 64))
    stored = json.loads(store.read_text())["records"]
    assert {(r["checkpoint"], r["length"]) for r in stored} == {("a.ckpt", 16), ("b.ckpt", 2**20), ("a.ckpt", 64)}
    assert final == [rec("a.ckpt", 16), rec("b.ckpt", 2**20)] and loop == stored
    assert not store.with_name("evaluations.json.partial").exists()


def test_bad_arguments_are_refused_by_name(run_dir, tmp_path, capsys):
    main = script()["main"]
    out = str(tmp_path / "eval")
    for bad, named in (
        (["--samples", "8@2^6,x"], "--samples"),
        (["--samples", "8@2^6,4@2^5,2"], "--samples: the lengths must increase"),
        (["--samples", "8,4"], "--samples: every part but the last"),
        (["--samples", "0"], "--samples: counts must be >= 1"),
        (["--lengths", "2^a"], "--lengths"),
        (["--lengths", "2"], "--lengths must be >= 3"),
        (["--chunk", "0"], "--chunk"),
    ):
        with pytest.raises(SystemExit):
            main([str(run_dir), "--out", out, *bad])
        assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none"), "--out", out])
    assert "no such checkpoint or run directory" in capsys.readouterr().err
    # evaluations of one split are not mixed with another's
    assert main([str(run_dir), "--out", out, "--lengths", "16", "--split", "val"]) == 0
    with pytest.raises(SystemExit):
        main([str(run_dir), "--out", out, "--lengths", "16"])
    assert "holds evaluations on the split 'val'" in capsys.readouterr().err


def test_split_names_are_the_data_modules():
    assert script()["SPLITS"] == {"test": TEST_SPLIT, "selection": SELECTION_SPLIT, "val": VALIDATION_SPLIT}


def saved_with_retention_script(checkpoint: dict, tmp_path: Path):
    """The checkpoint saved under tmp_path (its path) and scripts/dev/induction_retention.py's main."""
    path = tmp_path / "set.ckpt"
    torch.save(checkpoint, path)
    return path, runpy.run_path(str(ROOT / "scripts" / "dev" / "induction_retention.py"))["main"]


def softplus(bias: torch.Tensor) -> list[float]:
    """log(1 + e^b) of each entry, in Python floats (the Δ a zero projection leaves)."""
    import math

    return [math.log1p(math.exp(b)) for b in bias.tolist()]


def test_retention_script_reads_delta_and_the_slowest_decay(run_dir, tmp_path, capsys):
    """scripts/dev/induction_retention.py on a checkpoint whose Δ is set by hand: dt_proj's
    weight zero, so that Δ_d = softplus(bias_d) at every token, and A = −(1 .. N) per channel.
    Its median Δ, smallest Δ and the slowest decay min_d Δ_d·min_n |A_dn| come out as computed
    here; and a run of another task is refused."""
    import math

    checkpoint = torch.load(run_dir / "checkpoints" / "step-0000004.ckpt", map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    prefix = "model.backbone.layers.0.mixer."
    D, N = state[prefix + "A_log"].shape
    bias = torch.linspace(-6.0, 1.0, D)
    state[prefix + "dt_proj.weight"].zero_()
    state[prefix + "dt_proj.bias"].copy_(bias)
    state[prefix + "A_log"].copy_(torch.log(torch.arange(1.0, N + 1)).expand(D, N))
    path, main = saved_with_retention_script(checkpoint, tmp_path)
    assert main([str(path), "--samples", "5"]) == 0
    line = capsys.readouterr().out
    delta = softplus(bias)
    rate = min(delta) * 1.0  # the smallest Δ times the smallest |A| (1)
    median = sorted(delta)[(D - 1) // 2]  # torch.median: the lower of the two middle values
    assert f"Δ median {median:.3g} min {min(delta):.2g}," in line
    assert f"slowest decay {rate:.3g}/token, kept over 2^14 {math.exp(-rate * 2**14):.3g}," in line
    # --gradients: d loss / d A_log at the slowest state, (0, 0) here, against autograd run here
    # on the same validation batches; --precision: float32 and float64 differ, but only by rounding
    assert main([str(path), "--samples", "3", "--gradients", "2", "--precision", "16"]) == 0
    out = capsys.readouterr().out
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import load_checkpoint_model

    config, model, _ = load_checkpoint_model(path)
    dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, 16)
    grads = []
    for b in range(2):
        x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(8 * b, 8 * b + 8))))
        model.zero_grad()
        logp = model(x).log_softmax(-1)
        scored = y != -100
        (-logp[scored].gather(-1, y[scored][:, None]).mean()).backward()
        grads.append(float(model.backbone.layers[0].mixer.A_log.grad[0, 0]))
    assert f"layer 0 d loss/d A_log[0, 0]: mean {sum(grads) / 2:.3g} " in out
    diff = float(out.split("largest |Δ log p(answer)| ")[1].split()[0])
    assert "L 16: accuracy float32 " in out and 0 < diff < 1e-4
    # --share: the layer's output at the last position split by where it was written; the script
    # raises unless the parts add up to what the layer computed (its scan, not this formula)
    assert main([str(path), "--samples", "2", "--share", "2^5", "--share-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "L 32: accuracy " in out and "layer 0: |key| / |rest| median " in out
    with pytest.raises(SystemExit):  # parity is not induction heads
        other = tmp_path / "parity"
        train(load_config(None, [*TINY[:3], "data.task=parity", "data.seq_len=8", "trainer.max_steps=1",
                                 "checkpoint_every=1", "progress_bar=false", f"run_dir={other}"]))  # fmt: skip
        main([str(other / "checkpoints" / "last.ckpt")])


def test_phase_turn_by_hand():
    """induction_retention.phase_turn on numbers worked out by hand: Δ 0.5 and 0.25 at the two
    marked tokens (a third, unmarked, turns by 10), θ (1, -4) and (3, -4) for the two pairs. The
    turns are (0.5, -2) and (0.75, -1): pair 1 has the larger mean, -1.5, spread 0.5."""
    phase_turn = runpy.run_path(str(ROOT / "scripts" / "dev" / "induction_retention.py"))["phase_turn"]
    delta = torch.tensor([[0.5, 0.25, 10.0]])
    theta = torch.tensor([[[1.0, -4.0], [3.0, -4.0], [1.0, 1.0]]])
    other = torch.tensor([[True, True, False]])
    assert phase_turn(delta, theta, other) == (-1.5, 0.5)
    assert phase_turn(delta, theta[..., :0], other) == (0.0, 0.0)


def test_retention_script_reads_mamba3_decay_per_head(tmp_path, capsys):
    """induction_retention.py on a Mamba-3 checkpoint whose Δ and A are set by hand: in_proj's
    rows for Δ and A zero and A's floor at 2, so that Δ_h = softplus(dt_bias_h) and
    A_h = −max(softplus(0), 2) = −2 at every token. The slowest head is the one of the
    smallest bias, its decay 2·softplus(bias); the options that read Mamba-1 layers are
    refused."""
    import math

    run = tmp_path / "tiny-m3"
    layer = "model.ssm_cfg={layer: Mamba3, d_state: 8, headdim: 8, chunk_size: 8, A_floor: 2.0}"
    mamba3 = [*TINY[:2], layer, *TINY[3:]]
    train(load_config(ROOT / "configs" / "paper" / "induction_heads.yaml", mamba3 + [f"run_dir={run}"]))
    checkpoint = torch.load(run / "checkpoints" / "step-0000004.ckpt", map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    prefix = "model.backbone.layers.0.mixer."
    heads = state[prefix + "dt_bias"].shape[0]
    d_inner, rows = 2 * 16, state[prefix + "in_proj.weight"]
    start = 2 * d_inner + 2 * 8  # z, x, B, C (one group of N 8), then Δ and A (H rows each)
    rows[start : start + 2 * heads].zero_()
    rows[start + 3 * heads :].zero_()  # θ = π·tanh(0) = 0: no rotary turn
    bias = torch.linspace(-3.0, 1.0, heads).flip(0)  # the smallest bias on the last head
    state[prefix + "dt_bias"].copy_(bias)
    path, main = saved_with_retention_script(checkpoint, tmp_path)
    assert main([str(path), "--samples", "4"]) == 0
    line = capsys.readouterr().out
    delta = softplus(bias)
    rate = 2 * min(delta)
    assert f"slowest decay {rate:.3g}/token (head {heads - 1}: mean Δ {min(delta):.3g}, mean |A| 2)," in line, line
    assert f"kept over 2^14 {math.exp(-rate * 2**14):.3g}," in line and f"min {min(delta):.2g}," in line
    assert "its phase turns 0 rad/token on average (spread 0)" in line, line
    with pytest.raises(SystemExit):
        main([str(path), "--gradients", "1"])


def test_mamba3_interventions_baseline_mask_and_arguments(tmp_path, capsys):
    """scripts/dev/mamba3_interventions.py: the "none" row is the validation accuracy that
    ssm.training.evaluate.evaluate_length gives on the same sequences; the mask of "mute" keeps
    the triggers and the 4 tokens after the first one (worked by hand); bad arguments are
    refused by name."""
    from ssm.training.evaluate import evaluate_length

    run = tmp_path / "tiny-m3x2"
    layer = "model.ssm_cfg={layer: Mamba3, d_state: 8, headdim: 8, chunk_size: 8}"
    config = [*TINY[:1], "model.n_layer=2", layer, *TINY[3:], f"run_dir={run}"]
    train(load_config(ROOT / "configs" / "paper" / "induction_heads.yaml", config))
    capsys.readouterr()  # the training's log
    checkpoint = run / "checkpoints" / "last.ckpt"
    probe = runpy.run_path(str(ROOT / "scripts" / "dev" / "mamba3_interventions.py"))
    assert probe["main"]([str(checkpoint), "--layer", "1", "--lengths", "16,24", "--samples", "6"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(probe["INTERVENTIONS"])
    cfg, model, _ = load_checkpoint_model(checkpoint)
    data = TaskDataModule(cfg.data, seed=cfg.seed)
    for i, length in enumerate((16, 24)):
        expected = evaluate_length(model, data, length, 6, 16, None, split=VALIDATION_SPLIT)["val/acc"]
        assert rows["none"][2 * i : 2 * i + 2] == [f"{length}:", f"{expected:.3f}"]

    inputs = torch.tensor([[5, 9, 1, 2, 3, 4, 6, 9, 7], [9, 1, 2, 9, 3, 3, 3, 3, 3]])
    keep = probe["written_by"](inputs, 9)
    assert keep.tolist() == [[0, 1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]]

    main = probe["main"]
    for bad, named in (
        (["--do", "mute,nothing"], "--do"),
        (["--layer", "2"], "--layer"),
        (["--lengths", "2"], "--lengths"),
    ):
        with pytest.raises(SystemExit):
            main([str(checkpoint), *bad])
        assert named in capsys.readouterr().err
