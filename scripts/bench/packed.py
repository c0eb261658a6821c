"""--op packed: packed variable-length sequences on real documents: the files of the text task's
training split (the Python standard library's sources), drawn at random and cut at
``--max-doc-len`` bytes, ``--docs`` per batch. First, training throughput of a ``MambaLM``
(``--d-model``, ``--layers``, ``--layer``; AdamW steps, forward + backward + update) on the same
batches, padded to each batch's longest document against packed end to end with ``cu_seqlens``,
in real (non-padding) bytes per second, after checking that both give the same loss on the first
batch. Second, the scan alone on one batch's documents at the model's layer shape (D = 2·d_model,
N = 16): one packed ``selective_scan`` call against a Python loop calling it once per document,
forward + backward, for each backend in ``--backends`` (default: all but ref; on CUDA the Triton
one among them)."""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

from ssm.scan import backends, selective_scan

from . import report
from .common import TOLERANCE, config_of, describe_device, median_ms, relative_difference, synchronize
from .selective import inputs as selective_inputs


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op packed (also --d-model, --layers, --backends)")
    group.add_argument("--layer", choices=["Mamba1", "Mamba2"], default="Mamba1")
    group.add_argument("--docs", type=int, default=16, help="documents per batch")
    group.add_argument("--max-doc-len", type=int, default=1024, help="documents are cut at this many bytes")
    group.add_argument("--batches", type=int, default=3, help="timed training steps per way (after --warmup)")


def check(args, parser) -> None:
    if args.d_model is None:
        args.d_model = 128
    if min(args.d_model, args.layers, args.docs, args.max_doc_len, args.batches, args.repeats) < 1:
        parser.error("--d-model, --layers, --docs, --max-doc-len, --batches and --repeats must be positive")
    op = "selective_scan" if args.layer == "Mamba1" else "ssd"
    available = backends(op, args.device)
    requested = args.backends or [b for b in available if b != "ref"]
    args.backends = [b for b in requested if b not in args.skip]
    unknown = set(args.backends) - set(available)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)} for {op}; on {args.device}: {available}")


def text_documents(count: int, max_len: int, seed: int) -> list[bytes]:
    """``count`` documents drawn at random (with replacement) from the text task's training
    files, each cut at ``max_len`` bytes; empty files are skipped."""
    from ssm.training.data import default_text_files, split_files

    files, _ = split_files(default_text_files(), 0.1)
    g = torch.Generator().manual_seed(seed)
    docs = []
    while len(docs) < count:
        text = open(files[int(torch.randint(len(files), (), generator=g))], "rb").read()[:max_len]
        if text:
            docs.append(text)
    return docs


def padded_batch(docs: list[bytes], device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, longest) padded with 0 on the right, targets the next byte, -100 past each end."""
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    targets = torch.full((len(docs), longest), -100, dtype=torch.long)
    for i, d in enumerate(docs):
        x = torch.tensor(list(d))
        ids[i, : len(d)] = x
        targets[i, : len(d) - 1] = x[1:]
    return ids.to(device), targets.to(device)


def packed_batch(docs: list[bytes], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (1, total), targets the next byte of the same document (-100 at each document's
    last byte) and cu_seqlens."""
    ids = torch.tensor([b for d in docs for b in d])
    targets = torch.roll(ids, -1).clone()
    lengths = torch.tensor([len(d) for d in docs])
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
    targets[cu[1:] - 1] = -100
    return ids[None].to(device), targets[None].to(device), cu.to(device)


