"""--op generate: recurrent decoding of a small ``MambaLM`` (``--d-model``, ``--layers``, byte
vocabulary). It prefills ``--positions`` tokens into its cache and times one ``step`` there
(median of at least 10 after ``--warmup``, the positions taking turns), to show that a token
costs the same at position 2000 as at 10 (the picture: tokens/s against position); then it
generates ``--new-tokens`` tokens greedily with the cache and, for comparison, by running the full
forward over the growing sequence for every token, and checks that both give the same tokens
(exit status 1 if not)."""

from __future__ import annotations

import statistics
import time

import torch

from . import report
from .common import comma_ints, config_of, describe_device, synchronize


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op generate (also --d-model, --layers, --new-tokens, --prompt-length)")
    group.add_argument("--positions", type=comma_ints, default=[10, 2000], help="positions at which one step is timed")


def check(args, parser) -> None:
    if args.d_model is None:
        args.d_model = 256
    if min(args.d_model, args.layers, args.new_tokens, args.prompt_length, args.repeats, *args.positions) < 1:
        parser.error("--d-model, --layers, --new-tokens, --prompt-length, --positions and --repeats must be positive")


def run(args) -> tuple[int, dict]:
    """Per-token step time against position, and cached generation against full recomputation."""
    from ssm import MambaConfig, MambaLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=256)
    model = MambaLM(config).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"MambaLM d_model={args.d_model} n_layer={args.layers} vocab=256 ({params / 1e6:.2f} M parameters), "
        f"{describe_device(device)}"
    )

    # Prefill one cache per position, then time single steps at the positions in turn (so that
    # warm-up and machine noise fall on all of them alike); report the median per position.
    samples: dict[int, list[float]] = {p: [] for p in args.positions}
    with torch.no_grad():
        caches = {}
        for position in args.positions:
            caches[position] = model.allocate_inference_cache(1, device=device)
            model(torch.randint(0, 256, (1, position), device=device), cache=caches[position])
        token = torch.tensor([1], device=device)
        for i in range(args.warmup + max(args.repeats, 10)):
            for position, cache in caches.items():
                synchronize(device)
                start = time.perf_counter()
                model.step(token, cache)
                synchronize(device)
                if i >= args.warmup:
                    samples[position].append((time.perf_counter() - start) * 1e3)
    step_ms = {p: statistics.median(v) for p, v in samples.items()}
    first = args.positions[0]
    print("\nposition   step ms   / step ms at position", first)
    for position, ms in step_ms.items():
        print(f"{position:8d}  {ms:8.3f}   {ms / step_ms[first]:.2f}")

    prompt = torch.randint(0, 256, (1, args.prompt_length), device=device)

    def cached():
        return model.generate(prompt, args.new_tokens, temperature=0)

    def recompute():
        seq = prompt
        with torch.no_grad():
            for _ in range(args.new_tokens):
                seq = torch.cat([seq, model(seq, num_last_tokens=1)[:, -1, :256].argmax(-1, keepdim=True)], 1)
        return seq

    timings, outputs = {}, {}
    for name, fn in (("cached (prefill + step)", cached), ("full forward per token", recompute)):
        synchronize(device)
        start = time.perf_counter()
        outputs[name] = fn()
        synchronize(device)
        timings[name] = time.perf_counter() - start
    print(f"\ngenerating {args.new_tokens} tokens after a {args.prompt_length}-token prompt (greedy):")
    for name, seconds in timings.items():
        print(f"  {name:26s} {seconds:8.2f} s   {args.new_tokens / seconds:8.1f} tokens/s")
    same = torch.equal(*outputs.values())
    print(
        f"  speed-up of the cache: {timings['full forward per token'] / timings['cached (prefill + step)']:.1f}x; "
        f"same tokens: {same}"
    )
    result = {
        "config": config_of(args),
        "parameters": params,
        "step_ms": step_ms,
        "generate_s": timings,
        "same_tokens": same,
    }
    return (0 if same else 1), result


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, step_ms = result["config"], result["step_ms"]
    first = next(iter(step_ms))
    rows = [[str(p), f"{ms:.3f}", f"{1e3 / ms:.3g}", f"{ms / step_ms[first]:.2f}"] for p, ms in step_ms.items()]
    body = report.table(["position", "step ms", "tokens/s", f"x position {first}'s time"], rows)
    gen = result["generate_s"]
    rows = [[name, f"{s:.2f}", f"{c['new_tokens'] / s:.1f}"] for name, s in gen.items()]
    body += "\n\n" + report.table([f"{c['new_tokens']} tokens, greedy", "s", "tokens/s"], rows)
    body += (
        f"\n\nOne `MambaLM.step` at batch 1 after prefilling each position (median of at least 10); then "
        f"generation after a {c['prompt_length']}-token prompt with the cache against the full forward per "
        f"token: same tokens {result['same_tokens']}."
    )
    title = f"decoding step against position: MambaLM d_model {c['d_model']}, {c['layers']} layers, {c['device']}"
    return "generate", title, body


def plot(result: dict, path: str) -> None:
    report.save(figure(result), path)


def figure(result: dict):
    """Decoding tokens/s of one step at batch 1 against the position it is taken at."""
    plt = report.pyplot()
    positions = [int(p) for p in result["step_ms"]]
    rate = [1e3 / ms for ms in result["step_ms"].values()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(positions, rate, marker="o", label="ssm MambaLM.step")
    ax.set_xscale("log")
    ax.set_xticks(positions, [str(p) for p in positions], minor=False)
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_ylim(0, 1.15 * max(rate))
    ax.set_xlabel("position (tokens already in the cache)")
    ax.set_ylabel("tokens/s (batch 1)")
    c = result["config"]
    ax.set_title(f"decoding, MambaLM d_model {c['d_model']}, {c['layers']} layers, {c['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
