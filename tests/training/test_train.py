"""End to end: each task trains a few steps, leaves its results and no process-wide state; resume
is exact and restores only what it needs; checkpoints are read safely and written atomically;
two DDP processes on CPU split the examples and keep equal parameters; the scripts' main(argv)."""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from ssm import MambaLM
from ssm.training import CheckpointError, ConfigError, load_checkpoint, load_config, train
from ssm.training.checkpoint import save_atomically
from ssm.training.data import TaskDataModule

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.ssm_cfg={layer: Mamba1, d_state: 4}",
    "data.batch_size=4",
    "data.val_samples=8",
    "trainer.val_check_interval=2",
    "checkpoint_every=2",
    "progress_bar=false",
    "log_every=1",
    "trainer.log_every_n_steps=1",
]
TASKS = {
    "selective_copying": ["data.seq_len=12", "data.num_memorize=3"],
    "induction_heads": ["data.task=induction_heads", "data.seq_len=16"],
    "text": [
        "data.task=text",
        "data.seq_len=16",
        "model.ssm_cfg={layer: Mamba2, d_state: 4, headdim: 8, chunk_size: 8}",
    ],
}
LIGHTNING_NOTICES = ("GPU available", "TPU available", "litlogger", "Trainer.fit` stopped", "weights_only")
RESUMABLE = TINY + TASKS["selective_copying"] + ["trainer.max_steps=6", "optim.warmup_steps=2"]


def script(name):
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"))["main"]


def process_state():
    """What a run must leave as it found it. (Not the global random state: torch's DataLoader
    draws a seed for its workers from it whenever it starts an epoch.)"""
    return (
        list(warnings.filters),
        dict(os.environ),
        {name: logging.getLogger(name).level for name in ("pytorch_lightning", "lightning_fabric")},
    )


@pytest.mark.parametrize("task", TASKS)
def test_each_task_trains_and_leaves_its_results_and_nothing_else(task, tmp_path, capfd, caplog):
    run_dir = tmp_path / "run"
    config = load_config(
        ROOT / "configs" / "default.yaml", TINY + TASKS[task] + ["trainer.max_steps=3", f"run_dir={run_dir}"]
    )
    before = process_state()
    result = train(config)
    after = process_state()
    assert not result.interrupted
    for name in (
        "config.yaml",
        "metrics.csv",
        "metrics.json",
        "curves.png",
        "checkpoints/last.ckpt",
        "checkpoints/best.ckpt",
        "model/config.json",
    ):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 3 and 0 <= metrics["val/acc"] <= 1 and metrics["val/loss"] > 0
    model = MambaLM.from_pretrained(run_dir / "model")
    assert model.config.vocab_size == load_config(run_dir / "config.yaml").model.vocab_size
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,metric,value" and any(",train/loss," in line for line in lines)

    # No warning filter, environment variable or log level outlives the run ...
    assert before == after
    # ... and it prints only its own lines: none of Lightning's notices (which go to the root
    # logger here, under pytest, and to stderr otherwise).
    out, err = capfd.readouterr()
    assert out.startswith(f"training {task} with a ") and out.rstrip().endswith("curves.png")
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for notice in LIGHTNING_NOTICES:
        assert notice not in out + err + logged, notice


def test_a_finished_run_is_not_overwritten(tmp_path):
    args = TINY + TASKS["selective_copying"] + ["trainer.max_steps=1", f"run_dir={tmp_path}"]
    train(load_config(None, args))
    before = (tmp_path / "metrics.csv").read_text()
    with pytest.raises(ConfigError, match=f"run_dir='{tmp_path}' already holds a run; continue it with resume="):
        train(load_config(None, args))
    assert (tmp_path / "metrics.csv").read_text() == before


