"""The edges that read the world: caches, offline model loaders and text.

``cache`` reads ``blocks.{l}.attn.hook_pattern`` / ``hook_v`` by name from any cache and raises
every "your cache is missing X" error; ``models`` loads the built-in and your own models offline;
``text`` holds the built-in sample text and cuts text into token windows with BOS; ``capture``
runs a model's Hugging Face forward with SDPA attention and hands each layer's post-rotary q, k, v
and attention parameters to a callback, so that attention rows can be recomputed without the
full pattern; ``hf`` turns a plain Hugging Face forward's attentions and value states into the
dict that ``analyze_heads`` reads (:func:`from_hf`); ``nnsight_trace`` saves them from one trace
of an nnsight model (:func:`from_nnsight`; nnsight is imported on use, an optional dependency).
"""

from .hf import from_hf
from .nnsight_trace import from_nnsight

__all__ = ["from_hf", "from_nnsight"]
