"""--op precision: what each weight precision costs a trained text model. ``--run DIR`` (a text run
of scripts/train.py, or any model directory with its tokenizer) is loaded in float32, bfloat16
and float16, and quantised to int8 and int4, each with int8 and with float32 activations
(``load_model_and_tokenizer(..., dtype=, quantize=, activations=)``, as generate.py loads it).
For each: bits per byte on held-out text (``--text FILE``; by default the run's validation
files, the ones training never read, up to ``--text-bytes``),
read in pieces of 1024 tokens with the state carried; and greedy decoding of ``--new-tokens``
tokens (through the fused step) from ``--prompts`` prompts cut from that text, compared with
float32's tokens: the positions that agree, and the tokens before the first difference."""

from __future__ import annotations

from pathlib import Path

import torch

from . import report
from .common import PRECISIONS, config_of

PROMPT_TOKENS = 32


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op precision (also --new-tokens)")
    group.add_argument("--run", type=str, help="a trained text run (or model directory with a tokenizer)")
    group.add_argument("--text", type=str, default=None, help="held-out text (default: the run's validation files)")
    group.add_argument("--text-bytes", type=int, default=200_000, help="at most this much of it")
    group.add_argument("--prompts", type=int, default=4, help="greedy decodes compared with float32's")


def check(args, parser) -> None:
    if args.run is None or not Path(args.run).is_dir():
        parser.error(f"--op precision: --run must be a run or model directory, got {args.run}")
    if args.text is not None and not Path(args.text).is_file():
        parser.error(f"--text {args.text}: no such file")
    if min(args.text_bytes, args.prompts, args.new_tokens) < 1:
        parser.error("--text-bytes, --prompts and --new-tokens must be positive")
    if args.device != "cpu":
        parser.error("--op precision: the fused decoding step is the CPU's (--device cpu)")


def held_out_text(args) -> tuple[str, str]:
    """(text, where it came from): --text, else the run's validation files in split order."""
    if args.text is not None:
        return Path(args.text).read_text(encoding="utf-8", errors="replace")[: args.text_bytes], args.text
    from ssm.training import load_config
    from ssm.training.data import read_text, text_split

    _, val = text_split(load_config(Path(args.run) / "config.yaml").data)
    text, used = "", 0
    for path in val:
        if len(text) >= args.text_bytes:
            break
        text += read_text(path)
        used += 1
    return text[: args.text_bytes], f"the run's validation files (the first {used} of {len(val)})"


def _variants() -> list[tuple[str, str, str | None, str | None]]:
    """(name, dtype, quantize, activations) of each row: every precision of PRECISIONS, and the
    quantised ones with their activations rounded to int8 (the default) and kept in float32."""
    rows = []
    for name, (dtype, quantize) in PRECISIONS.items():
        if quantize is None:
            rows.append((name, dtype, None, None))
        else:
            rows += [(name, dtype, quantize, "int8"), (f"{name}, float32 act.", dtype, quantize, "float32")]
    return rows


def run(args) -> tuple[int, dict]:
    from ssm.models.scoring import score_ids, text_metrics
    from ssm.models.text import load_model_and_tokenizer

    text, source = held_out_text(args)
    rows, reference, ids = [], None, None
    for name, dtype, quantize, activations in _variants():
        model, tokenizer, directory = load_model_and_tokenizer(
            args.run, dtype=getattr(torch, dtype), quantize=quantize, activations=activations
        )
        if ids is None:  # one tokenizer for every precision: the text, its prompts and bytes once
            ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
            lengths = tokenizer.token_byte_lengths()
            n_bytes = sum(lengths[i] for i in ids[1:].tolist())
            starts = torch.linspace(0, ids.numel() - PROMPT_TOKENS - 1, args.prompts).long().tolist()
            prompts = torch.stack([ids[s : s + PROMPT_TOKENS] for s in starts])
        nats, count = score_ids(model, ids, 1024, carry=True)
        m = text_metrics(nats, count, n_bytes)
        with torch.no_grad():
            tokens = model.generate(prompts, args.new_tokens, temperature=0)[:, PROMPT_TOKENS:]
        reference = tokens if reference is None else reference
        agree = (tokens == reference).float().mean().item()
        differs = (tokens != reference).int()
        first = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], args.new_tokens))
        rows.append(
            {
                "precision": name,
                "bits_per_byte": m["bits_per_byte"],
                "greedy_agree": agree,
                "first_difference": first.tolist(),
            }
        )
        print(
            f"{name:24s} bits/byte {m['bits_per_byte']:.4f}  ({m['bits_per_byte'] / rows[0]['bits_per_byte'] - 1:+.2%}"
            f" against float32)  greedy tokens agreeing with float32: {agree:.1%}, first difference at "
            f"{first.tolist()} of {args.new_tokens}",
            flush=True,
        )
    print(f"held-out text: {source}, {m['bytes']} bytes scored; model {directory}")
    return 0, {"config": config_of(args), "text": source, "bytes": m["bytes"], "rows": rows}


def markdown(result: dict, args) -> tuple[str, str, str]:
    base = result["rows"][0]["bits_per_byte"]
    rows = [
        [
            r["precision"],
            f"{r['bits_per_byte']:.4f}",
            f"{r['bits_per_byte'] / base - 1:+.2%}",
            f"{r['greedy_agree']:.1%}",
            ", ".join(map(str, r["first_difference"])),
        ]
        for r in result["rows"]
    ]
    header = ["weights", "bits per byte", "against float32", "greedy tokens as float32's", "first difference"]
    body = report.table(header, rows)
    body += (
        f"\n\nHeld-out text: {result['text']} ({result['bytes']} bytes), read in pieces of 1024 tokens with the "
        f"state carried; greedy decoding of {args.new_tokens} tokens from {args.prompts} prompts of "
        f"{PROMPT_TOKENS} tokens cut from it."
    )
    return "precision", f"weight precision against quality: {Path(args.run).name}, cpu", body
