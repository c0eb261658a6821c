"""scripts/gpu_check.py: its dry run (the GPU plan at tiny sizes on the CPU) runs end to end and
reports every step, so that the script cannot rot between GPU windows; its log parsing and
summary read what they are given. The peer steps (mamba-ssm beside ssm) say what they skipped
and why; where mamba-ssm's source is in third_party/ (scripts/peers/fetch_mamba_ssm.sh) the dry
run checks in Triton's interpreter that the pairs agree, and a pair given a wrong argument
mapping or wrong weights must not."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
PEER = ROOT / "third_party" / "mamba-ssm" / "mamba_ssm" / "__init__.py"
NO_PEER = "no third_party/mamba-ssm here: scripts/peers/fetch_mamba_ssm.sh puts it there"


def script():
    return runpy.run_path(str(SCRIPT))


def test_the_dry_run_reports_every_step(tmp_path):
    out = tmp_path / "out"
    code = script()["main"](["--out", str(out), "--dry-run", "--steps", "tests,bench,train"])
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and report["environment"]["torch"]
    tests = report["tests"]
    assert tests["counts"].get("passed", 0) >= 10 and not tests["failed"], tests
    assert tests["returncode"] == 0
    cases = {row["case"]: row for row in report["bench"]}
    assert len(cases) == len(script()["SCAN_CASES"])
    for label, row in cases.items():
        assert row["returncode"] == 0, (label, row)
        results = row["report"].get("results") or row["report"].get("ms") or row["report"].get("bytes_per_token")
        assert results, label
    runs = report["train"]
    assert [r["returncode"] for r in runs] == [0, 0]
    # the same config, seed and steps on the same device: the comparison must see equal losses
    assert runs[0]["final"]["val/loss"] == runs[1]["final"]["val/loss"]
    assert runs[0]["train/loss"]["first"][1] > 0
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.log",
        "pytest.log",
        "report.json",
        "summary.md",
        "train.log",
    ]
    summary = (out / "summary.md").read_text()
    assert "| selective float32 L 2048 | triton |" in summary and "passed" in summary
    assert "| selective float32 L 2048 | step loop (torch.compile) |" in summary
    assert "| ssd float32 L 2048 | triton |" in summary  # the ssd benchmark times every backend of the table
    assert "| Mamba3: " in summary and "bytes a token kept for the backward" in summary  # --op saved's rows
    assert "| trapezoidal float32 batch 1 L 65536 | triton-ssd |" in summary
    assert code == 0


def test_pytest_outcome_reads_counts_and_failed_ids(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text(
        "$ python -m pytest ...\n..F.s\n"
        "FAILED tests/scan/test_triton.py::test_selective_lengths[19] - AssertionError: x\n"
        "ERROR tests/scan/test_triton.py::test_linear_shapes[a] - RuntimeError\n"
        "======= 1 failed, 3 passed, 1 skipped, 1 error in 2.00s =======\n"
    )
    outcome = script()["pytest_outcome"](log)
    assert outcome["counts"] == {"failed": 1, "passed": 3, "skipped": 1, "error": 1}
    assert outcome["summary"] == "1 failed, 3 passed, 1 skipped, 1 error in 2.00s"
    assert outcome["failed"] == [
        "tests/scan/test_triton.py::test_linear_shapes[a]",
        "tests/scan/test_triton.py::test_selective_lengths[19]",
    ]
    log.write_text("$ python -m pytest -q ...\n...............\n15 passed, 2 deselected in 54.60s\n")  # under -q
    assert script()["pytest_outcome"](log)["counts"] == {"passed": 15, "deselected": 2}
    # -v, killed at its budget: what it got to, its failures so far and the test it was in
    log.write_text(
        "$ python -m pytest -q ...\n3 failed in 1.00s\n"  # an earlier run in the same log
        "\n$ python -m pytest -v ...\n"
        "tests/scan/test_triton.py::test_a[1] PASSED                       [  1%]\n"
        "tests/scan/test_triton.py::test_a[2] FAILED                       [  2%]\n"
        "tests/scan/test_triton.py::test_b SKIPPED (no bf16)               [  3%]\n"
        "tests/scan/test_triton.py::test_c \n"
        "[gpu_check] killed after 200 s\n"
    )
    outcome = script()["pytest_outcome"](log)
    assert outcome["summary"] is None and outcome["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert outcome["failed"] == ["tests/scan/test_triton.py::test_a[2]"]
    assert outcome["unfinished"] == ["tests/scan/test_triton.py::test_c"]
    log.write_text(  # xdist under -v
        "$ python -m pytest -v -n 4 ...\n[gw1] [ 50%] PASSED tests/a.py::t[x] \n[gw0] [100%] ERROR tests/a.py::u \n"
    )
    outcome = script()["pytest_outcome"](log)
    assert outcome["counts"] == {"passed": 1, "errors": 1} and outcome["failed"] == ["tests/a.py::u"]


def test_the_summary_shows_each_form_of_result():
    report = {
        "environment": {"device": "H100"},
        "tests": {"summary": "2 passed in 1s", "failed": ["t::a"], "seconds": 1, "timed_out": False},
        "bench": [
            {
                "case": "sel",
                "report": {
                    "results": [{"name": "triton", "forward_ms": 1.5, "fwd_bwd_ms": 4.25, "fwd_bwd_peak_bytes": 2**21}]
                },
            },
            {"case": "ssd", "report": {"ms": {"chunked": 7.0}}},
            {"case": "late", "skipped": "out of the step's time"},
        ],
        "train": [{"run": "r", "returncode": 0, "seconds": 3, "train/loss": {"first": [0, 5.5], "last": [9, 1.25]}}],
        "peer_build": {"skipped": "dry run"},
    }
    text = script()["summary_markdown"](report)
    assert "| sel | triton | 1.500 | 4.250 | 2.0 |" in text
    assert "| ssd | chunked | - | 7.000 |" in text
    assert "| late | (out of the step's time) |" in text
    assert "- FAILED t::a" in text and "[9, 1.25]" in text


def dry_run_peers(out: Path, third_party: Path | None = None) -> tuple[int, dict]:
    """The dry run's build and peer steps in a child process (the peer's loader patches torch.cuda
    for the interpreter: not in the test session), with mamba-ssm from ``third_party``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    if third_party is not None:
        env["SSM_THIRD_PARTY"] = str(third_party)
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--dry-run", "--steps", "build,peers"]
    code = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900).returncode
    return code, json.loads((out / "report.json").read_text())


def test_the_dry_run_says_why_without_the_peer(tmp_path):
    code, report = dry_run_peers(tmp_path / "out", third_party=tmp_path / "empty")
    fetch = "run scripts/peers/fetch_mamba_ssm.sh; carry third_party to a GPU machine"
    why = f"no {tmp_path / 'empty' / 'mamba-ssm'} ({fetch})"
    assert report["build"] == {"skipped": why}
    rows = report["peers"]["rows"] + report["peers_built"]["rows"]
    assert [r["op"] for r in rows] == ["ssd", "mamba3", "mamba2_layer", "selective", "train_step"]
    assert all(r["skipped"] == why for r in rows)
    # the warm-up ran its processes, one per case, and each said the same
    assert [run["case"] for run in report["warm"]["runs"]] == list(script()["WARM_CASES"])
    assert [run["returncode"] for run in report["warm"]["runs"]] == [0] * len(script()["WARM_CASES"])
    assert [r["op"] for r in report["warm"]["rows"]] == list(script()["WARM_CASES"])
    assert all(r["skipped"] == why for r in report["warm"]["rows"])
    assert json.loads((tmp_path / "out" / "gpu-peers.json").read_text()) == []
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"- build: skipped: {why}" in summary and f"- not measured: ssd: {why}" in summary
    assert f"- warm-up, mamba3: first calls -; {why}" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-peers.json", "peers.log", "report.json",
                                                                      "summary.md"]  # fmt: skip
    assert code == 0


