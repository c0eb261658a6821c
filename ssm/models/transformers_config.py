"""transformers' config.json (model_type "mamba" or "mamba2") as a MambaConfig: each of its
fields either honoured, refused with a ValueError naming it (where this library cannot compute
what transformers would), or ignored because it cannot change the logits. checkpoint.py's
from_pretrained reads such a directory through ``config_from_transformers``."""

from __future__ import annotations

import math

from .config import MambaConfig

# Each field of transformers' MambaConfig and Mamba2Config (5.x), and the names older releases and
# checkpoints converted from mamba-ssm carry, by what it means for the logits. The fields that
# change them are read by config_from_transformers (with their checks); these cannot:
_IGNORED = {
    # the initialisation of fresh weights only
    "initializer_range",
    "rescale_prenorm_residual",
    "time_step_scale",
    "time_step_min",
    "time_step_max",
    "time_step_init_scheme",
    "time_step_floor",
    # how transformers computes, not what: a kernel or scan choice, caching
    "use_mambapy",
    "use_associative_scan",
    "use_cache",
    "fused_add_norm",
    # transformers' vocab_size is already the padded embedding size (converted checkpoints keep this)
    "pad_vocab_size_multiple",
    # special tokens and default generation settings: read by generate, not by the forward
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    # PreTrainedConfig's bookkeeping: names, versions, the stored dtype, outputs and heads of other tasks
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "name_or_path",
    "_commit_hash",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "use_return_dict",
    "torchscript",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "pruned_heads",
    "use_bfloat16",
    "tf_legacy_loss",
    "_attn_implementation",
    "attn_implementation",
}
# transformers 5.x's defaults of the fields that change the logits (a field left out takes them).
_DEFAULTS = {
    "mamba": dict(
        vocab_size=50280,
        hidden_size=768,
        state_size=16,
        num_hidden_layers=32,
        layer_norm_epsilon=1e-5,
        expand=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        hidden_act="silu",
        residual_in_fp32=True,
        time_step_rank="auto",
        tie_word_embeddings=True,
    ),
    "mamba2": dict(
        num_heads=128,
        head_dim=64,
        vocab_size=32768,
        hidden_size=4096,
        state_size=128,
        num_hidden_layers=64,
        layer_norm_epsilon=1e-5,
        expand=2,
        conv_kernel=4,
        n_groups=8,
        use_bias=False,
        use_conv_bias=True,
        hidden_act="silu",
        residual_in_fp32=True,
        time_step_limit=(0.0, math.inf),
        chunk_size=256,
        tie_word_embeddings=False,
    ),
}
# Read only to check them: the value transformers' code always computes with, or a duplicate.
_CHECKED = {
    "mamba": {"model_type", "intermediate_size", "rms_norm", "n_layer"},
    # Mamba-2 has no Δ projection: transformers computes time_step_rank and never uses it.
    "mamba2": {"model_type", "rms_norm", "norm_before_gate", "n_layer", "time_step_rank"},
}


def config_from_transformers(raw: dict) -> MambaConfig:
    """A MambaConfig from transformers' MambaConfig / Mamba2Config fields. Every field that
    changes the logits is honoured, or refused with a ValueError naming it when this library
    cannot compute what transformers would; fields that cannot change them are ignored; a field
    this loader does not know is refused."""
    kind = raw.get("model_type")
    if kind not in _DEFAULTS:
        raise ValueError(f"transformers model_type {kind!r} is not supported; expected 'mamba' or 'mamba2'")
    defaults = _DEFAULTS[kind]
    unknown = sorted(set(raw) - set(defaults) - _CHECKED[kind] - _IGNORED)
    if unknown:
        raise ValueError(
            f"transformers config ({kind}) has field(s) {unknown} that this loader does not know, so it cannot "
            "tell whether they change the model's output; remove them if they do not"
        )

    def bad(name, expected):
        value = raw.get(name, defaults.get(name))
        return ValueError(f"transformers config ({kind}) field {name!r} must be {expected}, got {value!r}")

    def positive_int(name):
        value = raw.get(name, defaults[name])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, "a positive int")
        return value

    def boolean(name):
        value = raw.get(name, defaults[name])
        if not isinstance(value, bool):
            raise bad(name, "true or false")
        return value

    d_model, n_layer = positive_int("hidden_size"), positive_int("num_hidden_layers")
    expand, d_state, d_conv = positive_int("expand"), positive_int("state_size"), positive_int("conv_kernel")
    eps = raw.get("layer_norm_epsilon", defaults["layer_norm_epsilon"])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise bad("layer_norm_epsilon", "a finite number > 0")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' names of one function
        raise bad("hidden_act", "'silu' (the only activation of these mixers)")
    if raw.get("rms_norm", True) is not True:  # transformers' Mamba and Mamba-2 always use RMSNorm
        raise bad("rms_norm", "true (transformers ignores it and always normalises with RMSNorm)")
    if "n_layer" in raw and raw["n_layer"] != n_layer:
        raise bad("n_layer", f"num_hidden_layers = {n_layer} (transformers reads num_hidden_layers)")

    if kind == "mamba":
        if "intermediate_size" in raw and raw["intermediate_size"] != expand * d_model:
            raise bad("intermediate_size", f"expand * hidden_size = {expand * d_model} (transformers recomputes it)")
        rank = raw.get("time_step_rank", defaults["time_step_rank"])
        if rank != "auto":
            rank = positive_int("time_step_rank")
        ssm_cfg = dict(
            layer="Mamba1",
            d_state=d_state,
            d_conv=d_conv,
            expand=expand,
            dt_rank=math.ceil(d_model / 16) if rank == "auto" else rank,
            conv_bias=boolean("use_conv_bias"),
            bias=boolean("use_bias"),
        )
    else:
        heads, headdim, groups = positive_int("num_heads"), positive_int("head_dim"), positive_int("n_groups")
        if heads * headdim != expand * d_model:
            raise bad("num_heads", f"expand * hidden_size / head_dim = {expand * d_model} / {headdim}")
        if heads % groups:
            raise bad("n_groups", f"a divisor of num_heads = {heads}")
        if raw.get("norm_before_gate", False) is not False:  # transformers always gates, then normalises
            raise bad("norm_before_gate", "false (transformers ignores it and gates before the norm)")
        limit = raw.get("time_step_limit", defaults["time_step_limit"])
        if (
            not isinstance(limit, (list, tuple))
            or len(limit) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in limit)
            or limit[0] > limit[1]
        ):
            raise bad("time_step_limit", "two numbers [low, high] with low <= high")
        ssm_cfg = dict(
            layer="Mamba2",
            d_state=d_state,
            d_conv=d_conv,
            expand=expand,
            headdim=headdim,
            ngroups=groups,
            chunk_size=positive_int("chunk_size"),
            conv_bias=boolean("use_conv_bias"),
            bias=boolean("use_bias"),
            rmsnorm=True,
            norm_before_gate=False,
            dt_limit=(float(limit[0]), float(limit[1])),
        )
    return MambaConfig(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=positive_int("vocab_size"),
        ssm_cfg=ssm_cfg,
        rms_norm=True,
        residual_in_fp32=boolean("residual_in_fp32"),
        pad_vocab_size_multiple=1,  # transformers' vocab_size is already the embedding size
        tie_embeddings=boolean("tie_word_embeddings"),
        norm_epsilon=float(eps),
    )