def run(args) -> tuple[int, dict]:
    """Training throughput, packed against padded, and the packed scan against a loop."""
    from ssm import MambaConfig, MambaLM

    device = torch.device(args.device)
    steps = args.warmup + args.batches
    docs = text_documents(args.docs * steps, args.max_doc_len, args.seed)
    batches = [docs[i * args.docs : (i + 1) * args.docs] for i in range(steps)]
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.float64)
    real = sum(len(d) for b in batches for d in b)
    padded_total = sum(len(b) * max(len(d) for d in b) for b in batches)
    ssm_cfg = (
        {"layer": args.layer, "d_state": 16}
        if args.layer == "Mamba1"
        else {"layer": "Mamba2", "d_state": 64, "headdim": 32}
    )
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=256, ssm_cfg=ssm_cfg)
    print(
        f"{len(docs)} documents of the text task (stdlib sources cut at {args.max_doc_len} bytes), "
        f"{args.docs} per batch: length mean {lengths.mean():.0f}, median {lengths.median():.0f}, "
        f"min {lengths.min():.0f}, max {lengths.max():.0f}; "
        f"padded to each batch's longest, {1 - real / padded_total:.0%} of the positions are padding"
    )
    print(f"MambaLM {args.layer} d_model={args.d_model} n_layer={args.layers}, {describe_device(device)}")

    def step_fn(model, optimizer, batch, packed):
        if packed:
            ids, targets, cu = packed_batch(batch, device)
            logits = model(ids, cu_seqlens=cu)
        else:
            ids, targets = padded_batch(batch, device)
            logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    training, first_losses, ok = {}, {}, True
    for backend in args.backends:
        for way in ("padded", "packed"):
            torch.manual_seed(args.seed)
            model = MambaLM(config, backend=backend).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            times = []
            for i, batch in enumerate(batches):
                synchronize(device)
                start = time.perf_counter()
                loss = step_fn(model, optimizer, batch, way == "packed")
                synchronize(device)
                if i == 0:
                    first_losses[backend, way] = loss
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            timed = sum(len(d) for b in batches[args.warmup :] for d in b)
            training[backend, way] = timed / sum(times)
            print(f"  trained {backend} {way}: {training[backend, way]:,.0f} bytes/s", file=sys.stderr, flush=True)
        same = math.isclose(first_losses[backend, "padded"], first_losses[backend, "packed"], rel_tol=1e-4)
        ok &= same
    print("\ntraining step (forward + backward + AdamW), real bytes per second:")
    print(f"{'backend':10s} {'padded':>12s} {'packed':>12s} {'packed/padded':>14s}  first-batch loss padded / packed")
    for backend in args.backends:
        pad, pack = training[backend, "padded"], training[backend, "packed"]
        print(
            f"{backend:10s} {pad:12,.0f} {pack:12,.0f} {pack / pad:13.2f}x  "
            f"{first_losses[backend, 'padded']:.5f} / {first_losses[backend, 'packed']:.5f}"
        )

    # The scan alone, at the model's layer shape, on the first timed batch's documents.
    scan_ms = {}
    if args.layer == "Mamba1":
        batch = batches[args.warmup]
        seq = [len(d) for d in batch]
        total, dim = sum(seq), 2 * args.d_model
        torch.manual_seed(args.seed)
        inputs = [x.to(device).requires_grad_() for x in selective_inputs(1, dim, 16, total)]
        u, delta, A, B, C, D, z, delta_bias = inputs
        grad = torch.randn(1, dim, total, device=device)
        cu = F.pad(torch.cumsum(torch.tensor(seq), 0), (1, 0)).to(device)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        for backend in args.backends:

            def packed_call():
                out = selective_scan(u, delta, A, B, C, D, z, delta_bias, True, cu_seqlens=cu, backend=backend)
                return torch.autograd.grad(out, inputs, grad)

            def loop_call():
                parts = [
                    selective_scan(
                        u[..., a:b],
                        delta[..., a:b],
                        A,
                        B[..., a:b],
                        C[..., a:b],
                        D,
                        z[..., a:b],
                        delta_bias,
                        True,
                        backend=backend,
                    )
                    for a, b in bounds
                ]
                return torch.autograd.grad(torch.cat(parts, -1), inputs, grad)

            got, want = packed_call(), loop_call()
            diff = max(relative_difference(g.float(), w.float()) for g, w in zip(got, want))
            ok &= diff < TOLERANCE[torch.float32]
            scan_ms[backend] = (
                median_ms(packed_call, device, args.warmup, args.repeats),
                median_ms(loop_call, device, args.warmup, args.repeats),
                diff,
            )
            print(f"  scan {backend}: done", file=sys.stderr, flush=True)
        print(f"\nselective_scan forward + backward on those {len(seq)} documents ({total} steps), D = {dim}, N = 16:")
        print(
            f"{'backend':10s} {'packed ms':>10s} {'loop ms':>10s} {'loop/packed':>12s}"
            "  max relative gradient difference"
        )
        for backend, (pack, loop, diff) in scan_ms.items():
            print(f"{backend:10s} {pack:10.1f} {loop:10.1f} {loop / pack:11.2f}x  {diff:.1e}")
    if not ok:
        print("MISMATCH: packed and padded (or looped) results differ", file=sys.stderr)
    result = {
        "config": config_of(args),
        "documents": {
            "count": len(docs),
            "mean": float(lengths.mean()),
            "median": float(lengths.median()),
            "max": float(lengths.max()),
            "padding_fraction": 1 - real / padded_total,
        },
        "training_bytes_per_s": {f"{b}/{w}": v for (b, w), v in training.items()},
        "first_batch_loss": {f"{b}/{w}": v for (b, w), v in first_losses.items()},
        "scan_ms": {b: {"packed": p, "loop": q, "max_grad_rel_diff": d} for b, (p, q, d) in scan_ms.items()},
        "device": describe_device(device),
    }
    return (0 if ok else 1), result


def markdown(result: dict, args) -> tuple[str, str, str]:
    c, docs, rate = result["config"], result["documents"], result["training_bytes_per_s"]
    rows = []
    for backend in c["backends"]:
        pad, pack = rate[f"{backend}/padded"], rate[f"{backend}/packed"]
        row = [backend, f"{pad:,.0f}", f"{pack:,.0f}", f"{pack / pad:.2f}"]
        scan = result["scan_ms"].get(backend)
        row += (
            [f"{scan['packed']:.1f}", f"{scan['loop']:.1f}", f"{scan['loop'] / scan['packed']:.2f}"]
            if scan
            else ["-"] * 3
        )
        rows.append(row)
    headers = ["backend", "padded bytes/s", "packed bytes/s", "packed / padded"]
    headers += ["scan packed ms", "scan loop ms", "loop / packed"]
    body = report.table(headers, rows)
    body += (
        f"\n\nTraining steps (forward, backward, AdamW) on {c['docs']} documents a batch, cut at "
        f"{c['max_doc_len']} bytes (mean {docs['mean']:.0f}), {docs['padding_fraction']:.0%} padding when padded; "
        "real bytes per second. The scan columns: one packed `selective_scan` call against a loop over the "
        "documents, forward + backward (Mamba1 only)."
    )
    title = f"packed sequences: MambaLM {c['layer']} d_model {c['d_model']}, {c['layers']} layers, {c['device']}"
    return "packed", title, body
