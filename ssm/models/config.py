"""The language model's configuration: mamba-ssm's ``MambaConfig`` field for field, so that its
config.json files load unchanged and ours load in mamba-ssm, plus one field mamba-ssm fixes:
``norm_epsilon``. Hybrid models (attention layers among the Mamba layers) through mamba-ssm's
``attn_layer_idx`` and ``attn_cfg``.

mamba-ssm builds every norm with ε = 1e-5 (``MixerModel``'s ``norm_epsilon`` argument, which its
``MambaConfig`` never sets, and the constant of Mamba-2's gated norm); transformers reads
``layer_norm_epsilon`` from its config. ``norm_epsilon`` carries that value. ``to_dict`` leaves
it out while it is mamba-ssm's 1e-5, so every config mamba-ssm can express is written field for
field and loads there; a config with another ε writes the field, and mamba-ssm then refuses the
file (an unexpected keyword) instead of running the model with the wrong ε.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..layers import Mamba, Mamba2, Mamba3
from ..layers.arguments import check_mixer_arguments

MIXERS = ("Mamba1", "Mamba2", "Mamba3")
_MIXER_CLASSES = dict(zip(MIXERS, (Mamba, Mamba2, Mamba3)))
MAMBA_SSM_NORM_EPSILON = 1e-5  # the ε mamba-ssm builds every norm with


@dataclass
class MambaConfig:
    d_model: int = 2560  # model width (the residual stream)
    d_intermediate: int = 0  # hidden width of the gated MLP after each mixer; 0 = no MLP
    n_layer: int = 64  # number of residual blocks
    vocab_size: int = 50277  # tokens; the embedding is padded up to pad_vocab_size_multiple
    ssm_cfg: dict = field(
        default_factory=dict
    )  # "layer": "Mamba1" (default), "Mamba2" or "Mamba3", plus the mixer's arguments (d_state, headdim, ...)
    # Hybrid models: the indices of the blocks whose mixer is attention (ssm.layers.MHA) instead
    # of ssm_cfg's Mamba layer, each in [0, n_layer) and once, as mamba-ssm writes them.
    attn_layer_idx: list = field(default_factory=list)
    # MHA's arguments for those layers: num_heads (required), num_heads_kv, head_dim, mlp_dim,
    # causal (must be true), d_conv, rotary_emb_dim, ... (mamba-ssm's names; d_model is embed_dim)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True  # RMSNorm (True) or LayerNorm (False)
    residual_in_fp32: bool = True  # keep the residual stream in float32
    fused_add_norm: bool = True  # a kernel choice in mamba-ssm; the result is the same either way
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True  # the LM head shares the embedding matrix
    # ε of every norm: the block norms, the final norm and Mamba-2's gated output norm. Not a
    # field of mamba-ssm's MambaConfig (it fixes 1e-5); written to config.json only when it differs.
    norm_epsilon: float = MAMBA_SSM_NORM_EPSILON

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.d_intermediate, bool) or not isinstance(self.d_intermediate, int) or self.d_intermediate < 0:
            raise ValueError(f"MambaConfig.d_intermediate must be an int >= 0, got {self.d_intermediate!r}")
        if not isinstance(self.ssm_cfg, dict):
            raise ValueError(f"MambaConfig.ssm_cfg must be a dict, got {type(self.ssm_cfg).__name__}")
        layer = self.ssm_cfg.get("layer", "Mamba1")
        if layer not in MIXERS:
            raise ValueError(f"MambaConfig.ssm_cfg['layer'] must be one of {list(MIXERS)}, got {layer!r}")
        # the mixer's own checks of its arguments, now rather than when the model is built (a
        # d_state or d_conv of 0 used to pass here and crash the C kernels in the backward)
        options = {key: value for key, value in self.ssm_cfg.items() if key != "layer"}
        try:
            check_mixer_arguments(_MIXER_CLASSES[layer], self.d_model, options)
        except ValueError as err:
            raise ValueError(f"MambaConfig.ssm_cfg ({layer}, d_model = {self.d_model}): {err}") from err
        eps = self.norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"MambaConfig.norm_epsilon must be a finite number > 0, got {eps!r}")
        self._check_attention()

    def _check_attention(self) -> None:
        idx, cfg = self.attn_layer_idx, self.attn_cfg
        if not isinstance(idx, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
            raise ValueError(f"MambaConfig.attn_layer_idx must be a list of layer indices (ints), got {idx!r}")
        outside = [i for i in idx if not 0 <= i < self.n_layer]
        if outside:
            raise ValueError(
                f"MambaConfig.attn_layer_idx {list(idx)} holds {outside}, outside [0, n_layer = {self.n_layer})"
            )
        repeated = sorted({i for i in idx if idx.count(i) > 1})
        if repeated:
            raise ValueError(f"MambaConfig.attn_layer_idx {list(idx)} repeats {repeated}; each layer once")
        if not isinstance(cfg, dict):
            raise ValueError(f"MambaConfig.attn_cfg must be a dict, got {type(cfg).__name__}")
        if not idx:
            return
        if "num_heads" not in cfg:
            raise ValueError("MambaConfig.attn_cfg must give num_heads for the attention layers (attn_layer_idx)")
        if cfg.get("causal", False) is not True:
            raise ValueError(
                f"MambaConfig.attn_cfg['causal'] must be true for a language model, got {cfg.get('causal')!r}: "
                "mamba-ssm's MHA defaults to causal=False, under which every position sees the tokens after it"
            )

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    def to_dict(self) -> dict:
        """The fields as config.json holds them; ``norm_epsilon`` only when it is not mamba-ssm's."""
        d = dataclasses.asdict(self)
        if d["norm_epsilon"] == MAMBA_SSM_NORM_EPSILON:
            del d["norm_epsilon"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MambaConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown MambaConfig field(s) {unknown}; valid fields: {names}")
        return cls(**d)
