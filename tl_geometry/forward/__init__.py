"""Running a model forward with hooks and measuring its loss, shared by ablation/ and capacity/:
``hooks`` (the hook context and the checks every hooked forward makes) and ``losses`` (the
batched loss engine, every loss kept per window for its standard error, SPEC §7).
"""

from .hooks import HookContext, HookList, check_tokens, head_mask, model_device
from .losses import (
    MEMORY_BUDGET_BYTES,
    WindowLosses,
    model_loss,
    replicas_per_forward,
    stacked_losses,
    stacked_window_losses,
    valid_targets,
    window_losses,
)

__all__ = [
    "MEMORY_BUDGET_BYTES",
    "HookContext",
    "HookList",
    "WindowLosses",
    "check_tokens",
    "head_mask",
    "model_device",
    "model_loss",
    "replicas_per_forward",
    "stacked_losses",
    "stacked_window_losses",
    "valid_targets",
    "window_losses",
]
