"""How long a Mamba-1 induction-heads checkpoint can hold a key (issue 46, goal 2): per layer, Δ
over the tokens that are neither a trigger nor the key (nor the 3 after it), the retention of the
slowest state, and (--share) the key's share of what a layer reads out at the end. For Mamba-3
layers (issue 48, goal 4) the first part: Δ and the slowest head's decay.

    python scripts/dev/induction_retention.py runs/RUN/checkpoints/step-*.ckpt

For each checkpoint, on --samples validation sequences (the "val" split, never the test split)
at the run's training length: Δ = softplus(dt_proj(x) + bias) at every such token (neither a
trigger, nor the key, nor the 3 tokens after the key: the causal conv of width 4 still sees the
trigger there, and a model writes the key with a large Δ at those positions, a fixed cost once
per sequence, not a rate per token; a mean over 256 tokens that counts them overstates the
decay of the long run up to 20-fold), its median and minimum; per channel d its mean Δ̄_d; and
the slowest state's decay per token,
r = min over (d, n) of Δ̄_d·|A_dn| (A = -exp(A_log)). A state decaying at r keeps exp(-r·G) of
what it held G tokens back: printed for G = 2^14 and 2^20. In a Mamba-3 layer A is per token
and head too (A_t = −max(softplus(A_proj(u_t)), A_floor)), so r = min over heads h of the mean
over those tokens of Δ_th·|A_th|, printed with that head's mean Δ and |A|. (A summary of the mean decay: the
readout can still succeed from a decayed state when what the later tokens add is smaller yet.)

``--gradients K``: what training at that length asks of the slowest state. K batches of 8
validation sequences, each's loss (cross-entropy at the answer) and its gradient with respect to
log|A| of each layer's slowest (d, n) (A_log[d, n]): their mean and spread over the batches.
A positive mean is a push towards a slower decay (a descent step lowers A_log); a mean small
against its spread is no consistent push (Adam then moves the parameter by about its rate
either way).

(--gradients, --share and --precision read Mamba-1 layers only.)

``--share L1,L2,...``: the key's share of what each layer reads out at the last position (the
trigger, where the answer is read), on --share-samples validation sequences at each length. The
layer's output there is a sum over the positions t of what each wrote into its state, decayed
since: y_d = Σ_t Δ_td·u_td·Σ_n C_n·B_tn·exp(A_dn·(S_d − S_td)), with S the cumulative Δ, then
gated and projected (out_proj(y·silu(z))). Split into the terms of the key and the three
positions after it (where the causal conv of width 4 still carries the key) and all the others,
it prints the median over sequences of |key part| / |the rest| (norms of the projected output),
and the accuracy: where the ratio falls below about 1, the key is outweighed by the writes of the
tokens since. Computed in float64 from the layer's own inputs (hooks on in_proj, x_proj and
out_proj), and checked against the layer's own output there.

``--precision L``: the same --samples validation sequences at length L read in float32 and in
float64 (the model and its scans), the accuracy of each and the largest difference of the
answer's log-probability: what float32 accumulation over L steps costs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY_WRITES = 4  # the key and the 3 tokens after it: where the key is written (a causal conv of width 4)
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--samples", type=int, default=64, help="validation sequences (default 64)")
    parser.add_argument(
        "--gradients", type=int, default=0, metavar="K", help="batches for the gradient (default 0: none)"
    )
    parser.add_argument("--precision", type=int, default=0, metavar="L", help="length to read in float32 and float64")
    parser.add_argument("--share", default="", metavar="L1,L2", help="lengths for the key's share (e.g. 2^8,2^12)")
    parser.add_argument("--share-samples", type=int, default=16, help="sequences per --share length (default 16)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    if args.gradients < 0 or args.precision < 0:
        parser.error(f"--gradients and --precision must be >= 0, got {args.gradients} and {args.precision}")

    import torch
    import torch.nn.functional as F

    from ssm.layers import Mamba, Mamba3
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import load_checkpoint_model, parse_lengths

    try:
        share_lengths = parse_lengths(args.share) if args.share else []
    except ValueError as err:
        parser.error(f"--share: {err}")
    for path in args.checkpoints:
        config, model, step = load_checkpoint_model(path)
        if config.data.task != "induction_heads":
            parser.error(f"{path}: a run of {config.data.task}, not induction_heads")
        dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, args.samples)
        x = torch.stack([dataset[i][0] for i in range(args.samples)])
        mixers = [m for m in model.modules() if isinstance(m, Mamba)]
        mamba3 = [m for m in model.modules() if isinstance(m, Mamba3)]
        if not mixers and not mamba3:
            parser.error(f"{path}: no Mamba-1 or Mamba-3 layers")
        if mamba3 and (args.gradients or args.precision or share_lengths):
            parser.error(f"{path}: --gradients, --precision and --share read Mamba-1 layers; this run is Mamba-3")
        low_rank = {}  # by mixer: a hybrid's Mamba-1 and Mamba-3 layers each have their own entry
        hooks = [  # Mamba-1: x_proj's output (Δ's low rank); Mamba-3: in_proj's input
            mixer.x_proj.register_forward_hook(lambda _m, _i, out, mixer=mixer: low_rank.__setitem__(mixer, out))
            for mixer in mixers
        ] + [
            mixer.in_proj.register_forward_hook(
                lambda _m, inputs, _o, mixer=mixer: low_rank.__setitem__(mixer, inputs[0])
            )
            for mixer in mamba3
        ]
        with torch.no_grad():
            model(x)
        for hook in hooks:
            hook.remove()
        other = x != dataset.trigger  # neither trigger
        keys = (x == dataset.trigger).int().argmax(1) + 1
        for after in range(KEY_WRITES):  # nor the key and the 3 tokens after it (see the module's docstring)
            other[torch.arange(len(x)), (keys + after).clamp(max=x.shape[1] - 1)] = False
        parts, slowest = [f"step {step:7d}"], []
        if mamba3:
            print("  ".join(parts + mamba3_decays(mamba3, low_rank, other)), flush=True)
            continue
        with torch.no_grad():
            for k, mixer in enumerate(mixers):
                delta = F.softplus(low_rank[mixer][..., : mixer.dt_rank] @ mixer.dt_proj.weight.T + mixer.dt_proj.bias)
                tokens = delta[other]  # (tokens, D)
                rates = tokens.mean(0)[:, None] * torch.exp(mixer.A_log.float())  # (D, N)
                rate = float(rates.min())
                slowest.append(divmod(int(rates.argmin()), rates.shape[1]))
                parts.append(
                    f"layer {k}: Δ median {float(tokens.median()):.3g} min {float(tokens.min()):.2g}, "
                    f"slowest decay {rate:.3g}/token, kept over 2^14 {math.exp(-rate * 2**14):.3g}, "
                    f"over 2^20 {math.exp(-rate * 2**20):.3g}"
                )
        print("  ".join(parts), flush=True)
        if args.gradients:
            print(f"step {step:7d}  " + gradient_report(model, mixers, slowest, config, args.gradients), flush=True)
        if args.precision:
            print(f"step {step:7d}  " + precision_report(model, config, args.precision, args.samples), flush=True)
        for length in share_lengths:
            print(f"step {step:7d}  " + share_report(model, mixers, config, length, args.share_samples), flush=True)
    return 0


def mamba3_decays(mixers, inputs, other) -> list[str]:
    """Per Mamba-3 layer, over the tokens ``other`` (B, L) marks: Δ's median and minimum, and the
    head of the slowest mean decay Δ·|A| per token, with its mean Δ and |A|, what it keeps over
    2^14 and 2^20 tokens, and how far its rotary phase turns (:func:`phase_turn`).
    ``inputs[mixer]``: that layer's in_proj input (B, L, d_model)."""
    import torch

    parts = []
    with torch.no_grad():
        for k, mixer in enumerate(mixers):
            _, _, _, _, delta, A, _, theta = mixer._inputs(inputs[mixer])  # Δ, A (B, L, H); θ (B, L, H, M)
            rates = (delta * -A)[other].mean(0)  # (H,) the mean decay per token of each head
            h = int(rates.argmin())
            rate = float(rates[h])
            drift, spread = phase_turn(delta[..., h], theta[..., h, :], other)
            parts.append(
                f"layer {k}: Δ median {float(delta[other].median()):.3g} min {float(delta[other].min()):.2g}, "
                f"slowest decay {rate:.3g}/token (head {h}: mean Δ {float(delta[other][:, h].mean()):.3g}, "
                f"mean |A| {float(-A[other][:, h].mean()):.3g}), kept over 2^14 {math.exp(-rate * 2**14):.3g}, "
                f"over 2^20 {math.exp(-rate * 2**20):.3g}; its phase turns {drift:.3g} rad/token on average "
                f"(spread {spread:.3g}): over 2^10 tokens {drift * 2**10:.3g} ± {spread * 2**5:.3g} rad"
            )
    return parts


