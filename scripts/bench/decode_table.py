"""--op decode-table: --op decode at batch 1 for every mixer of ``--decode-mixers`` and every precision of
``--precisions``, one after the other in this process, gathered into one table in issue 29's
layout (rows: engine per mixer; columns: precision) and one picture: generation-only tokens/s of
ssm and, with ``--peer llama.cpp``, of llama.cpp on the same weights, transformers' whole-run rate
where it has the mixer, and the weight-read limit of each precision (the rate at which torch
streams as many bytes as the weights hold). Mamba-2 runs at ``--vocab`` rounded up to a multiple
of 16 (mamba2-130m's 50288 for the default), as llama.cpp's Mamba-2 expects."""

from __future__ import annotations

import argparse
import copy

from . import decode, report
from .common import PRECISIONS, comma_list, config_of
from .llama_cpp import GGUF_TYPES as GGUF

NAMES = {"mamba1": "Mamba-1", "mamba2": "Mamba-2", "mamba3": "Mamba-3"}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op decode-table (also --op decode's arguments, and --precisions)")
    group.add_argument(
        "--decode-mixers", type=comma_list, default=["mamba1", "mamba2", "mamba3"], help="comma-separated"
    )


def variants(args) -> list[tuple[str, str, argparse.Namespace]]:
    """(mixer, precision, the --op decode arguments of that run)."""
    runs = []
    for mixer in args.decode_mixers:
        for precision in args.precisions:
            one = copy.copy(args)
            one.mixer, (one.dtype, one.quantize) = mixer, PRECISIONS[precision]
            one.decode_batches = [1]
            one.vocab = -(-args.vocab // 16) * 16 if mixer == "mamba2" else args.vocab
            one.peer = None if mixer == "mamba3" else args.peer
            runs.append((mixer, precision, one))
    return runs


def check(args, parser) -> None:
    unknown = [m for m in args.decode_mixers if m not in NAMES] + [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        parser.error(
            f"--op decode-table: unknown {unknown}; "
            f"--decode-mixers from {list(NAMES)}, --precisions from {list(PRECISIONS)}"
        )
    for _, _, one in variants(args):
        decode.check(one, parser)
    args.d_model = args.d_model or 768


def run(args) -> tuple[int, dict]:
    cells, status = [], 0
    for mixer, precision, one in variants(args):
        print(f"\n== {NAMES[mixer]}, {precision}", flush=True)
        code, result = decode.run(one)
        status = status or code
        (row,) = result["results"]
        cell = {"mixer": mixer, "precision": precision, "weight_bytes": result["weight_bytes"]}
        cell |= {"weight_read_limit": 1 / result["weight_read_s"], "ssm_whole": row["tokens_per_s"]["ssm"]}
        cell["transformers_whole"] = row["tokens_per_s"].get("transformers")
        if "llama_cpp" in result:
            median = result["llama_cpp"]["median"]
            cell |= {"ssm": median.get("generation ssm"), "llama.cpp": median.get("generation llama.cpp")}
            cell |= {"prefill ssm": median.get("prefill ssm"), "prefill llama.cpp": median.get("prefill llama.cpp")}
            for b in one.peer_batches:
                if b > 1:
                    key = decode.generation_key(b)
                    cell |= {f"{key} ssm": median[f"{key} ssm"], f"{key} llama.cpp": median[f"{key} llama.cpp"]}
            cell["runs"] = result["llama_cpp"]["runs"]
        cells.append(cell)
    return status, {"config": config_of(args), "cells": cells}


def markdown(result: dict, args) -> tuple[str, str, str]:
    cells, precisions = result["cells"], list(dict.fromkeys(c["precision"] for c in result["cells"]))
    header = ["tokens/s"] + [f"{p} ({GGUF[p]})" for p in precisions]
    peer_batches = result["config"].get("peer_batches", [1])
    batches = [b for b in peer_batches if b > 1]

    def row(label, mixer, key, fmt="{:.1f}"):
        values = {c["precision"]: c.get(key) for c in cells if c["mixer"] == mixer}
        return [label] + [fmt.format(values[p]) if values.get(p) else "–" for p in precisions]

    rows = []
    for mixer in dict.fromkeys(c["mixer"] for c in cells):
        name = NAMES[mixer]
        if any("llama.cpp" in c for c in cells if c["mixer"] == mixer):
            if 1 in peer_batches:
                rows.append(row(f"{name}, llama.cpp", mixer, "llama.cpp"))
                rows.append(row(f"**{name}, ssm**", mixer, "ssm"))
            for b in batches:
                key = decode.generation_key(b)
                rows.append(row(f"{name}, llama.cpp, batch {b}", mixer, f"{key} llama.cpp"))
                rows.append(row(f"**{name}, ssm, batch {b}**", mixer, f"{key} ssm"))
            if any(c.get("prefill ssm") for c in cells if c["mixer"] == mixer):
                n = result["config"]["prefill_length"]
                rows.append(row(f"{name}, llama.cpp, prefill pp{n}", mixer, "prefill llama.cpp"))
                rows.append(row(f"**{name}, ssm, prefill {n}**", mixer, "prefill ssm"))
        else:
            rows.append(row(f"**{name}, ssm** (whole run)", mixer, "ssm_whole"))
        rows.append(row(f"{name}, weight-read limit", mixer, "weight_read_limit", "{:.0f}"))
    c = result["config"]
    body = report.table(header, rows)
    prefill = (
        f"prefill: a {c['prefill_length']}-token prompt read (ssm: generate of one token; llama.cpp: llama-bench "
        f"-p {c['prefill_length']}); "
        if c.get("prefill_length") and c.get("peer")
        else ""
    )
    engines = (
        "median of {r} runs alternating the engines, the same weights (random, transformers' layout, converted by "
        "llama.cpp's convert_hf_to_gguf.py; q4_0 by llama-quantize)."
    ).format(r=c["repeats"])
    limit = (
        " The weight-read limit: tokens/s at batch 1 if a token cost only reading its weights' bytes once at the "
        "rate torch's float32 sum streams memory here."
    )
    if 1 in peer_batches:
        body += (
            f"\n\nBatch 1, {c['prompt_length']}-token prompt then {c['new_tokens']} greedy tokens, generation only "
            f"(ssm: (n - 1) tokens over the time of n less that of 1; llama.cpp: llama-bench -n {c['new_tokens']} "
            f"-d {c['prompt_length']}); {prefill}{engines} "
            "Mamba-3 has no llama.cpp or transformers implementation: its row is ssm's whole run, prompt included."
        )
    if batches:
        body += (
            f"\n\nBatches of {' and '.join(map(str, batches))} prompts decoded together: a {c['prompt_length']}-token "
            f"prompt each, then {c['new_tokens']} greedy tokens each, generation only; tokens/s counts all the "
            f"batch's generated tokens over the generation's time (llama.cpp: llama-batched-bench "
            f"-npp {c['prompt_length']} -ntg {c['new_tokens']} -npl B, its S_TG); {engines}"
        )
    body += limit
    title = "decoding per precision against llama.cpp"
    if batches:
        title += f", {'batch 1 and ' if 1 in peer_batches else ''}batches of {' and '.join(map(str, batches))}"
    return (
        "decode-table" + "".join(f"-b{b}" for b in batches),
        f"{title}, d_model {c['d_model']}, {c['layers']} layers, cpu",
        body,
    )


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    cells = result["cells"]
    mixers = list(dict.fromkeys(c["mixer"] for c in cells))
    fig, axes = plt.subplots(1, len(mixers), figsize=(5 * len(mixers), 4), sharey=True, squeeze=False)
    for ax, mixer in zip(axes[0], mixers):
        mine = [c for c in cells if c["mixer"] == mixer]
        xs = range(len(mine))
        engines = [("ssm", "ssm"), ("llama.cpp", "llama.cpp"), ("transformers_whole", "transformers (whole run)")]
        if not any("ssm" in c for c in mine):
            engines[0] = ("ssm_whole", "ssm (whole run)")
        width = 0.8 / len(engines)
        for k, (key, label) in enumerate(engines):
            heights = [c.get(key) or 0 for c in mine]
            if any(heights):
                ax.bar([x + (k - 1) * width for x in xs], heights, width, label=label)
        limit = [c["weight_read_limit"] for c in mine]
        ax.plot(list(xs), limit, "k_", markersize=28, mew=2, label="weight-read limit")
        ax.set_xticks(list(xs), [f"{c['precision']}\n({GGUF[c['precision']]})" for c in mine])
        ax.set_title(NAMES[mixer])
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("tokens/s, batch 1")
    axes[0][0].legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"decoding on the CPU, d_model {c['d_model']}, {c['layers']} layers, {c.get('device', 'cpu')}")
    report.save(fig, path)