class StopAt(pl.Callback):
    """Stops training after ``step`` steps, as an interruption would."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class KeepCheckpoint(pl.Callback):
    """Copies last.ckpt to ``name`` when it holds step ``step``."""

    def __init__(self, step, name):
        self.step, self.name = step, name

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:  # last.ckpt was written at the end of the previous step
            directory = Path(trainer.default_root_dir) / "checkpoints"
            shutil.copy(directory / "last.ckpt", directory / self.name)


def test_resume_gives_the_parameters_of_an_uninterrupted_run(tmp_path):
    # Guards every piece of state a resume restores: the parameters, the optimiser's moments,
    # the schedule's position, the step count (and with it the data order). Without any one of
    # them the parameters differ. The run resumes from step 4 although the interrupted run went
    # on to step 5, as when a run is killed between checkpoints.
    whole = train(load_config(None, RESUMABLE + [f"run_dir={tmp_path / 'whole'}"]))
    cut = train(
        load_config(None, RESUMABLE + [f"run_dir={tmp_path / 'cut'}"]),
        callbacks=(KeepCheckpoint(4, "step4.ckpt"), StopAt(5)),
    )
    step4 = tmp_path / "cut" / "checkpoints" / "step4.ckpt"
    assert cut.interrupted and load_checkpoint(step4)["global_step"] == 4
    resumed = train(load_config(None, RESUMABLE + [f"resume={step4}"]))
    assert resumed.run_dir == tmp_path / "cut" and not resumed.interrupted
    a = MambaLM.from_pretrained(whole.run_dir / "model").state_dict()
    b = MambaLM.from_pretrained(resumed.run_dir / "model").state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed.metrics == {**whole.metrics, "wall_s": resumed.metrics["wall_s"]}

    # metrics.csv reads as one run: what the interrupted run logged after step 4 is gone, and
    # every row equals the uninterrupted run's (rows are numbered from 0, as Lightning counts).
    def rows(run):
        return [
            line.split(",")
            for line in (tmp_path / run / "metrics.csv").read_text().splitlines()[1:]
            if ",lr," not in line and "tokens_per_s" not in line
        ]

    assert [int(step) for step, name, _ in rows("cut") if name == "train/loss"] == [0, 1, 2, 3, 4, 5]
    assert rows("cut") == rows("whole")


def test_a_resumed_run_trains_at_the_learning_rate_its_config_gives(tmp_path):
    # The schedule saves its base rate; a resume with another optim.lr (a curriculum stage that
    # anneals) must train at the new rate, not silently at the checkpoint's.
    constant = RESUMABLE + ["optim.warmup_steps=0", "optim.min_lr_ratio=1.0", f"run_dir={tmp_path}"]
    train(load_config(None, constant + ["trainer.max_steps=3", "optim.lr=1e-3"]))
    train(load_config(None, constant + ["trainer.max_steps=6", "optim.lr=2e-4", f"resume={tmp_path}"]))
    rates = {
        int(step): float(value)
        for step, name, value in (line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:])
        if name == "lr"
    }
    assert rates == pytest.approx({0: 1e-3, 1: 1e-3, 2: 1e-3, 3: 2e-4, 4: 2e-4, 5: 2e-4}, rel=1e-6)


def test_a_last_stage_anneals_with_decay_steps(tmp_path):
    # a curriculum's last stage resumed with optim.decay_steps = its length: constant rate, then
    # linearly to 0 over that stage (lr at its steps 3, 4, 5: 3/3, 2/3, 1/3 of the rate)
    constant = RESUMABLE + ["optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "optim.lr=1e-3", f"run_dir={tmp_path}"]
    train(load_config(None, constant + ["trainer.max_steps=3"]))
    train(load_config(None, constant + ["trainer.max_steps=6", "optim.decay_steps=3", f"resume={tmp_path}"]))
    rates = {
        int(step): float(value)
        for step, name, value in (line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:])
        if name == "lr"
    }
    assert rates == pytest.approx({0: 1e-3, 1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 2e-3 / 3, 5: 1e-3 / 3}, rel=1e-6)
    with pytest.raises(ValueError, match="optim.decay_steps must be an int >= 0"):
        train(load_config(None, constant + ["trainer.max_steps=6", "optim.decay_steps=-1", f"run_dir={tmp_path}/b"]))


def test_a_resumed_run_trains_with_the_adam_betas_and_eps_its_config_gives(tmp_path):
    # The optimiser's saved param_groups carry betas and eps; a curriculum stage that resumes
    # with others (a shorter second-moment memory for the long, batch-1 stages) must use them.
    constant = RESUMABLE + [f"run_dir={tmp_path}"]
    train(load_config(None, constant + ["trainer.max_steps=3", "optim.betas=[0.9, 0.999]", "optim.eps=1e-8"]))
    first = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"]
    assert [tuple(g["betas"]) for g in first] == [(0.9, 0.999)] * len(first)
    train(
        load_config(
            None,
            constant + ["trainer.max_steps=5", "optim.betas=[0.8, 0.95]", "optim.eps=1e-6", f"resume={tmp_path}"],
        )
    )
    groups = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"]
    assert [(tuple(g["betas"]), g["eps"]) for g in groups] == [((0.8, 0.95), 1e-6)] * len(groups)


def test_stateful_text_resumes_exactly(tmp_path):
    """data.stateful: the carried state of every row is part of the checkpoint, so a run
    resumed from step 4 continues each row's stream from where it stood and ends with the
    parameters of the uninterrupted run (without the state it would not)."""
    stateful = TINY + TASKS["text"] + ["data.stateful=true", "trainer.max_steps=6", "optim.warmup_steps=2"]
    whole = train(load_config(None, stateful + [f"run_dir={tmp_path / 'whole'}"]))
    train(
        load_config(None, stateful + [f"run_dir={tmp_path / 'cut'}"]),
        callbacks=(KeepCheckpoint(4, "step4.ckpt"), StopAt(5)),
    )
    step4 = tmp_path / "cut" / "checkpoints" / "step4.ckpt"
    carried = load_checkpoint(step4)["carried_state"]
    assert list(carried) == [0] and carried[0][0][1].shape[0] == 4  # one slot; (rows, H, P, N) per layer
    resumed = train(load_config(None, stateful + [f"resume={step4}"]))
    a = MambaLM.from_pretrained(whole.run_dir / "model").state_dict()
    b = MambaLM.from_pretrained(resumed.run_dir / "model").state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key


class Scramble(pl.Callback):
    """Ruins the model when training (re)starts, so that every later validation is worse."""

    def on_train_start(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 20)


class SignalAt(pl.Callback):
    """Sends ``signum`` to this process in the middle of step ``step`` (counted from 1), between
    its backward pass and its optimiser update, as a Ctrl+C or a job scheduler's SIGTERM would."""

    def __init__(self, signum, step):
        self.signum, self.step = signum, step

    def on_before_optimizer_step(self, trainer, *args):
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_in_progress_and_the_run_continues_from_it(tmp_path, signum):
    # Lightning's own answer to Ctrl+C is sys.exit, which lost every step since the last periodic
    # checkpoint (checkpoint_every=1000 here: all of them). The step the signal arrives in is
    # finished and saved, and the resumed run ends with the uninterrupted run's parameters.
    args = RESUMABLE + ["checkpoint_every=1000"]
    whole = train(load_config(None, args + [f"run_dir={tmp_path / 'whole'}"]))
    handler = signal.getsignal(signal.SIGINT)
    cut = train(load_config(None, args + [f"run_dir={tmp_path / 'cut'}"]), callbacks=(SignalAt(signum, 3),))
    assert signal.getsignal(signal.SIGINT) is handler  # the run's handler is gone again
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert cut.interrupted and load_checkpoint(last)["global_step"] == 3
    resumed = train(load_config(None, args + [f"resume={tmp_path / 'cut'}"]))
    assert not resumed.interrupted
    a = MambaLM.from_pretrained(whole.run_dir / "model").state_dict()
    b = MambaLM.from_pretrained(resumed.run_dir / "model").state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_keeps_the_best_checkpoint_of_before_the_interruption(tmp_path):
    # The checkpoint callbacks' state (the best score so far) is restored: after a resume that
    # only makes the model worse, best.ckpt still holds the best model from before the interruption.
    train(load_config(None, RESUMABLE + [f"run_dir={tmp_path}"]), callbacks=(StopAt(3),))
    best = tmp_path / "checkpoints" / "best.ckpt"
    best_step = load_checkpoint(best)["global_step"]
    train(load_config(None, RESUMABLE + [f"resume={tmp_path}"]), callbacks=(Scramble(),))
    rows = (line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:])
    val = {int(step): float(value) for step, name, value in rows if name == "val/loss"}
    assert best_step == 3 and val[best_step - 1] == min(val.values())  # rows are numbered from 0
    assert min(val[3], val[5]) > val[best_step - 1]  # the scramble made every later validation worse
    assert load_checkpoint(best)["global_step"] == best_step


