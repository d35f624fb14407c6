"""Does a head's geometry predict what top-N sparsification costs?

Per head: ``F_N`` (SPEC §3), the shell certificate ``F̲_N`` (SPEC §6d, ``K = 0`` and ``K = N``),
the tail mass ``τ_N`` and the relative output error ``‖o − o_N‖/‖o‖`` of the renormalised
top-``N`` set (SPEC §10), against the loss increase when that head alone keeps only its top-``N``
keys; Spearman's ρ over heads is the number reported per model (SPEC §10). A head whose top-``N``
keys are separable should lose little when the rest is cut (expected ρ < 0 for ``F_N`` and its
certificates); one that leaves more attention or output outside them should lose more (ρ > 0).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..forward import hooks as _hooks
from ..functional import last_positions, separability, shell_bounds, truncation
from ..functional.stats import spearman
from ..functional.uncertainty import check_window_indices, check_window_weight, window_mean
from ..inputs.cache import CACHE_NAMES_FILTER, check_attention_mask
from ..inputs.facts import model_facts
from ..inputs.tokens import token_digest
from .sweep import CapacitySweep, capacity_sweep
from .topn import SparsifyMode, check_n

SCORES = ("f_score", "shell_k0", "shell_kn", "tail_mass", "truncation_error")
#: The sign of ρ (predictor, loss increase) that a useful predictor has.
EXPECTED_SIGN = {"f_score": -1, "shell_k0": -1, "shell_kn": -1, "tail_mass": 1, "truncation_error": 1}


@torch.no_grad()
def head_geometry(
    model: Any, tokens: Int[Tensor, "batch pos"], n: int, *, attention_mask: Tensor | None = None,
) -> dict[str, Float[Tensor, "layer head"]]:
    """Per head, the mean over sequences (at each one's last valid query) of every score in
    :data:`SCORES`: ``F_N``, the shell certificate at ``K = 0`` and ``K = N``, ``τ_N`` and the
    relative truncation error (SPEC §10); NaN where ``N`` is out of range. One cached forward
    (``hook_pattern`` and ``hook_v`` only). On a sliding-window layer only the keys the last
    query sees are candidates, as in :func:`tl_geometry.analyze_heads` (SPEC §1)."""
    return {name: score.nanmean(0) for name, score in
            window_geometry(model, tokens, n, attention_mask=attention_mask).items()}


@torch.no_grad()
def window_geometry(
    model: Any, tokens: Int[Tensor, "batch pos"], n: int, *, attention_mask: Tensor | None = None,
) -> dict[str, Float[Tensor, "batch layer head"]]:
    """:func:`head_geometry` per sequence, ``[batch, layer, head]`` (the rows an interval over
    windows resamples, SPEC §8)."""
    check_n(n)
    tokens = _hooks.check_tokens(tokens, model=model)
    n_layers, n_heads = model_facts(model).shape()
    valid = check_attention_mask(attention_mask, *tokens.shape)
    device = _hooks.model_device(model)
    kwargs = {} if attention_mask is None else {"attention_mask": valid.long().to(device)}
    _, cache = model.run_with_cache(tokens.to(device), names_filter=CACHE_NAMES_FILTER, **kwargs)
    batch, n_pos = tokens.shape
    last = last_positions(valid)
    key_mask = valid & (torch.arange(n_pos)[None, :] <= last[:, None])  # [batch, key]
    windows = model_facts(model).windows or [None] * n_layers
    out = {name: torch.full((batch, n_layers, n_heads), math.nan, dtype=torch.float64) for name in SCORES}
    for layer in range(n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].cpu()
        v = cache[f"blocks.{layer}.attn.hook_v"].cpu()
        n_kv = v.shape[2]
        # The last query's row per sequence, query heads grouped by the KV head they read.
        alpha = pattern[torch.arange(batch), :, last].reshape(batch, n_kv, n_heads // n_kv, n_pos)
        values = v.permute(0, 2, 1, 3).unsqueeze(2)  # [batch, kv, 1, key, d]: shared by the group
        window = windows[layer]
        seen = key_mask if window is None else key_mask & (torch.arange(n_pos)[None, :] > last[:, None] - window)
        mask = seen[:, None, None, :]
        cut = truncation(alpha, values, n, key_mask=mask)
        scores = {
            "f_score": separability(alpha, values, n, key_mask=mask).f_score,
            "shell_k0": shell_bounds(alpha, values, n, k=0, key_mask=mask).f_score,
            "shell_kn": shell_bounds(alpha, values, n, k=n, key_mask=mask).f_score,
            "tail_mass": cut.tail_mass,
            "truncation_error": cut.truncation_error,
        }
        for name, score in scores.items():
            out[name][:, layer] = score.reshape(batch, n_heads)
    return out


def window_rho(
    window_scores: dict[str, Float[Tensor, "window layer head"]],
    window_loss_increase: Float[Tensor, "layer head window"],
    window_weight: Float[Tensor, " window"],
    windows: Int[Tensor, " k"],
) -> dict[str, float]:
    """:meth:`CapacityCorrelation.rho_over` on arrays, e.g. ones saved apart from the object
    (a ``ValueError`` for shapes that do not share one window axis)."""
    n_windows = _window_count(window_scores, window_loss_increase, window_weight)
    windows = check_window_indices(windows, n_windows)
    increase = window_mean(window_loss_increase, window_weight, windows)
    return {name: spearman(score[windows].nanmean(0), increase) for name, score in window_scores.items()}


def _window_count(window_scores: dict[str, Tensor], window_loss_increase: Tensor, window_weight: Tensor) -> int:
    """The number of windows the per-window arrays share, checked: arrays from different runs
    would otherwise pair the wrong windows, or fail inside torch."""
    if not isinstance(window_weight, Tensor) or window_weight.ndim != 1:
        raise ValueError("window_weight must be a 1-D tensor of per-window prediction counts "
                         "([window]), as CapacityCorrelation.window_weight.")
    n = len(window_weight)
    if not isinstance(window_loss_increase, Tensor) or window_loss_increase.ndim == 0 \
            or window_loss_increase.shape[-1] != n:
        shape = list(window_loss_increase.shape) if isinstance(window_loss_increase, Tensor) else None
        raise ValueError(f"window_loss_increase must be [layer, head, window] with {n} windows (as "
                         f"window_weight), got shape {shape}: pass both from the same run.")
    for name, score in window_scores.items():
        if not isinstance(score, Tensor) or score.ndim == 0 or score.shape[0] != n:
            shape = list(score.shape) if isinstance(score, Tensor) else type(score).__name__
            raise ValueError(f"window_scores[{name!r}] must be [window, layer, head] with {n} windows "
                             f"(as window_weight), got {shape}: pass every array from the same run.")
    check_window_weight(window_weight, n, "window_weight")
    return n


def _why_nan(score: Tensor, increase: Tensor) -> str:
    """The reason Spearman's ρ of ``score`` against ``increase`` is undefined."""
    swept = int(torch.isfinite(increase).sum())
    pairs = int((torch.isfinite(score) & torch.isfinite(increase)).sum())
    if pairs < 3:
        return (f"only {pairs} head(s) have both a score and a loss increase ({swept} of "
                f"{increase.numel()} heads were swept); ρ needs at least 3. Sweep more heads "
                "(capacity_sweep without heads=, or more of them).")
    return "the score or the loss increase is the same for every head, so it has no ranking."


@dataclass
class CapacityCorrelation:
    """Per-head predictors against the loss of sparsifying that head alone to ``N`` keys.

    ``scores[name]`` and ``loss_increase`` are ``[layer, head]`` for ``name`` in :data:`SCORES`.
    ``window_scores[name]`` (``[window, layer, head]``), ``window_loss_increase`` (``[layer, head,
    window]``) and ``window_weight`` (valid predictions) are the same per window, for
    :meth:`rho_over` (SPEC §8; ``None`` for an object built without them).
    """

    n: int
    mode: str
    scores: dict[str, Float[Tensor, "layer head"]]
    loss_increase: Float[Tensor, "layer head"]
    dense_loss: float
    metadata: dict[str, Any] = field(default_factory=dict)
    window_scores: dict[str, Float[Tensor, "window layer head"]] | None = None
    window_loss_increase: Float[Tensor, "layer head window"] | None = None
    window_weight: Float[Tensor, " window"] | None = None

    def rho_over(self, windows: Int[Tensor, " k"]) -> dict[str, float]:
        """Spearman's ρ per score on the windows ``windows`` (a 1-D integer tensor of indices,
        repeats allowed: one bootstrap resample, SPEC §8), the heads fixed: each head's score is
        its mean over those windows and its loss increase ``Σ w_b ΔL_b / Σ w_b``."""
        if self.window_scores is None or self.window_loss_increase is None or self.window_weight is None:
            raise ValueError("This CapacityCorrelation holds no per-window values (built without "
                             "them); run capacity_correlation again to resample windows.")
        return window_rho(self.window_scores, self.window_loss_increase, self.window_weight, windows)

    @property
    def rho(self) -> dict[str, float]:
        """Spearman's ρ per score over the heads with both numbers; NaN where :attr:`notes` says
        why."""
        return {name: spearman(score, self.loss_increase) for name, score in self.scores.items()}

    @property
    def notes(self) -> dict[str, str]:
        """Why each NaN ρ is NaN, by score name (empty when every ρ is a number)."""
        return {name: _why_nan(score, self.loss_increase) for name, score in self.scores.items()
                if math.isnan(spearman(score, self.loss_increase))}

    def summary(self) -> str:
        """The predictors as text, ranked by ``|ρ|`` when the sign is the expected one (0 when
        it is wrong, or NaN)."""
        lines = [f"Per-head predictors of the loss of top-{self.n} ({self.mode}) on one head alone "
                 f"(Spearman ρ over {int(torch.isfinite(self.loss_increase).sum())} heads):"]
        rows = []
        for name, rho in self.rho.items():
            sign = EXPECTED_SIGN.get(name, 0)
            strength = abs(rho) if (sign == 0 or rho * sign > 0) else (math.nan if math.isnan(rho) else 0.0)
            rows.append((strength, name, rho, sign))
        rows.sort(key=lambda r: -r[0] if not math.isnan(r[0]) else math.inf)
        for strength, name, rho, sign in rows:
            expected = {1: "ρ > 0", -1: "ρ < 0"}.get(sign, "")
            lines.append(f"  {name:<17} ρ = {rho:+.3f}   expected {expected}, strength {strength:.3f}")
        return "\n".join(lines)

    def to_pandas(self):
        """One row per head: ``layer, head, n, mode``, every score of :data:`SCORES`,
        ``loss_increase``."""
        import pandas as pd

        n_layers, n_heads = self.loss_increase.shape
        table = {"layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
                 "head": torch.arange(n_heads).repeat(n_layers).numpy(), "n": self.n, "mode": self.mode}
        table.update({name: score.flatten().numpy() for name, score in self.scores.items()})
        table["loss_increase"] = self.loss_increase.flatten().numpy()
        return pd.DataFrame(table)

    def plot(self):
        """Scatter of each geometric score against the loss increase, ρ in the titles."""
        from ..views.capacity import correlation_plot

        return correlation_plot(self.to_pandas())


def capacity_correlation(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    n: int = 4,
    *,
    mode: SparsifyMode = "renormalize",
    sweep: CapacitySweep | None = None,
    attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> CapacityCorrelation:
    """Spearman ρ, over heads, between each score of :data:`SCORES` (SPEC §10) and the loss
    increase when that head alone keeps its top-``N`` keys; ``sweep`` reuses a head
    :func:`~tl_geometry.capacity.capacity_sweep` on the same ``tokens`` and ``mode`` with ``N``.

    Examples:
        >>> corr = tl_geometry.capacity.capacity_correlation(model, tokens, 4)     # doctest: +SKIP
        >>> corr.rho           # {'f_score': ..., 'shell_k0': ..., 'tail_mass': ..., ...}  # doctest: +SKIP
        >>> print(corr.summary())                                           # doctest: +SKIP
    """
    check_n(n)
    if sweep is None:
        sweep = capacity_sweep(model, tokens, (n,), by="head", mode=mode, attention_mask=attention_mask,
                               batch_size=batch_size, progress=progress)
    else:
        _check_sweep(sweep, n, mode, _hooks.check_tokens(tokens, model=model), attention_mask)
    per_window = window_geometry(model, tokens, n, attention_mask=attention_mask)
    scores = {name: score.nanmean(0) for name, score in per_window.items()}
    i = sweep.n_values.index(n)
    increase = sweep.loss_increase[i]
    window_increase = (None if sweep.window_loss is None or sweep.dense_window_loss is None
                       else sweep.window_loss[i] - sweep.dense_window_loss)
    result = CapacityCorrelation(n, mode, scores, increase, sweep.dense_loss,
                                 {"tokens": list(tokens.shape), "sweep": sweep.metadata},
                                 per_window, window_increase, sweep.window_weight)
    for name, why in result.notes.items():
        warnings.warn(f"capacity_correlation: rho[{name!r}] is NaN: {why}", UserWarning, stacklevel=2)
    return result


def _check_sweep(sweep: Any, n: int, mode: str, tokens: Tensor, attention_mask: Tensor | None) -> None:
    """A reused sweep must be a head sweep at ``N``, in ``mode``, of these very tokens: pairing
    one batch's geometry with another batch's loss would give a meaningless ρ without a word."""
    if not isinstance(sweep, CapacitySweep) or sweep.by != "head" or n not in sweep.n_values:
        raise ValueError(f"sweep must be a by='head' CapacitySweep that contains N={n}.")
    if sweep.mode != mode:
        raise ValueError(f"sweep was run with mode={sweep.mode!r}, not {mode!r}.")
    shape = sweep.metadata.get("tokens")
    if shape is not None and list(shape) != list(tokens.shape):
        raise ValueError(f"sweep was run on tokens of shape {list(shape)}, these are "
                         f"{list(tokens.shape)}: pass the same tokens (and mask) to both, or "
                         "omit sweep= to run one here.")
    digest = sweep.metadata.get("tokens_digest")
    if digest is not None and digest != token_digest(tokens, attention_mask):
        raise ValueError("sweep was run on other tokens (or another attention_mask) than these: "
                         "pass the same tokens and mask to both, or omit sweep= to run one here.")
