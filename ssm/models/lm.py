"""The Mamba language model: embedding → residual blocks → final norm → (tied) LM head.

Module names and state-dict keys are those of mamba-ssm's ``MambaLMHeadModel``:
backbone.embedding, backbone.layers.{i}.norm / .mixer (/ .norm2 / .mlp), backbone.norm_f, lm_head.
A hybrid model's attention layers (``config.attn_layer_idx``) are ``MHA`` mixers in the same place.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..distributed import check_slices, group_rank_and_size, slice_packing
from ..layers import MHA, Block, GatedMLP, Mamba, Mamba2, Mamba3, RMSNorm
from ..layers.linear import Linear
from ..scan import PackedSequences, packed_sequences
from . import checkpoint, generation
from .cache import InferenceCache, check_cache
from .config import MambaConfig
from .fused_step import FusedStep, fused_step
from .inputs import check_ids
from .quantize import quantize_model, set_activations

_MIXERS = {"Mamba1": Mamba, "Mamba2": Mamba2, "Mamba3": Mamba3}


def _valid_keys(cls) -> list[str]:
    """The constructor arguments of mixer ``cls`` that a config may set."""
    fixed = ("self", "d_model", "embed_dim", "layer_idx", "device", "dtype")
    return [p for p in inspect.signature(cls).parameters if p not in fixed]


def _make_attention(config: MambaConfig, layer_idx: int, **kw) -> MHA:
    cfg = dict(config.attn_cfg)
    valid = _valid_keys(MHA)
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise ValueError(f"unknown attn_cfg key(s) {unknown} for MHA; valid keys: {valid}")
    try:
        return MHA(config.d_model, layer_idx=layer_idx, **cfg, **kw)
    except ValueError as err:
        raise ValueError(f"MambaConfig.attn_cfg (d_model = {config.d_model} is MHA's embed_dim): {err}") from err


def _make_mixer(config: MambaConfig, layer_idx: int, backend: str, **kw) -> nn.Module:
    if layer_idx in config.attn_layer_idx:
        return _make_attention(config, layer_idx, **kw)
    cfg = dict(config.ssm_cfg)
    cls = _MIXERS[cfg.pop("layer", "Mamba1")]
    valid = _valid_keys(cls)
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise ValueError(f"unknown ssm_cfg key(s) {unknown} for {cls.__name__}; valid keys: {['layer', *valid]}")
    cfg.setdefault("backend", backend)
    mixer = cls(config.d_model, layer_idx=layer_idx, **cfg, **kw)
    if isinstance(mixer, Mamba2) and mixer.rmsnorm:
        # The gated output norm takes the model's ε, as in transformers (mamba-ssm fixes 1e-5,
        # which is norm_epsilon's default).
        mixer.norm.eps = config.norm_epsilon
    return mixer


class MambaBackbone(nn.Module):
    """Token ids (batch, L) → normalised hidden states (batch, L, d_model)."""

    def __init__(self, config: MambaConfig, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)

        def norm():
            cls = RMSNorm if config.rms_norm else nn.LayerNorm
            return cls(config.d_model, eps=config.norm_epsilon, **kw)

        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, **kw)
        self.layers = nn.ModuleList(
            Block(
                _make_mixer(config, i, backend, **kw),
                norm(),
                mlp=GatedMLP(config.d_model, config.d_intermediate, **kw) if config.d_intermediate > 0 else None,
                norm2=norm() if config.d_intermediate > 0 else None,
                residual_in_fp32=config.residual_in_fp32,
            )
            for i in range(config.n_layer)
        )
        self.norm_f = norm()

    def forward(
        self, input_ids, cache: InferenceCache | None = None, step: bool = False, cu_seqlens=None, last=0, cp_group=None
    ):
        """``last`` > 0 (not with ``step`` or ``cu_seqlens``): only the last ``last`` positions'
        hidden states, (batch, last, d_model); the last block computes no others. ``cp_group``:
        context parallelism, passed to every block (``MambaLM.forward``)."""
        hidden, residual = self.embedding(input_ids), None
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            kw = {"last": last} if i == final and last > 0 else {}
            if cp_group is not None:
                kw["cp_group"] = cp_group
            layer_cache = None if cache is None else cache.layers[i]
            hidden, residual = layer(hidden, residual, cache=layer_cache, step=step, cu_seqlens=cu_seqlens, **kw)
        residual = hidden + residual if residual is not None else hidden
        return self.norm_f(residual.to(self.norm_f.weight.dtype))

    def fused_step(self, input_ids, cache: InferenceCache, lm_head: nn.Linear):
        """``lm_head(forward(input_ids, cache, step=True))`` with the blocks stepped in C, or None
        where none can be (ssm/models/fused_step.py: the plan)."""
        return fused_step(self, input_ids, cache, lm_head)

    def prepare_fused_step(self, cache: InferenceCache, lm_head: nn.Linear, batch: int | None = None):
        """``fused_step`` with its C arguments built once: a function input_ids (batch,) →
        logits, or None where the fused step does not apply. For a caller that changes neither
        the model's parameters nor the cache's tensors between tokens (``MambaLM.generate``)."""
        return FusedStep.prepare(self, cache, lm_head, batch)


class MambaLM(nn.Module):
    """A Mamba language model. ``forward(input_ids (batch, L)) → logits (batch, L, V)``, where
    V = config.padded_vocab_size (the vocabulary padded as in mamba-ssm).

    ``backend`` is the scan backend of every Mamba mixer ("auto" by default; an
    ``ssm_cfg["backend"]`` takes precedence). The blocks of ``config.attn_layer_idx`` have
    attention mixers (``ssm.layers.MHA`` with ``config.attn_cfg``) instead: a hybrid model.
    Recurrent inference: ``allocate_inference_cache(batch)``, then ``forward(prompt,
    cache=cache)`` (prefill) and ``step(token_ids, cache)`` per token; ``generate`` does both.
    """

    def __init__(self, config: MambaConfig, *, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MambaConfig):
            raise ValueError(f"config must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        self.quantization: dict | None = None  # set by quantize: scheme, block_size, modules
        self.backbone = MambaBackbone(config, backend=backend, device=device, dtype=dtype)
        self.lm_head = Linear(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's initialisation: embeddings N(0, 0.02²), linear biases 0 (except the Δ
        bias), and the output projections of each residual branch scaled by 1/√(branches·layers)."""
        branches = 2 if self.config.d_intermediate > 0 else 1
        for module in self.modules():
            if (
                isinstance(module, nn.Linear)
                and module.bias is not None
                and not getattr(module.bias, "_no_reinit", False)
            ):
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc2.weight")):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                p /= math.sqrt(branches * self.config.n_layer)

    def inference_cache_from(self, tensors: list[list[torch.Tensor]], seqlen_offset: int = 0) -> InferenceCache:
        """A cache holding ``tensors`` (from ``InferenceCache.tensors()``, e.g. a checkpoint's),
        each layer's in the kind of cache this model's layers use."""
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.backbone.layers):
            got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(f"tensors must hold one list per layer ({len(self.backbone.layers)}), got {got}")
        template = self.allocate_inference_cache(1, device="meta")
        return InferenceCache([c.replace(list(t)) for c, t in zip(template.layers, tensors)], seqlen_offset)

    def allocate_inference_cache(self, batch_size: int, dtype=None, device=None, max_seqlen: int = 0) -> InferenceCache:
        """An empty state for ``batch_size`` sequences. ``max_seqlen``: room reserved in the
        attention layers' key/value caches (they grow past it on demand; Mamba layers ignore it)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")

        def allocate(mixer):
            if isinstance(mixer, MHA):
                return mixer.allocate_inference_cache(batch_size, dtype, device, max_seqlen=max_seqlen)
            return mixer.allocate_inference_cache(batch_size, dtype, device)

        return InferenceCache([allocate(layer.mixer) for layer in self.backbone.layers])

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: InferenceCache | None = None,
        num_last_tokens: int = 0,
        cu_seqlens: torch.Tensor | PackedSequences | None = None,
        cp_group=None,
    ) -> torch.Tensor:
        """input_ids (batch, L) → logits (batch, L, V), or only the last ``num_last_tokens``
        positions when > 0. With ``cache``, continue from its state and leave the state after
        the last token in it.

        ``cp_group``: a torch.distributed process group of W ranks over which each sequence is
        split (context parallelism, ``ssm.distributed``). Every rank of the group calls this
        together with its slice of the same sequences, in rank order: rank r's ``input_ids``
        are positions [r·L/W, (r+1)·L/W) (``ssm.distributed.shard_sequence`` cuts them), the
        same number on every rank (checked: one all_gather of the shape), and it gets the
        logits of those positions, equal to the whole sequence's forward's. Gradients summed
        over the ranks are the whole's. No rank runs a layer over more than its slice (attention
        gathers keys and values). Every mixer takes it (Mamba, Mamba2, Mamba3, MHA); not with
        ``num_last_tokens``. A ``cache`` (the same on every rank) holds the state before the
        whole sequence and is left holding the state after it on every rank: a prompt
        prefilled over W processes, then decoded on any one. With it, ``cu_seqlens`` holds the
        boundaries of the whole row (batch 1, up to W·L), the same on every rank, and sequences
        may cross ranks (not with a cache).

        ``cu_seqlens`` (S + 1,) int32/int64: S sequences (documents, prompts) packed along L in
        a batch of one, 0 = cu_seqlens[0] <= ... <= cu_seqlens[S] = L. No layer carries
        anything across a boundary: each sequence's logits are those it would get alone. With a
        cache, the cache has batch S, one state per sequence (prefill of several prompts in one
        call; then ``step`` takes one token per sequence). It is validated once here (one host
        sync; none for a ``ssm.scan.PackedSequences``) and handed to every layer validated."""
        check_ids(self.config, input_ids, 2, "(batch, L)")
        if cp_group is not None:
            self._check_context_parallel(cache, num_last_tokens, cu_seqlens)
            check_slices(input_ids, cp_group)  # one small all_gather: the same slice shape on every rank
            if cu_seqlens is not None:  # validated once for every layer
                cu_seqlens = slice_packing(cu_seqlens, input_ids.shape[1], cp_group, input_ids.device)
            if cache is not None:
                check_cache(cache, input_ids.shape[0], "input_ids")
            hidden = self.backbone(input_ids, cache, cu_seqlens=cu_seqlens, cp_group=cp_group)
            if cache is not None:  # it has seen the whole sequence
                cache.seqlen_offset += input_ids.shape[1] * group_rank_and_size(cp_group)[1]
            return self.lm_head(hidden)
        packed = None
        if cu_seqlens is not None:
            packed = packed_sequences(cu_seqlens, input_ids.shape[1], input_ids.shape[0], input_ids.device)
        if cache is not None:
            check_cache(
                cache,
                input_ids.shape[0] if packed is None else packed.num_sequences,
                "input_ids" if packed is None else "cu_seqlens (sequences)",
            )
        # only the positions read: the last block computes no others (no packing: there the
        # last positions of the batch are not every sequence's)
        last = min(num_last_tokens, input_ids.shape[1]) if packed is None else 0
        hidden = self._blocks(input_ids, cache, packed, last, input_ids.shape[1])
        if num_last_tokens > 0:
            hidden = hidden[:, -num_last_tokens:]
        return self.lm_head(hidden)

    def _check_context_parallel(self, cache, num_last_tokens, cu_seqlens) -> None:
        if num_last_tokens > 0:
            raise ValueError("MambaLM.forward: num_last_tokens is not supported with cp_group (context parallelism)")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("MambaLM.forward: cache together with cu_seqlens is not supported with cp_group")
        for i, layer in enumerate(self.backbone.layers):
            if not getattr(layer.mixer, "context_parallel", False):
                raise ValueError(
                    f"MambaLM.forward: cp_group: layer {i}'s mixer {type(layer.mixer).__name__} has no context "
                    "parallelism (Mamba, Mamba2, Mamba3 and MHA have)"
                )

    def _blocks(self, input_ids, cache, packed, last: int, tokens: int) -> torch.Tensor:
        """The backbone over a sequence; the cache, if any, has seen ``tokens`` more positions."""
        hidden = self.backbone(input_ids, cache, cu_seqlens=packed, last=last)
        if cache is not None:
            cache.seqlen_offset += tokens
        return hidden

    def prefill(
        self, input_ids: torch.Tensor, cache: InferenceCache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run prompts (batch, L) into ``cache``; return the logits (batch, V) after each one's last
        token. ``attention_mask`` (batch, L): 1 for a token and 0 for padding, on the left (see
        ``generate``): the prompts are packed without their padding and run in one call, so each
        row's state is its prompt's alone. ``cache.seqlen_offset`` advances by L either way."""
        check_ids(self.config, input_ids, 2, "(batch, L)", attention_mask)
        check_cache(cache, input_ids.shape[0])
        if attention_mask is None:
            return self.lm_head(self._blocks(input_ids, cache, None, 1, input_ids.shape[1])[:, -1])
        tokens = attention_mask.bool()
        cu_seqlens = torch.nn.functional.pad(tokens.sum(1).cumsum(0), (1, 0))  # (batch + 1,)
        packed_ids = input_ids[tokens][None]  # (1, tokens)
        packed = packed_sequences(cu_seqlens, packed_ids.shape[1], 1, input_ids.device)
        hidden = self._blocks(packed_ids, cache, packed, 0, input_ids.shape[1])  # (1, tokens, d)
        return self.lm_head(hidden[0, packed.cu_seqlens[1:] - 1])  # (batch, V)

    def step(self, input_ids: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """One token per sequence: input_ids (batch,) → logits (batch, V); updates ``cache``.
        Costs the same at every position: it reads only the cache, never the earlier tokens."""
        check_ids(self.config, input_ids, 1, "(batch,)")
        check_cache(cache, input_ids.shape[0])
        return self.decoding_step(cache, prepare=False)(input_ids)

    def decoding_step(self, cache: InferenceCache, prepare: bool = True):
        """A function token ids (batch,) → logits (batch, V) that steps ``cache`` by one token and
        checks nothing (``generate``'s ids are drawn from the vocabulary). On the CPU without
        gradients the blocks step in C (ssm/models/fused_step.py), its arguments built once with
        ``prepare``: then nothing may change the model's parameters or the cache's tensors
        between calls. Elsewhere each block steps by its tensor code."""

        def tensor_step(input_ids):
            return self.lm_head(self.backbone(input_ids, cache, step=True))

        def fused_or_tensor_step(input_ids):  # planned again at each call
            logits = self.backbone.fused_step(input_ids, cache, self.lm_head)
            return tensor_step(input_ids) if logits is None else logits

        if prepare:
            run = self.backbone.prepare_fused_step(cache, self.lm_head) or tensor_step
        else:
            run = fused_or_tensor_step

        def step(input_ids):
            logits = run(input_ids)
            cache.seqlen_offset += 1
            return logits

        return step

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        on_token=None,
    ) -> torch.Tensor:
        """Continue each prompt of ``input_ids`` (batch, L ≥ 1) by up to ``max_new_tokens``
        tokens: one prefill, then one cached step per token (ssm/models/generation.py).

        Prompts of different lengths: ``attention_mask`` (batch, L), 1 for a token and 0 for
        padding, with the padding on the left (transformers' convention: every prompt ends at
        L). The model never sees the padding: the prompts are packed without it and prefilled
        together in one call (``prefill``), so the state, convolution window and (attention
        layers) keys and values each row decodes from are exactly those of its prompt alone, at
        its own positions, and greedy decoding gives each row the tokens of its prompt run
        alone. Padded positions may hold any id.

        ``temperature=0`` is greedy decoding; otherwise logits / temperature are sampled, from
        the ``top_k`` most likely tokens and/or the smallest set whose probability reaches
        ``top_p`` when given. A sequence that emits ``eos_token_id`` stops; its later positions
        hold ``eos_token_id``, and generation ends when all have stopped.
        Returns (batch, L + new) token ids, prompt included (padding too), like transformers'
        ``generate``. ``on_token``: called with each new column of ids (batch,) as soon as it is
        drawn, before the next step runs (to stream text as it is decoded).
        """
        return generation.generate(
            self,
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            generator=generator,
            attention_mask=attention_mask,
            on_token=on_token,
        )

    def quantize(self, scheme: str = "int8", activations: str = "int8") -> MambaLM:
        """Quantise the matrices that decoding reads in bulk to ``scheme`` ("int8" or "int4": a
        float32 scale per block of 32 inputs; ssm.ops.quant), in place; returns the model. Which
        layers stay in the float dtype, and why: ssm/models/quantize.py. ``activations``: "int8"
        rounds each quantised layer's input to int8 per block of 32 (as llama.cpp's q8_0 / q4_0
        do; the fused CPU step then multiplies integers, 1.24-1.65x faster), "float32" keeps it.
        The fused step reads the integers as they are (states and sums in float32);
        ``save_pretrained`` stores them with a quantization_config.json, and ``from_pretrained``
        loads them back without quantising again. A model is quantised once (ValueError else)."""
        quantize_model(self, scheme, activations)
        return self

    def set_activations(self, activations: str) -> MambaLM:
        """What a quantised model's layers multiply their integers by: "int8" or "float32" (see
        ``quantize``); returns the model."""
        set_activations(self, activations)
        return self

    def save_pretrained(self, save_directory, safe_serialization: bool = False) -> None:
        """Write config.json and pytorch_model.bin (mamba-ssm's format; model.safetensors with
        ``safe_serialization``) into ``save_directory``; a quantised model's
        quantization_config.json too."""
        checkpoint.save_pretrained(self, save_directory, safe_serialization)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path,
        *,
        dtype=None,
        device=None,
        backend: str = "auto",
        revision: str | None = None,
        quantize: str | None = None,
        activations: str | None = None,
    ) -> MambaLM:
        """Load a model from a local directory in mamba-ssm's format (config.json with
        MambaConfig fields) or transformers' (config.json with hidden_size, num_hidden_layers,
        ...; model_type "mamba" or "mamba2"), weights in model.safetensors or pytorch_model.bin
        or shards of either listed by model.safetensors.index.json / pytorch_model.bin.index.json.

        ``name_or_path`` that is not a directory is taken as a Hugging Face hub repo id
        (``state-spaces/mamba-130m-hf``, at ``revision``), fetched or read from the hub cache by
        huggingface_hub (``pip install "ssm-scan[hub]"``); with HF_HUB_OFFLINE=1 only the cache
        is read. ``dtype``: None or "auto" keeps the checkpoint's, else a torch dtype or its name
        (a quantised model's scales stay float32). A checkpoint saved quantised (with its
        quantization_config.json) loads quantised; ``quantize`` ("int8", "int4") quantises a
        float checkpoint as ``quantize`` does (after ``dtype``), each matrix as it is read, so
        that the float model never stands in memory whole. ``activations`` ("int8", "float32";
        a quantised model only): what its layers multiply the integers by (``quantize``); None
        keeps the checkpoint's, "int8" when quantising here."""
        return checkpoint.from_pretrained(
            cls,
            name_or_path,
            device=device,
            dtype=dtype,
            backend=backend,
            revision=revision,
            quantize=quantize,
            activations=activations,
        )
