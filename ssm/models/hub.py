"""Loading from the Hugging Face hub or a directory, under the name users import it by:
``from ssm.models.hub import load_model_and_tokenizer, complete``.

The work lives in two modules, one job each: resolve.py turns a name into a local directory
(what checkpoint.py and tokenizer.py use), text.py loads a model with its tokenizer and turns
text into text. This module only gathers their public names; nothing in the library imports it,
so that it can import both without a loop.
"""

from .resolve import looks_like_repo_id, resolve_model_dir
from .text import QuantizationMismatch, complete, continuation, left_pad, load_model_and_tokenizer

__all__ = [
    "resolve_model_dir",
    "looks_like_repo_id",
    "load_model_and_tokenizer",
    "complete",
    "left_pad",
    "continuation",
    "QuantizationMismatch",
]
