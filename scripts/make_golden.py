"""Regenerate the golden files of tests/models/golden/: what transformers' own MambaForCausalLM and
Mamba2ForCausalLM compute for tiny models with fixed random weights.

    python scripts/make_golden.py [--out tests/models/golden]

Needs transformers (and safetensors, which it brings); the tests that read the files need
neither transformers nor this script. For each model NAME it writes
    NAME/                      the model directory exactly as transformers' save_pretrained
                               writes it (config.json, generation_config.json, model.safetensors)
    NAME.outputs.safetensors   input_ids (B, L) and the logits (B, L, V) of one forward;
                               prompt (B, L0), the greedy continuation (B, L0 + new) from
                               transformers' generate and the logits of each generated position
                               (B, new, V); its metadata names the versions and the code path

Every parameter gets random values (norm weights, D, the Δ bias, A_log and the conv bias
included), layer_norm_epsilon is not the default, and Mamba-2 has several heads and ngroups > 1,
so that a swapped projection half, a wrong epsilon or a missing gate changes the logits.
"mamba2" also stores dt_limit (2,) and logits_dt_limit: the logits of the same weights under that
time_step_limit, which clamps Δ.
The script refuses to write when the run would not use transformers' pure-PyTorch code (a GPU,
or mamba-ssm / causal-conv1d / kernels installed), and when a greedy step's top two logits lie
closer than MIN_MARGIN (a near tie that rounding could flip).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "models" / "golden"
MIN_MARGIN = 1e-2  # smallest allowed gap between a greedy step's top two logits
# Packages through which transformers would replace its PyTorch code with compiled kernels.
KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d", "kernels")

# Shared by both models: B = 2 sequences of L = 13 tokens; greedy from a prompt of 5 tokens.
VOCAB, BATCH, LENGTH, PROMPT, NEW_TOKENS = 64, 2, 13, 5, 8
EPS = 1e-3  # layer_norm_epsilon, not the default 1e-5
# Δ clamp of the extra Mamba-2 run: bites on both sides of softplus(dt + dt_bias).
DT_LIMIT = (0.05, 0.6)

SPECS = {
    "mamba": dict(
        kind="mamba",
        hidden_size=32,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        state_size=8,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
        use_bias=True,
        use_conv_bias=True,
        layer_norm_epsilon=EPS,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        seed=1,
    ),
    "mamba2": dict(
        kind="mamba2",
        hidden_size=32,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        state_size=8,
        expand=2,
        head_dim=8,
        num_heads=8,
        n_groups=2,
        chunk_size=8,
        conv_kernel=3,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=EPS,
        residual_in_fp32=True,
        tie_word_embeddings=False,
        seed=3,
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter random values on a scale that keeps activations of order one."""
    g = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        return torch.randn(p.shape, generator=g) * std + mean

    def uniform(p, lo, hi):
        return torch.rand(p.shape, generator=g) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)[-2:]  # e.g. ["in_proj", "weight"], ["mixer", "A_log"]
            if name.endswith("embeddings.weight"):
                value = normal(p, 0.5)
            elif leaf[0] in ("norm", "norm_f") and leaf[1] == "weight":
                value = uniform(p, 0.5, 1.5)
            elif leaf[1] == "A_log":
                value = uniform(p, math.log(0.5), math.log(8.0))  # A in [-8, -0.5]
            elif leaf[1] == "D":
                value = normal(p, 1.0)
            elif leaf[1] == "dt_bias" or leaf == ["dt_proj", "bias"]:
                value = uniform(p, -4.0, 1.0)  # softplus: Δ from about 0.02 to 1.3
            elif leaf == ["conv1d", "weight"]:
                value = normal(p, 0.5)
            elif leaf[1] == "bias":  # in_proj, out_proj, conv1d
                value = normal(p, 0.3)
            elif leaf[1] == "weight" and p.ndim == 2:  # in_proj, x_proj, dt_proj, out_proj, lm_head
                value = normal(p, p.shape[1] ** -0.5)
            else:
                raise ValueError(f"no random rule for parameter {name} {tuple(p.shape)}")
            p.copy_(value)


