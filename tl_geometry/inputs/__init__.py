"""The edges that read the world: caches, offline model loaders and text.

``cache`` reads and checks ``hook_pattern`` / ``hook_v``; ``models`` loads models offline;
``text`` cuts text into token windows; ``capture`` hands each layer's q, k, v to a callback;
``hf`` and ``nnsight_trace`` turn a plain Hugging Face forward or an nnsight trace into the dict
that ``analyze_heads`` reads (:func:`from_hf`, :func:`from_nnsight`); ``facts`` reads what a
model says of itself besides its weights, once per model (:func:`model_facts`, :class:`ModelFacts`).
"""

from .facts import ModelFacts, model_facts
from .hf import from_hf
from .nnsight_trace import from_nnsight

__all__ = ["ModelFacts", "from_hf", "from_nnsight", "model_facts"]
