"""Accuracy of a trained run at several sequence lengths (length extrapolation), or, for a text
run, bits per byte with the recurrent state carried across segments against without it; or the
perplexity and bits per byte of any model on a text file.

    python scripts/evaluate.py RUN_DIR --lengths 64,128,256,512,1024
    python scripts/evaluate.py RUN_DIR --lengths 2^6..2^20          # every power of two between
    python scripts/evaluate.py RUN_DIR --carried-state --segments 32
    python scripts/evaluate.py NAME_OR_DIR --text FILE [--window 1024] [--stride 512 | --carried-state]

Text file (--text): NAME_OR_DIR is a model directory, a hub repo id or a run (as for
generate.py; --tokenizer as there). The file is encoded whole and every token after the first is
scored: in windows of --window tokens starting every --stride tokens (default: --window, no
overlap), each scoring the tokens no earlier window scored; or, with --carried-state, in pieces
of --window tokens with every layer's state carried across them (the file as one sequence).
Prints perplexity (per token) and bits per byte (per byte of the text the scored tokens stand
for, which compares across tokenizers).

Lengths (synthetic tasks): prints a table (accuracy per scored position, accuracy at each
sequence's last position, loss, seconds, peak memory per length) and
writes RUN_DIR/extrapolation.json and RUN_DIR/extrapolation.png. The examples are drawn from the
task's test split (ssm.training.data.TEST_SPLIT: a stream nothing trained, validated or chose on;
choose nothing from what it shows; --split val reads the validation stream instead): by default 1024 sequences per
length up to 2^14 and 64 above (--samples N for a fixed number). Forward only, logits only at
the scored positions (the last one for induction heads); each batch of --batch-size sequences is
read in pieces of --chunk tokens with every layer's state carried from one piece to the next, so
that memory stays O(batch·chunk·d_model) at any length (--chunk 0: one pass, O(batch·L·d_model)).
Both give the same accuracy; pieces of 256 tokens (the default) ran fastest on a CPU.
Threads: torch's default, or OMP_NUM_THREADS.

Carried state (text runs): the validation text read as data.batch_size long streams of
--segments consecutive segments of data.seq_len bytes, each scored once with every layer's state
carried from the segment before (as data.stateful trains) and once from a zero state; prints both
and writes RUN_DIR/carried_state.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's ssm, whichever one is installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, metavar="NAME_OR_DIR", help="a run; with --text, any model")
    parser.add_argument("--text", type=Path, default=None, help="score this text file (perplexity, bits per byte)")
    parser.add_argument("--window", type=int, default=1024, help="--text: tokens the model reads at a time")
    parser.add_argument("--stride", type=int, default=None, help="--text: tokens between window starts")
    parser.add_argument("--tokenizer", default=None, help="--text: tokenizer.json, its directory, hub id or 'bytes'")
    parser.add_argument("--dtype", default=None, help="--text: float32, bfloat16, ... (default: the checkpoint's)")
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma-separated sequence lengths, or 2^a..2^b for every power of two between "
        "(default: 1x, 2x, 4x, 8x the trained one)",
    )
    parser.add_argument(
        "--samples",
        "--val-samples",
        type=int,
        default=None,
        help="test sequences per length (default: 1024 up to length 2^14, 64 above)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    parser.add_argument(
        "--chunk",
        type=int,
        default=256,
        help="read sequences in pieces of this many tokens, the state carried across them "
        "(default 256, fastest on a CPU; 0: one pass)",
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write the json and png (default RUN_DIR)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--carried-state",
        action="store_true",
        help="text runs: bits per byte with the state carried across segments against without",
    )
    parser.add_argument("--segments", type=int, default=16, help="consecutive segments per stream (--carried-state)")
    parser.add_argument(
        "--per-sequence",
        action="store_true",
        help="also record every test sequence (its targets, predictions, the target's smallest probability; for "
        "induction heads the key's position and gap), print the misses, and write OUT/per_sequence.json",
    )
    parser.add_argument(
        "--split",
        default=None,
        help="the split the lengths read (ssm.training.data.SPLITS; default the test split, which must choose "
        "nothing: to compare recipes or checkpoints read val)",
    )
    args = parser.parse_args(argv)
    if args.text is not None:
        return evaluate_text(parser, args)

    from ssm.training.data import SPLITS, TEST_SPLIT, TaskDataModule
    from ssm.training.evaluate import evaluate_carried_state, evaluate_length, load_run

    config, model = load_run(args.run_dir, device=args.device)
    if args.carried_state:
        if config.data.task != "text":
            parser.error(f"--carried-state needs a text run; {args.run_dir} trained {config.data.task}")
        if args.segments < 1:
            parser.error("--segments must be positive")
        m = evaluate_carried_state(model, TaskDataModule(config.data, seed=config.seed), args.segments)
        L = config.data.seq_len
        print(
            f"text run {args.run_dir} (trained with data.stateful={config.data.stateful}): "
            f"{config.data.batch_size} streams of {args.segments} x {L} bytes, {m['bytes']} scored"
        )
        print(f"  bits per byte, state carried across segments: {m['bpb_carried']:.4f}")
        print(f"  bits per byte, each segment from a zero state: {m['bpb_fresh']:.4f}")
        (args.run_dir / "carried_state.json").write_text(
            json.dumps({**m, "segments": args.segments, "seq_len": L}, indent=2) + "\n"
        )
        return 0
    trained = config.data.seq_len
    try:
        lengths = parse_lengths(args.lengths) if args.lengths else [trained * f for f in (1, 2, 4, 8)]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints or 2^a..2^b, got {args.lengths!r}")
    if min(lengths) < 1:
        parser.error("--lengths must be positive")
    if args.samples is not None and args.samples < 1 or args.batch_size < 1 or args.chunk < 0:
        parser.error("--samples and --batch-size must be positive, --chunk >= 0")
    if config.data.task == "text":
        parser.error("--lengths scores the synthetic tasks; for a text run use --carried-state")
    split = args.split or TEST_SPLIT
    if split not in SPLITS:
        parser.error(f"--split must be one of {list(SPLITS)}, got {split!r}")
    data = TaskDataModule(config.data, seed=config.seed)
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)

    rows, sequences = [], {}
    chunk = args.chunk or None
    print(
        f"{config.data.task} run {args.run_dir} (trained at L = {trained}); {split} split, batch {args.batch_size}, "
        f"{'one pass' if chunk is None else f'chunks of {chunk}'}, {threads()} thread(s)"
    )
    print(f"{'L':>8}  {'samples':>7}  {'acc':>8}  {'last':>8}  {'loss':>9}  {'seconds':>8}  {'peak MiB':>8}")
    for length in lengths:
        samples = args.samples or default_samples(length)
        m = evaluate_length(
            model, data, length, samples, args.batch_size, chunk, split=split, per_sequence=args.per_sequence
        )
        if args.per_sequence:
            sequences[length] = m.pop("sequences")
        rows.append({"length": length, **m})
        mark = "  (trained)" if length == trained else ""
        peak = f"{m['peak_rss_bytes'] / 2**20:8.0f}" if m["peak_rss_bytes"] else f"{'?':>8}"
        print(
            f"{length:8d}  {samples:7d}  {m['val/acc']:8.4f}  {m['last/acc']:8.4f}  {m['val/loss']:9.4f}  "
            f"{m['seconds']:8.1f}  {peak}{mark}",
            flush=True,
        )
    total = sum(r["seconds"] for r in rows)
    print(f"total {total:.1f} s")
    if args.per_sequence:
        print_misses(sequences)
        (out / "per_sequence.json").write_text(json.dumps(sequences, indent=1) + "\n")
        print(f"per sequence: {out / 'per_sequence.json'}")
    (out / "extrapolation.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, trained, config.data.task, out / "extrapolation.png")
    print(f"plot: {out / 'extrapolation.png'}")
    return 0


def evaluate_text(parser, args) -> int:
    import torch

    from ssm.models.scoring import score_ids, text_metrics
    from ssm.models.text import load_model_and_tokenizer

    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.window < 2 or args.stride is not None and not 1 <= args.stride <= args.window:
        parser.error("--window must be >= 2 and --stride in [1, --window]")
    if args.stride is not None and args.carried_state:
        parser.error("--stride and --carried-state exclude each other")
    model, tokenizer, directory = load_model_and_tokenizer(
        str(args.run_dir), args.tokenizer, device=args.device, dtype=args.dtype
    )
    try:
        text = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        parser.error(f"--text {args.text} is not UTF-8 text: {err}")
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if ids.numel() < 2:
        parser.error(f"--text {args.text} encodes to {ids.numel()} token(s); at least 2 are needed")
    nats, count = score_ids(model, ids, args.window, args.stride, carry=args.carried_state)
    lengths = tokenizer.token_byte_lengths()
    m = text_metrics(nats, count, sum(lengths[i] for i in ids[1:].tolist()))
    how = (
        f"pieces of {args.window} tokens, state carried"
        if args.carried_state
        else f"windows of {args.window} tokens, stride {args.stride or args.window}"
    )
    print(f"{directory} on {args.text} ({tokenizer.source}): {m['tokens']} tokens scored, {m['bytes']} bytes; {how}")
    print(f"  perplexity {m['perplexity']:.4f} ({m['nats_per_token']:.4f} nats per token)")
    print(f"  bits per byte {m['bits_per_byte']:.4f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "text_eval.json").write_text(json.dumps({**m, "text": str(args.text)}, indent=2) + "\n")
    return 0


def print_misses(sequences: dict[int, list[dict]], most: int = 10) -> None:
    """The test sequences each length got wrong (the first ``most``), with what the model said."""
    for length, records in sequences.items():
        misses = [r for r in records if not r["correct"]]
        if not misses:
            continue
        print(f"L {length}: {len(misses)} of {len(records)} sequences missed")
        for r in misses[:most]:
            where = f"  gap {r['gap']:>8d}" if "gap" in r else ""
            print(
                f"  #{r['index']:<5d}{where}  target {r['targets']}  predicted {r['predicted']}  "
                f"p(target) {r['p_target_min']:.3f}"
            )


def threads() -> int:
    import torch

    return torch.get_num_threads()


def parse_lengths(text: str) -> list[int]:
    """ "64,128,4096" or "2^6..2^20" (every power of two from 2^6 to 2^20), or both, comma-separated."""
    from ssm.training.evaluate import parse_lengths as parse

    return parse(text)


def default_samples(length: int) -> int:
    """The issue's test-set sizes: >= 1024 sequences per length up to 2^14, >= 64 above."""
    return 1024 if length <= 2**14 else 64


def plot(rows, trained, task, path):
    from ssm.training._optional import require

    figure = require("matplotlib.figure", "scripts/evaluate.py (extrapolation.png)")
    fig = figure.Figure(figsize=(6, 4))  # a Figure of its own: no pyplot state
    ax = fig.subplots()
    ax.plot([r["length"] for r in rows], [r["val/acc"] for r in rows], marker="o")
    ax.axvline(trained, color="grey", linestyle="--", label=f"trained L = {trained}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{task}: length extrapolation")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
