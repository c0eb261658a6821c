"""Text in, text out: continue prompts with a pretrained model or a run of scripts/train.py.

    python scripts/generate.py state-spaces/mamba-130m-hf --prompt "Mamba is"
    python scripts/generate.py path/to/model_dir --prompt "a" --prompt "another" --temperature 0
    python scripts/generate.py runs/RUN_DIR --prompt "def main(" --max-new-tokens 200
    python scripts/generate.py state-spaces/mamba-130m-hf --prompt "Mamba is" --quantize int8

NAME_OR_DIR: a model directory (mamba-ssm's or transformers' layout, sharded or not), a Hugging
Face hub repo id (huggingface_hub; with HF_HUB_OFFLINE=1 from the local cache only), or a
training run (its model/). The tokenizer: --tokenizer (a tokenizer.json, its directory, a hub
repo id, or "bytes"), else the tokenizer.json beside the weights, else bytes for a model of 256
ids (this library's byte-level runs). One prompt streams its continuation token by token as it
is decoded; several are generated together as one batch (left padding, an attention mask) and
printed when done. A sequence ends at the tokenizer's eos token. The last line, on stderr, gives
tokens per second and the weights' precision (and a quantised model's activations).

Precision: --dtype casts the weights as they are read (default: the checkpoint's dtype); --quantize
int8 / int4 quantises them as they are read (MambaLM.quantize: blocks of 32 inputs, one float32
scale each), or names the scheme of a checkpoint saved quantised (loaded as saved; another scheme
is an error). --activations: what a quantised model's layers multiply their integers by, int8
(the default: each input rounded per block of 32, as llama.cpp's q8_0 / q4_0 do) or float32. On
the CPU, bfloat16 / float16 and int8 / int4 models decode through the fused C step, which reads
each matrix as stored (docs/guide.md, "Low precision on the CPU").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's ssm, whichever one is installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name_or_dir", help="model directory, hub repo id, or training run directory")
    parser.add_argument("--prompt", action="append", default=None, help="repeat for a batch (default: 'import ')")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json, its directory, a hub repo id, or 'bytes'")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help="the weights' dtype (default: the checkpoint's)",
    )
    parser.add_argument(
        "--quantize", default=None, choices=["int8", "int4"], help="quantise the weights (or: the checkpoint's scheme)"
    )
    parser.add_argument(
        "--activations",
        default=None,
        choices=["int8", "float32"],
        help="what a quantised model's layers multiply their integers by (default: int8, or the checkpoint's)",
    )
    parser.add_argument("--no-stream", action="store_true", help="print the text when done, not token by token")
    parser.add_argument("--show-ids", action="store_true", help="also print each row's new token ids")
    args = parser.parse_args(argv)
    prompts = args.prompt or ["import "]
    if any(not p for p in prompts):
        parser.error("--prompt must not be empty")
    if args.max_new_tokens < 0:
        parser.error("--max-new-tokens must be >= 0")

    import torch

    from ssm.models.text import QuantizationMismatch, continuation, left_pad, load_model_and_tokenizer
    from ssm.models.tokenizer import TextStream

    started = time.perf_counter()
    try:
        model, tokenizer, directory = load_model_and_tokenizer(
            args.name_or_dir,
            args.tokenizer,
            device=args.device,
            dtype=args.dtype,
            quantize=args.quantize,
        )
    except QuantizationMismatch as err:
        parser.error(f"--{err}")  # "--quantize int4: DIR is saved quantised as int8; ..."
    if args.activations is not None:
        if model.quantization is None:
            parser.error(f"--activations {args.activations}: applies to a quantised model (add --quantize)")
        model.set_activations(args.activations)
    if model.quantization:
        precision = f"{model.quantization['scheme']} weights, {model.quantization['activations']} activations"
    else:
        precision = str(model.lm_head.weight.dtype).split(".")[-1] + " weights"
    encoded = [tokenizer.encode(p) for p in prompts]
    if any(not ids for ids in encoded):
        parser.error("every --prompt must encode to at least one token")
    input_ids, attention_mask = left_pad(encoded, tokenizer, args.device)
    L = input_ids.shape[1]

    stream = len(prompts) == 1 and not args.no_stream
    text_stream = TextStream(tokenizer)
    first_token_at = []

    def on_token(next_ids):
        if not first_token_at:
            first_token_at.append(time.perf_counter())
        if stream and not (tokenizer.eos_token_id is not None and int(next_ids[0]) == tokenizer.eos_token_id):
            print(text_stream.push(int(next_ids[0])), end="", flush=True)

    if stream:
        print(prompts[0], end="", flush=True)
    decode_started = time.perf_counter()
    out = model.generate(
        input_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator(args.device).manual_seed(args.seed),
        attention_mask=attention_mask,
        on_token=on_token,
    )
    finished = time.perf_counter()
    new = [continuation(row[L:].tolist(), tokenizer.eos_token_id) for row in out]
    if stream:
        print(text_stream.finish())
    else:
        for i, (prompt, ids) in enumerate(zip(prompts, new)):
            if len(prompts) > 1:
                print(f"--- [{i}]")
            print(prompt + tokenizer.decode(ids))
    if args.show_ids:
        for i, ids in enumerate(new):
            print(f"ids[{i}]: {' '.join(map(str, ids))}")
    count = sum(len(ids) for ids in new)
    steps, seconds = out.shape[1] - L, finished - decode_started  # every row runs every step
    to_first = (first_token_at[0] if first_token_at else finished) - started
    print(
        f"{count} new token(s), {steps} step(s) x batch {len(prompts)} in {seconds:.2f} s: "
        f"{steps * len(prompts) / max(seconds, 1e-9):.1f} tokens/s "
        f"(first token {to_first:.2f} s after start, loading {directory} included; {precision})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
