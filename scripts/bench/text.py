"""--op text: text in, text out as a user runs it. A model directory at mamba-130m's shapes
(random weights, transformers' layout written by transformers itself, in safetensors shards)
with a byte-level BPE tokenizer.json trained on Python's own sources; then ``scripts/generate.py
DIR --prompt ... --temperature 0`` in a fresh process, timed from its start to the first
streamed token and at its decoding rate (its own last line), against transformers' greedy
``generate`` on the same directory and prompt (its weights and tokenizer loaded by
transformers, after a warm-up call). The new token ids of the two must be the same (exit status
1 otherwise; random weights make ties rare at 128 tokens, see --op decode)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import peers, report
from .common import ROOT, config_of, describe_device

PROMPT = "def main(argv):\n    "


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op text (also --d-model, --layers, --new-tokens)")
    group.add_argument("--tokenizer-vocab", type=int, default=8192, help="ids of the BPE trained for the run")


def check(args, parser) -> None:
    args.d_model = args.d_model or 768
    if min(args.d_model, args.layers, args.new_tokens, args.tokenizer_vocab) < 1:
        parser.error("--d-model, --layers, --new-tokens and --tokenizer-vocab must be positive")
    if args.device != "cpu":
        parser.error("--op text: generate.py is timed on the CPU (--device cpu)")


def build_directory(args, directory: Path):
    """transformers' MambaForCausalLM saved in shards (about half its bytes each) (or, without transformers or with
    --no-peer, this library's model in mamba-ssm's layout), plus a tokenizer trained here.
    Returns transformers' model, or None."""
    from ssm.models.tokenizer import train_bpe
    from ssm.training.data import default_text_files

    hf_model = None if args.no_peer else peers.transformers_mamba(args, torch.device("cpu"), vocab_size=50280)
    if hf_model is not None:
        hf_model.eval()
        size = sum(p.numel() * p.element_size() for p in hf_model.parameters())
        hf_model.save_pretrained(directory, max_shard_size=size // 2 + 1)
    else:
        from ssm import MambaConfig, MambaLM

        torch.manual_seed(args.seed)
        config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=50280, ssm_cfg={"d_state": 16})
        MambaLM(config).save_pretrained(directory, safe_serialization=True)
    texts = [Path(f).read_text(errors="replace") for f in default_text_files()[:200]]
    train_bpe(texts, args.tokenizer_vocab).save(directory)
    return hf_model


def run(args) -> tuple[int, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        hf_model = build_directory(args, directory)
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
        print(
            f"text in, text out at mamba-130m's shapes (d_model {args.d_model}, {args.layers} layers, vocabulary "
            f"50280, float32, {len(shards)} shards), {describe_device(torch.device('cpu'))}, "
            f"{torch.get_num_threads()} threads; greedy, {args.new_tokens} new tokens"
        )
        command = [sys.executable, str(ROOT / "scripts" / "generate.py"), str(directory), "--prompt", PROMPT]
        command += ["--max-new-tokens", str(args.new_tokens), "--temperature", "0", "--show-ids", "--no-stream"]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        process_s = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"generate.py failed:\n{done.stderr}")
        ours = [int(t) for t in re.search(r"ids\[0\]: ?(.*)", done.stdout).group(1).split()]
        last = done.stderr.strip().splitlines()[-1]
        rate = float(re.search(r"([\d.]+) tokens/s", last).group(1))
        first = float(re.search(r"first token ([\d.]+) s", last).group(1))

        hf_rate, theirs = None, None
        if hf_model is not None:
            from tokenizers import Tokenizer

            # the prompt's ids as transformers' fast tokenizers give them: the same tokenizer.json
            ids = torch.tensor([Tokenizer.from_file(str(directory / "tokenizer.json")).encode(PROMPT).ids])
            hf_model.generation_config.eos_token_id = None  # every one of --new-tokens tokens
            hf_model.generation_config.pad_token_id = 0

            def hf_generate():
                return hf_model.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
                )

            with torch.no_grad():
                hf_generate()  # warm-up
                start = time.perf_counter()
                theirs = hf_generate()[0, ids.shape[1] :].tolist()
                hf_rate = args.new_tokens / (time.perf_counter() - start)
    # generate.py stops at the tokenizer's eos; transformers was told to go on: compare up to there
    same = None if theirs is None else ours == theirs[: len(ours)]
    print(f"generate.py: {rate:.1f} tokens/s decoding, first token {first:.2f} s after start", end="")
    print(f", the whole process {process_s:.1f} s")
    if hf_rate is not None:
        print(f"transformers generate (warm): {hf_rate:.1f} tokens/s; ratio {rate / hf_rate:.2f}x; same tokens: {same}")
    result = {
        "config": config_of(args),
        "generate_py_tokens_per_s": rate,
        "generate_py_first_token_s": first,
        "generate_py_process_s": process_s,
        "transformers_tokens_per_s": hf_rate,
        "same_tokens": same,
        "shards": len(shards),
    }
    return (1 if same is False else 0), result


def markdown(result: dict, args) -> str:
    rows = [
        [
            "ssm: scripts/generate.py (fresh process)",
            f"{result['generate_py_tokens_per_s']:.1f}",
            f"{result['generate_py_first_token_s']:.2f} s",
        ],
    ]
    if result["transformers_tokens_per_s"] is not None:
        rows.append(
            ["transformers: MambaForCausalLM.generate (warm)", f"{result['transformers_tokens_per_s']:.1f}", "-"]
        )
    body = report.table(["engine", "tokens/s (greedy, batch 1)", "main() to first token (loading included)"], rows)
    body += (
        f"\n\nA {result['config']['d_model']}-wide, {result['config']['layers']}-layer Mamba-1 with random weights "
        f"in transformers' layout ({result.get('shards')} safetensors shards) and a BPE tokenizer.json trained on "
        "Python's sources; the same "
        f"prompt, {result['config']['new_tokens']} greedy tokens. Same tokens: {result['same_tokens']}. "
        "The whole generate.py process, Python's start and torch's import included: "
        f"{result['generate_py_process_s']:.1f} s."
    )
    title = f"text in, text out: scripts/generate.py against transformers, {result['config']['device']}"
    return "text", title, body