@pytest.mark.skipif(not PEER.exists(), reason=NO_PEER)
def test_the_dry_run_checks_the_peers_in_the_interpreter(tmp_path):
    docs = [ROOT / "BENCHMARKS.md", ROOT / "docs" / "bench" / "gpu-peers.json"]
    before = [p.read_bytes() if p.exists() else None for p in docs]
    code, report = dry_run_peers(tmp_path / "out")
    assert report["build"] == {"skipped": "no CUDA (dry run): nothing to build for"}
    rows = {
        (r["op"], r["shape"].split("mixer ")[-1][:6]): r
        for r in report["peers"]["rows"] + report["peers_built"]["rows"]
    }
    not_built = "selective_scan_cuda is not built (no CUDA here)"
    assert rows["selective", "batch "]["skipped"] == not_built
    assert rows["train_step", "Mamba1"]["skipped"] == not_built
    for pair in (("ssd", "batch "), ("mamba2_layer", "batch "), ("train_step", "Mamba2")):
        row = rows[pair]
        assert row["agree"] is True and row["pass"] == "fwd+bwd", row
        assert max(row["diff"].values()) <= 1e-4 and row["device"] == "cpu (Triton interpreter)"
        assert row["ssm"] > 0 and row["peer"] > 0 and row["commit"] and row["date"]
    assert rows["ssd", "batch "]["diff"].keys() >= {"out", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias"}
    mamba3 = rows["mamba3", "batch "]
    assert mamba3["agree"] == "unchecked" and "Triton's interpreter" in mamba3["why"] and mamba3["pass"] == "fwd"
    assert "interleaved rotary pairs" in mamba3["note"]
    written = json.loads((tmp_path / "out" / "gpu-peers.json").read_text())
    assert [r["op"] for r in written] == ["ssd", "mamba3", "mamba2_layer", "train_step"]
    # the warm-up: each pair's two sides called once, their seconds given, nothing checked or timed
    warm = {(r["op"], r["shape"].split("mixer ")[-1][:6]): r for r in report["warm"]["rows"]}
    for pair in (("ssd", "batch "), ("mamba3", "batch "), ("mamba2_layer", "batch "), ("train_step", "Mamba2")):
        row = warm[pair]
        assert row["compiled"] is True and "ssm" not in row and "agree" not in row, row
        assert row["first_call_s"].keys() == {"ssm", "peer"} and min(row["first_call_s"].values()) > 0
    assert warm["train_step", "Mamba1"]["skipped"] == not_built
    for row in report["peers"]["rows"] + report["peers_built"]["rows"]:
        assert "ssm" not in row or row["first_call_s"].keys() == {"ssm", "peer"}
    assert [p.read_bytes() if p.exists() else None for p in docs] == before  # a dry run writes nothing into docs/
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"- not measured: selective (batch 1, dim 8, N 4, L 64): {not_built}" in summary
    assert "- mamba3 (batch 1, L 40, heads 2, P 16, N 16, chunk 16, fwd): agree unchecked" in summary
    assert code == 0
    # its rows stay out of docs/ when applied
    assert script()["main"](["--apply", str(tmp_path / "out")]) == 1


def test_a_window_replaces_the_rows_it_measured_again_and_keeps_the_others():
    merge = script()["merge_rows"]
    old = [
        {"op": "ssd", "shape": "L 2048", "dtype": "bfloat16", "pass": "fwd", "ssm": 1.0, "date": "2026-11-27"},
        {"op": "ssd", "shape": "L 2048", "dtype": "bfloat16", "pass": "fwd+bwd", "ssm": 4.0, "date": "2026-11-27"},
        {"op": "selective", "shape": "L 2048", "dtype": "float32", "pass": "fwd", "ssm": 2.0, "date": "2026-11-27"},
    ]
    new = [
        {"op": "ssd", "shape": "L 2048", "dtype": "bfloat16", "pass": "fwd+bwd", "ssm": 5.0, "date": "2026-11-28"},
        {"op": "mamba3", "shape": "L 2048", "dtype": "bfloat16", "pass": "fwd", "ssm": 3.0, "date": "2026-11-28"},
    ]
    merged = merge(old, new)
    assert [(r["op"], r["pass"], r["ssm"], r["date"]) for r in merged] == [
        ("ssd", "fwd", 1.0, "2026-11-27"),
        ("ssd", "fwd+bwd", 5.0, "2026-11-28"),
        ("selective", "fwd", 2.0, "2026-11-27"),
        ("mamba3", "fwd", 3.0, "2026-11-28"),
    ]
    section = script()["peers_section"]([r | {"device": "H200", "unit": "ms", "peer": 1.0, "agree": True,
                                              "diff": {"out": 1e-3}, "worst": "out", "commit": "abc1234"}
                                         for r in merged])  # fmt: skip
    assert "| 2026-11-27, `abc1234` |" in section and "| 2026-11-28, `abc1234` |" in section
    assert section.startswith("<!-- bench:gpu-peers-cuda -->\n### ssm beside mamba-ssm on H200")


PLANTED = """
import sys
sys.path.insert(0, "scripts")
from bench import gpu_peer_cases as cases
from bench import gpu_peers

kernel_pair = cases.kernel_pair


def b_and_c_swapped(leaves, ssm_fn, ssm_args, peer_fn, peer_args, tolerance):
    def swapped(v):
        x, dt, A, B, C, *rest = peer_args(v)
        return (x, dt, A, C, B, *rest)
    return kernel_pair(leaves, ssm_fn, ssm_args, peer_fn, swapped, tolerance)


cases.kernel_pair = b_and_c_swapped
module_pair = cases.module_pair


def one_weight_off(ours, theirs, *args, **kwargs):
    with cases.torch.no_grad():
        ours.out_proj.weight[0, 0] += 0.1
    return module_pair(ours, theirs, *args, **kwargs)


cases.module_pair = one_weight_off
code, result = gpu_peers.run(gpu_peers_args)
"""


@pytest.mark.skipif(not PEER.exists(), reason=NO_PEER)
def test_a_wrong_mapping_or_wrong_weights_do_not_agree(tmp_path):
    """B and C swapped in the peer's SSD arguments; one weight of ssm's Mamba2 layer changed
    after loading the peer's: both pairs must say they disagree, and the op fail."""
    driver = tmp_path / "planted.py"
    driver.write_text(
        "import sys\nsys.path.insert(0, 'scripts')\nimport benchmark\n"
        "gpu_peers_args = benchmark.parse_args(['--op', 'gpu-peers', '--device', 'cpu', '--cases', 'ssd,mamba2_layer',"
        " '--repeats', '1', '--warmup', '0'])\n"
        + PLANTED
        + "\nimport json\nprint(json.dumps([code, result['rows']]))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(driver)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code, rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["op"], r["agree"]) for r in rows] == [("ssd", False), ("mamba2_layer", False)]
    assert rows[0]["diff"]["out"] > 0.1 and rows[0]["diff"]["dB"] > 0.1 and rows[0]["diff"]["dC"] > 0.1
    assert rows[1]["diff"]["out"] > 1e-3
    assert code == 1


@pytest.mark.skipif(not PEER.exists(), reason=NO_PEER)
def test_the_peer_loads_without_its_build_or_the_hub_libraries():
    """A GPU machine may lack transformers, huggingface_hub and causal-conv1d: mamba-ssm's modules
    still import (stubs for what they only name), and its Mamba2 module builds."""
    driver = (
        "import sys, json\n"
        "for name in ('transformers', 'huggingface_hub', 'causal_conv1d'):\n"
        "    sys.modules[name] = None  # not installed\n"
        "sys.path.insert(0, 'scripts')\n"
        "from bench import mamba_ssm_peer\n"
        "peer = mamba_ssm_peer.load(interpreting=True)\n"
        "layer = peer.mamba2.Mamba2(32, d_state=16, headdim=16, chunk_size=16, use_mem_eff_path=False)\n"
        "missing = [k for k in mamba_ssm_peer.MODULES if getattr(peer, k) is None]\n"
        "size = sum(p.numel() for p in layer.parameters())\n"
        "print(json.dumps([peer.stubs, peer.errors, missing, peer.built, size]))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", driver], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stubs, errors, missing, built, parameters = json.loads(done.stdout.strip().splitlines()[-1])
    assert stubs == ["selective_scan_cuda", "huggingface_hub", "transformers", "transformers.utils",
                     "transformers.utils.hub", "transformers.generation"]  # fmt: skip
    assert errors == {} and missing == [] and parameters > 0
    assert built == {"selective_scan_cuda": False, "causal_conv1d_cuda": False}


@pytest.mark.skipif(not PEER.exists(), reason=NO_PEER)
def test_the_130m_pairs_hold_the_same_tensors():
    """The GPU's training-step pairs at mamba-130m's shapes (on the meta device): ssm's MambaLM has
    MambaLMHeadModel's state dict, names and shapes, for Mamba-1 and Mamba-2 mixers."""
    driver = (
        "import sys, json\n"
        "sys.path.insert(0, 'scripts')\n"
        "from bench import mamba_ssm_peer\n"
        "peer = mamba_ssm_peer.load(interpreting=True)\n"
        "import ssm\n"
        "found = []\n"
        "for mixer in ({'layer': 'Mamba2', 'd_state': 128, 'headdim': 64, 'chunk_size': 256}, {'layer': 'Mamba1'}):\n"
        "    cfg = dict(d_model=768, n_layer=24, vocab_size=50280, ssm_cfg=mixer)\n"
        "    config = peer.config.MambaConfig(**cfg | {'ssm_cfg': dict(mixer)})\n"
        "    theirs = peer.models.MambaLMHeadModel(config, device='meta')\n"
        "    ours = ssm.MambaLM(ssm.MambaConfig(**cfg), device='meta')\n"
        "    shapes = [{k: list(v.shape) for k, v in m.state_dict().items()} for m in (theirs, ours)]\n"
        "    found.append([shapes[0] == shapes[1], len(shapes[0]), sum(p.numel() for p in theirs.parameters())])\n"
        "print(json.dumps(found))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", driver], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (same2, keys2, size2), (same1, keys1, size1) = json.loads(done.stdout.strip().splitlines()[-1])
    assert same2 and same1 and keys2 > 200 and keys1 > 200
    assert 125e6 < size2 < 135e6 and 125e6 < size1 < 135e6  # mamba-130m's and mamba2-130m's sizes


SHARDS = """
import sys, types
sys.path.insert(0, "scripts")
import triton
import triton.language as tl
from bench import mamba_ssm_peer


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (1, 2, 4, 8, 16)], key=["n"])
@triton.jit
def kernel(x, n, BLOCK: tl.constexpr):
    pass


@triton.autotune(configs=[triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def single(x, n, BLOCK: tl.constexpr):
    pass


def blocks(i, k):
    module = types.ModuleType("mamba_ssm.fake")
    module.kernel, module.single = kernel, single
    configs = list(kernel.configs)
    sys.modules["mamba_ssm.fake"] = module
    try:
        cut = mamba_ssm_peer.cut_autotuners((i, k))
        return cut, [c.kwargs["BLOCK"] for c in kernel.configs], [c.kwargs["BLOCK"] for c in single.configs]
    finally:
        kernel.configs = configs
        del sys.modules["mamba_ssm.fake"]


print([blocks(i, 3) for i in range(3)], blocks(6, 8))
"""


def test_autotune_shards_split_the_peers_configurations_between_processes():
    """--autotune-shard I/K keeps configurations I, I+K, ... of each autotuned kernel: K shards
    compile every configuration once between them, and a shard past the end keeps the first."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SHARDS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(1, [1, 8], [32]), (1, [2, 16], [32]), (1, [4], [32])] (1, [1], [32])"


def test_a_shard_is_refused_where_it_would_cut_a_timing():
    gpu_peers = ROOT / "scripts" / "benchmark.py"
    cmd = [sys.executable, str(gpu_peers), "--op", "gpu-peers", "--autotune-shard", "1/4", "--device", "cpu"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "only with --compile-only" in out.stderr, out.stderr
    out = subprocess.run(cmd[:-4] + ["--autotune-shard", "4/4", "--compile-only"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "0 <= I < K" in out.stderr, out.stderr