def build(spec: dict):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    fields = {k: v for k, v in spec.items() if k not in ("kind", "seed")}
    # No special tokens: greedy decoding runs its full length and nothing masks a logit.
    fields.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if spec["kind"] == "mamba":
        model = MambaForCausalLM(MambaConfig(**fields))
    else:
        model = Mamba2ForCausalLM(Mamba2Config(**fields))
    randomize(model, spec["seed"])
    return model.eval()


def code_path(model) -> str:
    """Which transformers code computes the outputs; refuses anything but the PyTorch fallbacks."""
    found = [name for name in KERNEL_PACKAGES if importlib.util.find_spec(name) is not None]
    if found or torch.cuda.is_available():
        raise SystemExit(
            f"refusing to write golden files: transformers could use compiled kernels here "
            f"(installed: {found}, CUDA available: {torch.cuda.is_available()}); run on a CPU-only "
            "environment without mamba-ssm, causal-conv1d and kernels"
        )
    if model.config.model_type == "mamba":
        if model.config.use_mambapy:
            raise SystemExit("use_mambapy must be False: the golden files come from the sequential scan")
        return (
            "pure PyTorch on CPU: transformers.models.mamba.modeling_mamba fallbacks causal_conv1d_fn, "
            "mamba_selective_scan (sequential loop; use_mambapy=False, associative scan only under "
            "torch.compile), causal_conv1d_update and mamba_selective_state_update in generate"
        )
    return (
        "pure PyTorch on CPU: transformers.models.mamba2.modeling_mamba2 fallbacks causal_conv1d_fn, "
        "mamba2_chunk_scan (chunked SSD), causal_conv1d_update and mamba2_selective_state_update in "
        "generate; MambaRMSNormGated"
    )


def run(name: str, spec: dict, out: Path) -> None:
    import transformers
    from safetensors.torch import save_file

    model = build(spec)
    path = code_path(model)
    g = torch.Generator().manual_seed(100 + spec["seed"])
    input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=g)
    with torch.no_grad():
        logits = model(input_ids).logits
        gen = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    step_logits = torch.stack(gen.logits, dim=1)  # (B, new, V)
    assert gen.sequences.shape == (BATCH, PROMPT + NEW_TOKENS), gen.sequences.shape
    assert torch.equal(gen.sequences[:, PROMPT:], step_logits.argmax(-1)), "generate is not greedy"
    top2 = step_logits.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    if margin < MIN_MARGIN:
        raise SystemExit(f"{name}: a greedy step has its top two logits {margin:.2g} apart; change the seed")

    tensors = {
        "input_ids": input_ids,
        "logits": logits.float().contiguous(),
        "prompt": prompt,
        "greedy": gen.sequences.contiguous(),
        "greedy_logits": step_logits.float().contiguous(),
    }
    if spec["kind"] == "mamba2":
        # The same weights with Δ clamped: transformers' forward clamps (its one-token step does not,
        # so only the forward's logits are stored).
        for layer in model.backbone.layers:
            layer.mixer.time_step_limit = DT_LIMIT
        with torch.no_grad():
            tensors["logits_dt_limit"] = model(input_ids).logits.float().contiguous()
        tensors["dt_limit"] = torch.tensor(DT_LIMIT, dtype=torch.float64)
        for layer in model.backbone.layers:
            layer.mixer.time_step_limit = model.config.time_step_limit

    directory = out / name
    model.save_pretrained(directory)  # config.json, generation_config.json, model.safetensors
    metadata = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "path": path,
        "min_greedy_margin": f"{margin:.4g}",
    }
    save_file(tensors, out / f"{name}.outputs.safetensors", metadata=metadata)
    print(f"{name}: wrote {directory} and {name}.outputs.safetensors (min greedy margin {margin:.3g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="directory for the golden files (default: %(default)s)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        parser.error("needs transformers: pip install transformers (in an environment of its own)")
    torch.set_num_threads(1)  # one summation order, whatever the machine
    args.out.mkdir(parents=True, exist_ok=True)
    for name, spec in SPECS.items():
        run(name, spec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
