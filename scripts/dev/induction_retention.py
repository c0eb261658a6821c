"""How long a Mamba-1 induction-heads checkpoint can hold a key (issue 46, goal 2): per layer, Δ
over the tokens that are neither the key nor a trigger, and the retention of the slowest state.

    python scripts/dev/induction_retention.py runs/RUN/checkpoints/step-*.ckpt

For each checkpoint, on --samples validation sequences (the "val" split, never the test split)
at the run's training length: Δ = softplus(dt_proj(x) + bias) at every such token, its median and
minimum; per channel d its mean Δ̄_d; and the slowest state's decay per token,
r = min over (d, n) of Δ̄_d·|A_dn| (A = -exp(A_log)). A state decaying at r keeps exp(-r·G) of
what it held G tokens back: printed for G = 2^14 and 2^20. (A summary of the mean decay: the
readout can still succeed from a decayed state when what the later tokens add is smaller yet.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--samples", type=int, default=64, help="validation sequences (default 64)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")

    import torch
    import torch.nn.functional as F

    from ssm.layers import Mamba
    from ssm.training.data import VALIDATION_SPLIT, TaskDataModule
    from ssm.training.evaluate import load_checkpoint_model

    for path in args.checkpoints:
        config, model, step = load_checkpoint_model(path)
        if config.data.task != "induction_heads":
            parser.error(f"{path}: a run of {config.data.task}, not induction_heads")
        dataset = TaskDataModule(config.data, seed=config.seed).dataset(VALIDATION_SPLIT, args.samples)
        x = torch.stack([dataset[i][0] for i in range(args.samples)])
        mixers = [m for m in model.modules() if isinstance(m, Mamba)]
        if not mixers:
            parser.error(f"{path}: no Mamba-1 layers")
        low_rank = {}
        hooks = [
            mixer.x_proj.register_forward_hook(lambda _m, _i, out, k=k: low_rank.__setitem__(k, out))
            for k, mixer in enumerate(mixers)
        ]
        with torch.no_grad():
            model(x)
        for hook in hooks:
            hook.remove()
        other = x != dataset.trigger  # neither trigger
        keys = (x == dataset.trigger).int().argmax(1) + 1
        other[torch.arange(len(x)), keys] = False  # nor the key
        parts = [f"step {step:7d}"]
        with torch.no_grad():
            for k, mixer in enumerate(mixers):
                delta = F.softplus(low_rank[k][..., : mixer.dt_rank] @ mixer.dt_proj.weight.T + mixer.dt_proj.bias)
                tokens = delta[other]  # (tokens, D)
                rate = float((tokens.mean(0)[:, None] * torch.exp(mixer.A_log.float())).min())
                parts.append(
                    f"layer {k}: Δ median {float(tokens.median()):.3g} min {float(tokens.min()):.2g}, "
                    f"slowest decay {rate:.3g}/token, kept over 2^14 {math.exp(-rate * 2**14):.3g}, "
                    f"over 2^20 {math.exp(-rate * 2**20):.3g}"
                )
        print("  ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
