"""The language model, one job per module:

config.py       MambaConfig: the model's sizes and mixers
lm.py           MambaLM: the network (embedding → blocks → norm → head), forward, prefill, step
cache.py        InferenceCache: every layer's recurrent state during inference
inputs.py       the checks of the token ids and attention masks a user hands the model
generation.py   generate's decoding loop and sampling
fused_step.py   the plan of the fused C decoding step over a model's blocks
checkpoint.py   save_pretrained / from_pretrained: mamba-ssm's and transformers' formats
weight_files.py which files are a directory's weights: one set per directory, atomic writes
quantize.py     int8 / int4 layers, and their quantization_config.json
resolve.py      a name (directory or hub repo id) → a local directory
tokenizer.py    tokenizers: bytes, tokenizer.json, special tokens
text.py         the text front door: load_model_and_tokenizer, complete
hub.py          the front door's public names, gathered (ssm.models.hub.complete, ...)
scoring.py      log-likelihood of token ids in windows, bits per byte
"""

from .cache import InferenceCache
from .config import MambaConfig
from .generation import sample
from .lm import MambaLM
from .text import complete, load_model_and_tokenizer

__all__ = ["MambaConfig", "MambaLM", "InferenceCache", "sample", "load_model_and_tokenizer", "complete"]
