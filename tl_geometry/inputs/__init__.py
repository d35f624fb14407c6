"""The edges that read the world: caches, offline model loaders and text (docs/api.md)."""

from .facts import ModelFacts, model_facts
from .hf import from_hf
from .nnsight_trace import from_nnsight

__all__ = ["ModelFacts", "from_hf", "from_nnsight", "model_facts"]
