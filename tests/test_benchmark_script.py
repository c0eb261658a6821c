"""scripts/benchmark.py runs end to end on a tiny shape and writes sound results."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import runpy
import sys
from pathlib import Path

import pytest

from ssm.scan import backends

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark.py"


def bench(module: str):
    """scripts/bench/<module>.py, the op modules behind the script."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module(f"bench.{module}")


def test_benchmark_script_writes_a_row_per_backend(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "b.json"
    tiny = ["--batch", "2", "--dim", "8", "--state", "4", "--length", "33", "--device", "cpu"]

    assert main([*tiny, "--repeats", "1", "--warmup", "0", "--json", str(path)]) == 0

    rows = {row["name"]: row for row in json.loads(path.read_text())["results"]}
    for name in backends("selective_scan", "cpu"):
        row = rows[name]
        assert row["forward_ms"] > 0 and row["fwd_bwd_ms"] > 0
        if name != "ref":
            assert "ref" in row["max_abs_diff"]
        for diff in row["max_abs_diff"].values():
            assert math.isfinite(diff) and diff < 1e-3


def test_generation_mode_checks_cached_against_recomputed_tokens(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "g.json"
    args = [
        "--op",
        "generate",
        "--d-model",
        "16",
        "--layers",
        "1",
        "--positions",
        "2,40",
        "--new-tokens",
        "5",
        "--prompt-length",
        "3",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--device",
        "cpu",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert report["same_tokens"] is True
    assert set(report["step_ms"]) == {"2", "40"} and all(v > 0 for v in report["step_ms"].values())
    assert all(v > 0 for v in report["generate_s"].values())


def test_bandwidth_columns(tmp_path):
    """Achieved bandwidth = required bytes / time, and its fraction of the measured copy
    bandwidth, for every row (on the CPU here; the same code runs with --device cuda)."""
    import torch

    script = runpy.run_path(str(SCRIPT))
    scans = bench("scans")
    u = torch.zeros(2, 3, 5)  # 120 bytes
    A = torch.zeros(3, 4, dtype=torch.float64)  # 96 bytes
    out = torch.zeros(2, 3, 5, dtype=torch.bfloat16)  # 60 bytes
    assert scans.required_bytes((u, A), out) == (120 + 96 + 60, 276 + 2 * 216 + 60)
    assert scans.copy_bandwidth_gbps(torch.device("cpu"), 1 << 20, warmup=0, repeats=1) > 0

    path = tmp_path / "b.json"
    tiny = ["--batch", "1", "--dim", "4", "--state", "2", "--length", "9", "--device", "cpu"]
    assert script["main"]([*tiny, "--repeats", "1", "--warmup", "0", "--copy-mib", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    copy = report["environment"]["copy_gbps"]
    assert copy > 0
    for row in report["results"]:
        forward_bytes = 4 * (3 * 1 * 4 * 9 + 4 * 2 + 2 * 1 * 2 * 9 + 2 * 4) + 4 * 4 * 9  # inputs + out
        expected = forward_bytes / (row["forward_ms"] * 1e-3) / 1e9
        assert math.isclose(row["forward_gbps"], expected, rel_tol=1e-9)
        assert math.isclose(row["forward_copy_fraction"], row["forward_gbps"] / copy, rel_tol=1e-9)
        assert row["fwd_bwd_gbps"] > 0 and row["fwd_bwd_copy_fraction"] > 0


def test_packed_mode_compares_packed_with_padded_and_looped(tmp_path):
    """--op packed on a few short documents: packed and padded training give the same first
    loss, the packed scan the loop's gradients, and every throughput is positive."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "p.json"
    args = [
        "--op",
        "packed",
        "--docs",
        "3",
        "--max-doc-len",
        "40",
        "--batches",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--d-model",
        "8",
        "--layers",
        "1",
        "--backends",
        "pscan",
        "--device",
        "cpu",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert set(report["training_bytes_per_s"]) == {"pscan/padded", "pscan/packed"}
    assert all(v > 0 for v in report["training_bytes_per_s"].values())
    losses = report["first_batch_loss"]
    assert math.isclose(losses["pscan/padded"], losses["pscan/packed"], rel_tol=1e-4)
    assert report["scan_ms"]["pscan"]["max_grad_rel_diff"] < 1e-4 and report["documents"]["count"] == 3


def test_layer_mode_times_every_mixer(tmp_path):
    """--op layer on a tiny shape: a forward and a forward + backward time for Mamba, Mamba2
    and both forms of Mamba3, and the parameter counts of the layers built."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "l.json"
    args = [
        "--op",
        "layer",
        "--batch",
        "1",
        "--length",
        "9",
        "--d-model",
        "8",
        "--state",
        "4",
        "--headdim",
        "4",
        "--mimo-rank",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--device",
        "cpu",
        "--json",
        str(path),
    ]
    assert main(args) == 0
    report = json.loads(path.read_text())
    names = {"Mamba", "Mamba2", "Mamba3", "Mamba3 MIMO R=2"}
    if importlib.util.find_spec("transformers") is not None:  # its Mamba2 mixer, checked equal to ours first
        names.add("transformers Mamba2")
    assert set(report["ms"]) == {f"{n}/{w}" for n in names for w in ("fwd", "fwd+bwd")}
    assert all(v > 0 for v in report["ms"].values())
    # in_proj 8 → 2·16 + 2·4 + 3·4 + 1 (SISO), out_proj, dt_bias, B/C biases (4, 1, 4), B/C norms, D
    assert report["parameters"]["Mamba3"] == 8 * 53 + 16 * 8 + 4 + 2 * 16 + 2 * 4 + 4


def test_decode_mode_reports_tokens_per_second_per_batch(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "d.json"
    args = ["--op", "decode", "--d-model", "16", "--layers", "2", "--vocab", "50", "--new-tokens", "4"]
    args += ["--prompt-length", "3", "--decode-batches", "1,3", "--device", "cpu", "--json", str(path)]
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert report["config"]["layers"] == 2 and report["parameters"] > 0
    assert report["weight_read_s"] > 0
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["tokens_per_s"]["ssm"] > 0
        # with transformers installed, its tokens must equal ours; without it there is no peer
        assert r["same_tokens"] is (True if "transformers" in r["tokens_per_s"] else None)


def test_ssd_mode_times_each_fast_backend(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "s.json"
    args = ["--op", "ssd", "--dim", "8", "--headdim", "4", "--state", "4", "--length", "21", "--repeats", "1"]
    assert main([*args, "--warmup", "0", "--device", "cpu", "--chunk-sizes", "8,16", "--json", str(path)]) == 0
    ms = json.loads(path.read_text())["ms"]
    others = {b for b in backends("ssd", "cpu") if b not in ("ref", "chunked")}  # cpu; triton in the interpreter
    assert set(ms) == {"auto", "chunked/8", "chunked/16"} | others and all(v > 0 for v in ms.values())
    with pytest.raises(SystemExit):
        main([*args, "--chunk-sizes", "8,0"])


def test_tie_gap_reads_the_first_difference_of_each_differing_row():
    """tie_gap: for each row where two token sequences differ, the float64 logit gap of the two
    tokens at the first difference, from the shared prefix; the largest over the rows. Checked
    against logits written by hand: a model stub whose logits at position t are row t of a table."""
    import torch

    tie_gap = bench("decode").tie_gap
    table = torch.arange(60, dtype=torch.float64).reshape(6, 10) ** 1.5 / 10

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(1, 1)

        def forward(self, ids):
            return table[: ids.shape[1]][None].expand(ids.shape[0], -1, -1)

    a = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0]])
    b = a.clone()
    b[0, 4:] = torch.tensor([9, 0])  # first difference at 4: logits of position 3, tokens 5 and 9
    b[2, 2] = 7  # at 2: position 1, tokens 0 and 7; row 1 the same
    gap = tie_gap(Stub(), a, b)
    assert math.isclose(gap, max(table[3, 9] - table[3, 5], table[1, 7] - table[1, 0]))


def test_train_step_without_peers_times_only_ssm(capsys):
    """--no-peer holds for --op train-step too: no compiling of transformers' model on the side."""
    main = runpy.run_path(str(SCRIPT))["main"]
    tiny = ["--d-model", "16", "--layers", "1", "--batch", "2", "--length", "16", "--repeats", "1", "--warmup", "0"]

    assert main(["--op", "train-step", *tiny, "--no-peer"]) == 0

    out = capsys.readouterr().out
    assert "ssm MambaLM (eager)" in out
    assert "transformers" not in out and "mambapy" not in out


def test_the_compiled_step_loop_row_computes_the_selective_scan(tmp_path):
    """--compiled-step: a loop of torch.compile(selective_scan_step) is timed beside the backends
    and checked against ref like them."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "b.json"
    tiny = ["--batch", "2", "--dim", "8", "--state", "4", "--length", "9", "--device", "cpu", "--no-peer"]
    args = [*tiny, "--backends", "ref", "--compiled-step", "--repeats", "1", "--warmup", "0", "--json", str(path)]
    assert main(args) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["results"]}
    loop = rows["step loop (torch.compile)"]
    assert loop["max_abs_diff"]["ref"] < 1e-5 and loop["max_grad_rel_diff"]["ref"] < 1e-4


def test_decode_mode_runs_mamba2_against_transformers_mamba2(tmp_path):
    """--mixer mamba2: ssm's Mamba-2 LM (the fused C step) holding transformers'
    Mamba2ForCausalLM's weights decodes its greedy tokens (when transformers is installed)."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "d2.json"
    args = ["--op", "decode", "--mixer", "mamba2", "--d-model", "16", "--layers", "2", "--vocab", "50"]
    args += ["--new-tokens", "6", "--prompt-length", "3", "--decode-batches", "1,2", "--device", "cpu"]
    assert main([*args, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["config"]["mixer"] == "mamba2"
    for r in report["results"]:
        assert r["tokens_per_s"]["ssm"] > 0
        assert r["same_tokens"] is (True if "transformers" in r["tokens_per_s"] else None)


def test_decode_mode_runs_mamba3_without_a_peer(tmp_path):
    """--mixer mamba3: ssm's Mamba-3 LM decodes (transformers has no Mamba-3: no peer row)."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "d3.json"
    args = ["--op", "decode", "--mixer", "mamba3", "--d-model", "16", "--layers", "2", "--vocab", "50"]
    args += ["--new-tokens", "4", "--prompt-length", "3", "--decode-batches", "1", "--device", "cpu"]
    assert main([*args, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["config"]["mixer"] == "mamba3"
    (r,) = report["results"]
    assert r["tokens_per_s"]["ssm"] > 0 and list(r["tokens_per_s"]) == ["ssm"] and r["same_tokens"] is None


@pytest.mark.skipif(sys.platform != "linux", reason="--op memory reads /proc/self/status")
def test_memory_mode_reports_each_precision_from_its_own_process(tmp_path):
    """--op memory: every precision loads the same float32 checkpoint in a process of its own and
    decodes; the weights' bytes shrink with the precision, the readings are ordered as they
    must be (after import <= before decoding <= whole peak), and the tokens are decoded."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "m.json"
    args = ["--op", "memory", "--device", "cpu", "--d-model", "32", "--layers", "2", "--vocab", "64"]
    args += ["--new-tokens", "3"]
    assert main([*args, "--precisions", "float32,bfloat16,int8,int4", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    weights = {name: r["weight_bytes"] for name, r in results.items()}
    assert weights["float32"] > weights["bfloat16"] > weights["int8"] > weights["int4"] > 0
    for r in results.values():
        assert 0 < r["import_rss"] <= r["before_decoding"] <= r["whole_peak"] and len(r["tokens"]) == 3
        assert r["decoding_peak"] <= r["whole_peak"]


@pytest.mark.parametrize("extra", [["--dtype", "bfloat16"], ["--quantize", "int8"], ["--quantize", "int4"]])
def test_decode_mode_at_low_precision(tmp_path, extra):
    """--dtype / --quantize: ssm decodes in that precision (the weights' bytes shrink with it);
    its tokens are reported against the peer's, not required to agree."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "d.json"
    args = ["--op", "decode", "--d-model", "32", "--layers", "2", "--vocab", "50", "--new-tokens", "4"]
    args += ["--prompt-length", "3", "--decode-batches", "1", "--device", "cpu", "--json", str(path), *extra]
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert report["results"][0]["tokens_per_s"]["ssm"] > 0
    params = report["parameters"]
    assert report["weight_bytes"] < 2.5 * params  # float32 would be 4 bytes a weight


def assert_refused(main, argv: list[str], message: str, capsys) -> None:
    """``main(argv)`` stops with a usage error whose text holds ``message``."""
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


DECODE_ARGS = ["--op", "decode", "--d-model", "16", "--layers", "1", "--vocab", "50", "--device", "cpu"]


def test_decode_peer_llama_cpp_refuses_what_it_cannot_run(tmp_path, monkeypatch, capsys):
    """--peer llama.cpp: Mamba-3 (llama.cpp has none) and a missing build are errors that say
    what to do, before anything is timed."""
    main = runpy.run_path(str(SCRIPT))["main"]
    assert_refused(main, [*DECODE_ARGS, "--mixer", "mamba3", "--peer", "llama.cpp"], "llama.cpp has no Mamba-3", capsys)
    refused = "--prefill-length must be >= 0"
    assert_refused(main, [*DECODE_ARGS, "--peer", "llama.cpp", "--prefill-length", "-1"], refused, capsys)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "nowhere"))
    assert_refused(main, [*DECODE_ARGS, "--peer", "llama.cpp"], "bash scripts/peers/build_llama_cpp.sh", capsys)


def test_decode_peer_batches_need_llama_batched_bench(tmp_path, monkeypatch, capsys):
    """--peer-batches above 1 time llama-batched-bench: a build without it, or a batch out of
    1..256, is an error naming what is missing, before anything is timed."""
    home = tmp_path / "llama.cpp"
    for name in ("build/bin/llama-bench", "build/bin/llama-quantize", "src/convert_hf_to_gguf.py"):
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text("")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(home))
    main = runpy.run_path(str(SCRIPT))["main"]
    peer = [*DECODE_ARGS, "--peer", "llama.cpp", "--peer-batches"]
    assert_refused(main, [*peer, "1,4"], "llama-batched-bench missing", capsys)
    for bad in ("0", "300"):
        assert_refused(main, [*peer, bad], "--peer-batches must be from 1 to 256", capsys)


def test_llama_batched_bench_rate_is_its_generation_speed_for_the_asked_row():
    """The rate read from llama-batched-bench's JSONL is S_TG (all generated tokens over the
    generation's time) of the row with the asked prompt, tokens and batch; no such row is an
    error."""
    llama_cpp = bench("llama_cpp")
    row = '{{"pp": {pp}, "tg": 128, "pl": {pl}, "t_pp": 0.5, "t_tg": {t}, "speed_tg": {s}, "speed": 9.0}}'
    output = "\n".join(
        ["main: n_kv_max = 4096", row.format(pp=16, pl=4, t=2.0, s=256.0), row.format(pp=16, pl=16, t=4.0, s=512.0)]
    )
    assert llama_cpp.batched_rate(output, batch=16, new_tokens=128, context=16) == 512.0
    assert llama_cpp.batched_rate(output, batch=4, new_tokens=128, context=16) == 4 * 128 / 2.0
    with pytest.raises(RuntimeError, match="pl 8"):
        llama_cpp.batched_rate(output, batch=8, new_tokens=128, context=16)


def test_decode_peer_llama_cpp_maps_each_precision_to_its_gguf_type():
    """ssm's precision and llama.cpp's of the same width and block layout."""
    llama_cpp = bench("llama_cpp")
    assert llama_cpp.gguf_type("float32", None) == "f32"
    assert llama_cpp.gguf_type("bfloat16", None) == "bf16"
    assert llama_cpp.gguf_type("float16", None) == "f16"
    assert llama_cpp.gguf_type("float32", "int8") == "q8_0"
    assert llama_cpp.gguf_type("float32", "int4") == "q4_0"


def test_precision_mode_scores_each_precision_of_a_trained_text_run(tmp_path):
    """--op precision on a text run: every precision scores the run's held-out files and decodes;
    float32 agrees with itself; the quantised ones really run quantised (their bits per byte
    differ from float32's), with and without their activations rounded."""
    from ssm.training import load_config, train
    from tests.training.test_text_tokenizer import TINY, corpus

    args = TINY + [f"data.paths=[{corpus(tmp_path)}]", "data.batch_size=2", "trainer.max_steps=3"]
    run_dir = train(load_config(None, args + [f"run_dir={tmp_path / 'run'}"])).run_dir
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "p.json"
    cli = ["--op", "precision", "--run", str(run_dir), "--new-tokens", "8", "--prompts", "2", "--device", "cpu"]
    assert main([*cli, "--json", str(path)]) == 0
    rows = {r["precision"]: r for r in json.loads(path.read_text())["rows"]}
    quantised = ["int8", "int8, float32 act.", "int4", "int4, float32 act."]
    assert list(rows) == ["float32", "bfloat16", "float16", *quantised]
    assert rows["float32"]["greedy_agree"] == 1.0 and rows["float32"]["first_difference"] == [8, 8]
    for name, r in rows.items():
        assert math.isfinite(r["bits_per_byte"]) and 0 < r["bits_per_byte"] < 9, name
        assert 0 <= r["greedy_agree"] <= 1 and all(0 <= f <= 8 for f in r["first_difference"])
    for name in quantised:
        assert rows[name]["bits_per_byte"] != rows["float32"]["bits_per_byte"], name
    assert rows["int4"]["bits_per_byte"] != rows["int4, float32 act."]["bits_per_byte"]  # the rounding ran


@pytest.mark.parametrize("op", ["decode", "decode-table", "memory", "text"])
def test_the_decoding_ops_default_to_mamba_130m_depth(op):
    """The ops that compare decoding with peers (llama.cpp, transformers) run 24 layers unless
    told otherwise, as their tables say (decode-table once ran 4: every rate 3x too high)."""
    import argparse

    common = bench("common")
    args = argparse.Namespace(op=op, layers=None, batch=None, length=None, d_model=None)
    common.fill_defaults(args)
    assert args.layers == 24


def test_decode_table_gathers_each_mixer_and_precision(tmp_path):
    """--op decode-table: one --op decode run per (mixer, precision) at batch 1, gathered into
    one table with a weight-read limit per cell that grows as the weights narrow."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path, md = tmp_path / "t.json", tmp_path / "B.md"
    args = [
        "--op",
        "decode-table",
        "--decode-mixers",
        "mamba1,mamba3",
        "--precisions",
        "float32,int4",
        "--d-model",
        "32",
    ]
    args += ["--layers", "1", "--vocab", "50", "--new-tokens", "3", "--prompt-length", "2", "--device", "cpu"]
    assert main([*args, "--no-peer", "--json", str(path), "--markdown", str(md)]) == 0
    cells = json.loads(path.read_text())["cells"]
    assert [(c["mixer"], c["precision"]) for c in cells] == [
        ("mamba1", "float32"),
        ("mamba1", "int4"),
        ("mamba3", "float32"),
        ("mamba3", "int4"),
    ]
    for c in cells:
        assert c["ssm_whole"] > 0 and c["weight_read_limit"] > 0 and "llama.cpp" not in c
    assert cells[1]["weight_bytes"] < cells[0]["weight_bytes"] / 2
    assert "Mamba-1, ssm** (whole run)" in md.read_text() and "int4 (q4_0)" in md.read_text()


def test_context_parallel_mode_runs_each_world_size_and_counts_what_is_sent(tmp_path):
    """--op context-parallel: one row per (L, W); every rank's step holds memory and takes time;
    one process sends nothing, two send the summary and the halo by hand: Mamba-1 at d_model
    32 has d_inner 64 and N 16, so its final state (64·16 floats), its Σ_t Δ_t (64 floats, made
    the log-decay by A after the exchange) and a flag to the other rank, and the conv's 3
    positions of 64 channels to the next, 4 bytes each.
    A W that does not divide L is refused."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "cp.json"
    args = ["--op", "context-parallel", "--device", "cpu", "--d-model", "32", "--lengths", "64,128"]
    assert main([*args, "--worlds", "1,2", "--repeats", "1", "--warmup", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["length"], r["world"]) for r in rows] == [(64, 1), (64, 2), (128, 1), (128, 2)]
    for r in rows:
        assert r["step_peak_bytes"] >= 0 and r["before_bytes"] > 0 and r["ms"] > 0
        sent = r["sent_bytes_per_layer"]
        assert sent == ({"summary": 0, "halo": 0} if r["world"] == 1 else {"summary": 4356, "halo": 768})
    with pytest.raises(SystemExit):
        main([*args, "--worlds", "3"])


def test_saved_mode_counts_what_grows_with_the_tokens(tmp_path):
    """--op saved on the CPU's own paths: each layer's bytes a token are what
    ssm.memory.saved_bytes counts at 2L less at L, over batch·L tokens (the weights, kept
    whatever L, are not in them). The op counts with saved_bytes too: this checks the
    difference and the division; the GPU-path test below checks a count against one by hand."""
    import torch

    import ssm
    from ssm.memory import saved_bytes

    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "s.json"
    args = ["--op", "saved", "--batch", "2", "--length", "8", "--d-model", "16", "--state", "8", "--headdim", "8"]
    assert main([*args, "--device", "cpu", "--json", str(path)]) == 0
    got = json.loads(path.read_text())["bytes_per_token"]
    assert set(got) == {"Mamba", "Mamba2", "Mamba3", "Mamba3 MIMO R=4"} and got["Mamba3 MIMO R=4"] > 0
    for name, layer in (("Mamba", ssm.Mamba(16, d_state=16)), ("Mamba2", ssm.Mamba2(16, d_state=8, headdim=8))):
        kept = [saved_bytes(lambda L=L: layer(torch.randn(2, L, 16, requires_grad=True)))[0] for L in (8, 16)]
        assert got[name] == (kept[1] - kept[0]) / 16 > 0, name


def test_saved_mode_on_a_gpus_path_keeps_no_upcast_copies(tmp_path):
    """--op saved --gpu-path in bfloat16 (Triton interpreted, the tensor conv and norm): a Mamba-2
    layer keeps, a token, in_proj's input and output, the conv's output, the scan's output and
    out_proj's input, each once in bfloat16, and nothing else that grows with L (the gated norm
    through autograd kept five float32 copies of the scan's output, the conv its padded input
    and its output before the SiLU)."""
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "g.json"
    d, N, P = 16, 16, 8
    args = ["--op", "saved", "--gpu-path", "--dtype", "bfloat16", "--skip", "Mamba", "--batch", "1", "--length", "16"]
    args += ["--d-model", str(d), "--state", str(N), "--headdim", str(P), "--device", "cpu", "--json", str(path)]
    assert main(args) == 0
    got = json.loads(path.read_text())["bytes_per_token"]
    d_inner = 2 * d
    in_proj_out = 2 * d_inner + 2 * N + d_inner // P  # z, x, B, C, dt (one group)
    conv_out, y = d_inner + 2 * N, d_inner
    assert got["Mamba2"] == 2 * (d + in_proj_out + conv_out + y + y) + 4, got  # + the norm's float32 1/rms
    from ssm.ops import conv, norm

    assert norm.BACKENDS.auto["cpu"] == conv.BACKENDS.auto["cpu"] == ("cpu", "torch")  # restored after the call
    assert 0 < got["Mamba3"]
