"""llama.cpp as the CPU decoding peer of --op decode (``--peer llama.cpp``): the same weights,
saved by transformers, converted to GGUF with llama.cpp's own convert_hf_to_gguf.py at the
precision ssm runs in (float32 -> f32, bfloat16 -> bf16, float16 -> f16, int8 -> q8_0, int4 ->
q4_0 through llama-quantize), and timed with llama-bench on torch's thread count: generation
only, batch 1, after a ``--prompt-length`` context (llama-bench's -d), and the prefill of a
``--prefill-length`` prompt (-p); at batches above 1 (``--peer-batches``), llama-batched-bench:
that many sequences decoded together, one token each per step.

Built by ``bash scripts/peers/build_llama_cpp.sh`` into third_party/llama.cpp (or
$LLAMA_CPP_DIR). Optional: without it the benchmark says how to build it and stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD_COMMAND = "bash scripts/peers/build_llama_cpp.sh"

# ssm's precision (--dtype, --quantize) -> llama.cpp's type of the same width and layout
# (q8_0 / q4_0: blocks of 32 inputs with one scale each, as ssm.ops.quant's int8 / int4).
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}


def home() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR", ROOT / "third_party" / "llama.cpp"))


def tool(name: str) -> Path:
    return home() / "build" / "bin" / name


def missing(batched: bool = False) -> str | None:
    """Why llama.cpp cannot run here (``batched``: at batches above 1 too), or None."""
    needed = [tool("llama-bench"), tool("llama-quantize"), home() / "src" / "convert_hf_to_gguf.py"]
    needed += [tool("llama-batched-bench")] if batched else []
    absent = [str(p) for p in needed if not p.is_file()]
    return f"llama.cpp is not built ({', '.join(absent)} missing): run `{BUILD_COMMAND}`" if absent else None


def gguf_type(dtype: str, quantize: str | None) -> str:
    return GGUF_TYPES[quantize or dtype]


def convert(hf_model, workdir: Path, kind: str) -> Path:
    """``hf_model`` (transformers, float32) as a GGUF file of type ``kind`` in ``workdir``."""
    source = workdir / "hf"
    if not (source / "config.json").is_file():
        hf_model.save_pretrained(source, safe_serialization=True)
    direct = kind if kind != "q4_0" else "f32"  # convert_hf_to_gguf writes no q4_0
    out = workdir / f"model-{direct}.gguf"
    if not out.is_file():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(home() / "src" / "gguf-py"), str(home() / "src")])}
        script = home() / "src" / "convert_hf_to_gguf.py"
        command = [sys.executable, str(script), str(source), "--outtype", direct, "--outfile", str(out)]
        run(command, env=env)
    if kind != "q4_0":
        return out
    quantised = workdir / "model-q4_0.gguf"
    if not quantised.is_file():
        run([str(tool("llama-quantize")), str(out), str(quantised), "q4_0"])
    return quantised


def tokens_per_s(gguf: Path, threads: int, *, new_tokens: int = 0, context: int = 0, prompt: int = 0) -> float:
    """llama-bench's tokens/s, batch 1, one timed run after its own warm-up: generating
    ``new_tokens`` after ``context`` tokens (-n, -d), or reading a ``prompt`` (-p: prefill)."""
    command = [str(tool("llama-bench")), "-m", str(gguf), "-p", str(prompt), "-n", str(new_tokens)]
    command += ["-d", str(context), "-t", str(threads), "-r", "1", "-o", "json"]
    rows = json.loads(run(command))
    (row,) = [r for r in rows if (r["n_gen"], r["n_prompt"]) == (new_tokens, prompt)]
    return float(row["avg_ts"])


def batched_tokens_per_s(gguf: Path, threads: int, batch: int, *, new_tokens: int, context: int) -> float:
    """llama-batched-bench's generation rate: ``batch`` sequences, each after its own
    ``context``-token prompt, decoding ``new_tokens`` tokens together (one token of every
    sequence per step), all generated tokens over the generation's time (its S_TG)."""
    need = batch * (context + new_tokens)
    command = [str(tool("llama-batched-bench")), "-m", str(gguf), "-c", str(-(-need // 256) * 256)]
    command += ["-npp", str(context), "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads)]
    command += ["--output-format", "jsonl"]
    return batched_rate(run(command), batch=batch, new_tokens=new_tokens, context=context)


def batched_rate(output: str, *, batch: int, new_tokens: int, context: int) -> float:
    """The S_TG (``speed_tg``) of llama-batched-bench's JSONL row for (context, new_tokens,
    batch) in ``output``; an error naming what was looked for if there is not exactly one."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    mine = [r for r in rows if (r["pp"], r["tg"], r["pl"]) == (context, new_tokens, batch)]
    if len(mine) != 1:
        raise RuntimeError(
            f"llama-batched-bench: expected one row for pp {context}, tg {new_tokens}, pl {batch}; "
            f"got {len(mine)} in:\n{output[-2000:]}"
        )
    return float(mine[0]["speed_tg"])


def run(command: list[str], env: dict | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout
