"""--op decode: greedy decoding throughput of a language model at a real size (mamba-130m's by
default: d_model 768, 24 layers, vocabulary 50280, float32), ssm against transformers'
MambaForCausalLM (``--mixer mamba2``: Mamba2ForCausalLM at mamba2-130m's shapes) holding the
same weights (``--mixer mamba3``: Mamba-3 SISO at the same shapes, no peer), at each of
``--decode-batches``, beside the rate at which torch reads as many bytes
as the weights hold. The tokens must be the same, or part only at
a tie: where the float64 model finds the two tokens' logits closer than ``TIE`` (exit status 1
otherwise).

``--dtype bfloat16`` / ``float16`` runs both models in that dtype (ssm through its fused step,
which widens the matrices in registers); ``--quantize int8`` / ``int4`` quantises ssm's weights
(MambaLM.quantize; transformers keeps ``--dtype``). Tokens then are reported, not required to
agree: the two engines round differently.

``--peer llama.cpp`` (Mamba-1 and Mamba-2) also times llama.cpp on the same weights at the same
precision (scripts/bench/llama_cpp.py), generation only at batch 1, alternating the two engines
``--repeats`` times; ssm's generation-only rate is (n - 1) tokens over the time of generating n
tokens less the time of generating 1 (which holds the prompt's prefill)."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import llama_cpp, peers, report
from .common import DTYPES, comma_ints, config_of, decode_mixer_config, describe_device, synchronize

# Greedy tokens of two float32 runs may part where the two best logits are closer than float32's
# rounding leaves them apart (random weights over 50280 tokens: such ties come every few hundred
# tokens). Logits of our float32 step differ from float64's by up to 0.013 over 256 steps
# (measured at mamba-130m size), so a float64 gap below 0.05 is a tie, not an error.
TIE = 0.05


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op decode (also --d-model, --layers, --new-tokens, --prompt-length)")
    group.add_argument("--vocab", type=int, default=50280, help="vocabulary size (mamba-130m's by default)")
    group.add_argument("--decode-batches", type=comma_ints, default=[1, 8], help="batch sizes to decode")
    group.add_argument(
        "--mixer",
        choices=("mamba1", "mamba2", "mamba3"),
        default="mamba1",
        help="the layers: Mamba-1 (N 16), Mamba-2 (N 128, head dim 64, one group) or Mamba-3 SISO (N 128, "
        "head dim 64; no transformers peer)",
    )
    group.add_argument(
        "--quantize", choices=("int8", "int4"), default=None, help="quantise ssm's weights (MambaLM.quantize)"
    )
    group.add_argument(
        "--activations",
        choices=("int8", "float32"),
        default="int8",
        help="what the quantised layers multiply their integers by (MambaLM.quantize's activations)",
    )
    group.add_argument(
        "--peer",
        choices=("llama.cpp",),
        default=None,
        help=f"also time llama.cpp on the same weights at batch 1 (built by `{llama_cpp.BUILD_COMMAND}`)",
    )
    group.add_argument(
        "--peer-batches",
        type=comma_ints,
        default=[1],
        help="--peer: the batches to time both engines at, generation only (above 1: llama-batched-bench)",
    )
    group.add_argument(
        "--prefill-length", type=int, default=512, help="--peer: also time both reading a prompt this long (0: not)"
    )


def check(args, parser) -> None:
    args.d_model = args.d_model or 768
    if min(args.d_model, args.layers, args.vocab, args.new_tokens, args.prompt_length, *args.decode_batches) < 1:
        parser.error(
            "--d-model, --layers, --vocab, --new-tokens, --prompt-length and --decode-batches must be positive"
        )
    if args.peer == "llama.cpp":
        if args.mixer == "mamba3" or args.no_peer:
            parser.error("--peer llama.cpp: needs --mixer mamba1 or mamba2 (llama.cpp has no Mamba-3) and no --no-peer")
        if args.new_tokens < 2:
            parser.error("--peer llama.cpp: needs --new-tokens of 2 or more (the rate is of generated tokens)")
        if not args.peer_batches or min(args.peer_batches) < 1 or max(args.peer_batches) > 256:
            parser.error(f"--peer-batches must be from 1 to 256 (llama.cpp's most sequences), got {args.peer_batches}")
        args.peer_batches = list(dict.fromkeys(args.peer_batches))
        if args.prefill_length < 0:
            parser.error(f"--prefill-length must be >= 0 (0: no prefill timing), got {args.prefill_length}")
        if args.mixer == "mamba2" and args.vocab % 16:
            parser.error(
                f"--peer llama.cpp --mixer mamba2: llama.cpp expects the embedding padded to a multiple of 16 rows; "
                f"--vocab {args.vocab} is not (mamba2-130m's is 50288)"
            )
        if args.device != "cpu":
            parser.error(f"--peer llama.cpp: runs on the CPU, got --device {args.device}")
        if (why := llama_cpp.missing(batched=max(args.peer_batches) > 1)) is not None:
            parser.error(f"--peer llama.cpp: {why}")


def run(args) -> tuple[int, dict]:
    device = torch.device(args.device)
    peer = peers.transformers_mamba2 if args.mixer == "mamba2" else peers.transformers_mamba
    dtype = DTYPES[args.dtype]
    hf_model = None if args.no_peer or args.mixer == "mamba3" else peer(args, device, vocab_size=args.vocab)
    if hf_model is not None:
        hf_model.eval()
        hf_model.generation_config.eos_token_id = None  # every row decodes --new-tokens tokens
        hf_model.generation_config.pad_token_id = 0
    ssm_cfg = decode_mixer_config(args.mixer, args.d_model)
    model = peers.ssm_lm(args, hf_model, device, vocab_size=args.vocab, ssm_cfg=ssm_cfg).eval()
    workdir = None
    if args.peer == "llama.cpp":
        if hf_model is None:
            raise SystemExit("--peer llama.cpp: needs transformers (pip install transformers) to write the weights")
        workdir = tempfile.TemporaryDirectory(prefix="ssm-llama-cpp-")
        gguf = llama_cpp.convert(hf_model, Path(workdir.name), llama_cpp.gguf_type(args.dtype, args.quantize))
    exact_precision = dtype == torch.float32 and args.quantize is None  # else tokens are not required to agree
    if exact_precision is False:
        exact = copy.deepcopy(model).double()  # for the tie gaps, before the weights are rounded
        model.to(dtype)
        hf_model = None if hf_model is None else hf_model.to(dtype)
        if args.quantize:
            model.quantize(args.quantize, activations=args.activations)
    params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    precision = args.dtype + (f", {args.quantize} weights, {args.activations} activations" if args.quantize else "")
    print(
        f"greedy decoding, MambaLM ({args.mixer}) d_model={args.d_model} n_layer={args.layers} vocab={args.vocab} "
        f"({params / 1e6:.1f} M parameters, {precision}), {describe_device(device)}; "
        f"{args.new_tokens} new tokens after a {args.prompt_length}-token prompt"
    )
    read_s, read_bytes = weight_read_seconds(model, device)
    ceiling = 1 / read_s
    print(
        f"reading the weights' bytes once (torch's sum over them as one tensor, median of 9): "
        f"{read_s * 1e3:.1f} ms, {read_bytes / read_s / 1e9:.1f} GB/s: {ceiling:.1f} tokens/s at batch 1 if a "
        "token cost only its weight reads at that rate (caches can hold part of them between tokens)"
    )
    print(f"{'batch':>5s} {'ssm tok/s':>10s} {'transformers tok/s':>19s} {'ratio':>6s}  same tokens")
    exact = None if exact_precision else exact  # the model in float64, built when the two disagree
    g = torch.Generator().manual_seed(args.seed)
    results, ok = [], True
    for batch in args.decode_batches:
        prompt = torch.randint(0, args.vocab, (batch, args.prompt_length), generator=g).to(device)
        runs = {"ssm": lambda: model.generate(prompt, args.new_tokens, temperature=0)}
        if hf_model is not None:
            runs["transformers"] = lambda: hf_model.generate(
                prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )
        seconds, tokens = {}, {}
        with torch.no_grad():
            for name, fn in runs.items():
                fn()  # warm-up (first-call allocations, lazy kernel builds)
                synchronize(device)
                start = time.perf_counter()
                tokens[name] = fn()
                synchronize(device)
                seconds[name] = time.perf_counter() - start
        rate = {name: batch * args.new_tokens / s for name, s in seconds.items()}
        same = torch.equal(*tokens.values()) if len(tokens) == 2 else None
        gap = None
        if same is False:
            exact = exact or copy.deepcopy(model).double()
            gap = tie_gap(exact, *tokens.values())
        ok = ok and (same is not False or gap < TIE or not exact_precision)
        peer = rate.get("transformers")
        verdict = "-" if same is None else "True" if same else f"False, at a tie (float64 gap {gap:.1e})"
        if gap is not None and gap >= TIE and not exact_precision:
            verdict = f"False, at a float64 gap of {gap:.1e} ({precision}: not required)"
        elif gap is not None and gap >= TIE:
            verdict = f"False: float64 gap {gap:.1e} at the first difference, not a tie"
        print(
            f"{batch:5d} {rate['ssm']:10.1f} {peer or float('nan'):19.1f} "
            f"{rate['ssm'] / peer if peer else float('nan'):5.2f}x  {verdict}"
        )
        results.append({"batch": batch, "tokens_per_s": rate, "same_tokens": same, "tie_gap": gap})
    if 1 in args.decode_batches:
        at_one = results[args.decode_batches.index(1)]["tokens_per_s"]["ssm"]
        print(f"batch 1: ssm decodes at {at_one / ceiling:.0%} of that rate")
    result = {"config": config_of(args), "parameters": params, "weight_read_s": read_s, "results": results}
    result["weight_bytes"] = read_bytes
    if workdir is not None:
        with workdir:
            result["llama_cpp"] = against_llama_cpp(args, model, gguf, device, ceiling)
    return (0 if ok else 1), result


def generation_key(batch: int) -> str:
    """The name of the generation rate at ``batch`` in --peer's results ("generation" at 1)."""
    return "generation" if batch == 1 else f"generation batch {batch}"


def against_llama_cpp(args, model, gguf: Path, device: torch.device, ceiling: float) -> dict:
    """Tokens/s of ssm and of llama.cpp on ``gguf`` (the same weights), alternating,
    ``args.repeats`` times each after a warm-up of ssm; medians: generation only at each of
    ``--peer-batches`` (all the batch's generated tokens over the generation's time; llama.cpp:
    llama-bench at 1, llama-batched-bench above), and with ``--prefill-length`` the prefill of a
    prompt that long at batch 1 (ssm: ``generate`` of one token, which reads the prompt in one
    parallel pass; llama.cpp: llama-bench -p)."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(args.seed)
    prompts = {
        b: torch.randint(0, args.vocab, (b, args.prompt_length), generator=g).to(device) for b in args.peer_batches
    }
    long_prompt = torch.randint(0, args.vocab, (1, max(1, args.prefill_length)), generator=g).to(device)

    def seconds(tokens: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        model.generate(tokens, n, temperature=0)
        synchronize(device)
        return time.perf_counter() - start

    def llama_rate(batch: int) -> float:
        n, context = args.new_tokens, args.prompt_length
        if batch == 1:
            return llama_cpp.tokens_per_s(gguf, threads, new_tokens=n, context=context)
        return llama_cpp.batched_tokens_per_s(gguf, threads, batch, new_tokens=n, context=context)

    kinds = [generation_key(b) for b in args.peer_batches] + (["prefill"] if args.prefill_length else [])
    rates = {(kind, engine): [] for kind in kinds for engine in ("ssm", "llama.cpp")}
    with torch.no_grad():
        for prompt in prompts.values():
            seconds(prompt, args.new_tokens)  # warm-up
        if args.prefill_length:
            seconds(long_prompt, 1)
        for _ in range(max(1, args.repeats)):
            for batch, prompt in prompts.items():
                full, one = seconds(prompt, args.new_tokens), seconds(prompt, 1)
                rates[generation_key(batch), "ssm"].append(batch * (args.new_tokens - 1) / (full - one))
                rates[generation_key(batch), "llama.cpp"].append(llama_rate(batch))
            if args.prefill_length:
                rates["prefill", "ssm"].append(args.prefill_length / seconds(long_prompt, 1))
                rates["prefill", "llama.cpp"].append(llama_cpp.tokens_per_s(gguf, threads, prompt=args.prefill_length))
    median = {f"{kind} {engine}": statistics.median(r) for (kind, engine), r in rates.items()}
    kind = gguf.stem.removeprefix("model-")
    for what in kinds:
        ours, theirs = median[f"{what} ssm"], median[f"{what} llama.cpp"]
        label = f"prefill of {args.prefill_length} tokens" if what == "prefill" else what + " only"
        print(
            f"{label}{', batch 1' if what in ('generation', 'prefill') else ''}, {threads} threads, median of "
            f"{args.repeats} alternating runs ({kind} in llama.cpp): ssm {ours:.1f} tokens/s, "
            f"llama.cpp {theirs:.1f}: {ours / theirs:.2f}x"
            + (f"; ssm at {ours / ceiling:.0%} of the weight-read rate" if what == "generation" else "")
        )
    runs = {f"{kind} {engine}": r for (kind, engine), r in rates.items()}
    return {"gguf_type": kind, "threads": threads, "runs": runs, "median": median}


def weight_read_seconds(model: torch.nn.Module, device: torch.device, repeats: int = 9) -> tuple[float, int]:
    """(seconds, bytes) for torch's ``sum`` to read as many bytes as ``model``'s weights hold (a
    tied one once), laid out as one contiguous float32 tensor: the memory traffic a batch-1
    decoding step cannot avoid, at the rate torch streams memory: 1 / seconds is the tokens/s
    such a step would reach if nothing else cost (more when caches hold part of the weights
    between tokens). Always a float32 sum, whatever the weights' dtype: torch's sums of 16-bit
    and integer tensors run below the memory's rate (at mamba-130m's shapes on a 2-core Xeon, an
    int8 model's 153 MB summed as int32 took 96 ms where 517 MB of float32 took 19.7), which
    would make the limit the sum's, not the memory's. Median of ``repeats`` after one warm-up."""
    weights = {p.data_ptr(): p.detach() for p in [*model.parameters(), *model.buffers()]}.values()
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.ones(-(-nbytes // 4), dtype=torch.float32, device=device)

    def read() -> float:
        synchronize(device)
        start = time.perf_counter()
        flat.sum()
        synchronize(device)
        return time.perf_counter() - start

    read()
    return statistics.median(read() for _ in range(repeats)), nbytes


def tie_gap(exact, a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest float64 logit gap, over the rows where token sequences a and b (batch, L)
    differ, between the two tokens chosen at the row's first difference, computed by ``exact``
    (the model in float64) on the tokens both runs share before it."""
    gaps = []
    with torch.no_grad():
        for r in (a != b).any(1).nonzero()[:, 0].tolist():
            j = int((a[r] != b[r]).nonzero()[0])
            logits = exact(a[r : r + 1, :j].to(exact.lm_head.weight.device))[0, -1]
            gaps.append(abs(float(logits[a[r, j]] - logits[b[r, j]])))
    return max(gaps)