def phase_turn(delta, theta, other) -> tuple[float, float]:
    """How far a head's rotary phase turns per token over the tokens ``other`` (B, L) marks, from
    its Δ (B, L) and angles θ (B, L, M): the turn Δ_t·θ_t of each of its M pairs, and of the
    pair whose mean turn is largest in magnitude, that mean (signed) and the spread (standard
    deviation) of its turns. Between the key and the query a gap of G such tokens turns the
    key's rotated pairs by about G·mean ± √G·spread (the turns taken as independent): what a
    head that retrieves through rotated pairs must hold still at lengths it never trained on."""
    turns = (delta[..., None] * theta)[other]  # (tokens, M)
    if turns.shape[-1] == 0:  # no rotated pairs
        return 0.0, 0.0
    means = turns.mean(0)
    m = int(means.abs().argmax())
    return float(means[m]), float(turns[:, m].std(correction=0))


def gradient_report(model, mixers, slowest, config, batches: int) -> str:
    """The loss and d loss / d A_log[d, n] at each layer's slowest (d, n), over ``batches``
    batches of 8 validation sequences at the run's length (mean ± spread)."""
    import torch
    import torch.nn.functional as F

    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule

    dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, 8 * batches)
    losses, grads = [], [[] for _ in mixers]
    for b in range(batches):
        x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(8 * b, 8 * b + 8))))
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        losses.append(float(loss.detach()))
        for k, (mixer, (d, n)) in enumerate(zip(mixers, slowest)):
            grads[k].append(float(mixer.A_log.grad[d, n]))
    model.zero_grad(set_to_none=True)
    parts = [f"loss {sum(losses) / batches:.3g} (over {batches} batches of 8)"]
    for k, g in enumerate(grads):
        mean = sum(g) / len(g)
        spread = (sum((v - mean) ** 2 for v in g) / max(len(g) - 1, 1)) ** 0.5
        parts.append(f"layer {k} d loss/d A_log[{slowest[k][0]}, {slowest[k][1]}]: mean {mean:.3g} spread {spread:.3g}")
    return "  ".join(parts)