class ScrambleAfter(pl.Callback):
    """Ruins the model after step ``step``, so that every later validation is worse."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == self.step:
            Scramble().on_train_start(trainer, pl_module)


@pytest.mark.parametrize("export", ["best", "last"])
def test_export_best_leaves_the_weights_the_validation_chose(tmp_path, export):
    # Ruined after its first validation (step 2), a run's later validations are worse: export =
    # best leaves best.ckpt's weights (step 2) in model/, export = last the final step's.
    run = train(
        load_config(None, RESUMABLE + [f"run_dir={tmp_path}", f"export={export}"]), callbacks=(ScrambleAfter(2),)
    )
    best = load_checkpoint(tmp_path / "checkpoints" / "best.ckpt")
    last = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert best["global_step"] == 2 and last["global_step"] == 6
    exported = MambaLM.from_pretrained(tmp_path / "model").state_dict()
    chosen = best if export == "best" else last
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, chosen["state_dict"][f"model.{name}"], rtol=0, atol=0)
    assert run.metrics["exported_step"] == chosen["global_step"]
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["exported_step"] == chosen["global_step"] and saved["step"] == 6


def test_export_best_refuses_sharded_training():
    with pytest.raises(ConfigError, match='export = "best" does not combine with trainer.strategy = fsdp'):
        load_config(None, ["export=best", "trainer.strategy=fsdp"])
    with pytest.raises(ConfigError, match='export must be "last" or "best", got \'first\''):
        load_config(None, ["export=first"])


class CreatesFile:
    """Unpickling this object creates ``path`` (open(path, "w")): a stand-in for any code a
    pickled checkpoint could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    train(load_config(None, RESUMABLE + ["trainer.max_steps=2", f"run_dir={tmp_path / 'run'}"]), callbacks=(StopAt(1),))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    marker = tmp_path / "code-ran"
    checkpoint["callbacks"]["extra"] = CreatesFile(marker)
    torch.save(checkpoint, ckpt)
    refused = f"{ckpt} holds pickled objects other than tensors and plain containers \\(it names io.open\\)"
    with pytest.raises(CheckpointError, match=refused):
        train(load_config(None, RESUMABLE + [f"resume={tmp_path / 'run'}"]))
    assert not marker.exists()
    # Lightning's own loading goes through the same reader:
    from ssm.training.checkpoint import SafeCheckpointIO

    with pytest.raises(CheckpointError, match="holds pickled objects"):
        SafeCheckpointIO().load_checkpoint(ckpt, weights_only=False)
    assert not marker.exists()


