"""--op hybrid: a hybrid language model (mamba-ssm's attn_layer_idx: attention in one block of
every ``--attn-every`` (4), the third of each four) against the same model all Mamba-1 (N 16),
on random byte tokens: the training step (forward, cross-entropy over every position, backward;
``--batch`` 8, ``--length`` 512, ``--d-model`` 256, ``--layers`` 4) and greedy decoding tokens/s
at batch 1 with the cache prefilled to each of ``--decode-positions`` (128,4096), ``--new-tokens``
steps timed from a copy of that cache per repeat. The attention layers: ``--attn-heads`` heads
(4; as many key/value heads), causal, rotary on half of each head. The all-Mamba model decodes
with its fused C step where that applies; the hybrid decodes its runs of Mamba blocks the same
way and each run of attention blocks by their C step (ssm/native/decode_attention.c), which
reads every cached key at each token."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from . import report
from .common import alternate, comma_ints, config_of, describe_device, synchronize


def add_arguments(parser) -> None:
    group = parser.add_argument_group(
        "--op hybrid (also --batch, --length, --d-model, --layers, --new-tokens, --repeats, --warmup)"
    )
    group.add_argument("--attn-every", type=int, default=4, help="one attention block in every this many")
    group.add_argument("--attn-heads", type=int, default=4, help="heads of the attention layers")
    group.add_argument(
        "--decode-positions", type=comma_ints, default=[128, 4096], help="cache positions at which decoding is timed"
    )


def check(args, parser) -> None:
    args.d_model = args.d_model or 256
    sizes = (args.batch, args.length, args.d_model, args.layers, args.repeats, args.new_tokens, args.attn_every)
    if min(*sizes, args.attn_heads, *args.decode_positions) < 1 or args.warmup < 0:
        parser.error("--op hybrid: sizes, --repeats, --attn-every, --attn-heads and positions must be positive")
    if args.d_model % args.attn_heads or (args.d_model // args.attn_heads) % 2:
        parser.error(f"--attn-heads {args.attn_heads} must divide --d-model {args.d_model} into even head dims")


def attention_layers(args) -> list[int]:
    every = args.attn_every
    return [i for i in range(args.layers) if i % every == min(2, every - 1)]


def build(args, device, hybrid: bool):
    from ssm import MambaConfig, MambaLM

    head_dim = args.d_model // args.attn_heads
    attn = dict(num_heads=args.attn_heads, causal=True, rotary_emb_dim=head_dim // 2)
    config = MambaConfig(
        d_model=args.d_model,
        n_layer=args.layers,
        vocab_size=256,
        ssm_cfg={"d_state": 16},
        attn_layer_idx=attention_layers(args) if hybrid else [],
        attn_cfg=attn if hybrid else {},
    )
    torch.manual_seed(args.seed)
    return MambaLM(config).to(device)


def decode_runner(model, args, device, position: int):
    """A function timing ``--new-tokens`` greedy steps at batch 1 from a copy of a cache
    prefilled with ``position`` tokens; returns seconds."""
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, 256, (1, position), generator=g).to(device)
    with torch.no_grad():
        cache = model.allocate_inference_cache(1, device=device, max_seqlen=position + args.new_tokens)
        first = model(prompt, cache=cache, num_last_tokens=1)[:, -1, :256].argmax(-1)

    def run() -> float:
        with torch.no_grad():
            state, token = cache.map(lambda t: t.clone()), first
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                token = model.step(token, state)[:, :256].argmax(-1)
            synchronize(device)
            return time.perf_counter() - start

    return run


def run(args) -> tuple[int, dict | None]:
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 256, (args.batch, args.length + 1), generator=g).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    names = {"all Mamba-1": False, f"hybrid, attention at {attention_layers(args)}": True}
    models = {name: build(args, device, hybrid).train() for name, hybrid in names.items()}

    def step_runner(model):
        def step() -> float:
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs)[..., :256].reshape(-1, 256).float(), targets.reshape(-1))
            loss.backward()
            synchronize(device)
            return time.perf_counter() - start

        return step

    print("measuring the training steps (the two models take turns) ...", file=sys.stderr, flush=True)
    steps = {name: step_runner(model) for name, model in models.items()}
    first = {name: fn() for name, fn in steps.items()}
    step_s = alternate(steps, args.warmup, args.repeats)
    decode = {name: {} for name in models}
    for model in models.values():
        model.eval()
    for position in args.decode_positions:
        print(f"measuring decoding at position {position} (taking turns) ...", file=sys.stderr, flush=True)
        runners = {name: decode_runner(model, args, device, position) for name, model in models.items()}
        for name, seconds in alternate(runners, args.warmup, args.repeats).items():
            decode[name][position] = args.new_tokens / statistics.median(seconds)
    rows = {
        name: {
            "params": sum(p.numel() for p in model.parameters()),
            "first_s": first[name],
            "step_s": step_s[name],
            "decode_tok_s": decode[name],
        }
        for name, model in models.items()
    }

    print(
        f"hybrid against all-Mamba: d_model {args.d_model}, {args.layers} layers, vocab 256, N 16, "
        f"{args.attn_heads} attention heads; training step at batch {args.batch}, L {args.length}; decoding "
        f"{args.new_tokens} tokens at batch 1; {describe_device(device)}; medians of {args.repeats}"
    )
    positions = "".join(f" {f'tok/s @{p}':>12s}" for p in args.decode_positions)
    print(f"\n{'':40s} {'params M':>9s} {'step s':>8s}{positions}")
    for name, row in rows.items():
        decode = "".join(f" {row['decode_tok_s'][p]:12.1f}" for p in args.decode_positions)
        print(f"{name:40s} {row['params'] / 1e6:9.2f} {statistics.median(row['step_s']):8.3f}{decode}")
    return 0, {"config": config_of(args), "rows": rows}


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, rows = result["config"], result["rows"]
    positions = c["decode_positions"]
    headers = ["model", "parameters M", "training step s", *(f"decoding tok/s at {p}" for p in positions)]
    table = []
    for name, row in rows.items():
        decode = row["decode_tok_s"]
        decode = [f"{decode.get(p, decode.get(str(p))):.1f}" for p in positions]  # (str keys from JSON)
        table.append([name, f"{row['params'] / 1e6:.2f}", f"{statistics.median(row['step_s']):.3f}", *decode])
    body = report.table(headers, table)
    body += (
        f"\n\nTraining step: forward, cross-entropy and backward at batch {c['batch']}, L {c['length']}. "
        f"Decoding: {c['new_tokens']} greedy steps at batch 1 after a prefill to that position. Medians of "
        f"{c['repeats']} after {c['warmup']} untimed. The all-Mamba model decodes through its fused C step; the "
        "hybrid decodes each run of Mamba blocks in one fused C call and each attention block in the C step "
        "of attention (ssm/native/decode_attention.c), which reads every cached key at each token."
    )
    title = f"hybrid model: d_model {c['d_model']}, {c['layers']} layers, {c['device']}"
    return "hybrid", title, body