def share_report(model, mixers, config, length: int, samples: int) -> str:
    """Per layer, the median over ``samples`` validation sequences at ``length`` of the key's
    share of the layer's output at the last position, |key part| / |rest| (see the module's
    docstring), and the model's accuracy on those sequences."""
    import torch
    import torch.nn.functional as F

    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule

    dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, samples, length)
    ratios, right = [[] for _ in mixers], 0
    for i in range(samples):
        x, y = dataset[i]
        seen = {}
        hooks = []
        for k, mixer in enumerate(mixers):
            hooks.append(mixer.in_proj.register_forward_hook(lambda _m, _i, out, k=k: seen.__setitem__(("z", k), out)))
            hooks.append(
                mixer.out_proj.register_forward_hook(lambda _m, inp, _o, k=k: seen.__setitem__(("gated", k), inp[0]))
            )
            hooks.append(
                mixer.x_proj.register_forward_hook(
                    lambda _m, inp, out, k=k: seen.update({("u", k): inp[0], ("proj", k): out})
                )
            )
        with torch.no_grad():
            logits = model(x[None])
        for hook in hooks:
            hook.remove()
        scored = y != -100
        right += int((logits[0][scored].argmax(-1) == y[scored]).all())
        key = int((x == dataset.trigger).int().argmax()) + 1
        window = torch.zeros(length, dtype=torch.bool)
        window[key : key + KEY_WRITES] = True
        with torch.no_grad():
            for k, mixer in enumerate(mixers):
                u = seen[("u", k)][0].double()  # (L, D)
                dt, B, C = seen[("proj", k)][0].double().split([mixer.dt_rank, mixer.d_state, mixer.d_state], -1)
                delta = F.softplus(dt @ mixer.dt_proj.weight.double().T + mixer.dt_proj.bias.double())  # (L, D)
                A = -torch.exp(mixer.A_log.double())  # (D, N)
                since = delta.flip(0).cumsum(0).flip(0) - delta  # Σ_{s > t} Δ_s: (L, D)
                parts = torch.zeros(2, u.shape[1], dtype=torch.float64)
                for lo in range(0, length, 4096):  # (T, D, N) at a time
                    hi = min(lo + 4096, length)
                    decay = torch.exp(A * since[lo:hi, :, None])
                    w = (decay * (B[lo:hi, None, :] * C[-1])).sum(-1) * delta[lo:hi] * u[lo:hi]  # (T, D)
                    in_window = window[lo:hi]
                    parts[0] += w[in_window].sum(0)
                    parts[1] += w[~in_window].sum(0)
                z = seen[("z", k)][0, -1].chunk(2, dim=-1)[1].double()  # the gate's half of in_proj
                # the decomposition checked against the layer's own output there (out_proj's input)
                whole = (parts.sum(0) + mixer.D.double() * u[-1]) * F.silu(z)
                got = seen[("gated", k)][0, -1].double()
                if not torch.allclose(whole, got, rtol=1e-3, atol=1e-4 * float(got.abs().max())):
                    raise RuntimeError(f"layer {k}: the sum over positions is not the layer's output")
                out = (parts * F.silu(z)) @ mixer.out_proj.weight.double().T  # (2, d_model)
                ratios[k].append(float(out[0].norm() / out[1].norm()))
    text = [f"L {length}: accuracy {right}/{samples}"]
    for k, r in enumerate(ratios):
        r = torch.tensor(r)
        spread = f"min {float(r.min()):.3g}, max {float(r.max()):.3g}"
        text.append(f"layer {k}: |key| / |rest| median {float(r.median()):.3g} ({spread})")
    return "  ".join(text)


def precision_report(model, config, length: int, samples: int) -> str:
    """Accuracy at ``length`` in float32 and float64 on the same validation sequences, and the
    largest difference of the answers' log-probability between the two."""
    import copy

    import torch

    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule

    dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, samples, length)
    x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in range(samples))))
    scored = y != -100
    results = {}
    for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        m = copy.deepcopy(model).to(dtype)
        with torch.no_grad():
            logp = torch.cat([m(x[i : i + 1]).log_softmax(-1)[scored[i : i + 1]] for i in range(samples)])
        results[name] = logp.double()
    answers = y[scored]
    acc = {n: float((lp.argmax(-1) == answers).double().mean()) for n, lp in results.items()}
    diff = float((results["float32"] - results["float64"]).gather(-1, answers[:, None]).abs().max())
    return (
        f"L {length}: accuracy float32 {acc['float32']:.4f}, float64 {acc['float64']:.4f} ({samples} sequences); "
        f"largest |Δ log p(answer)| {diff:.3g}"
    )


if __name__ == "__main__":
    sys.exit(main())
