"""--op memory: the resident memory of greedy decoding at each precision, as a user runs it: a
checkpoint in float32 safetensors (random weights at mamba-130m's shapes by default: d_model 768,
24 layers, vocabulary 50280; ``--mixer`` as --op decode), loaded by ``MambaLM.from_pretrained``
with ``dtype=`` / ``quantize=``, then ``generate`` of --new-tokens tokens after a
--prompt-length prompt. Each precision runs in a process of its own, so that its peak is its own
(Linux VmHWM): the peak of the whole run, loading included; the resident memory before decoding;
and the peak while decoding alone (the peak is reset once the model is loaded). Beside them the
weights' bytes as held and the process's memory after importing torch and ssm. Linux only."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from . import report
from .common import PRECISIONS as DTYPE_AND_QUANTIZE
from .common import ROOT, comma_list, config_of, decode_mixer_config

# what each precision asks from_pretrained for (float32 weights: the checkpoint's, no argument)
PRECISIONS = {
    name: ({"dtype": dtype} if dtype != "float32" else {}) | ({"quantize": quantize} if quantize else {})
    for name, (dtype, quantize) in DTYPE_AND_QUANTIZE.items()
}

# the readings of each run, and their headings in the table
READINGS = ("weight_bytes", "import_rss", "load_peak", "before_decoding", "decoding_peak", "whole_peak")
HEADINGS = ("weights MiB", "after import", "load peak", "before decoding", "decoding peak", "whole peak")

# The child: load, decode, report. Its memory readings come from /proc/self/status (kB).
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

import torch
from ssm import MambaLM
torch.set_num_threads(int(sys.argv[5]))
base = status("VmRSS")
options = json.loads(sys.argv[3])
if "dtype" in options:
    options["dtype"] = getattr(torch, options["dtype"])
model = MambaLM.from_pretrained(sys.argv[2], **options).eval()
weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
loaded_peak, before = status("VmHWM"), status("VmRSS")
reset_peak()
new_tokens, prompt_length = (int(v) for v in sys.argv[4].split(","))
prompt = torch.randint(0, model.config.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(0))
tokens = model.generate(prompt, new_tokens, temperature=0)
print(json.dumps({
    "import_rss": base, "weight_bytes": weights, "load_peak": loaded_peak, "before_decoding": before,
    "decoding_peak": status("VmHWM"), "whole_peak": max(loaded_peak, status("VmHWM")),
    "tokens": tokens[0, -new_tokens:].tolist(),
}))
"""


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--op memory (also --d-model, --layers, --vocab, --mixer, --new-tokens)")
    group.add_argument(
        "--precisions",
        type=comma_list,
        default=list(PRECISIONS),
        help=f"comma-separated, from {', '.join(PRECISIONS)}",
    )


def check(args, parser) -> None:
    args.d_model = args.d_model or 768
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"--precisions: unknown {unknown}; choose from {list(PRECISIONS)}")
    if sys.platform != "linux":
        parser.error("--op memory reads /proc/self/status: Linux only")
    if args.device != "cpu":
        parser.error("--op memory measures decoding on the CPU (resident memory); run it with --device cpu")


def save_checkpoint(args, directory: str) -> None:
    """The float32 checkpoint every precision loads (safetensors, random weights, seeded)."""
    import torch

    from ssm import MambaConfig, MambaLM

    ssm_cfg = decode_mixer_config(args.mixer, args.d_model)
    torch.manual_seed(args.seed)
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=args.vocab, ssm_cfg=ssm_cfg)
    MambaLM(config).save_pretrained(directory, safe_serialization=True)


def run(args) -> tuple[int, dict | None]:
    MiB = 2**20
    print(
        f"resident memory of greedy decoding ({args.new_tokens} tokens after {args.prompt_length}), MambaLM "
        f"({args.mixer}) d_model={args.d_model} n_layer={args.layers} vocab={args.vocab}, from a float32 "
        "safetensors checkpoint, one process per precision (MiB)"
    )
    print(" ".join(f"{h:>15s}" for h in ("precision", *HEADINGS)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(args, tmp)
        for name in args.precisions:
            command = [sys.executable, "-c", CHILD, str(ROOT), tmp, json.dumps(PRECISIONS[name])]
            command += [f"{args.new_tokens},{args.prompt_length}", "1"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-2000:] + done.stderr[-2000:])
                print(f"error: the {name} run failed (exit {done.returncode})")
                return 1, None
            r = results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:>15s} " + " ".join(f"{r[k] / MiB:15.0f}" for k in READINGS))
    return 0, {"config": config_of(args), "results": results}


def markdown(result: dict, args) -> tuple[str, str, str]:
    MiB = 2**20
    c = result["config"]
    rows = [[name] + [f"{r[k] / MiB:.0f}" for k in READINGS] for name, r in result["results"].items()]
    body = report.table(["precision", *HEADINGS], rows)
    body += (
        f"\n\nMambaLM ({c['mixer']}) d_model {c['d_model']}, {c['layers']} layers, vocabulary {c['vocab']}, "
        f"loaded with `MambaLM.from_pretrained(dir, dtype= | quantize=)` from float32 safetensors; greedy "
        f"decoding of {c['new_tokens']} tokens after {c['prompt_length']}, batch 1, one process per precision "
        "(Linux VmRSS / VmHWM, MiB; the decoding peak is measured from a reset after loading). The int8 / "
        "int4 decoding peak moves by up to ~150 MiB from run to run: the prompt's pass on the tensor path "
        "widens each matrix 1024 rows at a time, and glibc keeps those freed chunks in its heap "
        "(with MALLOC_MMAP_THRESHOLD_=131072 that pass added 13 MiB instead of 179, int8, measured once)."
    )
    return "memory", f"resident memory of decoding per precision, {c['device']}", body
