"""Memory (and time) of ``ssm.scan.scan``'s backward with and without checkpointing.

The scan is a tanh RNN whose carry is worth keeping an eye on: h = tanh(h @ W + x_t), with
h: (B, D) the carry, W: (D, D) a closed-over parameter, x_t: (D,) and y_t = h.mean(0): (D,),
so that the carry, not xs or ys, is what grows with L. For each length and each ``checkpoint``
setting it reports, for one forward+backward (loss = ys.sum() + final.sum()):

- saved: the bytes of the distinct storages autograd keeps from the forward for the backward
  (``torch.autograd.graph.saved_tensors_hooks``); with checkpointing this is what the
  checkpoints keep, the recomputed segment's tensors come and go during the backward;
- peak: the most memory held at once beyond the inputs during forward+backward, recomputation
  included (CPU: the running sum of the profiler's allocation events; CUDA: max_memory_allocated);
- time of that forward+backward: the median of ``--repeats`` runs (noisy; compare within a run).

Examples:

    python scripts/scan_memory.py                              # L = 400 and 4096, B=64, D=256
    python scripts/scan_memory.py --length 1000 --checkpoint none,sqrt,10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ssm.memory import extra_peak_bytes, saved_bytes
from ssm.scan import scan

MiB = 2**20


def measure(length: int, batch: int, width: int, checkpoint, device: torch.device, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(width, width, generator=g) / width**0.5).to(device).requires_grad_()
    init = torch.randn(batch, width, generator=g).to(device).requires_grad_()
    xs = torch.randn(length, width, generator=g).to(device).requires_grad_()

    def step(h, x):
        h = torch.tanh(h @ W + x)
        return h, h.mean(0)

    def forward():
        final, ys = scan(step, init, xs, checkpoint=checkpoint)
        return ys.sum() + final.sum()

    def forward_backward():
        return torch.autograd.grad(forward(), [W, init, xs])

    forward_backward()  # warm-up (the first checkpointed call imports torch._dynamo)
    # timed first, then measured (the hooks and the profiler add their own overhead)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward_backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    saved, loss = saved_bytes(forward)
    del loss
    peak, _ = extra_peak_bytes(forward_backward, device)
    return dict(
        length=length, batch=batch, width=width, checkpoint=str(checkpoint),
        carry_bytes=batch * width * 4, saved_bytes=saved, peak_bytes=peak, seconds=seconds,
    )  # fmt: skip


def parse_checkpoint(text: str):
    return None if text == "none" else text if text == "sqrt" else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, nargs="+", default=[400, 4096])
    parser.add_argument("--batch", type=int, default=64, help="B: rows of the carry")
    parser.add_argument("--width", type=int, default=256, help="D: columns of the carry and of W")
    parser.add_argument("--checkpoint", default="none,sqrt", help="comma list of none, sqrt or ints")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (the median is shown)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    print(f"carry (B, D) = ({args.batch}, {args.width}) float32 = {args.batch * args.width * 4 / 1024:.0f} KiB; "
          f"device {device}, {torch.get_num_threads()} threads")  # fmt: skip
    print(
        f"{'L':>6} {'checkpoint':>10} {'saved MiB':>10} {'peak MiB':>9} {'carries':>8} {'fwd+bwd s':>9}"
        f"  (median of {args.repeats})"
    )
    for length in args.length:
        for text in args.checkpoint.split(","):
            row = measure(length, args.batch, args.width, parse_checkpoint(text), device, args.repeats)
            rows.append(row)
            print(
                f"{length:>6} {row['checkpoint']:>10} {row['saved_bytes'] / MiB:>10.1f} {row['peak_bytes'] / MiB:>9.1f}"
                f" {row['peak_bytes'] / row['carry_bytes']:>8.0f} {row['seconds']:>9.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