def markdown(result: dict, args) -> tuple[str, str, str]:
    c = result["config"]
    rows = []
    for r in result["results"]:
        rate = r["tokens_per_s"]
        peer = rate.get("transformers")
        same = "-" if r["same_tokens"] is None else "yes" if r["same_tokens"] else f"at a tie ({r['tie_gap']:.1e})"
        rows.append(
            [
                str(r["batch"]),
                f"{rate['ssm']:.1f}",
                f"{peer:.1f}" if peer else "-",
                f"{rate['ssm'] / peer:.2f}" if peer else "-",
                same,
            ]
        )
    body = report.table(["batch", "ssm tokens/s", "transformers tokens/s", "ratio", "same tokens"], rows)
    body += (
        f"\n\nGreedy decoding of {c['new_tokens']} tokens after a {c['prompt_length']}-token prompt, both "
        f"models holding the same weights, {c.get('dtype', 'float32')}"
        f"{', ssm quantised to ' + c['quantize'] if c.get('quantize') else ''}. Reading the weights' bytes once takes "
        f"{result['weight_read_s'] * 1e3:.1f} ms here (torch's `sum` over them): "
        f"{1 / result['weight_read_s']:.1f} tokens/s at batch 1 if a token cost only its weight reads."
    )
    if "llama_cpp" in result:
        peer = result["llama_cpp"]
        for what in [generation_key(b) for b in c.get("peer_batches", [1])] + ["prefill"]:
            if f"{what} ssm" in peer["median"]:
                ours, theirs = peer["median"][f"{what} ssm"], peer["median"][f"{what} llama.cpp"]
                body += (
                    f"\n\n{what.capitalize()}{', batch 1' if what in ('generation', 'prefill') else ''}, "
                    f"{peer['threads']} threads, median of "
                    f"{len(peer['runs'][f'{what} ssm'])} alternating runs: ssm {ours:.1f} tokens/s, llama.cpp "
                    f"({peer['gguf_type']}, the same weights) {theirs:.1f}, ratio {ours / theirs:.2f}."
                )
    title = (
        f"decoding: MambaLM ({c.get('mixer', 'mamba1')}) d_model {c['d_model']}, {c['layers']} layers, "
        f"vocabulary {c['vocab']} ({result['parameters'] / 1e6:.0f} M parameters), {c['device']}"
    )
    return "decode", title, body