def test_resume_stops_at_a_damaged_checkpoint_naming_it(tmp_path, capsys):
    train(load_config(None, RESUMABLE + ["trainer.max_steps=2", f"run_dir={tmp_path}"]), callbacks=(StopAt(1),))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])  # cut short, as by a full disk or a copy that stopped
    metrics = (tmp_path / "metrics.csv").read_text()
    with pytest.raises(CheckpointError, match=f"{ckpt} is damaged"):
        train(load_config(None, RESUMABLE + [f"resume={tmp_path}"]))
    assert (tmp_path / "metrics.csv").read_text() == metrics  # nothing touched
    capsys.readouterr()
    assert script("train")([f"resume={tmp_path}"]) == 2
    assert f"error: {ckpt} is damaged" in capsys.readouterr().err


def test_checkpoints_are_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_atomically({"global_step": 1, "state_dict": {"w": torch.ones(1000)}}, path)
    real_save = torch.save

    def killed_midway(obj, f, *args, **kwargs):  # writes half of the new checkpoint, then dies
        real_save(obj, f, *args, **kwargs)
        f.seek(0)
        f.truncate(f.tell() + 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_atomically({"global_step": 2, "state_dict": {"w": torch.zeros(1000)}}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["global_step"] == 1  # the previous checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left


def test_train_script_reports_mistakes(capsys):
    assert script("train")(["trainer.max_stpes=3"]) == 2
    assert "unknown key 'trainer.max_stpes'" in capsys.readouterr().err


def test_evaluate_and_generate_scripts(tmp_path, capsys):
    for task in ("induction_heads", "text"):
        config = load_config(None, TINY + TASKS[task] + ["trainer.max_steps=2", f"run_dir={tmp_path / task}"])
        train(config)
    assert script("evaluate")([str(tmp_path / "induction_heads"), "--lengths", "16,32"]) == 0
    rows = json.loads((tmp_path / "induction_heads" / "extrapolation.json").read_text())
    assert [r["length"] for r in rows] == [16, 32] and (tmp_path / "induction_heads" / "extrapolation.png").is_file()
    # carried state: with one segment per stream nothing is carried, so both read the same
    for segments in (1, 3):
        assert script("evaluate")([str(tmp_path / "text"), "--carried-state", "--segments", str(segments)]) == 0
        m = json.loads((tmp_path / "text" / "carried_state.json").read_text())
        assert m["bytes"] == 4 * segments * 16 and (m["bpb_carried"] == m["bpb_fresh"]) == (segments == 1)
    assert "state carried across segments" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        script("evaluate")([str(tmp_path / "induction_heads"), "--carried-state"])
    assert stop.value.code == 2 and "--carried-state needs a text run" in capsys.readouterr().err
    capsys.readouterr()
    assert script("generate")([str(tmp_path / "text"), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_two_process_ddp_on_cpu_splits_examples_and_keeps_parameters_equal(tmp_path):
    """trainer.devices=2 trainer.strategy=ddp: Lightning launches a second process (gloo). No
    run_dir is given: both processes must use the one rank 0 chose."""
    steps, batch = 3, 4
    overrides = [
        *TINY,
        *TASKS["selective_copying"],
        f"trainer.max_steps={steps}",
        f"data.batch_size={batch}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
    ]
    args = [sys.executable, str(ROOT / "tests" / "training" / "ddp_probe.py"), str(tmp_path / "out"), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for notice in LIGHTNING_NOTICES:
        assert notice not in proc.stdout + proc.stderr, notice
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]

    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1 and ranks[0]["run_dir"] == ranks[1]["run_dir"] == str(run_dirs[0].resolve())
    assert json.loads((run_dirs[0] / "metrics.json").read_text())["step"] == steps

    # Each step, the ranks take disjoint examples that together are the step's share of the stream.
    stream = TaskDataModule(load_config(None, overrides).data).dataset("train", steps * 2 * batch)
    for step in range(steps):
        seen = [tuple(x.tolist()) for r in range(2) for x in ranks[r]["inputs"][step]]
        expected = [tuple(stream[i][0].tolist()) for i in range(step * 2 * batch, (step + 1) * 2 * batch)]
        assert len(set(seen)) == 2 * batch and set(seen) == set(expected), f"step {step}"
    # After every step the ranks hold the same parameters, and the steps changed them.
    for step in range(steps):
        assert torch.equal(ranks[0]["params"][step], ranks[1]["params"][step]), f"step {step}"
    assert not torch.equal(ranks[0]["params"][0], ranks[0]["params"][-1])


def test_a_cpu_step_flushes_subnormals_on_every_thread_and_only_the_step(tmp_path):
    """FlushSubnormals: inside a training step (the backward, before the optimizer step) a
    parallel torch op over subnormal inputs gives zeros in every thread's share; outside it
    (every callback's batch start and end, validation, checkpoints) and after the run the same
    op keeps them."""
    x = torch.full((1 << 21,), 1e-39)  # subnormal in float32, large enough for every thread

    def mode():
        zeros = x * 1.5 == 0
        return "flushed" if bool(zeros.all()) else "kept" if not bool(zeros.any()) else "mixed"

    seen = {}

    class Probe(pl.Callback):  # each hook of HOOKS records the mode it runs in
        def __getattribute__(self, name):
            if name in HOOKS:
                return lambda *args: seen.setdefault(name, set()).add(mode())
            return super().__getattribute__(name)

    HOOKS = {
        "on_train_batch_start": "kept",
        "on_before_backward": "flushed",
        "on_after_backward": "flushed",
        "on_before_optimizer_step": "flushed",
        "on_train_batch_end": "kept",
        "on_validation_batch_start": "kept",
        "on_validation_batch_end": "kept",
        "on_save_checkpoint": "kept",
    }
    args = TINY + TASKS["selective_copying"] + ["trainer.max_steps=3", f"run_dir={tmp_path}"]
    train(load_config(None, args), callbacks=(Probe(),))
    assert seen == {hook: {expected} for hook, expected in HOOKS.items()}
    assert mode() == "kept", "a thread kept flushing after the run"


def test_train_runs_off_the_main_thread(tmp_path):
    """Signal handlers can be installed from the main thread only: from another one, train()
    runs without them (Ctrl+C reaches the main thread) and touches none of the process's."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = {}

    def run():
        try:
            args = TINY + TASKS["selective_copying"] + ["trainer.max_steps=2", f"run_dir={tmp_path}"]
            out["result"] = train(load_config(None, args))
        except BaseException as err:  # noqa: BLE001 (reported below)
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=300)
    assert "error" not in out, repr(out.get("error"))
    assert out["result"].metrics["step"] == 2 and not out["result"].interrupted
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_kept_checkpoints_are_all_kept_across_a_resume_and_load_as_models(tmp_path):
    """keep_checkpoint_every=2: checkpoints/step-NNNNNNN.ckpt at steps 2, 4, 6, none replaced,
    a resume adding to them; each loads (load_checkpoint_model) as the model of its step."""
    from ssm.training.evaluate import load_checkpoint_model

    run_dir = tmp_path / "run"
    args = RESUMABLE + ["keep_checkpoint_every=2", f"run_dir={run_dir}"]
    train(load_config(ROOT / "configs" / "default.yaml", args + ["trainer.max_steps=5"]))
    kept = run_dir / "checkpoints"
    assert sorted(p.name for p in kept.glob("step-*.ckpt")) == ["step-0000002.ckpt", "step-0000004.ckpt"]
    train(load_config(ROOT / "configs" / "default.yaml", args + ["trainer.max_steps=6", f"resume={run_dir}"]))
    names = sorted(p.name for p in kept.glob("step-*.ckpt"))
    assert names == ["step-0000002.ckpt", "step-0000004.ckpt", "step-0000006.ckpt"]
    final = MambaLM.from_pretrained(run_dir / "model")
    weights = []
    for name, step in zip(names, (2, 4, 6)):
        config, model, at = load_checkpoint_model(kept / name)
        assert at == step and config.keep_checkpoint_every == 2
        weights.append(torch.cat([p.flatten() for p in model.parameters()]))
    assert not torch.equal(weights[0], weights[1])
    assert torch.equal(weights[2], torch.cat([p.flatten() for p in final.parameters()]))
    # without the key, no step checkpoints
    other = tmp_path / "other"
    train(load_config(ROOT / "configs" / "default.yaml", RESUMABLE + ["trainer.max_steps=2", f"run_dir={other}"]))
    assert not list((other / "checkpoints").glob("step-*"))
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        torch.save({"x": torch.zeros(1)}, tmp_path / "bad.ckpt")
        load_checkpoint_model(tmp_path / "bad.ckpt")
